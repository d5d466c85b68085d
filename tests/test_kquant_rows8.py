"""Q4_K, Q5_K and Q6_K on the repacked eight-row layouts (``kquant_rows8``): what ``kquant_matmul.matmul`` runs
for such weights whose rows come in whole groups of eight.

The layout is checked against the file's values through an independent reading of its documented
bytes; the products against the exact float64 product of the dequantized weights and the Q8_K-rounded
activations, with the bound of ``test_kquants``; and the determinism rules: a token's row is the same
bits alone or in a prompt (register quads, their tail, any token count), at 1 and 2 threads, and with
activations shared or quantized in the call. (Rows that are not whole groups keep the row-by-row
kernel, which ``test_kquants`` covers with its 37-row weights.)
"""

from __future__ import annotations

import mmap

import numba
import numpy as np
import pytest
from test_kquants import acts, deq, fast, rounded_acts, term_scale, weight

from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import kquant_rows8 as r8
from minfer.formats.block_types import GGMLType
from minfer.formats.tensors import WeightTensor

U = 2.0**-24
Q4_K, Q5_K, Q6_K = GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K
TYPES = [Q4_K, Q5_K, Q6_K]


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    km.warmup()


def _f16_rows(sb: np.ndarray, at: int) -> np.ndarray:
    """The eight rows' float16 at byte ``at`` of each repacked super-block, as float64 ``[n_out, nbk]``."""
    g, nbk = sb.shape[:2]
    h = sb[..., at : at + 16].copy().view(np.float16).astype(np.float64)
    return h.reshape(g, nbk, 8).transpose(0, 2, 1).reshape(8 * g, nbk)


def _unpack_q4_k(packed: np.ndarray, n_out: int, n_in: int, five: bool = False) -> np.ndarray:
    """The float64 weights read back from the repacked bytes as the module documents them: value = d sc q -
    dmin m per 32-value sub-block (``five``: Q5_K, whose fifth bits sit after the nibbles)."""
    g, nbk = n_out // 8, n_in // 256
    x = 256 if five else 0
    sb = packed.reshape(g, nbk, r8.SB_BYTES + x)
    q = sb[..., :1024].reshape(g, nbk, 8, 4, 8, 4)  # [g, b, j, c, row, k]
    vals = np.concatenate([q & 15, q >> 4], axis=5)  # [..., row, 8]: values 8c + k, 8c + 4 + k
    vals = vals.transpose(0, 4, 1, 2, 3, 5).reshape(n_out, nbk, 8, 32).astype(np.float64)
    if five:  # register m = value 4m + k: bit m of byte [row, k]
        top = sb[..., 1024:1280].reshape(g, nbk, 8, 8, 4)  # [g, b, j, row, k]
        bits = np.stack([(top >> m) & 1 for m in range(8)], axis=4)  # [g, b, j, row, m, k]
        vals += 16 * bits.transpose(0, 3, 1, 2, 4, 5).reshape(n_out, nbk, 8, 32)
    sc = sb[..., x + 1024 : x + 1088].reshape(g, nbk, 8, 8).transpose(0, 3, 1, 2).reshape(n_out, nbk, 8)
    mn = sb[..., x + 1088 : x + 1152].reshape(g, nbk, 4, 8, 2).transpose(0, 3, 1, 2, 4).reshape(n_out, nbk, 8)
    d, nd = _f16_rows(sb, x + 1152)[..., None, None], _f16_rows(sb, x + 1168)[..., None, None]
    return (d * sc[..., None] * vals + nd * mn[..., None]).reshape(n_out, n_in)


def _unpack_q6_k(packed: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """As ``_unpack_q4_k``: value = d sc (u - 32) per 16-value sub-block."""
    g, nbk = n_out // 8, n_in // 256
    sb = packed.reshape(g, nbk, r8.Q6_SB_BYTES)
    sub = sb[..., :1536].reshape(g, nbk, 16, 3, 8, 4)  # [g, b, s, register, row, k]
    n0, n1, top = sub[..., 0, :, :], sub[..., 1, :, :], sub[..., 2, :, :]
    low = np.stack([n0 & 15, n0 >> 4, n1 & 15, n1 >> 4], axis=3)  # [g, b, s, m, row, k]: value 4m + k
    high = np.stack([(top >> (2 * m)) & 3 for m in range(4)], axis=3)
    u = (low | (high << 4)).transpose(0, 4, 1, 2, 3, 5).reshape(n_out, nbk, 16, 16).astype(np.float64)
    sc = sb[..., 1536:1664].view(np.int8).reshape(g, nbk, 8, 8, 2).transpose(0, 3, 1, 2, 4).reshape(n_out, nbk, 16)
    d = _f16_rows(sb, 1664)[..., None, None]
    return (d * sc[..., None] * (u - 32)).reshape(n_out, n_in)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_repacked_bytes_hold_the_files_values(t):
    w = weight(t, 24, 768, seed=20)
    repack, _ = r8.REPACKED[t]
    packed = repack(w.data, 24, 768)
    if t == Q6_K:
        got = _unpack_q6_k(packed, 24, 768)
    else:
        got = _unpack_q4_k(packed, 24, 768, five=t == Q5_K)
    np.testing.assert_array_equal(got, deq(w.data, t, 768).astype(np.float64))


def test_which_weights_take_the_repacked_layout():
    assert km.prepare(weight(Q4_K, 16, 512)).rows8 is not None
    assert km.prepare(weight(Q4_K, 37, 512)).rows8 is None  # not whole groups: the row-by-row kernel
    assert km.prepare(weight(Q6_K, 16, 512)).rows8 is not None
    assert km.prepare(weight(Q5_K, 16, 512)).rows8 is not None
    assert km.prepare(weight(GGMLType.Q3_K, 16, 512)).rows8 is None


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 3, 4, 5, 8, 9, 21])
def test_matmul_parity(t, n_tok):
    n_out, n_in = 40, 1024
    w = weight(t, n_out, n_in, seed=21)
    x = acts(n_tok, n_in)
    out = fast(x, w)
    wd = deq(w.data, t, n_in).astype(np.float64)
    xr, _ = rounded_acts(x, t)
    exact = xr @ wd.T
    scale = np.abs(xr) @ term_scale(w).T
    n_blocks = n_in // 256
    assert np.all(np.abs(out - exact) <= (2 * n_blocks + 8) * U * scale + 1e-30)
    assert np.max(np.abs(out - exact) / (scale + 1e-30)) < 1e-6


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_prefill_rows_equal_decode_rows(t):
    w = weight(t, 48, 512, seed=22)
    x = acts(23, 512, seed=23)  # five register quads and a tail of three
    many = fast(x, w)
    for i in range(x.shape[0]):
        one = fast(x[i : i + 1], w)
        assert one.view(np.uint32).tolist() == many[i : i + 1].view(np.uint32).tolist(), i
    for k in (2, 3, 6, 7, 16):  # the super-block-major order of a few tokens (kquant_rows8.SMALL_PASS_TOKENS)
        assert fast(x[:k], w).view(np.uint32).tolist() == many[:k].view(np.uint32).tolist(), k


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_bit_identical_at_1_and_2_threads_and_with_shared_activations(t):
    w = weight(t, 64, 512, seed=24)
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
        shared = np.empty_like(results[0])
        km.matmul(x, p, shared, km.quantize_activations_q8_k(x))
        assert np.array_equal(shared, results[0])
        direct = np.empty_like(shared)
        km.direct_call(x, p, direct, None)()
        assert np.array_equal(direct, results[0])


@pytest.mark.parametrize("t", [*TYPES, GGMLType.Q5_0], ids=lambda t: t.name)  # Q5_0: block32_rows8's layout
def test_file_pages_of_a_repacked_weight_are_given_back(t, tmp_path):
    """The repacked copy replaces the file's resident pages instead of sitting beside them."""
    w = weight(t, 256, 2048, seed=26)
    path = tmp_path / "w.bin"
    path.write_bytes(w.data.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped = np.frombuffer(mm, np.uint8).reshape(w.data.shape)
    x = acts(3, 2048, seed=27)
    before = fast(x, w)
    assert int(mapped.sum()) > 0  # every page of the mapping read in

    def resident_kib() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile:"))

    held = resident_kib()
    after = fast(x, WeightTensor("w", t, w.shape, mapped))
    assert held - resident_kib() > 0.8 * w.data.nbytes / 1024
    assert after.view(np.uint32).tolist() == before.view(np.uint32).tolist()
    assert int(mapped[-1].sum()) == int(w.data[-1].sum())  # still readable: the file is still there


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 6, 13])
def test_weights_reading_one_input_in_one_call_give_their_own_bits(t, n_tok):
    """q/k/v (gate/up) in one parallel loop: each output equals its own matmul's, bit for bit."""
    ws = [km.prepare(weight(t, n_out, 512, seed=30 + i)) for i, n_out in enumerate((40, 16, 24))]
    x = acts(n_tok, 512, seed=33)
    for members in (ws[:2], ws):
        outs = [np.full((n_tok, w.n_out), np.nan, np.float32) for w in members]
        call = km.group_call(x, members, outs)
        assert call is not None
        call()
        for w, out in zip(members, outs, strict=True):
            own = fast(x, w.tensor)
            assert out.view(np.uint32).tolist() == own.view(np.uint32).tolist()


def test_only_weights_of_one_repacked_type_and_input_width_are_grouped():
    x = acts(2, 512, seed=34)
    q4, q6 = km.prepare(weight(Q4_K, 16, 512)), km.prepare(weight(Q6_K, 16, 512))
    rows = km.prepare(weight(Q4_K, 37, 512))  # not whole groups of eight: not repacked
    wide = km.prepare(weight(Q4_K, 16, 768))
    for members in ([q4, q6], [q4, rows], [q4, wide], [q4], [q4] * 4):
        outs = [np.empty((2, w.n_out), np.float32) for w in members]
        assert km.group_call(x, members, outs) is None
    assert km.group_call(x, [q4, q4], [np.empty((2, 16), np.float32), np.empty((2, 8), np.float32)]) is None
