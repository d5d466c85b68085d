"""The non-linear 4-bit block types IQ4_NL, IQ4_XS and MXFP4: dequantization bit-equal to ``gguf``, the fast
matmul against dequantize-then-matmul, and llama.cpp-quantized files through the whole model, held to the same
bar as llama.cpp on them (``tests/fixtures/iq4``, made by ``scripts/make_iq4_fixture.py``)."""

from __future__ import annotations

import json

import gguf
import numba
import numpy as np
import pytest
from conftest import fixture_dir, fixture_logits, fixture_sequences

import minfer
from minfer.backends.cpu import iquant_matmul as iq
from minfer.formats.block_types import row_nbytes, type_size
from minfer.formats.gguf_file import GGUFFile, GGUFTensor
from minfer.formats.quants import GGMLType, dequantize_rows

TYPES = [GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4]


def _random_rows(t: GGMLType, n_out: int, n_in: int, seed: int = 0) -> np.ndarray:
    """Random blocks of type ``t`` with finite, moderate scales (every other byte random)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n_out, row_nbytes(t, n_in)), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size(t))
    if t is GGMLType.MXFP4:
        blocks[:, 0] = 118 + blocks[:, 0] % 12  # exponents 2^-10 .. 2^1
    else:
        blocks[:, 1] = (blocks[:, 1] & 0x03) | 0x20  # f16 d in [2^-7, 2^-5)
    return raw


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_equal_to_gguf(t):
    raw = _random_rows(t, 7, 512)
    want = gguf.quants.dequantize(raw, t).reshape(7, 512)
    got = dequantize_rows(raw, t, 512)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_dequantize_round_trips_gguf_quantize():
    """gguf's MXFP4 quantizer (it has none for the IQ4 types) then our dequantizer equals gguf's round trip."""
    t = GGMLType.MXFP4
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    q = gguf.quants.quantize(x, t)
    np.testing.assert_array_equal(dequantize_rows(q, t, 256), gguf.quants.dequantize(q, t).reshape(4, 256))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 3, 17])
def test_fast_matmul_matches_dequantize_then_matmul(t, n_tok):
    n_out, n_in = 37, 512
    raw = _random_rows(t, n_out, n_in, seed=n_tok)
    w = GGUFTensor("w", t, (n_out, n_in), raw)
    x = np.random.default_rng(2).standard_normal((n_tok, n_in)).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize_rows(raw, t, n_in).T.astype(np.float64)
    outs = []
    previous = numba.get_num_threads()
    try:
        for threads in (1, 2):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            out = np.empty((n_tok, n_out), np.float32)
            iq.matmul(x, iq.prepare(w), out)
            outs.append(out)
    finally:
        numba.set_num_threads(previous)
    assert float(np.abs(outs[0] - ref).max()) <= 1e-5 * float(np.abs(ref).max())
    np.testing.assert_array_equal(outs[0], outs[1])  # the same bits at any thread count
    for r in range(n_tok):  # a decode row equals its prefill row
        one = np.empty((1, n_out), np.float32)
        iq.matmul(x[r : r + 1], w, one)
        np.testing.assert_array_equal(one[0], outs[0][r])


@pytest.mark.parametrize("name", ["model-iq4_nl.gguf", "model-iq4_xs.gguf"])
@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_llamacpp_quantized_file_no_worse_than_llamacpp(name, kernels):
    """llama.cpp quantized this file itself; its relative logit error against the F32 logits (stored with the
    fixture) is the bar: ours on the same file may be at most 1.25 times it."""
    d = fixture_dir("iq4")
    meta = json.loads((d / "meta.json").read_text())["files"][name]
    types = {t.ggml_type.name for t in GGUFFile(d / name) if len(t.shape) == 2}
    assert name.split("-")[1].split(".")[0].upper() in types
    seq = json.loads((d / "tokens.json").read_text())["sequence"]
    ref = np.load(d / "logits_f32.npy")
    got = minfer.load(d / name, n_ctx=64, kernels=kernels).logits(seq)
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel <= 1.25 * meta["llamacpp_relative_logit_error"], (rel, meta["llamacpp_relative_logit_error"])


@pytest.mark.parametrize("qtype", ["MXFP4"])
def test_whole_model_fast_equals_reference(tmp_path, qtype):
    """The llama fixture with every 2-D tensor quantized by gguf (which quantizes MXFP4, not the IQ4 types: those
    come from llama.cpp's quantizer in tests/fixtures/iq4): the fast kernels (f32 activations) agree with
    the dequantize-then-matmul reference within the f32 contract, and the logits still follow transformers'."""
    from conftest import derive_gguf

    t = GGMLType[qtype]

    def quantize(name, arr):
        if arr.ndim == 2:
            return gguf.quants.quantize(arr, t), t
        return arr, None

    path = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path / f"{qtype}.gguf", transform=quantize)
    assert {x.ggml_type for x in GGUFFile(path) if len(x.shape) == 2} == {t}
    seq = fixture_sequences("llama")[2]
    fast = minfer.load(path, n_ctx=64, kernels="fast").logits(seq)
    exact = minfer.load(path, n_ctx=64, kernels="reference").logits(seq)
    assert float(np.abs(fast - exact).max()) <= 1e-4
    want = fixture_logits("llama", 2)
    # 4-bit E2M1 values are coarse (this model's logits move by ~0.66 of their norm), but it is the same model
    assert np.corrcoef(exact.ravel(), want.ravel())[0, 1] > 0.7
