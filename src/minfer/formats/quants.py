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

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from minfer.errors import ModelError

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
