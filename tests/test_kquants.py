"""Q5_0, Q5_1 and K-quant blocks: dequantization bit-equal to gguf, Q8_K activations bit-equal to llama.cpp,
fast matmuls within derived bounds, bit-identical across thread counts and SIMD formulations.

Matmul bounds (u = 2^-24, the float32 unit roundoff; derived, not tuned):

* Against the *exact* product (float64) of the dequantized weights and the activations as the kernel
  rounds them (``d * q`` per 32-block for Q5_0/Q5_1, per 256-block for the K-quants): the kernel's integer
  sums are exact, so its errors are float32 roundings. Each term it accumulates (one int32 lane of a
  block times a scale product; K-quants with mins have two per block, the scale part and the min part,
  and Q5_1 has its ``m d_x Σq`` terms) is the product of a rounded scale and a rounded int->float
  conversion: relative error <= 2u. Each fused accumulation rounds a partial sum bounded by
  ``S = Σ |terms|``: <= u S per term. The horizontal sum (3 levels) and the final add: <= 4u S. The
  reference's own dequantized weights were rounded too (``(d sc) q - dmin m``: <= 2u per weight). So
  ``|out - exact| <= (2 + n_terms + 4 + 2) u S <= (2 n_blocks + 8) u S`` with ``n_terms <= 2 n_blocks``
  per lane, where ``S`` sums the separate parts (``|d sc q| + |dmin m|``) of each weight times ``|x̂|``.
* Against dequantize-then-float32-matmul on the unquantized activations: the activation rounding moves
  each x by at most ``|d| / 2`` of its block (times 1 + 1e-4 for the float32 rounding of ``x / d``), so
  ``|out - x @ W^T| <= Σ_k |w_k| |d_block(k)| (1/2 + 1e-4)`` plus the bound above plus the reference's
  float32 accumulation (``2 n_in u Σ |w| |x|``). Q5_0/Q5_1 use 32-value activation blocks, the K-quants
  256-value ones (their bound is looser: one scale for 8x more values). The RMS error is checked against
  the uniform-rounding prediction ``sqrt(Σ w² d² / 12)`` too, not only against the worst case.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from gguf import quants as gq

from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import simd
from minfer.errors import ModelError
from minfer.formats.block_types import GGMLType, block_size, row_nbytes, type_size
from minfer.formats.kquants import KQUANT_DEQUANTIZERS
from minfer.formats.tensors import WeightTensor

U = 2.0**-24
K_TYPES = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
Q5_TYPES = [GGMLType.Q5_0, GGMLType.Q5_1]
ALL_TYPES = Q5_TYPES + K_TYPES
# byte offsets of each block's f16 fields: (scale d, offset/min or None)
F16_FIELDS = {
    GGMLType.Q5_0: (0, None),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108, None),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208, None),
}
# 1 token: decode only; 3: prefill tail only; 8: one whole tile; 21: tiles + tail
TOKENS = [1, 3, 8, 21]


GENERIC_TEST = "test_generic_simd_path_gives_the_same_bits"


@pytest.fixture(scope="module", autouse=True)
def _compiled(request, tmp_path_factory):
    """Compile here; and, when the generic-SIMD test is selected, start its subprocess first, so that its
    JIT (a cold cache costs ~15 s) runs on the other CPU while this process compiles and tests."""
    generic = None
    if simd.AVX2 and any(item.name == GENERIC_TEST for item in request.session.items):
        generic = _start_generic(tmp_path_factory.mktemp("generic"), request.config.cache.mkdir("numba-kquant-generic"))
    km.warmup()
    yield generic
    if generic is not None and generic[0].poll() is None:  # the test did not run to collect it
        generic[0].kill()
        generic[0].wait()


def _ids(t: GGMLType) -> str:
    return t.name


def random_blocks(t: GGMLType, n_rows: int, n: int, rng: np.random.Generator, scale: float = 1e-2) -> np.ndarray:
    """Valid random rows of ``t``: random bytes everywhere (every bit pattern of the quants and the packed
    scales) except the f16 fields, which get sane values of either sign around ``scale``."""
    nb = n // block_size(t)
    raw = rng.integers(0, 256, (n_rows, nb, type_size(t)), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        if off is not None:
            v = rng.uniform(0.25, 1.0, (n_rows, nb)) * rng.choice([-1.0, 1.0], (n_rows, nb)) * scale
            raw[:, :, off : off + 2] = v.astype(np.float16).view(np.uint8).reshape(n_rows, nb, 2)
    return raw.reshape(n_rows, -1)


def weight(t: GGMLType, n_out: int, n_in: int, seed: int = 0) -> WeightTensor:
    rng = np.random.default_rng(seed)
    if t in Q5_TYPES:  # gguf quantizes these: Gaussian weights, one block with a clear offset
        w = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.1
        w[0, :32] += 0.5
        raw = gq.quantize(w, t)
    else:  # gguf-py cannot quantize K-quants
        raw = random_blocks(t, n_out, n_in, rng)
    return WeightTensor("w", t, (n_out, n_in), raw)


def acts(n_tok: int, n_in: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[:, 256:288] *= 30.0  # blocks of very different scales
    x[0, :256] = 0.0  # an all-zero block: d = 0 for every block size
    return x


def deq(raw: np.ndarray, t: GGMLType, n: int) -> np.ndarray:
    return KQUANT_DEQUANTIZERS[t](raw, n)


# --- dequantization --------------------------------------------------------------------------------


def test_registry():
    assert set(KQUANT_DEQUANTIZERS) == set(ALL_TYPES)
    assert km.SUPPORTED_TYPES == tuple(ALL_TYPES)
    assert all(km.supports(t) for t in ALL_TYPES)
    assert not km.supports(GGMLType.Q4_1) and not km.supports(GGMLType.F32)


@pytest.mark.parametrize("t", Q5_TYPES, ids=_ids)
def test_dequantize_gguf_quantized_bit_equal(t):
    rng = np.random.default_rng(int(t))
    x = rng.standard_normal((7, 256)).astype(np.float32) * rng.uniform(0.01, 10, (7, 1)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (d = 0)
    x[1, 32:64] = -3.0  # a constant block
    raw = gq.quantize(x, t)
    assert raw.shape == (7, row_nbytes(t, 256))
    ours = deq(raw, t, 256)
    assert ours.dtype == np.float32 and ours.shape == (7, 256)
    assert np.array_equal(ours.view(np.uint32), gq.dequantize(raw, t).reshape(7, 256).view(np.uint32))


@pytest.mark.parametrize("t", ALL_TYPES, ids=_ids)
def test_dequantize_random_blocks_bit_equal(t):
    rng = np.random.default_rng(10 + int(t))
    n = 2 * 256
    raws = [random_blocks(t, 5, n, rng), rng.integers(0, 256, (5, row_nbytes(t, n)), dtype=np.uint8)]
    for raw in raws:  # sane scales; then anything at all, f16 NaN/inf/subnormal scales included
        with np.errstate(invalid="ignore", over="ignore"):
            ours = deq(raw, t, n)
            theirs = gq.dequantize(raw, t).reshape(5, n)
        assert ours.dtype == np.float32
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    # a view of a bigger buffer (as an mmapped tensor is) works the same
    big = np.zeros((5, row_nbytes(t, n) + 7), np.uint8)
    big[:, 3 : 3 + row_nbytes(t, n)] = raws[0]
    assert np.array_equal(deq(big[:, 3 : 3 + row_nbytes(t, n)], t, n), deq(raws[0], t, n))


def _layout_value(t: GGMLType, blk: np.ndarray, i: int) -> np.float32:
    """Value i of one block, read off the layout table in kquants' docstring, one value at a time."""

    def f16(off: int) -> np.float32:
        return np.float32(blk[off : off + 2].view(np.float16)[0])

    f32, b = np.float32, [int(v) for v in blk]
    if t in Q5_TYPES:
        qh_at = 2 if t == GGMLType.Q5_0 else 4
        qh = int(blk[qh_at : qh_at + 4].view(np.uint32)[0])
        nib = (b[qh_at + 4 + i % 16] >> (4 * (i // 16))) & 15
        q = nib | ((qh >> i) & 1) << 4
        return f16(0) * f32(q - 16) if t == GGMLType.Q5_0 else f16(0) * f32(q) + f16(2)
    if t == GGMLType.Q2_K:
        h, c, lo = i // 128, (i % 128) // 32, i % 32
        s = b[i // 16]
        q = (b[16 + 32 * h + lo] >> (2 * c)) & 3
        return (f16(80) * f32(s & 15)) * f32(q) - f16(82) * f32(s >> 4)
    if t == GGMLType.Q3_K:
        s = i // 16
        low4 = b[96 + s] & 15 if s < 8 else b[96 + s - 8] >> 4
        sc = (low4 | ((b[104 + s % 4] >> (2 * (s // 4))) & 3) << 4) - 32
        h, c, lo = i // 128, (i % 128) // 32, i % 32
        low = (b[32 + 32 * h + lo] >> (2 * c)) & 3
        hb = (b[i % 32] >> (i // 32)) & 1
        return (f16(108) * f32(sc)) * f32(low - 4 * (1 - hb))
    if t in (GGMLType.Q4_K, GGMLType.Q5_K):
        s, sb = i // 32, b[4:16]
        if s < 4:
            sc, mn = sb[s] & 63, sb[s + 4] & 63
        else:
            sc = (sb[s + 4] & 15) | (sb[s - 4] >> 6) << 4
            mn = (sb[s + 4] >> 4) | (sb[s] >> 6) << 4
        c, h, lo = i // 64, (i % 64) // 32, i % 32
        qs_at = 16 if t == GGMLType.Q4_K else 48
        q = (b[qs_at + 32 * c + lo] >> (4 * h)) & 15
        if t == GGMLType.Q5_K:
            q |= ((b[16 + i % 32] >> (i // 32)) & 1) << 4
        return (f16(0) * f32(sc)) * f32(q) - f16(2) * f32(mn)
    assert t == GGMLType.Q6_K
    h, r = i // 128, i % 128
    low = (b[64 * h + r % 64] >> (4 * (r // 64))) & 15
    high = (b[128 + 32 * h + r % 32] >> (2 * (r // 32))) & 3
    sc = int(blk[192 + i // 16 : 193 + i // 16].view(np.int8)[0])
    return (f16(208) * f32(sc)) * f32((low | high << 4) - 32)


def test_get_rows_of_a_quantized_table_gives_the_rows_dequantized_together():
    """An embedding lookup dequantizes a few rows at a time (a bound on numpy's temporaries): ids that span
    several such chunks, with repeats, give the whole table's dequantized rows bit for bit."""
    from minfer.backends.cpu import reference as ref

    t = GGMLType.Q6_K
    table = weight(t, 50, 256, seed=3)
    ids = np.random.default_rng(4).integers(0, 50, 2 * ref.GET_ROWS_CHUNK + 7)
    out = np.full((len(ids), 256), np.nan, np.float32)
    ref.get_rows(table, ids, out)
    whole = deq(table.data.reshape(50, -1), t, 256)
    assert np.array_equal(out.view(np.uint32), whole[ids].view(np.uint32))


@pytest.mark.parametrize("t", ALL_TYPES, ids=_ids)
def test_documented_layout(t):
    """The docstring's layout table, applied value by value, gives the dequantizers' results."""
    raw = random_blocks(t, 1, block_size(t), np.random.default_rng(20 + int(t)))
    ours = deq(raw, t, block_size(t))[0]
    by_hand = np.array([_layout_value(t, raw[0], i) for i in range(block_size(t))], np.float32)
    assert np.array_equal(ours.view(np.uint32), by_hand.view(np.uint32))


# --- Q8_K activations ------------------------------------------------------------------------------


def llama_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A transcription of llama.cpp's quantize_row_q8_K_ref (nearest_int's 1.5 * 2^23 trick included)."""
    n_tok, n = x.shape
    blocks = x.reshape(n_tok, n // 256, 256)
    q = np.zeros(blocks.shape, np.int8)
    d = np.zeros(blocks.shape[:2], np.float32)
    for t in range(n_tok):
        for b in range(n // 256):
            v = blocks[t, b]
            amax, mx = np.float32(0), np.float32(0)
            for j in range(256):
                if abs(v[j]) > amax:
                    amax, mx = abs(v[j]), v[j]
            if amax == 0:
                continue
            iscale = np.float32(-127.0) / mx
            shifted = (iscale * v).astype(np.float32) + np.float32(12582912.0)
            qi = (shifted.view(np.int32) & 0x007FFFFF) - 0x00400000
            q[t, b] = np.minimum(127, qi)
            d[t, b] = np.float32(1.0) / iscale
    bsums = q.reshape(n_tok, n // 256, 16, 16).astype(np.int32).sum(-1).astype(np.int16)
    return q.reshape(n_tok, n), d, bsums


def test_q8_k_activations_are_llama_cpp_bit_for_bit():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((20, 1024)).astype(np.float32) * rng.uniform(1e-3, 100, (20, 1)).astype(np.float32)
    x[0, :256] = 0.0  # all zero: d = 0, q = 0
    x[1, 256:512] = 3.0  # constant positive: max > 0, iscale < 0
    x[2, 512:768] = -3.0
    x[3, 5], x[3, 9] = 7.0, -7.0  # equal magnitudes: the first one sets the sign
    x[4, :256] = rng.integers(-4, 5, 256) * np.float32(0.25)  # many exact .5 ties for nearest_int
    q, d, bsums = llama_q8_k(x)
    for xs in (x, x[:5]):  # the parallel (>= 16 tokens) and the serial quantizer
        got = km.quantize_activations_q8_k(xs)
        n = xs.shape[0]
        assert np.array_equal(got.q, q[:n])
        assert np.array_equal(got.d.view(np.uint32), d[:n].view(np.uint32))
        assert np.array_equal(got.bsums, bsums[:n])
    assert -127 <= q.min() and q.max() <= 127
    with pytest.raises(ModelError, match="not a multiple of 256"):
        km.quantize_activations_q8_k(np.zeros((1, 288), np.float32))


# --- matmul ----------------------------------------------------------------------------------------


def rounded_acts(x: np.ndarray, t: GGMLType) -> tuple[np.ndarray, np.ndarray]:
    """The activations as the kernel sees them (float64) and each value's block scale |d|."""
    n_tok, n = x.shape
    if t in K_TYPES:
        xq = km.quantize_activations_q8_k(x)
        d = xq.d.astype(np.float64)
        return xq.dequantize().astype(np.float64), np.abs(np.repeat(d, 256, axis=1))
    xq = km.quantize_activations(x)
    d = xq.ds[:, :, 0].astype(np.float64)
    return (xq.q.reshape(n_tok, -1, 32) * d[..., None]).reshape(n_tok, n), np.repeat(d, 32, axis=1)


def term_scale(w: WeightTensor) -> np.ndarray:
    """|W| as the kernel's terms split it: for types with an offset/min, |d sc q| + |dmin m| per weight."""
    t, (n_out, n_in) = w.ggml_type, w.shape
    d_at, m_at = F16_FIELDS[t]
    if m_at is None:
        return np.abs(deq(w.data, t, n_in).astype(np.float64))
    parts = []
    for zero in (m_at, d_at):  # zero one f16 field, keep the other part
        raw = w.data.reshape(n_out, -1, type_size(t)).copy()
        raw[:, :, zero : zero + 2] = 0
        parts.append(np.abs(deq(raw.reshape(n_out, -1), t, n_in).astype(np.float64)))
    return parts[0] + parts[1]


def fast(x: np.ndarray, w: WeightTensor, xq=None) -> np.ndarray:
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    km.matmul(x, w, out, xq)
    return out


@pytest.mark.parametrize("t", ALL_TYPES, ids=_ids)
@pytest.mark.parametrize("n_tok", TOKENS)
def test_matmul_parity(t, n_tok):
    n_out, n_in = 37, 512  # rows: not a multiple of 4 (decode pass) nor of 16 (prefill work item)
    w = weight(t, n_out, n_in)
    x = acts(n_tok, n_in)
    out = fast(x, w)
    wd = deq(w.data, t, n_in).astype(np.float64)

    xr, d = rounded_acts(x, t)
    exact = xr @ wd.T
    scale = np.abs(xr) @ term_scale(w).T
    n_blocks = n_in // block_size(t)
    own = (2 * n_blocks + 8) * U * scale
    assert np.all(np.abs(out - exact) <= own + 1e-30)
    assert np.max(np.abs(out - exact) / (scale + 1e-30)) < 1e-6  # the "~1e-5 relative" of the spec, with room

    expected = x @ wd.astype(np.float32).T  # dequantize, then a float32 matmul
    bound = (0.5 + 1e-4) * d @ np.abs(wd).T + own + 2 * n_in * U * (np.abs(x) @ np.abs(wd).T)
    err = np.abs(out - expected)
    assert np.all(err <= bound)
    # typical size: a rounding error uniform in ±d/2 has variance d²/12
    predicted = np.sqrt(np.mean((d**2 / 12) @ (wd**2).T))
    assert 0.5 < np.sqrt(np.mean(err**2)) / predicted < 2


@pytest.mark.parametrize("t", ALL_TYPES, ids=_ids)
def test_prefill_rows_equal_decode_rows(t):
    w = weight(t, 37, 512, seed=4)
    x = acts(21, 512, seed=5)
    many = fast(x, w)
    for i in range(x.shape[0]):
        one = fast(x[i : i + 1], w)
        assert one.view(np.uint32).tolist() == many[i : i + 1].view(np.uint32).tolist(), i


@pytest.mark.parametrize("t", ALL_TYPES, ids=_ids)
def test_bit_identical_at_1_and_2_threads(t):
    w = weight(t, 70, 512, seed=6)
    saved = numba.get_num_threads()
    for n_tok in (1, 21):
        x = acts(n_tok, 512, seed=7)
        results = []
        try:
            for n in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
                numba.set_num_threads(n)
                results.append(fast(x, w))
        finally:
            numba.set_num_threads(saved)
        assert results[0].view(np.uint32).tolist() == results[1].view(np.uint32).tolist()


@pytest.mark.parametrize("t", [GGMLType.Q5_1, GGMLType.Q4_K], ids=_ids)
def test_small_weights_shared_activations_and_layouts(t):
    x = acts(9, 256, seed=8)
    for n_out in (1, 3, 4, 5):  # fewer rows than a decode pass: padded
        w = weight(t, n_out, 256, seed=n_out)
        wd = deq(w.data, t, 256).astype(np.float64)
        xr, _ = rounded_acts(x, t)
        np.testing.assert_allclose(fast(x, w), xr @ wd.T, rtol=0, atol=1e-6 * float(np.abs(xr).sum(1).max()))
    w = weight(t, 20, 256)
    base = fast(x, w)
    xq = km.quantize_activations_q8_k(x) if t in K_TYPES else km.quantize_activations(x)
    assert np.array_equal(fast(x, w, xq), base)
    out = np.full((9, 40), np.nan, np.float32)
    km.matmul(x.astype(np.float64), w, out[:, ::2])  # non-contiguous output, float64 input
    assert np.array_equal(out[:, ::2], base)
    assert np.array_equal(fast(np.asfortranarray(x), w), base)
    empty = WeightTensor("w", t, (3, 0), np.zeros((3, 0), np.uint8))
    assert np.array_equal(fast(np.zeros((2, 0), np.float32), empty), np.zeros((2, 3), np.float32))


def test_errors_name_the_problem():
    x = np.zeros((2, 256), np.float32)
    out = np.zeros((2, 8), np.float32)
    with pytest.raises(ModelError, match="no K-quant matmul for ggml type Q4_1"):
        km.matmul(x, WeightTensor("w", GGMLType.Q4_1, (8, 256), np.zeros((8, 160), np.uint8)), out)
    with pytest.raises(ModelError, match="not whole Q4_K blocks of 256"):
        bad = WeightTensor("w", GGMLType.Q4_K, (8, 288), np.zeros((8, 1), np.uint8))
        km.matmul(np.zeros((2, 288), np.float32), bad, out)
    w = weight(GGMLType.Q4_K, 8, 256)
    with pytest.raises(ModelError, match="bytes of data"):
        km.matmul(x, WeightTensor("w", GGMLType.Q4_K, (8, 256), w.data[:, :100]), out)
    with pytest.raises(ModelError, match="do not match"):
        km.matmul(np.zeros((2, 512), np.float32), w, out)
    with pytest.raises(ModelError, match="output must be float32"):
        km.matmul(x, w, np.zeros((2, 7), np.float32))
    with pytest.raises(ModelError, match="need Q8_K activations"):
        km.matmul(x, w, out, km.quantize_activations(x))
    with pytest.raises(ModelError, match="need Q8 activations"):
        km.matmul(x, weight(GGMLType.Q5_0, 8, 256), out, km.quantize_activations_q8_k(x))


_SUBPROCESS_SCRIPT = """
import sys
import numpy as np
from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import simd
from minfer.formats.tensors import WeightTensor
from minfer.formats.quants import GGMLType

data = np.load(sys.argv[1])
res = {"avx2": np.array(simd.AVX2)}
for name in sys.argv[3].split(","):
    w = WeightTensor("w", GGMLType[name.split("@")[0]], tuple(data[name + "_shape"]), data[name])
    for n in (1, 13):
        out = np.empty((n, w.shape[0]), np.float32)
        km.matmul(data["x"][:n], w, out)
        res[f"{name}_{n}"] = out
np.savez(sys.argv[2], **res)
"""


def _generic_inputs() -> tuple[np.ndarray, dict[str, WeightTensor]]:
    weights = {t.name: weight(t, 23, 512, seed=10) for t in ALL_TYPES}
    for t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q5_0):  # whole groups of 8: repacked
        weights[f"{t.name}@24"] = weight(t, 24, 512, seed=11)
    return acts(13, 512, seed=9), weights


def _start_generic(tmp: Path, cache: Path) -> tuple[subprocess.Popen, Path]:
    """Run the kernels with MINFER_GENERIC_SIMD=1 in a fresh interpreter with its own numba cache."""
    x, weights = _generic_inputs()
    arrays: dict[str, np.ndarray] = {"x": x}
    for name, w in weights.items():
        arrays[name], arrays[name + "_shape"] = np.ascontiguousarray(w.data), np.array(w.shape)
    np.savez(tmp / "in.npz", **arrays)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), MINFER_GENERIC_SIMD="1")
    env["PYTHONPATH"] = str(Path(km.__file__).parents[3]) + os.pathsep + env.get("PYTHONPATH", "")
    (tmp / "run.py").write_text(_SUBPROCESS_SCRIPT)
    cmd = [sys.executable, str(tmp / "run.py"), str(tmp / "in.npz"), str(tmp / "out.npz"), ",".join(weights)]
    return subprocess.Popen(cmd, env=env), tmp / "out.npz"


@pytest.mark.slow
@pytest.mark.skipif(not simd.AVX2, reason="this host already runs the generic path")
def test_generic_simd_path_gives_the_same_bits(_compiled):
    """The portable LLVM vectors (non-x86 CPUs) compute the same integer lanes as the AVX2 instructions."""
    proc, out_path = _compiled
    assert proc.wait(timeout=300) == 0
    got = np.load(out_path)
    assert not got["avx2"]
    x, weights = _generic_inputs()
    for name, w in weights.items():
        for n in (1, 13):
            assert got[f"{name}_{n}"].view(np.uint32).tolist() == fast(x[:n], w).view(np.uint32).tolist(), name
