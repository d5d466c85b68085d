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
from numba import njit

from minfer.errors import ContextOverflowError, ModelError
from minfer.formats.block_types import GGMLType, row_nbytes, type_size
from minfer.formats.iquants import IQUANT_DEQUANTIZERS
from minfer.formats.kquants import KQUANT_DEQUANTIZERS


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
    **KQUANT_DEQUANTIZERS,  # the K-quants and Q5 types
    **IQUANT_DEQUANTIZERS,  # IQ4_NL, IQ4_XS, MXFP4
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
#     amax = max |x|                     float32
#     d    = amax / 127                  float32 division
#     id   = 1 / d if d != 0 else 0      float32
#     q    = roundf(x * id)              float32 product, rounded half away from zero
#     out  = f16(d) (round to nearest even, overflow to inf) | int8(q)
#
# Edge cases, held by the tests against gguf: all-zero and negative-zero blocks store d = 0, q = 0; ties
# (x * id = k + 0.5) round away from zero; ``x * id`` stays within +-127.00003 for finite blocks, so q
# always fits in int8; blocks beyond f16's range (amax > 65504 * 127) store exact q and d = inf, as gguf
# does. Where ``x * id`` is NaN or infinite (a block holding inf or NaN, or one so small that ``1/d``
# overflows: amax below ~3.7e-37) numpy's float -> int8 cast gives 0, and so do we. A block holding a
# NaN stores q = 0 and d = NaN (0x7E00); gguf's d is NaN too, but which payload numpy's vectorized max
# carries depends on its SIMD path, so only NaN-free blocks are promised bit-equal in d.
#
# Dequantization is ``f32(q) * f32(d)``, exactly what ``gguf.quants.dequantize`` computes.
#
# The kernels are serial (rows are independent: a caller may split rows across threads and get the same
# bits), without fastmath (results decided by the source, not by what LLVM vectorizes). The Python
# functions check shapes and bounds and write nothing when a check fails.
#
# Loop shape (measured, n = 192, see tests/test_quants.py): the 32-value block loops take their trip
# count ``qk`` as a runtime argument (always QK8_0). With the constant 32, LLVM fully unrolls the loop
# before its loop vectorizer runs, and numba leaves the SLP vectorizer off, so it stays 32 scalar
# conversions: the window read took 86 us for 512 rows instead of 13. Likewise the f16 -> f32 scale uses
# a table of powers of two rather than ``math.ldexp``, a libm call per block, and the per-block helpers
# are inlined (``inline="always"``): a call per block cost as much as the block's work.
# ---------------------------------------------------------------------------------------------------------

QK8_0 = 32  # values per Q8_0 block
Q8_0_BLOCK_BYTES = 34  # f16 d + 32 int8

_F32 = np.float32
_TWO_POW_24 = 16777216.0  # f16 subnormals are multiples of 2**-24
_F16_MIN_NORMAL = 6.103515625e-05  # 2**-14
_F16_OVERFLOW = 65520.0  # 65504 + half an ulp: from here f16 rounds to inf (the tie goes to the even inf)
_F16_EXP_SCALE = np.array([2.0 ** (e - 25) for e in range(32)])  # normal half: (1024 + mant) * 2**(exp - 25)


@njit(inline="always", error_model="numpy")
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


@njit(inline="always", error_model="numpy")
def _f16_bits_to_f32(h):
    """float32 value of IEEE half bits ``h`` (exact; a NaN comes back as the default quiet NaN)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = np.float64(m) / _TWO_POW_24
    elif e == 0x1F:
        v = np.inf if m == 0 else np.nan
    else:
        v = np.float64(m + 1024) * _F16_EXP_SCALE[e]
    if h & 0x8000:
        v = -v
    return _F32(v)


@njit(inline="always", error_model="numpy")
def _quantize_row(src, dst, qk):
    """Quantize float32 ``src`` (a whole number of blocks) into uint8 ``dst`` (34 bytes per block)."""
    for b in range(src.shape[0] // qk):
        k0 = b * qk
        o = b * Q8_0_BLOCK_BYTES
        amax = _F32(0.0)
        nan = False
        for j in range(qk):
            a = abs(src[k0 + j])
            if a > amax:
                amax = a
            nan |= a != a  # `a > amax` skips a NaN; numpy's max returns it (and then every q is 0)
        d = amax / _F32(127.0)
        if nan:
            d = _F32(np.nan)
        inv = _F32(1.0) / d if d != _F32(0.0) else _F32(0.0)
        h = _f32_to_f16_bits(d)
        dst[o] = np.uint8(h & 0xFF)
        dst[o + 1] = np.uint8(h >> 8)
        for j in range(qk):
            # roundf: |v| + 0.5 then truncation toward zero, in float64 where the sum is exact (in float32,
            # 0.49999997 + 0.5 rounds to 1.0). No branch on the sign. NaN/inf fail the test and give 0.
            v = np.float64(src[k0 + j] * inv)
            if not abs(v) <= 127.5:
                v = 0.0
            dst[o + 2 + j] = np.uint8(np.int32(v + math.copysign(0.5, v)) & 0xFF)


@njit(inline="always", error_model="numpy")
def _dequantize_row(src, dst, qk):
    """Dequantize uint8 Q8_0 blocks ``src`` into float32 ``dst`` (``dst.shape[0]`` values)."""
    for b in range(dst.shape[0] // qk):
        o = b * Q8_0_BLOCK_BYTES
        d = _f16_bits_to_f32(np.int32(src[o]) | (np.int32(src[o + 1]) << 8))
        k0 = b * qk
        for j in range(qk):
            q = (np.int32(src[o + 2 + j]) ^ 0x80) - 0x80  # the byte as int8
            dst[k0 + j] = _F32(q) * d


@njit(inline="always", error_model="numpy")
def _q8_0_shapes_fit(n, region_width, qk):
    return n % qk == 0 and region_width == n // qk * Q8_0_BLOCK_BYTES


@njit(cache=True, nogil=True, error_model="numpy")
def _quantize_rows_kernel(x, out, qk):
    """Returns -1 when done, -2 when the shapes do not fit (nothing written)."""
    if out.shape[0] != x.shape[0] or not _q8_0_shapes_fit(x.shape[1], out.shape[1], qk):
        return -2
    for i in range(x.shape[0]):
        _quantize_row(x[i], out[i], qk)
    return -1


@njit(cache=True, nogil=True, error_model="numpy")
def _store_kernel(x, region, rows, qk):
    """Returns -1 when stored, -2 when the shapes do not fit, else the first ``i`` whose ``rows[i]`` is
    outside the region. Nothing is written unless everything fits."""
    if rows.shape[0] != x.shape[0] or not _q8_0_shapes_fit(x.shape[1], region.shape[1], qk):
        return -2
    n_rows = region.shape[0]
    for i in range(rows.shape[0]):
        if rows[i] < 0 or rows[i] >= n_rows:
            return i
    for i in range(rows.shape[0]):
        _quantize_row(x[i], region[rows[i]], qk)
    return -1


@njit(cache=True, nogil=True, error_model="numpy")
def _load_kernel(region, rows, out, qk):
    """Returns -1 when done, -2 when the shapes do not fit, -3 when a row is not within the region or
    there are more rows than ``out`` has (nothing written then)."""
    if not _q8_0_shapes_fit(out.shape[1], region.shape[1], qk):
        return -2
    if rows.shape[0] > out.shape[0]:
        return -3
    for i in range(rows.shape[0]):
        if rows[i] < 0 or rows[i] >= region.shape[0]:
            return -3
    for i in range(rows.shape[0]):
        _dequantize_row(region[rows[i]], out[i], qk)
    return -1


def _check_array(a: object, dtype: type, what: str) -> None:
    # the kernels would compile (and run) a new specialization for another dtype or layout: refuse instead
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 2 or not a.flags.c_contiguous:
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{what} must be a 2-D C-contiguous {np.dtype(dtype).name} array, got {got}")


def _shape_error(name: str, n: int, *shapes: str) -> Exception:
    if n % QK8_0:
        return ModelError(f"{name}: rows of {n} values are not a whole number of Q8_0 blocks of {QK8_0}")
    return ValueError(
        f"{name}: {', '.join(shapes)} do not fit (Q8_0 rows of {n} values take {n // QK8_0 * Q8_0_BLOCK_BYTES} bytes)"
    )


def quantize_q8_0_rows(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Quantize float32 ``x[rows, n]`` (n a multiple of 32) to Q8_0 blocks, ``uint8[rows, n // 32 * 34]``.

    Bit-identical to ``gguf.quants.quantize(x, GGMLQuantizationType.Q8_0)`` (see the notes above for NaN).
    Other float dtypes are cast to float32 first, as gguf does. Writes into ``out`` (C-contiguous, of that
    shape) when given, and returns it.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize_q8_0_rows: x must be 2-D [rows, n], got shape {x.shape}")
    n = x.shape[1]
    if out is None:
        out = np.empty((x.shape[0], row_nbytes(GGMLType.Q8_0, n)), np.uint8)
    else:
        _check_array(out, np.uint8, "quantize_q8_0_rows: out")
    if _quantize_rows_kernel(x, out, QK8_0) != -1:
        raise _shape_error("quantize_q8_0_rows", n, f"x {x.shape}", f"out {out.shape}")
    return out


def quantize_q8_0_into(x: np.ndarray, region: np.ndarray, rows: np.ndarray) -> None:
    """Quantize row ``x[i]`` into ``region[rows[i]]`` in place, for every i (the q8_0 KV store).

    ``x`` is float32 ``[k, n]``, ``region`` uint8 ``[n_rows, n // 32 * 34]`` (one row per cache
    position), ``rows`` ``k`` integers. Each stored row is bit-identical to ``quantize_q8_0_rows(x)[i]``.
    A row index outside the region raises :class:`ContextOverflowError`; nothing is written then.
    """
    _check_array(x, np.float32, "quantize_q8_0_into: x")
    _check_array(region, np.uint8, "quantize_q8_0_into: region")
    if not isinstance(rows, np.ndarray) or rows.ndim != 1 or rows.dtype.kind not in "iu":
        raise ValueError(f"quantize_q8_0_into: rows must be a 1-D integer array, got {rows!r}")
    code = _store_kernel(x, region, rows, QK8_0)
    if code == -1:
        return
    if code == -2:
        raise _shape_error(
            "quantize_q8_0_into", x.shape[1], f"x {x.shape}", f"region {region.shape}", f"rows {rows.shape}"
        )
    raise ContextOverflowError(
        f"Q8_0 store: row {int(rows[code])} (of input row {code}) is outside the region of {region.shape[0]} rows"
    )


def dequantize_q8_0_rows_into(region: np.ndarray, rows: np.ndarray, out_f32: np.ndarray) -> None:
    """Dequantize Q8_0 rows ``region[rows[i]]`` into ``out_f32[i]`` (the window read, through the KV
    cache's row map).

    ``region`` is uint8 ``[n_rows, n // 32 * 34]``, ``rows`` a 1-D int32 array, ``out_f32`` float32
    ``[>= len(rows), n]``. Row for row bit-identical to ``gguf.quants.dequantize``.
    """
    _check_array(region, np.uint8, "dequantize_q8_0_rows_into: region")
    _check_array(out_f32, np.float32, "dequantize_q8_0_rows_into: out_f32")
    if not isinstance(rows, np.ndarray) or rows.ndim != 1 or rows.dtype != np.int32:
        raise ValueError(f"dequantize_q8_0_rows_into: rows must be a 1-D int32 array, got {rows!r}")
    code = _load_kernel(region, rows, out_f32, QK8_0)
    if code == -1:
        return
    if code == -2:
        raise _shape_error(
            "dequantize_q8_0_rows_into", out_f32.shape[1], f"region {region.shape}", f"out {out_f32.shape}"
        )
    raise ValueError(
        f"dequantize_q8_0_rows_into: rows {rows.tolist()[:8]}... are not all within the region's "
        f"{region.shape[0]} rows or do not fit in out_f32's {out_f32.shape[0]}"
    )
