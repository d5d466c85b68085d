"""GGML block types: sizes and the plain numpy dequantizers (the reference every fast kernel is tested against).

Each dequantizer computes exactly what the ``gguf`` package's ``gguf.quants.dequantize`` computes, in the
same float32 operation order, so the results are bit-equal (tests hold this).

Block layouts (little-endian, one block = ``block_size`` values):

====== ===== ===== =============================================================
type   block bytes layout
====== ===== ===== =============================================================
Q8_0   32    34    d: f16, qs: int8[32]                 x = d * q
Q4_0   32    18    d: f16, qs: u8[16] (two nibbles)     x = d * (nibble - 8)
Q4_1   32    20    d: f16, m: f16, qs: u8[16]           x = d * nibble + m
====== ===== ===== =============================================================

Nibble order: byte j holds value j in its low nibble and value j + 16 in its high nibble.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import njit

from minfer.errors import ContextOverflowError, ModelError

GGMLType = GGMLQuantizationType


def block_size(t: GGMLType) -> int:
    return GGML_QUANT_SIZES[t][0]


def type_size(t: GGMLType) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[t][1]


def row_nbytes(t: GGMLType, n: int) -> int:
    """Bytes taken by a row of ``n`` values of type ``t``; n must be a whole number of blocks."""
    bs = block_size(t)
    if n % bs != 0:
        raise ModelError(f"a row of {n} values is not a whole number of {t.name} blocks of {bs}")
    return n // bs * type_size(t)


def _f32(raw: np.ndarray, n: int) -> np.ndarray:
    return raw.view(np.float32).reshape(-1, n)


def _f16(raw: np.ndarray, n: int) -> np.ndarray:
    return raw.view(np.float16).reshape(-1, n).astype(np.float32)


def _bf16(raw: np.ndarray, n: int) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1, n)


def _blocks(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    return np.ascontiguousarray(raw).reshape(-1, type_size(t))


def _q8_0(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.Q8_0)
    d = b[:, :2].view(np.float16).astype(np.float32)
    q = b[:, 2:].view(np.int8).astype(np.float32)
    return (d * q).reshape(-1, n)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    lo = qs & np.uint8(0x0F)
    hi = qs >> np.uint8(4)
    return np.concatenate([lo, hi], axis=1)


def _q4_0(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.Q4_0)
    d = b[:, :2].view(np.float16).astype(np.float32)
    q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return (d * q).reshape(-1, n)


def _q4_1(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.Q4_1)
    d = b[:, 0:2].view(np.float16).astype(np.float32)
    m = b[:, 2:4].view(np.float16).astype(np.float32)
    q = _nibbles(b[:, 4:])
    return (d * q + m).reshape(-1, n)


DEQUANTIZERS: dict[GGMLType, Callable[[np.ndarray, int], np.ndarray]] = {
    GGMLType.F32: _f32,
    GGMLType.F16: _f16,
    GGMLType.BF16: _bf16,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
}

SUPPORTED_TYPES = tuple(DEQUANTIZERS)


def is_supported(t: GGMLType) -> bool:
    return t in DEQUANTIZERS


def dequantize_rows(raw: np.ndarray, t: GGMLType, n: int) -> np.ndarray:
    """Dequantize rows of raw bytes (``uint8[rows, row_nbytes]``) holding ``n`` values each to ``f32[rows, n]``."""
    try:
        fn = DEQUANTIZERS[t]
    except KeyError:
        supported = ", ".join(x.name for x in SUPPORTED_TYPES)
        raise ModelError(f"ggml type {t.name} is not supported yet (supported: {supported})") from None
    return fn(raw, n)


# ---------------------------------------------------------------------------------------------------------
# Q8_0 quantization for the KV cache
#
# The q8_0 KV cache keeps each K/V row as packed Q8_0 blocks: quantized when the row is stored, dequantized
# when attention reads the window. The quantizer reproduces ``gguf.quants.quantize(x, Q8_0)`` (itself
# ggml's ``quantize_row_q8_0_ref``) bit for bit, per block of 32 float32 values:
#
#     amax = max |x|                     float32; NaN if the block holds a NaN (numpy's max propagates it)
#     d    = amax / 127                  float32 division
#     id   = 1 / d if d != 0 else 0      float32
#     q    = roundf(x * id)              float32 product; round half away from zero
#     out  = f16(d) (round to nearest even, overflow to inf) | int8(q)
#
# Edge cases, as numpy casts them on x86 (and as the tests hold against gguf): ``x * id`` is within
# +-127.00003 for finite blocks, so ``q`` always fits in int8 and never wraps. Where ``x * id`` is NaN or
# infinite (a block holding NaN or inf, or a block so small that ``1/d`` overflows: amax below ~3.7e-37),
# numpy's float -> int8 cast gives 0, and so do we. Such blocks store d = f16(d): 0 for tiny blocks (the
# values dequantize to 0), inf for inf blocks, and the quiet NaN 0x7E00 for NaN blocks (NaN payloads
# are not carried). Values too large for f16 (amax > 65504 * 127) still quantize their q exactly; d
# becomes inf, as in gguf.
#
# Dequantization is ``f32(q) * f32(d)``, exactly what ``gguf.quants.dequantize`` computes.
#
# The kernels are serial, one row at a time, no fastmath (results decided by the source alone, so
# bit-identical at any thread count). The row-level helpers ``q8_0_quantize_row`` /
# ``q8_0_dequantize_row`` are plain ``@njit`` functions other kernels may call (a fused KV store, an
# attention that reads q8_0 rows); the Python functions below check shapes and bounds and never write
# anything when a check fails.
# ---------------------------------------------------------------------------------------------------------

QK8_0 = 32  # values per Q8_0 block
Q8_0_BLOCK_BYTES = 34  # f16 d + 32 int8

_F32 = np.float32
_TWO_POW_24 = 16777216.0  # f16 subnormals are multiples of 2**-24
_F16_MIN_NORMAL = 6.103515625e-05  # 2**-14
_F16_OVERFLOW = 65520.0  # 65504 + half an ulp: from here f16 rounds to inf (the tie goes to the even inf)


@njit(cache=True, nogil=True, error_model="numpy")
def _f32_to_f16_bits(x):
    """IEEE half bits of float32 ``x``, rounded to nearest even like numpy's ``astype(np.float16)``.

    Done in float64 arithmetic, where every float32 and every half is exact and ``np.rint`` rounds half
    to even, so no bit casts are needed (numba has none for scalars). NaN maps to the quiet NaN 0x7E00.
    """
    v = np.float64(x)
    if v != v:
        return np.int32(0x7E00)
    sign = np.int32(0x8000) if math.copysign(1.0, v) < 0.0 else np.int32(0)
    a = abs(v)
    if a >= _F16_OVERFLOW:
        return sign | np.int32(0x7C00)
    if a < _F16_MIN_NORMAL:
        # subnormal (or zero): a multiple of 2**-24; rounding up to 1024 gives the smallest normal's bits
        return sign | np.int32(np.rint(a * _TWO_POW_24))
    m, e = math.frexp(a)  # a = m * 2**e, 0.5 <= m < 1
    # 11 significant bits, rounded half to even; a carry to 2048 bumps the exponent field by itself
    mant = np.int32(np.rint(m * 2048.0))
    return sign | (np.int32((e + 14) << 10) + mant - np.int32(1024))


@njit(cache=True, nogil=True, error_model="numpy")
def _f16_bits_to_f32(h):
    """float32 value of IEEE half bits ``h`` (exact; NaN payloads are not carried)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = np.float64(m) / _TWO_POW_24
    elif e == 0x1F:
        v = np.inf if m == 0 else np.nan
    else:
        v = math.ldexp(np.float64(m + 1024), e - 25)
    if h & 0x8000:
        v = -v
    return _F32(v)


@njit(cache=True, nogil=True, error_model="numpy")
def q8_0_quantize_row(x, i, region, r):
    """Quantize float32 row ``x[i]`` (a multiple of 32 values) into uint8 row ``region[r]`` (34 bytes per block).

    No checks: the caller guarantees the shapes and that ``i`` and ``r`` are in range.
    """
    nb = x.shape[1] // QK8_0
    for b in range(nb):
        k0 = b * QK8_0
        o = b * Q8_0_BLOCK_BYTES
        amax = _F32(0.0)
        nan = False
        for j in range(QK8_0):
            a = abs(x[i, k0 + j])
            if a > amax:
                amax = a
            nan |= a != a  # `a > amax` skips NaN; numpy's max would return it
        d = amax / _F32(127.0)
        if nan:
            d = _F32(np.nan)
        inv = _F32(1.0) / d if d != _F32(0.0) else _F32(0.0)
        h = _f32_to_f16_bits(d)
        region[r, o] = np.uint8(h & 0xFF)
        region[r, o + 1] = np.uint8(h >> 8)
        for j in range(QK8_0):
            # roundf (half away from zero) without a branch on the sign: |v| + 0.5 is exact in float64
            # (in float32, 0.49999997 + 0.5 would round to 1.0). NaN/inf fail the test and give 0.
            v = np.float64(x[i, k0 + j] * inv)
            t = np.floor(abs(v) + 0.5)
            if not t <= 127.0:
                t = 0.0
            region[r, o + 2 + j] = np.uint8(np.int32(math.copysign(t, v)) & 0xFF)


@njit(cache=True, nogil=True, error_model="numpy")
def q8_0_dequantize_row(region, r, out, i):
    """Dequantize uint8 row ``region[r]`` into float32 row ``out[i]`` (``out.shape[1]`` values). No checks."""
    nb = out.shape[1] // QK8_0
    for b in range(nb):
        o = b * Q8_0_BLOCK_BYTES
        d = _f16_bits_to_f32(np.int32(region[r, o]) | (np.int32(region[r, o + 1]) << 8))
        k0 = b * QK8_0
        for j in range(QK8_0):
            q = (np.int32(region[r, o + 2 + j]) ^ 0x80) - 0x80  # the byte as int8
            out[i, k0 + j] = _F32(q) * d


@njit(cache=True, nogil=True, error_model="numpy")
def _q8_0_quantize_rows_kernel(x, out):
    for i in range(x.shape[0]):
        q8_0_quantize_row(x, i, out, i)


@njit(cache=True, nogil=True, error_model="numpy")
def _q8_0_store_kernel(x, region, rows):
    """Returns -1 when stored, else the first ``i`` whose ``rows[i]`` is outside the region (nothing written)."""
    n_rows = region.shape[0]
    for i in range(rows.shape[0]):
        if rows[i] < 0 or rows[i] >= n_rows:
            return i
    for i in range(rows.shape[0]):
        q8_0_quantize_row(x, i, region, rows[i])
    return -1


@njit(cache=True, nogil=True, error_model="numpy")
def _q8_0_load_kernel(region, start, stop, out):
    for r in range(start, stop):
        q8_0_dequantize_row(region, r, out, r - start)


def _q8_0_input(x: np.ndarray, what: str) -> np.ndarray:
    # float32 like gguf (which casts with astype); C order so the kernel sees one layout
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"{what}: x must be 2-D [rows, n], got shape {x.shape}")
    row_nbytes(GGMLType.Q8_0, x.shape[1])  # raises ModelError when n is not a multiple of 32
    return x


def _q8_0_region_check(region: np.ndarray, n: int, what: str) -> None:
    want = n // QK8_0 * Q8_0_BLOCK_BYTES
    if not isinstance(region, np.ndarray) or region.dtype != np.uint8 or region.ndim != 2 or region.shape[1] != want:
        got = f"{region.dtype} {region.shape}" if isinstance(region, np.ndarray) else type(region).__name__
        raise ValueError(f"{what}: the Q8_0 region for rows of {n} values must be uint8 [rows, {want}], got {got}")


def quantize_q8_0_rows(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Quantize float32 ``x[rows, n]`` (n a multiple of 32) to Q8_0 blocks, ``uint8[rows, n // 32 * 34]``.

    Bit-identical to ``gguf.quants.quantize(x, GGMLQuantizationType.Q8_0)``. Writes into ``out`` (of that
    shape and dtype) when given, and returns it.
    """
    x = _q8_0_input(x, "quantize_q8_0_rows")
    if out is None:
        out = np.empty((x.shape[0], row_nbytes(GGMLType.Q8_0, x.shape[1])), np.uint8)
    else:
        _q8_0_region_check(out, x.shape[1], "quantize_q8_0_rows")
        if out.shape[0] != x.shape[0]:
            raise ValueError(f"quantize_q8_0_rows: out has {out.shape[0]} rows, x has {x.shape[0]}")
    _q8_0_quantize_rows_kernel(x, out)
    return out


def quantize_q8_0_into(x: np.ndarray, region: np.ndarray, rows: np.ndarray) -> None:
    """Quantize row ``x[i]`` into ``region[rows[i]]`` in place, for every i (the q8_0 KV store).

    ``region`` is ``uint8[n_rows, n // 32 * 34]`` (one row per cache position), ``rows`` an integer array
    of ``len(x)`` row indices. Each stored row is bit-identical to ``quantize_q8_0_rows(x)[i]``. A row
    index outside the region raises :class:`ContextOverflowError` and nothing is written.
    """
    x = _q8_0_input(x, "quantize_q8_0_into")
    _q8_0_region_check(region, x.shape[1], "quantize_q8_0_into")
    rows = np.asarray(rows)
    if rows.dtype.kind not in "iu" or rows.shape != (x.shape[0],):
        raise ValueError(f"quantize_q8_0_into: rows must be {x.shape[0]} integers, got {rows.dtype} {rows.shape}")
    bad = _q8_0_store_kernel(x, region, rows)
    if bad != -1:
        raise ContextOverflowError(
            f"Q8_0 store: row {int(rows[bad])} (input row {bad}) is outside the region of {region.shape[0]} rows"
        )


def dequantize_q8_0_rows_into(region: np.ndarray, start: int, stop: int, out_f32: np.ndarray) -> None:
    """Dequantize ``region[start:stop]`` (Q8_0 rows) into ``out_f32[:stop - start]`` (the window read).

    ``out_f32`` is float32 ``[>= stop - start, n]``; row for row equal to ``gguf.quants.dequantize``.
    """
    if not isinstance(out_f32, np.ndarray) or out_f32.dtype != np.float32 or out_f32.ndim != 2:
        raise ValueError("dequantize_q8_0_rows_into: out_f32 must be a 2-D float32 array")
    n = out_f32.shape[1]
    row_nbytes(GGMLType.Q8_0, n)
    _q8_0_region_check(region, n, "dequantize_q8_0_rows_into")
    if not 0 <= start <= stop <= region.shape[0]:
        raise ValueError(
            f"dequantize_q8_0_rows_into: rows {start}:{stop} are not within the region's {region.shape[0]}"
        )
    if out_f32.shape[0] < stop - start:
        raise ValueError(f"dequantize_q8_0_rows_into: out_f32 has {out_f32.shape[0]} rows, {stop - start} needed")
    _q8_0_load_kernel(region, start, stop, out_f32)
