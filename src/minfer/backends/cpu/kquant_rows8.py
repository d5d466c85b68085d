"""Q4_K, Q5_K and Q6_K weights repacked at load into groups of eight rows, and the matmuls on those layouts
(decode and prefill alike). Q4_K is described here, Q5_K beside it (the same kernel, ``five`` = 1: a
register of fifth bits per sub-block after the nibbles, ``_Q5_EXTRA`` bytes, so 1440 per super-block, the
file's 8 x 176), and Q6_K's layout and arithmetic in its own section below.

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
    * sub-block j: the int16 pair sums of its eight pmaddubsw, in two halves of four (at most 8
      products of 31 x 127 per lane, Q5_K: 31496 < 2^15), each half times the sub-block's scale in one
      pmaddwd (``scale_pairs8``); summed over j: S (at most 8 x 63 x 32 x 31 x 127 < 2^31);
    * the min term M = Σ_j m_j B_j, with B_j the sum of the token's 32 quantized activations of
      sub-block j (from Q8_K's bsums; |B_j| <= 4064 fits int16), in four pmaddwd;
    * ``acc = fma(float(S), d d_x, acc); acc = fma(float(M), (-dmin) d_x, acc)``.
The float operations per (row, token) are the same in decode and prefill, at any thread count, and on
the AVX2 and generic paths (the integers are exact), so a token's logits are the same bits alone or in a
prompt. Weights whose rows are not a multiple of eight keep the row-by-row kernel (whole tensor).

Measured (1.7B-shaped Q4_K_M quantized by llama.cpp, 2 threads, AVX2-only Zen 3 class, paired with
llama-cpp-python 0.3.36 in the same run): pp512 45 -> 78 t/s (llama.cpp 46), tg32 unchanged at ~22 t/s
(decode there was already at the memory wall: ~26 GB/s per matmul at 2 threads); per matmul at 1 thread
with the weights in cache, decode 1.9-2.0x (Q4_K) and 1.4-1.5x (Q6_K) the row-by-row kernel.

Loop shape: a work item is one group; tokens go four at a time through the group's super-blocks with
their accumulators in registers (each weight register unpacked once for four tokens), then one at a
time. Decode streams the repacked copy, prefetching ``PREFETCH_BYTES`` ahead (one linear stream per
group).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from minfer.backends.cpu.simd import (
    LL_I8,
    V8I,
    V16S,
    V32B,
    add_i16x16,
    add_i32x8,
    broadcast_4bytes,
    broadcast_i16_pair,
    fma_i32x8,
    high_nibbles32,
    i8x32,
    i16x16,
    i32x8,
    is_1d,
    load_element,
    load_f32x8,
    load_halves8,
    load_u8_i16x16,
    low_nibbles32,
    madd_i16x16,
    mul_f32x8,
    pairs_u8s8,
    prefetch,
    scale_pairs8,
    shuffle_mask,
    splat_at,
    splat_constant,
    store_f32x8,
    target_cpu_name,
    zeros_f32x8,
    zeros_i32x8,
)
from minfer.formats.quants import GGMLType

QK_K = 256
Q4_K_BYTES = 144  # one super-block of one row in the file
SB_BYTES = 1184  # one super-block of a group of eight rows, repacked
_Q5_EXTRA = 256  # Q5_K: one register of fifth bits per sub-block, after the nibbles (the rest moves up)
_SCALES, _MINS, _D, _NDMIN = 1024, 1088, 1152, 1168
QUAD = 4  # tokens whose accumulators stay in registers through one pass over a group
# Prefetch distance, 1.7B Q4_K_M decode at 2 threads on a Sapphire Rapids-class VM (weights from DRAM):
# 256 bytes 17.4 t/s, 512 19.0, 1024 18.8, 2048 14.7 (the eight-row matmul alone: 22.7, 24.8, 20.9,
# 16.9 GB/s).
PREFETCH_BYTES = 512  # decode: how far ahead in the group's stream to fetch
# Zen 4 streams a decode's Q6_K weights faster on its hardware prefetchers alone: 2048x8192 on kquant_rows16's
# kernels, 1-2 tokens, 0.84-0.94x the time at 2 threads, 0.78-0.87x at 1 (Q4_K: 0.89-1.17x, no clear sign,
# so it keeps them; Sapphire Rapids decoded faster with them: 1.7B Q4_K_M tg32 14.7 -> 19.0 t/s at 512 bytes)
Q6_DECODE_PREFETCH = target_cpu_name() != "znver4"


def supports(ggml_type: GGMLType, n_out: int, n_in: int) -> bool:
    """Whether a weight of this type and shape takes a repacked layout (whole groups of eight rows)."""
    return ggml_type in REPACKED and n_out > 0 and n_out % 8 == 0 and n_in > 0 and n_in % QK_K == 0


# ---------------------------------------------------------------------------------------------------
# Repacking (at load; parallel over groups, no temporaries)
# ---------------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _repack(raw, rb, packed, five):
    """``five``: Q5_K (176-byte blocks: d, dmin, scales, qh[32], qs[128]), else Q4_K (144: no qh)."""
    nbk = rb // (Q4_K_BYTES + 32 * five)
    sb_bytes = SB_BYTES + _Q5_EXTRA * five
    extra = _Q5_EXTRA * five
    n_groups = packed.shape[0] // (nbk * sb_bytes)
    for g in prange(n_groups):
        for b in range(nbk):
            po = (g * nbk + b) * sb_bytes
            for r in range(8):
                src = (8 * g + r) * rb + b * (Q4_K_BYTES + 32 * five)
                packed[po + extra + _D + 2 * r] = raw[src]
                packed[po + extra + _D + 2 * r + 1] = raw[src + 1]
                packed[po + extra + _NDMIN + 2 * r] = raw[src + 2]
                packed[po + extra + _NDMIN + 2 * r + 1] = raw[src + 3] ^ np.uint8(0x80)
                s = src + 4  # the 12 bytes of 6-bit scales and mins (llama.cpp's get_scale_min_k4)
                qs = src + 16 + 32 * five
                for j in range(8):
                    if j < 4:
                        sc = raw[s + j] & 63
                        mn = raw[s + j + 4] & 63
                    else:
                        sc = (raw[s + j + 4] & 15) | ((raw[s + j - 4] >> 6) << 4)
                        mn = (raw[s + j + 4] >> 4) | ((raw[s + j] >> 6) << 4)
                    packed[po + extra + _SCALES + 8 * j + r] = sc
                    packed[po + extra + _MINS + 16 * (j // 2) + 2 * r + j % 2] = mn
                    q = qs + 32 * (j // 2)  # value 32 j + l: nibble j % 2 of byte q + l (Q5_K: bit j of qh[l])
                    shift = 4 * (j % 2)
                    for c in range(4):
                        for i in range(4):
                            lo = (raw[q + 8 * c + i] >> shift) & 15
                            hi = (raw[q + 8 * c + 4 + i] >> shift) & 15
                            packed[po + 128 * j + 32 * c + 4 * r + i] = lo | (hi << 4)
                    if five:  # register m of sub-block j: values 32 j + 4 m + k, fifth bits at bit m
                        for k in range(4):
                            bits = 0
                            for m in range(8):
                                bits |= ((raw[src + 16 + 4 * m + k] >> j) & 1) << m
                            packed[po + 1024 + 32 * j + 4 * r + k] = bits


def _repacker(five: int):
    def repack(raw: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
        """K-quant rows ``[n_out, n_in]`` (raw file blocks, ``supports``) -> the layout above, flat."""
        nbk = n_in // QK_K
        packed = np.empty(n_out // 8 * nbk * (SB_BYTES + _Q5_EXTRA * five), np.uint8)
        _repack(np.ascontiguousarray(raw).reshape(-1), nbk * (Q4_K_BYTES + 32 * five), packed, five)
        return packed

    return repack


repack, repack_q5_k = _repacker(0), _repacker(1)


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


@intrinsic
def _chunks5(typingctx, raw, off, hb):
    """Q5_K's ``_chunks``: the nibble registers at ``off`` with each value's fifth bit (bit m of the byte
    at ``hb`` for register m) set as bit 4."""
    if not is_1d(raw):
        return None
    tup = types.UniTuple(i8x32, 8)

    def codegen(context, builder, sig, args):
        b = builder

        def load(at, delta):
            index = b.add(args[at], ir.Constant(args[at].type, delta))
            return load_element(context, b, sig.args[0], args[0], index, sig.args[at], V16S)

        h = load(2, 0)
        regs = []
        for m in range(8):
            v = load(1, 32 * (m // 2))
            if m % 2:
                v = b.lshr(v, splat_constant(V16S, 4))
            low = b.and_(b.bitcast(v, V32B), splat_constant(V32B, 15))
            # bit m of each byte to bit 4 (16-bit shifts, then a byte mask: no bit crosses into bit 4)
            t = b.shl(h, splat_constant(V16S, 4 - m)) if m <= 4 else b.lshr(h, splat_constant(V16S, m - 4))
            regs.append(b.or_(low, b.and_(b.bitcast(t, V32B), splat_constant(V32B, 0x10))))
        return context.make_tuple(b, tup, regs)

    return tup(raw, off, hb), codegen


@njit(inline="always")
def _half_pairs(w, k0, aq, ao):
    """Sixteen int16 lanes (two per row): registers k0..k0+3 against the activation quads from ``ao``,
    summed in pairs; exact (at most 8 products of 31 x 127 per lane: 31496 < 2^15)."""
    p = pairs_u8s8(w[k0], broadcast_4bytes(aq, ao))
    p = add_i16x16(p, pairs_u8s8(w[k0 + 1], broadcast_4bytes(aq, ao + 4)))
    p = add_i16x16(p, pairs_u8s8(w[k0 + 2], broadcast_4bytes(aq, ao + 8)))
    return add_i16x16(p, pairs_u8s8(w[k0 + 3], broadcast_4bytes(aq, ao + 12)))


@njit(inline="always")
def _sub(s, w, sc, aq, ao):
    """``s`` plus one sub-block's 32 products per row (registers ``w``) times its scales ``sc``, against the
    activations at byte ``ao`` of ``aq``."""
    s = add_i32x8(s, madd_i16x16(_half_pairs(w, 0, aq, ao), sc))
    return add_i32x8(s, madd_i16x16(_half_pairs(w, 4, aq, ao + 16), sc))


@njit(inline="always")
def _values(packed, o, j, five):
    """Sub-block j's eight registers of the super-block at ``o`` (``five``: Q5_K's layout)."""
    if five:
        return _chunks5(packed, o + 128 * j, o + 1024 + 32 * j)
    return _chunks(packed, o + 128 * j)


@njit(inline="always")
def _finish(acc, s, packed, o, bp, bo, dq, do, five):
    """``acc`` after one super-block: S (``s``) and the min term against the token's sub-block sums at
    ``bp[bo:bo + 8]``, scaled by d d_x and (-dmin) d_x (``dq[do]`` is d_x)."""
    om = o + _MINS + _Q5_EXTRA * five
    od = o + _D + _Q5_EXTRA * five
    m = madd_i16x16(load_u8_i16x16(packed, om), broadcast_i16_pair(bp, bo))
    m = add_i32x8(m, madd_i16x16(load_u8_i16x16(packed, om + 16), broadcast_i16_pair(bp, bo + 2)))
    m = add_i32x8(m, madd_i16x16(load_u8_i16x16(packed, om + 32), broadcast_i16_pair(bp, bo + 4)))
    m = add_i32x8(m, madd_i16x16(load_u8_i16x16(packed, om + 48), broadcast_i16_pair(bp, bo + 6)))
    dx = splat_at(dq, do)
    acc = fma_i32x8(acc, s, mul_f32x8(load_halves8(packed, od), dx))
    return fma_i32x8(acc, m, mul_f32x8(load_halves8(packed, od + 16), dx))


@njit(inline="always")
def _store_quad(flat, at, n_out, a0, a1, a2, a3):
    """Four consecutive tokens' eight rows, the first at ``flat[at:at + 8]``."""
    store_f32x8(flat, at, a0)
    store_f32x8(flat, at + n_out, a1)
    store_f32x8(flat, at + 2 * n_out, a2)
    store_f32x8(flat, at + 3 * n_out, a3)


@njit(inline="always")
def _one(acc, packed, o, aq, ao, bp, bo, dq, do, five):
    """One token through one super-block of a group."""
    s = zeros_i32x8()
    osc = o + _SCALES + _Q5_EXTRA * five
    for j in range(8):
        s = _sub(s, _values(packed, o, j, five), scale_pairs8(packed, osc + 8 * j), aq, ao + 32 * j)
    return _finish(acc, s, packed, o, bp, bo, dq, do, five)


@njit(inline="always")
def _quad(a0, a1, a2, a3, packed, o, aq, ao, n_in, bp, bo, nb8, dq, do, nbk, five):
    """Four consecutive tokens through one super-block of a group, each weight register unpacked once."""
    s0 = s1 = s2 = s3 = zeros_i32x8()
    osc = o + _SCALES + _Q5_EXTRA * five
    for j in range(8):
        w = _values(packed, o, j, five)
        sc = scale_pairs8(packed, osc + 8 * j)
        s0 = _sub(s0, w, sc, aq, ao + 32 * j)
        s1 = _sub(s1, w, sc, aq, ao + n_in + 32 * j)
        s2 = _sub(s2, w, sc, aq, ao + 2 * n_in + 32 * j)
        s3 = _sub(s3, w, sc, aq, ao + 3 * n_in + 32 * j)
    a0 = _finish(a0, s0, packed, o, bp, bo, dq, do, five)
    a1 = _finish(a1, s1, packed, o, bp, bo + nb8, dq, do + nbk, five)
    a2 = _finish(a2, s2, packed, o, bp, bo + 2 * nb8, dq, do + 2 * nbk, five)
    a3 = _finish(a3, s3, packed, o, bp, bo + 3 * nb8, dq, do + 3 * nbk, five)
    return a0, a1, a2, a3


@njit(inline="always")
def _duo(a0, a1, packed, o, aq, ao, n_in, bp, bo, nb8, dq, do, nbk, five):
    """Two consecutive tokens through one super-block of a group, each weight register unpacked once."""
    s0 = s1 = zeros_i32x8()
    osc = o + _SCALES + _Q5_EXTRA * five
    for j in range(8):
        w = _values(packed, o, j, five)
        sc = scale_pairs8(packed, osc + 8 * j)
        s0 = _sub(s0, w, sc, aq, ao + 32 * j)
        s1 = _sub(s1, w, sc, aq, ao + n_in + 32 * j)
    return (_finish(a0, s0, packed, o, bp, bo, dq, do, five),
            _finish(a1, s1, packed, o, bp, bo + nb8, dq, do + nbk, five))


@njit(inline="always")
def _member(gg, pa, pb, pc, oa, ob, oc, fa, fb, fc):
    """Group ``gg`` of a call's weights a, b, c (in that order): (its weight, its flat output (``fa``, ``fb``,
    ``fc``: the outputs' flat views, made once per call: a view made per item, its reference counted by both
    threads, cost ~1.3 us of a 9 us decode), the output's width, its index among that weight's groups)."""
    i = np.int64(gg)  # a prange index may be unsigned: minus a signed count it would be a float
    na = oa.shape[1] // 8
    nb = ob.shape[1] // 8
    if i >= na + nb:
        return pc, fc, oc.shape[1], i - na - nb
    if i >= na:
        return pb, fb, ob.shape[1], i - na
    return pa, fa, oa.shape[1], i


@njit(inline="always")
def _sub_block_sums(bs, n):
    """Per token and super-block, the eight sub-block sums B_j = bsums[2 j] + bsums[2 j + 1] (``n`` of them)."""
    bp = np.empty(n, np.int16)
    for i in range(n):
        bp[i] = bs[2 * i] + bs[2 * i + 1]
    return bp


# Passes of up to SMALL_PASS_TOKENS tokens (decode, a few sequences' decode, a verified draft) go through each
# group's super-blocks once, every token at each super-block: the weights are read from memory once and
# their streaming overlaps all the tokens' arithmetic, where token-major order would stream them during the
# first four tokens alone. The tokens' accumulators live in the output between super-blocks (a float32
# store and load are exact, so the bits are those of token-major order).
# Measured (1.7B-shaped Q4_K_M gate+up, weights from memory, 2 threads, the 256-bit VNNI path) against one
# token: 2 tokens 1.49x -> 1.18x, 4 tokens 1.90x -> 1.49x, 8 tokens 2.76x -> 1.76x, 16 tokens 4.32x -> 3.16x.
SMALL_PASS_TOKENS = 16


@njit(inline="always")
def _load_quad(flat, at, n_out, first):
    """The accumulators ``_store_quad`` left at ``at`` (zeros before the first super-block)."""
    if first:
        z = zeros_f32x8()
        return z, z, z, z
    return (load_f32x8(flat, at), load_f32x8(flat, at + n_out), load_f32x8(flat, at + 2 * n_out),
            load_f32x8(flat, at + 3 * n_out))


@njit(inline="always")
def _load_one(flat, at, first):
    return zeros_f32x8() if first else load_f32x8(flat, at)


@njit(inline="always")
def _small_pass(packed, flat, n_out, g, og, aq, dq, bp, n_tok, n_in, nbk, five):
    """One group's rows for a pass of at most ``SMALL_PASS_TOKENS`` tokens, super-block-major."""
    nb8 = nbk * 8
    sb_bytes = SB_BYTES + _Q5_EXTRA * five
    n_quad = n_tok - n_tok % QUAD
    for b in range(nbk):
        o = og + b * sb_bytes
        for k in range(0, sb_bytes, 64):
            prefetch(packed, o + PREFETCH_BYTES + k)
        first = b == 0
        for t in range(0, n_quad, QUAD):
            at = t * n_out + 8 * g
            a0, a1, a2, a3 = _load_quad(flat, at, n_out, first)
            a0, a1, a2, a3 = _quad(a0, a1, a2, a3, packed, o, aq, t * n_in + b * QK_K, n_in, bp, t * nb8 + 8 * b,
                                   nb8, dq, t * nbk + b, nbk, five)
            _store_quad(flat, at, n_out, a0, a1, a2, a3)
        t_rest = n_quad
        if n_tok - n_quad >= 2:  # two of the last three tokens on one unpacking of the weights
            t = n_quad
            at = t * n_out + 8 * g
            a0, a1 = _duo(_load_one(flat, at, first), _load_one(flat, at + n_out, first), packed, o, aq,
                          t * n_in + b * QK_K, n_in, bp, t * nb8 + 8 * b, nb8, dq, t * nbk + b, nbk, five)
            store_f32x8(flat, at, a0)
            store_f32x8(flat, at + n_out, a1)
            t_rest += 2
        for t in range(t_rest, n_tok):
            at = t * n_out + 8 * g
            store_f32x8(flat, at, _one(_load_one(flat, at, first), packed, o, aq, t * n_in + b * QK_K, bp,
                                       t * nb8 + 8 * b, dq, t * nbk + b, five))


@njit(parallel=True, cache=True)
def _matmul(pa, pb, pc, aq, dq, bs, oa, ob, oc, five):
    """``oa[n_tok, n_a]`` (C-contiguous) from the repacked weights ``pa`` (``five``: 1 for Q5_K's layout, 0
    for Q4_K's) and Q8_K activations: ``aq`` int8[n_tok * n_in], ``dq`` float32[n_tok * nbk], ``bs``
    int16[n_tok * nbk * 16] (flat); and ``ob`` from ``pb``, ``oc`` from ``pc`` in the same parallel loop
    (weights that read the same activations: q/k/v, gate/up), or outputs of no columns where there are
    none. Each group of eight rows is the same operations whichever call it is in."""
    n_tok = oa.shape[0]
    n_in = aq.shape[0] // n_tok
    nbk = n_in // QK_K
    nb8 = nbk * 8
    sb_bytes = SB_BYTES + _Q5_EXTRA * five
    bp = _sub_block_sums(bs, n_tok * nb8)
    n_quad = n_tok - n_tok % QUAD
    fa, fb, fc = oa.reshape(-1), ob.reshape(-1), oc.reshape(-1)  # once, not per item
    for gg in prange((oa.shape[1] + ob.shape[1] + oc.shape[1]) // 8):
        packed, flat, n_out, g = _member(gg, pa, pb, pc, oa, ob, oc, fa, fb, fc)
        og = g * nbk * sb_bytes
        if n_tok <= SMALL_PASS_TOKENS:
            _small_pass(packed, flat, n_out, g, og, aq, dq, bp, n_tok, n_in, nbk, five)
            continue
        for t in range(0, n_quad, QUAD):
            a0 = a1 = a2 = a3 = zeros_f32x8()
            for b in range(nbk):
                o = og + b * sb_bytes
                a0, a1, a2, a3 = _quad(a0, a1, a2, a3, packed, o, aq, t * n_in + b * QK_K, n_in, bp,
                                       t * nb8 + 8 * b, nb8, dq, t * nbk + b, nbk, five)
            _store_quad(flat, t * n_out + 8 * g, n_out, a0, a1, a2, a3)
        for t in range(n_quad, n_tok):  # the last n_tok % 4 tokens (the group's weights are in cache by now)
            a0 = zeros_f32x8()
            for b in range(nbk):
                o = og + b * sb_bytes
                a0 = _one(a0, packed, o, aq, t * n_in + b * QK_K, bp, t * nb8 + 8 * b, dq, t * nbk + b, five)
            store_f32x8(flat, t * n_out + 8 * g, a0)


# the absent weights and outputs of a call with fewer than three
NO_WEIGHT = np.empty(0, np.uint8)
NO_OUTPUT = np.empty((0, 0), np.float32)


def _matmul_q4_k(
    packed: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray, out: np.ndarray,
    pb: np.ndarray = NO_WEIGHT, ob: np.ndarray = NO_OUTPUT, pc: np.ndarray = NO_WEIGHT, oc: np.ndarray = NO_OUTPUT,
) -> None:
    _matmul(packed, pb, pc, q, d, bsums, out, ob, oc, 0)


def _matmul_q5_k(
    packed: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray, out: np.ndarray,
    pb: np.ndarray = NO_WEIGHT, ob: np.ndarray = NO_OUTPUT, pc: np.ndarray = NO_WEIGHT, oc: np.ndarray = NO_OUTPUT,
) -> None:
    _matmul(packed, pb, pc, q, d, bsums, out, ob, oc, 1)


# ---------------------------------------------------------------------------------------------------
# Q6_K in groups of eight rows
#
# Per group and super-block, ``Q6_SB_BYTES`` = 1680 bytes (the file's 8 x 210):
#   0..1535  sub-block s (16 values) at 96 s: two nibble registers (as Q4_K's chunks: ``[row (8), k (4)]``,
#            register c holds the low four bits of value 16 s + 8 c + k in its low nibble and of value
#            16 s + 8 c + 4 + k in its high one), then one register of the values' top two bits: byte
#            ``[row, k]`` holds those of values 16 s + 4 m + k at bits 2 m (m = 0..3)
#   1536     the signed scales, int8 ``[i (8), row (8), (sc_2i, sc_2i+1)]``
#   1664     d, float16 ``[row (8)]``
# A value is u = q + 32 (0..63). Per sub-block, two pmaddubsw pair sums fit int16 (2 x 2 x 63 x 127 =
# 32004 < 2^15): two such sums, each times the sub-block's scale in one pmaddwd, make S; the offset
# 32 Σ_s sc_s B_s (B_s: Q8_K's bsums) is removed as an integer, and ``acc = fma(float(S - 32 M), d d_x,
# acc)``: one rounding per super-block and token, the same in decode and prefill.
# ---------------------------------------------------------------------------------------------------

Q6_K_BYTES = 210
Q6_SB_BYTES = 1680
_Q6_SCALES, _Q6_D = 1536, 1664
Q6_PREFETCH_BYTES = PREFETCH_BYTES


@njit(parallel=True, cache=True)
def _repack_q6(raw, rb, packed):
    nbk = rb // Q6_K_BYTES
    n_groups = packed.shape[0] // (nbk * Q6_SB_BYTES)
    for g in prange(n_groups):
        u = np.empty(256, np.uint8)
        for b in range(nbk):
            po = (g * nbk + b) * Q6_SB_BYTES
            for r in range(8):
                src = (8 * g + r) * rb + b * Q6_K_BYTES
                # the row's 256 values q + 32 (llama.cpp's dequantize_row_q6_K): ql[128] | qh[64] | sc[16] | d
                for n in range(2):
                    for l in range(32):
                        ql0 = raw[src + 64 * n + l]
                        ql1 = raw[src + 64 * n + l + 32]
                        qh = raw[src + 128 + 32 * n + l]
                        u[128 * n + l] = (ql0 & 15) | ((qh & 3) << 4)
                        u[128 * n + l + 32] = (ql1 & 15) | (((qh >> 2) & 3) << 4)
                        u[128 * n + l + 64] = (ql0 >> 4) | (((qh >> 4) & 3) << 4)
                        u[128 * n + l + 96] = (ql1 >> 4) | (((qh >> 6) & 3) << 4)
                for sb in range(16):
                    o = po + 96 * sb
                    for k in range(4):
                        v0 = u[16 * sb + k]
                        v1 = u[16 * sb + 4 + k]
                        v2 = u[16 * sb + 8 + k]
                        v3 = u[16 * sb + 12 + k]
                        packed[o + 4 * r + k] = (v0 & 15) | ((v1 & 15) << 4)
                        packed[o + 32 + 4 * r + k] = (v2 & 15) | ((v3 & 15) << 4)
                        packed[o + 64 + 4 * r + k] = (v0 >> 4) | ((v1 >> 4) << 2) | ((v2 >> 4) << 4) | ((v3 >> 4) << 6)
                    packed[po + _Q6_SCALES + 16 * (sb // 2) + 2 * r + sb % 2] = raw[src + 192 + sb]
                packed[po + _Q6_D + 2 * r] = raw[src + 208]
                packed[po + _Q6_D + 2 * r + 1] = raw[src + 209]


def repack_q6_k(raw: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q6_K rows ``[n_out, n_in]`` (raw file blocks, ``supports(n_out, n_in)``) -> the layout above, flat."""
    nbk = n_in // QK_K
    packed = np.empty(n_out // 8 * nbk * Q6_SB_BYTES, np.uint8)
    _repack_q6(np.ascontiguousarray(raw).reshape(-1), nbk * Q6_K_BYTES, packed)
    return packed


_V16B = ir.VectorType(LL_I8, 16)


@intrinsic
def _q6_values(typingctx, raw, off):
    """Sub-block at byte ``off``: its four registers of values u (0..63), in the order of the activation
    quads they meet (16 s + 4 m + k for register m)."""
    if not is_1d(raw):
        return None
    tup = types.UniTuple(i8x32, 4)

    def codegen(context, builder, sig, args):
        b = builder

        def load(delta):
            return load_element(context, b, sig.args[0], args[0], b.add(args[1], ir.Constant(args[1].type, delta)),
                                sig.args[1], V16S)

        def nibbles(v, high):
            if high:
                v = b.lshr(v, splat_constant(V16S, 4))
            return b.and_(b.bitcast(v, V32B), splat_constant(V32B, 15))

        n0, n1, h = load(0), load(32), load(64)
        tops = []
        for m in range(4):  # bits 2m..2m+1 of each byte moved to bits 4..5 (16-bit shifts, then a byte mask)
            shift = 4 - 2 * m
            v = h
            if shift > 0:
                v = b.shl(h, splat_constant(V16S, shift))
            elif shift < 0:
                v = b.lshr(h, splat_constant(V16S, -shift))
            tops.append(b.and_(b.bitcast(v, V32B), splat_constant(V32B, 0x30)))
        lows = [nibbles(n0, False), nibbles(n0, True), nibbles(n1, False), nibbles(n1, True)]
        return context.make_tuple(b, tup, [b.or_(lo, top) for lo, top in zip(lows, tops, strict=True)])

    return tup(raw, off), codegen


@intrinsic
def _q6_scales(typingctx, raw, off):
    """The 16 signed scale bytes at ``off`` (``[row, (sc_2i, sc_2i+1)]``) as (sub-block 2i's per-row
    multiplier in both int16 lanes of each row, sub-block 2i+1's, and all 16 widened: the min-term
    operand against a bsums pair)."""
    if not is_1d(raw):
        return None
    tup = types.UniTuple(i16x16, 3)

    def codegen(context, builder, sig, args):
        b = builder
        v = load_element(context, b, sig.args[0], args[0], args[1], sig.args[1], _V16B)
        even = b.sext(b.shuffle_vector(v, v, shuffle_mask(16, lambda i: 2 * (i // 2))), V16S)
        odd = b.sext(b.shuffle_vector(v, v, shuffle_mask(16, lambda i: 2 * (i // 2) + 1)), V16S)
        return context.make_tuple(b, tup, [even, odd, b.sext(v, V16S)])

    return tup(raw, off), codegen


@intrinsic
def _minus_32x(typingctx, s, m):
    """s - 32 m, int32 lanes (exact here: see the bound above)."""
    if not (s == i32x8 and m == i32x8):
        return None
    return i32x8(s, m), lambda context, builder, sig, args: builder.sub(
        args[0], builder.shl(args[1], splat_constant(V8I, 5)))


@njit(inline="always")
def _q6_sub(s, u, sc, aq, ao):
    """``s`` plus one sub-block's products (values ``u``, per-row scale multiplier ``sc``) against the
    activations at ``ao``."""
    lo = add_i16x16(pairs_u8s8(u[0], broadcast_4bytes(aq, ao)), pairs_u8s8(u[1], broadcast_4bytes(aq, ao + 4)))
    hi = add_i16x16(pairs_u8s8(u[2], broadcast_4bytes(aq, ao + 8)), pairs_u8s8(u[3], broadcast_4bytes(aq, ao + 12)))
    return add_i32x8(add_i32x8(s, madd_i16x16(lo, sc)), madd_i16x16(hi, sc))


@njit(inline="always")
def _q6_finish(acc, s, m, packed, o, dq, do):
    return fma_i32x8(acc, _minus_32x(s, m), mul_f32x8(load_halves8(packed, o + _Q6_D), splat_at(dq, do)))


@njit(inline="always")
def _q6_one(acc, packed, o, aq, ao, bs, bo, dq, do):
    """One token through one super-block of a group."""
    s = zeros_i32x8()
    m = zeros_i32x8()
    for i in range(8):
        sc = _q6_scales(packed, o + _Q6_SCALES + 16 * i)
        s = _q6_sub(s, _q6_values(packed, o + 192 * i), sc[0], aq, ao + 32 * i)
        s = _q6_sub(s, _q6_values(packed, o + 192 * i + 96), sc[1], aq, ao + 32 * i + 16)
        m = add_i32x8(m, madd_i16x16(sc[2], broadcast_i16_pair(bs, bo + 2 * i)))
    return _q6_finish(acc, s, m, packed, o, dq, do)


@njit(inline="always")
def _q6_quad(a0, a1, a2, a3, packed, o, aq, ao, n_in, bs, bo, nb16, dq, do, nbk):
    """Four consecutive tokens through one super-block of a group, each register unpacked once."""
    s0 = s1 = s2 = s3 = m0 = m1 = m2 = m3 = zeros_i32x8()
    for i in range(8):
        sc = _q6_scales(packed, o + _Q6_SCALES + 16 * i)
        for h in range(2):
            u = _q6_values(packed, o + 192 * i + 96 * h)
            a = ao + 32 * i + 16 * h
            s0 = _q6_sub(s0, u, sc[h], aq, a)
            s1 = _q6_sub(s1, u, sc[h], aq, a + n_in)
            s2 = _q6_sub(s2, u, sc[h], aq, a + 2 * n_in)
            s3 = _q6_sub(s3, u, sc[h], aq, a + 3 * n_in)
        m0 = add_i32x8(m0, madd_i16x16(sc[2], broadcast_i16_pair(bs, bo + 2 * i)))
        m1 = add_i32x8(m1, madd_i16x16(sc[2], broadcast_i16_pair(bs, bo + nb16 + 2 * i)))
        m2 = add_i32x8(m2, madd_i16x16(sc[2], broadcast_i16_pair(bs, bo + 2 * nb16 + 2 * i)))
        m3 = add_i32x8(m3, madd_i16x16(sc[2], broadcast_i16_pair(bs, bo + 3 * nb16 + 2 * i)))
    a0 = _q6_finish(a0, s0, m0, packed, o, dq, do)
    a1 = _q6_finish(a1, s1, m1, packed, o, dq, do + nbk)
    a2 = _q6_finish(a2, s2, m2, packed, o, dq, do + 2 * nbk)
    a3 = _q6_finish(a3, s3, m3, packed, o, dq, do + 3 * nbk)
    return a0, a1, a2, a3


@njit(inline="always")
def _q6_small_pass(packed, flat, n_out, g, og, aq, dq, bs, n_tok, n_in, nbk):
    """``_small_pass`` for the Q6_K layout."""
    nb16 = nbk * 16
    n_quad = n_tok - n_tok % QUAD
    for b in range(nbk):
        o = og + b * Q6_SB_BYTES
        if Q6_DECODE_PREFETCH:
            for k in range(0, Q6_SB_BYTES, 64):
                prefetch(packed, o + Q6_PREFETCH_BYTES + k)
        first = b == 0
        for t in range(0, n_quad, QUAD):
            at = t * n_out + 8 * g
            a0, a1, a2, a3 = _load_quad(flat, at, n_out, first)
            a0, a1, a2, a3 = _q6_quad(a0, a1, a2, a3, packed, o, aq, t * n_in + b * QK_K, n_in, bs,
                                      (t * nbk + b) * 16, nb16, dq, t * nbk + b, nbk)
            _store_quad(flat, at, n_out, a0, a1, a2, a3)
        for t in range(n_quad, n_tok):  # (two tokens on one unpacking spill registers here: 1.2-1.4x slower)
            at = t * n_out + 8 * g
            store_f32x8(flat, at, _q6_one(_load_one(flat, at, first), packed, o, aq, t * n_in + b * QK_K, bs,
                                          (t * nbk + b) * 16, dq, t * nbk + b))


@njit(parallel=True, cache=True)
def _matmul_q6_group(pa, pb, pc, aq, dq, bs, oa, ob, oc):
    """``_matmul`` for the repacked Q6_K layout."""
    n_tok = oa.shape[0]
    n_in = aq.shape[0] // n_tok
    nbk = n_in // QK_K
    nb16 = nbk * 16
    n_quad = n_tok - n_tok % QUAD
    fa, fb, fc = oa.reshape(-1), ob.reshape(-1), oc.reshape(-1)  # once, not per item
    for gg in prange((oa.shape[1] + ob.shape[1] + oc.shape[1]) // 8):
        packed, flat, n_out, g = _member(gg, pa, pb, pc, oa, ob, oc, fa, fb, fc)
        og = g * nbk * Q6_SB_BYTES
        if n_tok <= SMALL_PASS_TOKENS:
            _q6_small_pass(packed, flat, n_out, g, og, aq, dq, bs, n_tok, n_in, nbk)
            continue
        for t in range(0, n_quad, QUAD):
            a0 = a1 = a2 = a3 = zeros_f32x8()
            for b in range(nbk):
                o = og + b * Q6_SB_BYTES
                a0, a1, a2, a3 = _q6_quad(a0, a1, a2, a3, packed, o, aq, t * n_in + b * QK_K, n_in, bs,
                                          (t * nbk + b) * 16, nb16, dq, t * nbk + b, nbk)
            _store_quad(flat, t * n_out + 8 * g, n_out, a0, a1, a2, a3)
        for t in range(n_quad, n_tok):
            a0 = zeros_f32x8()
            for b in range(nbk):
                o = og + b * Q6_SB_BYTES
                a0 = _q6_one(a0, packed, o, aq, t * n_in + b * QK_K, bs, (t * nbk + b) * 16, dq, t * nbk + b)
            store_f32x8(flat, t * n_out + 8 * g, a0)


def _matmul_q6(
    packed: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray, out: np.ndarray,
    pb: np.ndarray = NO_WEIGHT, ob: np.ndarray = NO_OUTPUT, pc: np.ndarray = NO_WEIGHT, oc: np.ndarray = NO_OUTPUT,
) -> None:
    _matmul_q6_group(packed, pb, pc, q, d, bsums, out, ob, oc)


# per weight type: (repack(raw, n_out, n_in) -> packed, kernel(packed, q, d, bsums, out[, pb, ob[, pc, oc]]));
# the kernel takes the flat buffers of Q8_K activations (kquant_matmul's Q8KActivations ``_q``, ``_d``,
# ``_bs``) and a C-contiguous float32 ``out[n_tok, n_out]``; up to two more weights of the type that read the
# same activations (``pb`` -> ``ob``, ``pc`` -> ``oc``) run in the same parallel loop
REPACKED = {
    GGMLType.Q4_K: (repack, _matmul_q4_k),
    GGMLType.Q5_K: (repack_q5_k, _matmul_q5_k),
    GGMLType.Q6_K: (repack_q6_k, _matmul_q6),
}
