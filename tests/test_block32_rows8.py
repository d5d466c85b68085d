"""Q4_0, Q4_1, Q5_0, IQ4_NL and IQ4_XS on the repacked eight-row layouts (``block32_rows8``): what the matmuls
(``kquant_matmul``'s for Q5_0, ``quant_matmul``'s for Q4_x, ``iquant_matmul``'s for IQ4) run for weights whose
rows come in whole groups of eight. Q5_0 is
what llama.cpp writes for the K-quant rows of files whose rows are not a multiple of 256 (SmolLM2-360M's).

The layouts are read back through their documented bytes independently of the kernels; the compiled
repack equals the numpy reference; the products are held to ``test_kquants``' bound against the exact
float64 product of the dequantized weights and the quantized activations; and the determinism rules hold:
a token's row is the same bits alone or in a prompt (one pass, several 64-token passes), at 1 and 2
threads, with activations shared or quantized in the call, and on 512-bit registers (``_pairs``) as on
256-bit ones. (Rows that are not whole groups keep the row-by-row kernels: ``test_kquants``' and
``test_iquants``' 37 rows.)
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from gguf import quants as gq
from test_iquants import _random_rows
from test_kquants import acts, weight

from minfer.backends.cpu import block32_rows8 as b32
from minfer.backends.cpu import iquant_matmul as iq
from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import quant_matmul as qm
from minfer.backends.cpu import simd512
from minfer.formats.block_types import GGMLType
from minfer.formats.iquants import IQ4_VALUES
from minfer.formats.quants import dequantize_rows
from minfer.formats.tensors import WeightTensor

U = 2.0**-24
Q5_0, Q5_1, Q4_0, Q4_1 = GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_0, GGMLType.Q4_1
IQ4_NL, IQ4_XS = GGMLType.IQ4_NL, GGMLType.IQ4_XS
TYPES = [Q5_0, Q5_1, Q4_0, Q4_1, IQ4_NL, IQ4_XS]
MODULES = {Q5_0: km, Q5_1: km, Q4_0: qm, Q4_1: qm, IQ4_NL: iq, IQ4_XS: iq}
WITH_MIN = {Q4_1: 20, Q5_1: 24}  # the types with an offset m (f16 at byte 2 of a block of these bytes)
NO_WIDE = "no AVX-512 F/BW/VNNI on this CPU (or MINFER_AVX512=0): the 512-bit kernel cannot run here"


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    km.warmup()
    iq.warmup()
    qm.warmup()


def _ids(t: GGMLType) -> str:
    return t.name


def _weight(t: GGMLType, n_out: int, n_in: int, seed: int = 0) -> WeightTensor:
    if t in (Q5_0, Q5_1):  # gguf quantizes them: Gaussian weights, one block with a clear offset
        return weight(t, n_out, n_in, seed)
    if t in (Q4_0, Q4_1):
        w = np.random.default_rng(seed).standard_normal((n_out, n_in)).astype(np.float32) * 0.1
        return WeightTensor("w", t, (n_out, n_in), gq.quantize(w, t).view(np.uint8))
    return WeightTensor("w", t, (n_out, n_in), _random_rows(t, n_out, n_in, seed))


def _fast(x: np.ndarray, w: WeightTensor | object, xq=None) -> np.ndarray:
    t = (w.tensor if hasattr(w, "tensor") else w).ggml_type
    out = np.full((x.shape[0], (w.tensor if hasattr(w, "tensor") else w).shape[0]), np.nan, np.float32)
    MODULES[t].matmul(x, w, out, xq)
    return out


def _prepare(w: WeightTensor):
    return MODULES[w.ggml_type].prepare(w)


def _unpack(t: GGMLType, packed: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """The float64 weights read back from the repacked bytes as the module documents them."""
    g, nb = n_out // 8, n_in // 32
    if t == IQ4_XS:
        sup = packed.reshape(g, nb // 8, b32.XS_SUPER)
        blk = sup[..., : 8 * 136].reshape(g, nb, 136)
        d = sup[..., 8 * 136 :].copy().view(np.float16).astype(np.float64)  # [g, s, row]
        d = np.repeat(d, 8, axis=1) * blk[..., 128:136].view(np.int8)  # [g, b, row]: d (ls - 32)
    else:
        blk = packed.reshape(g, nb, b32.GROUP_BLOCK[b32.KINDS[t]])
        at = 160 if t in (Q5_0, Q5_1) else 128
        d = blk[..., at : at + 16].copy().view(np.float16).astype(np.float64)  # [g, b, row]
    nib = blk[..., :128].reshape(g, nb, 4, 8, 4)  # [g, b, j, row, i]
    u = np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.int64)  # [g, b, c, row, i]: chunk c < 4 low
    if t in (Q5_0, Q5_1):
        words = blk[..., 128:160].copy().view("<u4")  # [g, b, c]
        bits = (words[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [g, b, c, 4 row + i]
        u = u + 16 * bits.reshape(g, nb, 8, 8, 4)
    if t in WITH_MIN:  # d u + m
        at = 144 if t == Q4_1 else 176
        m = blk[..., at : at + 16].copy().view(np.float16).astype(np.float64).transpose(0, 2, 1).reshape(n_out, nb, 1)
        u = u.transpose(0, 3, 1, 2, 4).reshape(n_out, nb, 32)
        return (d.transpose(0, 2, 1).reshape(n_out, nb, 1) * u + m).reshape(n_out, n_in)
    if t in (Q5_0, Q4_0):
        q = u - (16 if t == Q5_0 else 8)
    else:
        q = IQ4_VALUES[u].astype(np.int64)
    q = q.transpose(0, 3, 1, 2, 4).reshape(n_out, nb, 32)
    return (d.transpose(0, 2, 1).reshape(n_out, nb, 1) * q).reshape(n_out, n_in)


@pytest.mark.parametrize("t", TYPES, ids=_ids)
def test_repacked_bytes_hold_the_files_values(t):
    w = _weight(t, 24, 768, seed=20)
    packed = b32.repack(t, w.data, 24, 768)
    np.testing.assert_array_equal(packed, b32.repack_reference(t, w.data, 24, 768))
    np.testing.assert_array_equal(_unpack(t, packed, 24, 768), dequantize_rows(w.data, t, 768).astype(np.float64))
    assert packed.nbytes == w.data.nbytes + (24 // 8 * 768 // 256 * 16 if t == IQ4_XS else 0)


def test_which_weights_take_the_repacked_layout():
    for t in TYPES:
        assert _prepare(_weight(t, 16, 512)).block32_kind == b32.KINDS[t]
        assert _prepare(_weight(t, 37, 512)).block32_kind is None  # not whole groups: the other kernels
    assert iq.prepare(_weight(GGMLType.MXFP4, 16, 512)).block32_kind is None


@pytest.mark.parametrize("t", TYPES, ids=_ids)
@pytest.mark.parametrize("n_tok", [1, 2, 5, 9, 21, 70])
def test_matmul_parity(t, n_tok):
    n_out, n_in = 40, 1024
    w = _weight(t, n_out, n_in, seed=21)
    x = acts(n_tok, n_in)
    out = _fast(x, w)
    wd = dequantize_rows(w.data, t, n_in).astype(np.float64)
    xq = qm.quantize_activations(x)
    xr = (xq.q.reshape(n_tok, -1, 32) * xq.ds[:, :, :1]).reshape(x.shape).astype(np.float64)
    exact = xr @ wd.T
    terms = np.abs(wd)
    if t in WITH_MIN:  # the kernel adds d u and m apart: bound by both terms' magnitudes (they may cancel)
        parts = []
        for zero in (0, 2):  # d, then m zeroed
            raw = w.data.reshape(n_out, -1, WITH_MIN[t]).copy()
            raw[:, :, zero : zero + 2] = 0
            parts.append(np.abs(dequantize_rows(raw.reshape(n_out, -1), t, n_in).astype(np.float64)))
        terms = parts[0] + parts[1]
    scale = np.abs(xr) @ terms.T
    n_blocks = n_in // 32
    assert np.all(np.abs(out - exact) <= (2 * n_blocks + 8) * U * scale + 1e-30)
    assert np.max(np.abs(out - exact) / (scale + 1e-30)) < 1e-6


@pytest.mark.parametrize("t", TYPES, ids=_ids)
def test_prefill_rows_equal_decode_rows(t):
    w = _weight(t, 48, 512, seed=22)
    x = acts(70, 512, seed=23)  # past one 64-token pass over a group's blocks
    many = _fast(x, w)
    for i in range(x.shape[0]):
        one = _fast(x[i : i + 1], w)
        assert one.view(np.uint32).tolist() == many[i : i + 1].view(np.uint32).tolist(), i
    for k in (2, 6, 16):  # a few tokens: what a verify pass or a batched decode runs
        assert _fast(x[:k], w).view(np.uint32).tolist() == many[:k].view(np.uint32).tolist(), k


@pytest.mark.parametrize("t", TYPES, ids=_ids)
def test_bit_identical_at_1_and_2_threads_and_with_shared_activations(t):
    w = _weight(t, 64, 512, seed=24)
    p = _prepare(w)
    saved = numba.get_num_threads()
    for n_tok in (1, 13):
        x = acts(n_tok, 512, seed=25)
        results = []
        try:
            for n in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
                numba.set_num_threads(n)
                results.append(_fast(x, w))
        finally:
            numba.set_num_threads(saved)
        assert results[0].view(np.uint32).tolist() == results[1].view(np.uint32).tolist()
        xq = qm.quantize_activations(x)
        assert np.array_equal(_fast(x, p, xq), results[0])
        if t not in (IQ4_NL, IQ4_XS):  # a plan's bound call (IQ4's plans call matmul)
            direct = np.empty_like(results[0])
            MODULES[t].direct_call(x, p, direct, xq)()
            assert np.array_equal(direct, results[0])


@pytest.mark.skipif(not simd512.WIDE, reason=NO_WIDE)
@pytest.mark.parametrize("t", TYPES, ids=_ids)
@pytest.mark.parametrize("n_out", [40, 48])  # five groups (one alone at the end), six
@pytest.mark.parametrize("n_tok", [2, 13, 70])
def test_the_512_bit_prefill_gives_the_eight_row_kernels_bits(t, n_out, n_tok):
    p = _prepare(_weight(t, n_out, 512, seed=n_out + n_tok))
    xq = qm.quantize_activations(acts(n_tok, 512))
    wide, narrow = (np.full((n_tok, n_out), np.nan, np.float32) for _ in range(2))
    none = (b32.NO_WEIGHT, b32.NO_OUTPUT) * 2
    b32._pairs(b32.KINDS[t], b32.IQ4_TABLE, xq.q_flat, xq.ds_flat, p.rows8, wide, *none)
    b32._rows8(b32.KINDS[t], b32.IQ4_TABLE, xq.q_flat, xq.ds_flat, p.rows8, narrow, *none)
    assert not np.isnan(wide).any()
    assert wide.view(np.uint32).tolist() == narrow.view(np.uint32).tolist()


@pytest.mark.parametrize("n_tok", [1, 2, 9])
def test_a_plans_bound_call_runs_the_kernel_matmul_runs(monkeypatch, n_tok):
    ran = []
    for name in ("_pairs", "_rows8"):
        kernel = getattr(b32, name)
        monkeypatch.setattr(b32, name, lambda *a, _k=kernel, _n=name: (ran.append(_n), _k(*a)))
    p = km.prepare(weight(Q5_0, 40, 512, seed=3))
    x = acts(n_tok, 512)
    xq = km.quantize_activations(x)
    out = np.empty((n_tok, 40), np.float32)
    km.matmul(x, p, out, xq)
    km.direct_call(x, p, out, xq)()
    expected = "_pairs" if simd512.WIDE and n_tok > 1 else "_rows8"
    assert ran == [expected, expected]


@pytest.mark.parametrize("t", [Q5_0, Q5_1, Q4_0, Q4_1], ids=_ids)
@pytest.mark.parametrize("n_tok", [1, 6, 13, 70])
def test_weights_reading_one_input_in_one_call_give_their_own_bits(t, n_tok):
    """q/k/v (gate/up) in one parallel loop: each output equals its own matmul's, bit for bit."""
    ws = [_prepare(_weight(t, n_out, 512, seed=30 + i)) for i, n_out in enumerate((40, 16, 24))]
    x = acts(n_tok, 512, seed=33)
    xq = km.quantize_activations(x)
    for members in (ws[:2], ws):
        outs = [np.full((n_tok, w.n_out), np.nan, np.float32) for w in members]
        call = km.group_call(x, members, outs, None, xq)
        assert call is not None
        call()
        for w, out in zip(members, outs, strict=True):
            own = _fast(x, w.tensor)
            assert out.view(np.uint32).tolist() == own.view(np.uint32).tolist()


def test_weights_of_other_row_counts_keep_a_correct_path():
    x = acts(5, 512, seed=34)
    xq = qm.quantize_activations(x)
    xr = (xq.q.reshape(5, -1, 32) * xq.ds[:, :, :1]).reshape(x.shape).astype(np.float64)
    for t in TYPES:
        for n_out in (8, 12, 37):
            w = _weight(t, n_out, 512, seed=n_out)
            wd = dequantize_rows(w.data, t, 512).astype(np.float64)
            np.testing.assert_allclose(_fast(x, w), xr @ wd.T, rtol=0, atol=1e-6 * float(np.abs(xr).sum(1).max()))
    pair, outs = [km.prepare(weight(Q5_0, 16, 512))] * 2, [np.empty((5, 16), np.float32)] * 2
    assert km.group_call(x, pair, outs) is None  # no quantized activations to share
    assert km.group_call(x, pair, outs, None, qm.quantize_activations(x[:4])) is None  # not these activations
    rows = [km.prepare(weight(Q5_0, 16, 512)), km.prepare(weight(Q5_0, 12, 512))]  # 12: not repacked
    assert km.group_call(x, rows, [np.empty((5, 16), np.float32), np.empty((5, 12), np.float32)], None, xq) is None
    empty = WeightTensor("w", Q5_0, (8, 0), np.zeros((8, 0), np.uint8))
    assert np.array_equal(_fast(np.zeros((2, 0), np.float32), empty), np.zeros((2, 8), np.float32))
