"""Q4_K weights repacked at load into groups of eight rows, and the matmul on that layout (decode and prefill).

Why: the row-by-row K-quant kernel (:mod:`minfer.backends.cpu.kquant_matmul`) decodes each row's
super-block on its own (nibbles, a scale shuffle per 32 values, a pmaddwd by the scales, the min
correction, a horizontal sum at the end): ~70 vector operations per row and super-block, which kept
1.7B Q4_K_M decode compute-bound below the memory bandwidth. Here one 256-bit register holds four
consecutive values of each of eight rows, so four activation bytes broadcast to all lanes give eight
rows' products in one pmaddubsw, and the lanes are the rows: no horizontal sum, and the per-super-block
scale work is shared by eight rows (~45 operations per row and super-block).

Layout (``repack``), per group of eight rows and super-block, ``SB_BYTES`` = 1184 bytes (the file's
8 x 144 = 1152, plus the unpacked scales):

    ======== ========================================================================================
    bytes    what
    ======== ========================================================================================
    0..1023  sub-block j (32 values), chunk c: 32 bytes at 128 j + 32 c, ``[row (8), i (4)]`` with value
             32 j + 8 c + i of the row in the low nibble and value 32 j + 8 c + 4 + i in the high one
    1024     the 6-bit scales, u8 ``[j (8), row (8)]``
    1088     the 6-bit mins, u8 ``[i (4), row (8), (m_2i, m_2i+1)]``
    1152     d, float16 ``[row (8)]``
    1168     -dmin, float16 ``[row (8)]`` (the sign bit flipped: exact)
    ======== ========================================================================================

Arithmetic, per group of eight rows (the lanes), token and super-block, all integer until the last step:
    * sub-block j: the int16 pair sums of its eight pmaddubsw (at most 16 products of 15 x 127 per lane:
      30480 < 2^15) times the sub-block's scale, in one pmaddwd (``scale_pairs8``); summed over j: S
      (at most 8 x 63 x 60960 < 2^31);
    * the min term M = Σ_j m_j B_j, with B_j the sum of the token's 32 quantized activations of
      sub-block j (from Q8_K's bsums; |B_j| <= 4064 fits int16), in four pmaddwd;
    * ``acc = fma(float(S), d d_x, acc); acc = fma(float(M), (-dmin) d_x, acc)``.
The float operations per (row, token) are the same in decode and prefill, at any thread count, and on
the AVX2 and generic paths (the integers are exact), so a token's logits are the same bits alone or in a
prompt. Weights whose rows are not a multiple of eight keep the row-by-row kernel (whole tensor).

Loop shape: a work item is one group; tokens go four at a time through the group's super-blocks with
their accumulators in registers (each weight register unpacked once for four tokens), then one at a
time. Decode streams the repacked copy, prefetching ``PREFETCH_BYTES`` ahead (one linear stream per
group).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.simd import (
    add_i16x16,
    add_i32x8,
    broadcast_4bytes,
    broadcast_i16_pair,
    fma_i32x8,
    high_nibbles32,
    load_halves8,
    load_u8_i16x16,
    low_nibbles32,
    madd_i16x16,
    mul_f32x8,
    pairs_u8s8,
    prefetch,
    scale_pairs8,
    splat_at,
    store_f32x8,
    zeros_f32x8,
    zeros_i32x8,
)

QK_K = 256
Q4_K_BYTES = 144  # one super-block of one row in the file
SB_BYTES = 1184  # one super-block of a group of eight rows, repacked
_SCALES, _MINS, _D, _NDMIN = 1024, 1088, 1152, 1168
QUAD = 4  # tokens whose accumulators stay in registers through one pass over a group
PREFETCH_BYTES = 2048  # decode: how far ahead in the group's stream to fetch


def supports(n_out: int, n_in: int) -> bool:
    """Whether a Q4_K weight of this shape takes the repacked layout (whole groups of eight rows)."""
    return n_out > 0 and n_out % 8 == 0 and n_in > 0 and n_in % QK_K == 0


# ---------------------------------------------------------------------------------------------------
# Repacking (at load; parallel over groups, no temporaries)
# ---------------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _repack(raw, rb, packed):
    nbk = rb // Q4_K_BYTES
    n_groups = packed.shape[0] // (nbk * SB_BYTES)
    for g in prange(n_groups):
        for b in range(nbk):
            po = (g * nbk + b) * SB_BYTES
            for r in range(8):
                src = (8 * g + r) * rb + b * Q4_K_BYTES
                packed[po + _D + 2 * r] = raw[src]
                packed[po + _D + 2 * r + 1] = raw[src + 1]
                packed[po + _NDMIN + 2 * r] = raw[src + 2]
                packed[po + _NDMIN + 2 * r + 1] = raw[src + 3] ^ np.uint8(0x80)
                s = src + 4  # the 12 bytes of 6-bit scales and mins (llama.cpp's get_scale_min_k4)
                for j in range(8):
                    if j < 4:
                        sc = raw[s + j] & 63
                        mn = raw[s + j + 4] & 63
                    else:
                        sc = (raw[s + j + 4] & 15) | ((raw[s + j - 4] >> 6) << 4)
                        mn = (raw[s + j + 4] >> 4) | ((raw[s + j] >> 6) << 4)
                    packed[po + _SCALES + 8 * j + r] = sc
                    packed[po + _MINS + 16 * (j // 2) + 2 * r + j % 2] = mn
                    q = src + 16 + 32 * (j // 2)  # value 32 j + l: nibble j % 2 of byte q + l
                    shift = 4 * (j % 2)
                    for c in range(4):
                        for i in range(4):
                            lo = (raw[q + 8 * c + i] >> shift) & 15
                            hi = (raw[q + 8 * c + 4 + i] >> shift) & 15
                            packed[po + 128 * j + 32 * c + 4 * r + i] = lo | (hi << 4)


def repack(raw: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q4_K rows ``[n_out, n_in]`` (raw file blocks, ``supports(n_out, n_in)``) -> the layout above, flat."""
    nbk = n_in // QK_K
    packed = np.empty(n_out // 8 * nbk * SB_BYTES, np.uint8)
    _repack(np.ascontiguousarray(raw).reshape(-1), nbk * Q4_K_BYTES, packed)
    return packed


# ---------------------------------------------------------------------------------------------------
# The matmul
# ---------------------------------------------------------------------------------------------------


@njit(inline="always")
def _chunks(packed, o):
    """Sub-block at byte ``o``: its eight nibble registers (four consecutive values of each row), in the
    order of the activation quads they meet (one flat tuple: numba's parallel-loop analysis rejects
    unpacking a nested one)."""
    return (
        low_nibbles32(packed, o), high_nibbles32(packed, o), low_nibbles32(packed, o + 32),
        high_nibbles32(packed, o + 32), low_nibbles32(packed, o + 64), high_nibbles32(packed, o + 64),
        low_nibbles32(packed, o + 96), high_nibbles32(packed, o + 96),
    )


@njit(inline="always")
def _sub_pairs(w, aq, ao):
    """Sixteen int16 lanes (two per row): the sub-block's 32 products per row against the activations at
    byte ``ao`` of ``aq``, summed in pairs; exact (see the module's bound)."""
    p = pairs_u8s8(w[0], broadcast_4bytes(aq, ao))
    p = add_i16x16(p, pairs_u8s8(w[1], broadcast_4bytes(aq, ao + 4)))
    p = add_i16x16(p, pairs_u8s8(w[2], broadcast_4bytes(aq, ao + 8)))
    p = add_i16x16(p, pairs_u8s8(w[3], broadcast_4bytes(aq, ao + 12)))
    p = add_i16x16(p, pairs_u8s8(w[4], broadcast_4bytes(aq, ao + 16)))
    p = add_i16x16(p, pairs_u8s8(w[5], broadcast_4bytes(aq, ao + 20)))
    p = add_i16x16(p, pairs_u8s8(w[6], broadcast_4bytes(aq, ao + 24)))
    return add_i16x16(p, pairs_u8s8(w[7], broadcast_4bytes(aq, ao + 28)))


@njit(inline="always")
def _finish(acc, s, packed, o, bp, bo, dq, do):
    """``acc`` after one super-block: S (``s``) and the min term against the token's sub-block sums at
    ``bp[bo:bo + 8]``, scaled by d d_x and (-dmin) d_x (``dq[do]`` is d_x)."""
    m = madd_i16x16(load_u8_i16x16(packed, o + _MINS), broadcast_i16_pair(bp, bo))
    m = add_i32x8(m, madd_i16x16(load_u8_i16x16(packed, o + _MINS + 16), broadcast_i16_pair(bp, bo + 2)))
    m = add_i32x8(m, madd_i16x16(load_u8_i16x16(packed, o + _MINS + 32), broadcast_i16_pair(bp, bo + 4)))
    m = add_i32x8(m, madd_i16x16(load_u8_i16x16(packed, o + _MINS + 48), broadcast_i16_pair(bp, bo + 6)))
    dx = splat_at(dq, do)
    acc = fma_i32x8(acc, s, mul_f32x8(load_halves8(packed, o + _D), dx))
    return fma_i32x8(acc, m, mul_f32x8(load_halves8(packed, o + _NDMIN), dx))


@njit(inline="always")
def _one(acc, packed, o, aq, ao, bp, bo, dq, do):
    """One token through one super-block of a group."""
    s = zeros_i32x8()
    for j in range(8):
        p = _sub_pairs(_chunks(packed, o + 128 * j), aq, ao + 32 * j)
        s = add_i32x8(s, madd_i16x16(p, scale_pairs8(packed, o + _SCALES + 8 * j)))
    return _finish(acc, s, packed, o, bp, bo, dq, do)


@njit(inline="always")
def _quad(a0, a1, a2, a3, packed, o, aq, ao, n_in, bp, bo, nb8, dq, do, nbk):
    """Four consecutive tokens through one super-block of a group, each weight register unpacked once."""
    s0 = s1 = s2 = s3 = zeros_i32x8()
    for j in range(8):
        w = _chunks(packed, o + 128 * j)
        sc = scale_pairs8(packed, o + _SCALES + 8 * j)
        s0 = add_i32x8(s0, madd_i16x16(_sub_pairs(w, aq, ao + 32 * j), sc))
        s1 = add_i32x8(s1, madd_i16x16(_sub_pairs(w, aq, ao + n_in + 32 * j), sc))
        s2 = add_i32x8(s2, madd_i16x16(_sub_pairs(w, aq, ao + 2 * n_in + 32 * j), sc))
        s3 = add_i32x8(s3, madd_i16x16(_sub_pairs(w, aq, ao + 3 * n_in + 32 * j), sc))
    a0 = _finish(a0, s0, packed, o, bp, bo, dq, do)
    a1 = _finish(a1, s1, packed, o, bp, bo + nb8, dq, do + nbk)
    a2 = _finish(a2, s2, packed, o, bp, bo + 2 * nb8, dq, do + 2 * nbk)
    a3 = _finish(a3, s3, packed, o, bp, bo + 3 * nb8, dq, do + 3 * nbk)
    return a0, a1, a2, a3


@njit(parallel=True, cache=True)
def _matmul(packed, aq, dq, bs, out):
    """``out[n_tok, n_out]`` (C-contiguous) from the repacked weights and Q8_K activations: ``aq``
    int8[n_tok * n_in], ``dq`` float32[n_tok * nbk], ``bs`` int16[n_tok * nbk * 16] (flat)."""
    n_tok, n_out = out.shape
    n_in = aq.shape[0] // n_tok
    nbk = n_in // QK_K
    nb8 = nbk * 8
    # per token and super-block, the eight sub-block sums B_j = bsums[2 j] + bsums[2 j + 1]
    bp = np.empty(n_tok * nb8, np.int16)
    for i in range(n_tok * nb8):
        bp[i] = bs[2 * i] + bs[2 * i + 1]
    flat = out.reshape(-1)
    n_quad = n_tok - n_tok % QUAD
    for g in prange(n_out // 8):
        og = g * nbk * SB_BYTES
        for t in range(0, n_quad, QUAD):
            a0 = a1 = a2 = a3 = zeros_f32x8()
            for b in range(nbk):
                o = og + b * SB_BYTES
                a0, a1, a2, a3 = _quad(a0, a1, a2, a3, packed, o, aq, t * n_in + b * QK_K, n_in, bp,
                                       t * nb8 + 8 * b, nb8, dq, t * nbk + b, nbk)
            store_f32x8(flat, t * n_out + 8 * g, a0)
            store_f32x8(flat, (t + 1) * n_out + 8 * g, a1)
            store_f32x8(flat, (t + 2) * n_out + 8 * g, a2)
            store_f32x8(flat, (t + 3) * n_out + 8 * g, a3)
        for t in range(n_quad, n_tok):  # decode, and the last n_tok % 4 tokens
            a0 = zeros_f32x8()
            for b in range(nbk):
                o = og + b * SB_BYTES
                for k in range(0, SB_BYTES, 64):
                    prefetch(packed, o + PREFETCH_BYTES + k)
                a0 = _one(a0, packed, o, aq, t * n_in + b * QK_K, bp, t * nb8 + 8 * b, dq, t * nbk + b)
            store_f32x8(flat, t * n_out + 8 * g, a0)


def matmul(packed: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray, out: np.ndarray) -> None:
    """``out = x @ W^T`` for a repacked Q4_K weight and ``x``'s Q8_K quantization given as its flat
    buffers (kquant_matmul's ``Q8KActivations._q``, ``._d``, ``._bs``); ``out`` C-contiguous float32."""
    _matmul(packed, q, d, bsums, out)
