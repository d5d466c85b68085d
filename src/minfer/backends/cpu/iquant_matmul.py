"""Fast matmul for the non-linear 4-bit block types: IQ4_NL, IQ4_XS and MXFP4 (their layouts:
:mod:`minfer.formats.iquants`).

Each worker owns ``ROWS`` weight rows: it decodes a row into float32 values, bit-equal to the block type's
dequantizer (``d * table[q]``, IQ4_XS with its sub-block scale), then takes the row's dot product with every
token's activations, eight lanes at a time in the fixed order of ``simd`` (lane l sums the products at
i = l mod 8, then the fixed tree). Activations stay float32 (llama.cpp quantizes them to 8 bits for these
types; this is closer to the dequantize-then-f32 reference). A decode step and a prefill run the same float
operations per row, and every row is computed by one worker: the same bits at any thread count.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.matmul_tiles import check_operands, read_only, weight_bytes, weight_shape
from minfer.backends.cpu.simd import hsum_tree, load_row_f32x8, muladd_f32x8, zeros_f32x8
from minfer.formats.block_types import block_size, type_size
from minfer.formats.gguf_file import GGUFTensor
from minfer.formats.iquants import IQ4_VALUES, MXFP4_VALUES
from minfer.formats.quants import GGMLType, _f16_bits_to_f32

SUPPORTED_TYPES = (GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4)
_KIND = {GGMLType.IQ4_NL: 0, GGMLType.IQ4_XS: 1, GGMLType.MXFP4: 2}
ROWS = 8  # weight rows per work item
_IQ4 = IQ4_VALUES.astype(np.float32)
_FP4 = MXFP4_VALUES.astype(np.float32)


@njit(inline="always", error_model="numpy")
def _nibbles(flat, at, d, table, vals, v0):
    """16 bytes at ``flat[at]``: vals[v0 + j] = d * table[low nibble j], vals[v0 + 16 + j] = d * table[high]."""
    for j in range(16):
        q = flat[at + j]
        vals[0, v0 + j] = d * table[q & 15]
        vals[0, v0 + 16 + j] = d * table[q >> 4]


@njit(cache=True, error_model="numpy")
def _decode_row(flat, start, n_in, kind, iq4, fp4, vals):
    """Row values of the weight row whose bytes begin at ``flat[start]`` into ``vals[0, :n_in]``."""
    if kind == 0:  # IQ4_NL: 18-byte blocks of 32
        for b in range(n_in // 32):
            at = start + 18 * b
            d = _f16_bits_to_f32(np.int32(flat[at]) | (np.int32(flat[at + 1]) << 8))
            _nibbles(flat, at + 2, d, iq4, vals, 32 * b)
    elif kind == 1:  # IQ4_XS: 136-byte super-blocks of 256
        for b in range(n_in // 256):
            at = start + 136 * b
            d = _f16_bits_to_f32(np.int32(flat[at]) | (np.int32(flat[at + 1]) << 8))
            sh = np.int32(flat[at + 2]) | (np.int32(flat[at + 3]) << 8)
            for ib in range(8):
                ls = ((np.int32(flat[at + 4 + ib // 2]) >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4)
                dl = d * np.float32(ls - 32)
                _nibbles(flat, at + 8 + 16 * ib, dl, iq4, vals, 256 * b + 32 * ib)
    else:  # MXFP4: 17-byte blocks of 32, an E8M0 exponent byte (2^(e - 127), halved for the doubled table)
        for b in range(n_in // 32):
            at = start + 17 * b
            d = np.float32(math.ldexp(1.0, np.int32(flat[at]) - 128))
            _nibbles(flat, at + 1, d, fp4, vals, 32 * b)


@njit(cache=True, error_model="numpy", parallel=True)
def _matmul_kernel(x, flat, rb, n_out, n_in, kind, iq4, fp4, out):
    n_tok = x.shape[0]
    n_items = (n_out + ROWS - 1) // ROWS
    for it in prange(n_items):
        vals = np.empty((1, n_in), np.float32)
        for r in range(it * ROWS, min(n_out, (it + 1) * ROWS)):
            _decode_row(flat, r * rb, n_in, kind, iq4, fp4, vals)
            for t in range(n_tok):
                acc = zeros_f32x8()
                for i in range(0, n_in, 8):
                    acc = muladd_f32x8(acc, load_row_f32x8(x, t, i), load_row_f32x8(vals, 0, i))
                out[t, r] = hsum_tree(acc)


def supports(ggml_type: GGMLType) -> bool:
    return ggml_type in _KIND


class _Prepared:
    """The flat bytes and geometry of one weight, computed once per tensor."""

    __slots__ = ("tensor", "flat", "rb", "n_out", "n_in", "kind")

    def __init__(self, w: GGUFTensor) -> None:
        t = w.ggml_type
        self.n_out, self.n_in = weight_shape(w, "IQ4/MXFP4", SUPPORTED_TYPES, block_size(t))
        self.rb = self.n_in // block_size(t) * type_size(t)
        self.flat = read_only(weight_bytes(w, self.rb))
        self.tensor, self.kind = w, _KIND[t]


def prepare(w: GGUFTensor) -> _Prepared:
    return _Prepared(w)


def matmul(x: np.ndarray, w: GGUFTensor | _Prepared, out: np.ndarray, xq: object = None) -> None:
    """``out[n_tok, n_out] = x[n_tok, n_in] @ W^T`` with ``W`` read as raw IQ4_NL / IQ4_XS / MXFP4 blocks."""
    p = w if isinstance(w, _Prepared) else _Prepared(w)
    n_tok = check_operands(x, p.tensor, out, p.n_in, p.n_out)
    if n_tok == 0 or p.n_out == 0:
        return
    _matmul_kernel(np.ascontiguousarray(x, dtype=np.float32), p.flat, p.rb, p.n_out, p.n_in, p.kind, _IQ4, _FP4, out)


def warmup() -> None:
    """Compile (or load from numba's cache) the kernel once."""
    x = np.zeros((2, 256), np.float32)
    out = np.empty((2, 3), np.float32)
    for t in SUPPORTED_TYPES:
        raw = np.zeros((3, 256 // block_size(t) * type_size(t)), np.uint8)
        matmul(x, GGUFTensor("warmup", t, (3, 256), raw), out)
