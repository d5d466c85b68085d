"""Each block type dequantizes bit-exactly like the gguf package's reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from gguf import quants as gq
from numba import njit

from minfer.errors import ContextOverflowError, ModelError
from minfer.formats.quants import (
    GGMLType,
    _f16_bits_to_f32,
    _f32_to_f16_bits,
    dequantize_q8_0_rows_into,
    dequantize_rows,
    quantize_q8_0_into,
    quantize_q8_0_rows,
    row_nbytes,
)


def _raw(values: np.ndarray, t: GGMLType) -> np.ndarray:
    if t == GGMLType.F32:
        return values.astype(np.float32).view(np.uint8)
    q = gq.quantize(values.astype(np.float32), t)
    return q if q.dtype == np.uint8 else q.view(np.uint8)  # F16/BF16 come back as 16-bit arrays


@pytest.mark.parametrize("t", [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1])
def test_dequantize_bit_equal_to_gguf(t):
    rng = np.random.default_rng(int(t))
    x = rng.standard_normal((7, 256)).astype(np.float32) * rng.uniform(0.01, 10, (7, 1)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (d = 0)
    x[1, 32:64] = -3.0  # a constant block
    raw = _raw(x, t)
    assert raw.shape == (7, row_nbytes(t, 256))
    ours = dequantize_rows(raw, t, 256)
    theirs = gq.dequantize(raw, t).reshape(7, 256)
    assert ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


def test_q4_1_layout_by_hand():
    # one block: d = 0.5, m = -1, nibbles: byte j = (j+16 in the high nibble... as values j%16, (15-j)%16)
    d, m = np.float16(0.5), np.float16(-1.0)
    lo = np.arange(16, dtype=np.uint8)
    hi = 15 - lo
    block = np.concatenate([np.array([d, m], np.float16).view(np.uint8), lo | (hi << 4)])
    out = dequantize_rows(block[None, :], GGMLType.Q4_1, 32)[0]
    np.testing.assert_array_equal(out[:16], 0.5 * lo - 1.0)
    np.testing.assert_array_equal(out[16:], 0.5 * hi - 1.0)


def test_unsupported_type_is_a_clear_error():
    with pytest.raises(ModelError, match="IQ2_XXS is not supported yet"):
        dequantize_rows(np.zeros((1, 66), np.uint8), GGMLType.IQ2_XXS, 256)


def test_row_not_whole_blocks():
    with pytest.raises(ModelError, match="not a whole number of Q8_0 blocks"):
        row_nbytes(GGMLType.Q8_0, 33)


# ---------------------------------------------------------------------------------------------------------
# Q8_0 quantization for the KV cache: quantize_q8_0_rows / quantize_q8_0_into / dequantize_q8_0_rows_into
#
# Measured on the 2-vCPU dev box (AMD EPYC Zen 3, numba 0.61), n = 192 (SmolLM2's n_kv_embd), best of 5;
# the kernel figures exclude the Python wrapper's checks:
#   rows = 1:   quantize_q8_0_into 1.5 us (kernel 0.7), quantize_q8_0_rows 1.3 us,
#               dequantize_q8_0_rows_into 1.2 us (kernel 0.5); gguf: quantize 50 us, dequantize 28 us
#   rows = 512: quantize_q8_0_into 114 us (kernel 110), quantize_q8_0_rows 112 us,
#               dequantize_q8_0_rows_into 14 us (kernel 13.5); gguf: quantize 1550 us, dequantize 510 us
# ---------------------------------------------------------------------------------------------------------


def _gguf_q8_0(x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():  # numpy warns on the NaN -> int8 casts of inf/NaN blocks
        warnings.simplefilter("ignore", RuntimeWarning)
        return gq.quantize(x, GGMLType.Q8_0)


def _gguf_dequantize(raw: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():  # an inf scale times q = 0 (NaN, in both implementations)
        warnings.simplefilter("ignore", RuntimeWarning)
        return gq.dequantize(raw, GGMLType.Q8_0)


def _blocks_nan(x: np.ndarray) -> np.ndarray:
    return np.isnan(x.reshape(-1, 32)).any(axis=1)


def _assert_q8_0_equal(ours: np.ndarray, theirs: np.ndarray, x: np.ndarray) -> None:
    """Bit-equal, except that a block holding a NaN only needs q equal and d a NaN (see quants.py)."""
    ours, theirs = ours.reshape(-1, 34), theirs.reshape(-1, 34)
    nan = _blocks_nan(x)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    np.testing.assert_array_equal(ours[:, 2:], theirs[:, 2:])
    assert np.isnan(ours[nan, :2].copy().view(np.float16)).all()


def _edge_rows() -> np.ndarray:
    """One block per row, each an edge case of the reference's arithmetic."""
    rows = []

    def block(*vals, fill=0.0):
        b = np.full(32, fill, np.float32)
        b[: len(vals)] = vals
        rows.append(b)

    block()  # all zero: d = 0, id = 0
    block(fill=-0.0)  # negative zeros
    block(-0.0, 0.0, -0.0, 5.0)
    block(127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.49999976, -3.50000024)  # d = 1: exact ties
    block(254.0, 1.0, 3.0, -5.0, 7.0, -253.0)  # d = 2: x * id = k + 0.5 again
    block(fill=-3.0)  # constant block
    block(127.0, 0.49999997, -0.49999997, 1.4999999)  # d = 1, just below ties (float32 +0.5 would round up)
    block(65504.0 * 127, 1.0, -7e6)  # d = 65504: the largest finite f16
    block(65520.0 * 127, 3.0)  # d rounds to f16 inf; q still exact
    block(1e30, -1e30, 3e29)  # far beyond f16: d = inf
    block(3.4e38, -1.7e38)  # near float32 max
    block(np.inf, 1.0, -2.0)  # inf: id = 0, q = 0 (inf * 0 = NaN -> 0)
    block(-np.inf, np.inf)
    block(1e-5, -3e-6, 2e-6)  # d is an f16 subnormal
    block(2.0**-24 * 127 * 1.5, 1e-9)  # d exactly halfway between two f16 subnormals
    block(1e-36, -4e-37)  # d a float32 subnormal with a finite 1/d
    block(3e-37, -1e-37)  # 1/d overflows: x * id = +-inf -> 0
    block(1e-40, -1e-45)  # float32 subnormal inputs
    block(*np.arange(32, dtype=np.float32) - 16)
    return np.stack(rows)


def test_q8_0_quantize_bit_equal_to_gguf_random():
    rng = np.random.default_rng(80)
    x = rng.standard_normal((257, 192)).astype(np.float32) * rng.uniform(1e-3, 1e3, (257, 1)).astype(np.float32)
    np.testing.assert_array_equal(quantize_q8_0_rows(x), _gguf_q8_0(x))
    # every binary exponent float32 has, per block
    w = rng.standard_normal((4000, 32)) * np.exp2(rng.uniform(-149, 127, (4000, 1)))
    w = np.clip(w, -3e38, 3e38).astype(np.float32)
    np.testing.assert_array_equal(quantize_q8_0_rows(w), _gguf_q8_0(w))


def test_q8_0_quantize_edge_blocks():
    x = _edge_rows()
    ours = quantize_q8_0_rows(x)
    np.testing.assert_array_equal(ours, _gguf_q8_0(x))
    q = ours[:, 2:].view(np.int8)
    assert not ours[:2].any()  # zero blocks: d = +0, q = 0
    np.testing.assert_array_equal(q[3, :11], [127, 1, 2, 3, -1, -2, -3, 127, -127, 3, -4])  # half away from 0
    np.testing.assert_array_equal(q[6, :4], [127, 0, 0, 1])


def test_q8_0_quantize_random_bit_patterns():
    # every float32 pattern: NaNs, infs, subnormals, mixed magnitudes in one block
    rng = np.random.default_rng(81)
    x = rng.integers(0, 2**32, (3000, 64), dtype=np.uint64).astype(np.uint32).view(np.float32)
    _assert_q8_0_equal(quantize_q8_0_rows(x), _gguf_q8_0(x), x)


def test_q8_0_quantize_nan_block():
    x = np.ones((1, 64), np.float32)
    x[0, 5] = np.nan
    ours = quantize_q8_0_rows(x)
    _assert_q8_0_equal(ours, _gguf_q8_0(x), x)
    assert ours[0, :2].view(np.uint16)[0] == 0x7E00 and not ours[0, 2:34].any()
    np.testing.assert_array_equal(ours[0, 34:], _gguf_q8_0(x)[0, 34:])  # the other block is untouched by it


def test_q8_0_quantize_casts_like_gguf():
    x = np.random.default_rng(82).standard_normal((3, 96))  # float64: gguf casts to float32 first
    np.testing.assert_array_equal(quantize_q8_0_rows(x), _gguf_q8_0(x))
    out = np.empty((3, 102), np.uint8)
    assert quantize_q8_0_rows(x, out) is out
    np.testing.assert_array_equal(out, _gguf_q8_0(x))


def test_q8_0_dequantize_bit_equal_to_gguf():
    rng = np.random.default_rng(83)
    edges = _edge_rows()
    x = np.concatenate(
        [rng.standard_normal((40, 64)).astype(np.float32) * 7, edges[: len(edges) // 2 * 2].reshape(-1, 64)]
    )
    raw = _gguf_q8_0(x)
    out = np.full((len(raw) + 3, 64), np.nan, np.float32)
    dequantize_q8_0_rows_into(raw, np.arange(len(raw), dtype=np.int32), out)
    theirs = _gguf_dequantize(raw)
    np.testing.assert_array_equal(out[: len(raw)].view(np.uint32), theirs.view(np.uint32))
    assert np.isnan(out[len(raw) :]).all()  # rows past stop - start are not written
    # arbitrary bytes: every f16 scale pattern (NaN scales: NaN results, payloads not carried)
    raw = rng.integers(0, 256, (500, 68), dtype=np.uint8)
    out = np.empty((500, 64), np.float32)
    dequantize_q8_0_rows_into(raw, np.arange(500, dtype=np.int32), out)
    theirs = _gguf_dequantize(raw)
    nan = np.isnan(theirs)
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), theirs[~nan].view(np.uint32))


@njit
def _to_f16_bits(x, out):
    for i in range(x.shape[0]):
        out[i] = _f32_to_f16_bits(x[i])


@njit
def _from_f16_bits(h, out):
    for i in range(h.shape[0]):
        out[i] = _f16_bits_to_f32(h[i])


def test_f16_scale_conversions_match_numpy():
    h = np.arange(65536, dtype=np.int32)
    got = np.empty(65536, np.float32)
    _from_f16_bits(h, got)
    want = h.astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()
    # float32 -> f16: a stride through all 2**32 patterns plus every rounding boundary of the half grid
    bits = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32)
    half_grid = np.arange(0x7C01, dtype=np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    near = (half_grid[:, None].astype(np.int64) + np.arange(-2, 3) * 0x1000).clip(0, 0x7F800000).astype(np.uint32)
    bits = np.concatenate([bits, near.ravel(), near.ravel() | np.uint32(0x80000000)])
    x = bits.view(np.float32)
    got16 = np.empty(x.shape[0], np.int32)
    _to_f16_bits(x, got16)
    with warnings.catch_warnings():  # "overflow encountered in cast": the inf results are what we compare
        warnings.simplefilter("ignore", RuntimeWarning)
        want16 = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got16[~nan], want16[~nan])
    assert (got16[nan] == 0x7E00).all()


def test_q8_0_into_variants_equal_plain():
    rng = np.random.default_rng(84)
    x = rng.standard_normal((9, 192)).astype(np.float32)
    plain = quantize_q8_0_rows(x)
    region = np.full((20, 204), 0xAB, np.uint8)
    rows = np.array([3, 0, 19, 7, 8, 12, 1, 15, 4], np.int32)
    quantize_q8_0_into(x, region, rows)
    np.testing.assert_array_equal(region[rows], plain)
    untouched = np.setdiff1d(np.arange(20), rows)
    assert (region[untouched] == 0xAB).all()
    quantize_q8_0_into(x[:1], region, np.array([5], np.int64))  # a decode-sized store, int64 rows
    np.testing.assert_array_equal(region[5], plain[0])
    # the window read of a slice equals gguf's dequantization of the same rows
    out = np.empty((20, 192), np.float32)
    dequantize_q8_0_rows_into(region, np.arange(3, 9, dtype=np.int32), out)
    np.testing.assert_array_equal(out[:6], gq.dequantize(region[3:9], GGMLType.Q8_0))
    # rows in any order (a window read through the KV cache's row map)
    dequantize_q8_0_rows_into(region, rows, out)
    np.testing.assert_array_equal(out[: len(rows)], gq.dequantize(region[rows], GGMLType.Q8_0))
    dequantize_q8_0_rows_into(region, np.zeros(0, np.int32), out)  # an empty window is fine


def test_q8_0_errors_name_the_problem_and_write_nothing():
    x = np.ones((2, 64), np.float32)
    region = np.zeros((4, 68), np.uint8)
    with pytest.raises(ModelError, match="not a whole number of Q8_0 blocks"):
        quantize_q8_0_rows(np.ones((2, 48), np.float32))
    with pytest.raises(ContextOverflowError, match=r"row 4 \(of input row 1\) is outside the region of 4 rows"):
        quantize_q8_0_into(x, region, np.array([0, 4]))
    with pytest.raises(ContextOverflowError, match="row -1"):
        quantize_q8_0_into(x, region, np.array([-1, 0]))
    assert not region.any()  # the in-range row 0 was not written either
    with pytest.raises(ValueError, match="do not fit"):
        quantize_q8_0_into(x, np.zeros((4, 34), np.uint8), np.array([0, 1]))
    with pytest.raises(ValueError, match="do not fit"):
        quantize_q8_0_into(x, region, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="float32"):
        quantize_q8_0_into(x.astype(np.float64), region, np.array([0, 1]))
    with pytest.raises(ValueError, match="integer"):
        quantize_q8_0_into(x, region, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="uint8"):
        quantize_q8_0_rows(x, np.zeros((2, 68), np.int8))
    out = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError, match=r"rows \[2, 3, 4\]\.\.\. are not all within"):
        dequantize_q8_0_rows_into(region, np.arange(2, 5, dtype=np.int32), out)
    with pytest.raises(ValueError, match=r"rows \[0, 1, 2, 3\]"):
        dequantize_q8_0_rows_into(region, np.arange(4, dtype=np.int32), out[:3])
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_q8_0_rows_into(region, np.zeros(1, np.int32), np.zeros((4, 32), np.float32))
    with pytest.raises(ValueError, match="1-D int32"):
        dequantize_q8_0_rows_into(region, np.zeros(1, np.int64), out)
