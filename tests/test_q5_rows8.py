"""Q5_0 on the repacked eight-row layout (``q5_rows8``): what ``kquant_matmul.matmul`` runs for Q5_0 weights
whose rows come in whole groups of eight (the K-quant rows llama.cpp writes as Q5_0 in files whose rows are
not a multiple of 256, e.g. SmolLM2-360M's).

The layout is read back through the documented bytes independently of the kernels; the compiled repack
equals the numpy reference; the products are held to ``test_kquants``' bound against the exact float64
product of the dequantized weights and the quantized activations; and the determinism rules hold: a
token's row is the same bits alone or in a prompt (one pass, several 64-token passes), at 1 and 2
threads, with activations shared or quantized in the call, and on 512-bit registers (``_pairs``) as on
256-bit ones. (Rows that are not whole groups keep the row-by-row kernel: ``test_kquants``' 37 rows.)
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from test_kquants import acts, deq, fast, rounded_acts, weight

from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import q5_rows8 as q5
from minfer.backends.cpu import simd512
from minfer.formats.block_types import GGMLType
from minfer.formats.gguf_file import GGUFTensor

U = 2.0**-24
Q5_0 = GGMLType.Q5_0
NO_WIDE = "no AVX-512 F/BW/VNNI on this CPU (or MINFER_AVX512=0): the 512-bit kernel cannot run here"


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    km.warmup()


def _unpack(packed: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """The float64 weights read back from the repacked bytes as the module documents them: d (u - 16)."""
    g, nb = n_out // 8, n_in // 32
    blk = packed.reshape(g, nb, q5.GROUP_BLOCK)
    nib = blk[..., :128].reshape(g, nb, 4, 8, 4)  # [g, b, j, row, i]
    low = np.concatenate([nib & 15, nib >> 4], axis=2)  # [g, b, c, row, i]: chunk c < 4 low, c >= 4 high
    words = blk[..., 128:160].copy().view("<u4")  # [g, b, c]
    bits = (words[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [g, b, c, 4 row + i]
    u = low + 16 * bits.reshape(g, nb, 8, 8, 4)
    u = u.transpose(0, 3, 1, 2, 4).reshape(n_out, nb, 32).astype(np.float64)
    d = blk[..., 160:176].copy().view(np.float16).astype(np.float64)  # [g, b, row]
    d = d.transpose(0, 2, 1).reshape(n_out, nb, 1)
    return (d * (u - 16)).reshape(n_out, n_in)


def test_repacked_bytes_hold_the_files_values():
    w = weight(Q5_0, 24, 768, seed=20)
    packed = q5.repack(w.data, 24, 768)
    np.testing.assert_array_equal(packed, q5.repack_reference(w.data, 24, 768))
    np.testing.assert_array_equal(_unpack(packed, 24, 768), deq(w.data, Q5_0, 768).astype(np.float64))


def test_which_weights_take_the_repacked_layout():
    assert km.prepare(weight(Q5_0, 16, 512)).rows8 is not None
    assert km.prepare(weight(Q5_0, 37, 512)).rows8 is None  # not whole groups: the row-by-row kernel
    assert km.prepare(weight(GGMLType.Q5_1, 16, 512)).rows8 is None


@pytest.mark.parametrize("n_tok", [1, 2, 5, 9, 21, 70])
def test_matmul_parity(n_tok):
    n_out, n_in = 40, 1024
    w = weight(Q5_0, n_out, n_in, seed=21)
    x = acts(n_tok, n_in)
    out = fast(x, w)
    wd = deq(w.data, Q5_0, n_in).astype(np.float64)
    xr, _ = rounded_acts(x, Q5_0)
    exact = xr @ wd.T
    scale = np.abs(xr) @ np.abs(wd).T
    n_blocks = n_in // 32
    assert np.all(np.abs(out - exact) <= (2 * n_blocks + 8) * U * scale + 1e-30)
    assert np.max(np.abs(out - exact) / (scale + 1e-30)) < 1e-6


def test_prefill_rows_equal_decode_rows():
    w = weight(Q5_0, 48, 512, seed=22)
    x = acts(70, 512, seed=23)  # past one 64-token pass over a group's blocks
    many = fast(x, w)
    for i in range(x.shape[0]):
        one = fast(x[i : i + 1], w)
        assert one.view(np.uint32).tolist() == many[i : i + 1].view(np.uint32).tolist(), i
    for k in (2, 6, 16):  # a few tokens: what a verify pass or a batched decode runs
        assert fast(x[:k], w).view(np.uint32).tolist() == many[:k].view(np.uint32).tolist(), k


def test_bit_identical_at_1_and_2_threads_and_with_shared_activations():
    w = weight(Q5_0, 64, 512, seed=24)
    p = km.prepare(w)
    saved = numba.get_num_threads()
    for n_tok in (1, 13):
        x = acts(n_tok, 512, seed=25)
        results = []
        try:
            for n in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
                numba.set_num_threads(n)
                results.append(fast(x, w))
        finally:
            numba.set_num_threads(saved)
        assert results[0].view(np.uint32).tolist() == results[1].view(np.uint32).tolist()
        xq = km.quantize_activations(x)
        shared = np.empty_like(results[0])
        km.matmul(x, p, shared, xq)
        assert np.array_equal(shared, results[0])
        direct = np.empty_like(shared)
        km.direct_call(x, p, direct, xq)()
        assert np.array_equal(direct, results[0])


@pytest.mark.skipif(not simd512.WIDE, reason=NO_WIDE)
@pytest.mark.parametrize("n_out", [40, 48])  # five groups (one alone at the end), six
@pytest.mark.parametrize("n_tok", [2, 13, 70])
def test_the_512_bit_prefill_gives_the_eight_row_kernels_bits(n_out, n_tok):
    p = km.prepare(weight(Q5_0, n_out, 512, seed=n_out + n_tok))
    xq = km.quantize_activations(acts(n_tok, 512))
    wide, narrow = (np.full((n_tok, n_out), np.nan, np.float32) for _ in range(2))
    none = (q5.NO_WEIGHT, q5.NO_OUTPUT) * 2
    q5._pairs(p.rows8, xq.q_flat, xq.ds_flat, wide, *none)
    q5._rows8(p.rows8, xq.q_flat, xq.ds_flat, narrow, *none)
    assert not np.isnan(wide).any()
    assert wide.view(np.uint32).tolist() == narrow.view(np.uint32).tolist()


@pytest.mark.parametrize("n_tok", [1, 2, 9])
def test_a_plans_bound_call_runs_the_kernel_matmul_runs(monkeypatch, n_tok):
    ran = []
    for name in ("_pairs", "_rows8"):
        kernel = getattr(q5, name)
        monkeypatch.setattr(q5, name, lambda *a, _k=kernel, _n=name: (ran.append(_n), _k(*a)))
    p = km.prepare(weight(Q5_0, 40, 512, seed=3))
    x = acts(n_tok, 512)
    xq = km.quantize_activations(x)
    out = np.empty((n_tok, 40), np.float32)
    km.matmul(x, p, out, xq)
    km.direct_call(x, p, out, xq)()
    expected = "_pairs" if simd512.WIDE and n_tok > 1 else "_rows8"
    assert ran == [expected, expected]


@pytest.mark.parametrize("n_tok", [1, 6, 13, 70])
def test_weights_reading_one_input_in_one_call_give_their_own_bits(n_tok):
    """q/k/v (gate/up) in one parallel loop: each output equals its own matmul's, bit for bit."""
    ws = [km.prepare(weight(Q5_0, n_out, 512, seed=30 + i)) for i, n_out in enumerate((40, 16, 24))]
    x = acts(n_tok, 512, seed=33)
    xq = km.quantize_activations(x)
    for members in (ws[:2], ws):
        outs = [np.full((n_tok, w.n_out), np.nan, np.float32) for w in members]
        call = km.group_call(x, members, outs, None, xq)
        assert call is not None
        call()
        for w, out in zip(members, outs, strict=True):
            own = fast(x, w.tensor)
            assert out.view(np.uint32).tolist() == own.view(np.uint32).tolist()


def test_weights_of_other_row_counts_keep_a_correct_path():
    x = acts(5, 512, seed=34)
    for n_out in (8, 12, 37):
        w = weight(Q5_0, n_out, 512, seed=n_out)
        wd = deq(w.data, Q5_0, 512).astype(np.float64)
        xr, _ = rounded_acts(x, Q5_0)
        np.testing.assert_allclose(fast(x, w), xr @ wd.T, rtol=0, atol=1e-6 * float(np.abs(xr).sum(1).max()))
    pair, outs = [km.prepare(weight(Q5_0, 16, 512))] * 2, [np.empty((5, 16), np.float32)] * 2
    assert km.group_call(x, pair, outs) is None  # no quantized activations to share
    assert km.group_call(x, pair, outs, None, km.quantize_activations(x[:4])) is None  # not these activations
    rows = [km.prepare(weight(Q5_0, 16, 512)), km.prepare(weight(Q5_0, 12, 512))]  # 12: not repacked
    assert km.group_call(x, rows, [np.empty((5, 16), np.float32), np.empty((5, 12), np.float32)], None,
                         km.quantize_activations(x)) is None
    empty = GGUFTensor("w", Q5_0, (8, 0), np.zeros((8, 0), np.uint8))
    assert np.array_equal(fast(np.zeros((2, 0), np.float32), empty), np.zeros((2, 8), np.float32))
