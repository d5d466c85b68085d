"""GGML block types and their sizes: the one place both dequantizer modules (``quants``, ``kquants``) and
everything that sizes a tensor read them from."""

from __future__ import annotations

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
