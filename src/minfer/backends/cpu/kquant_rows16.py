"""The repacked Q4_K, Q5_K and Q6_K weights of :mod:`kquant_rows8` on 512-bit registers: two groups of eight rows
at a time, one in each half of a zmm register (where ``simd512.WIDE``: AVX-512 VNNI), prefill and decode.

Why: the eight-row kernel spends ~18 operations on each sub-block of each token and group (eight
pmaddubsw, six int16 adds, two pmaddwd by the scales, two int32 adds). Here a sub-block of a token and
*two* groups is eight ``vpdpbusd`` (the 32 products of each row summed into int32 lanes, no int16 pair
step), one ``vpmulld`` by the rows' scales and one add. In prefill the weight registers are unpacked once
for four tokens, as before; decode streams both groups, prefetching each.

The integers are the eight-row kernels' (each row's Σ_j scale_j · dot_j is exact in int32 either way:
see kquant_rows8's bounds), and each group's float accumulation is the very same ``_finish`` on its
eight lanes, so every output is the same bits as the eight-row kernel's, and a token's row is the same
alone or in a prompt. A weight with an odd number of groups runs its last group on the eight-row code.
Where the CPU splits 512-bit operations (Zen 4), Q4_K/Q5_K passes of up to three tokens and Q6_K passes of up
to two run on the eight-row kernels instead (``FEW_TOKENS_ON_EIGHT_ROWS``, ``FEW_Q6_TOKENS_ON_EIGHT_ROWS``).

Measured (1.7B-shaped Q4_K_M, 2 threads, Sapphire Rapids-class VM, against the eight-row kernels):
512-token matmuls Q4_K 1.41-1.56x, Q6_K 1.29-1.34x; pp512 92.7 -> 128.8 t/s; tg32 19.0 -> 20.9 t/s.
Passes of a few tokens (``_small_pass``) against one token, gate+up with the weights read from memory:
2 tokens 1.22x -> 1.13x, 4 tokens 1.94x -> 1.23x, 8 tokens 2.51x -> 1.73x, 16 tokens 3.68x -> 2.91x.
Two of the last three tokens of such a pass share one unpacking of the weights (``_pair_duo``): on Zen 4,
Q6_K 2048x8192 at 2 threads, 3 tokens 0.91x the time of one at a time, 6-7 tokens 0.92x (Q4_K 0.92-0.94x).
Zen 4 (2 threads, weights from memory), a decode's Q4_K 8192x2048: 554 us on these kernels, 316-341 us on
the eight-row ones; 1.7B Q4_K_M decode 61.0 -> 53.4 ms a token, 2-token passes 71.3 -> 60.7 ms.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from minfer.backends.cpu import kquant_rows8 as r8
from minfer.backends.cpu.kquant_rows8 import (
    _Q5_EXTRA,
    _Q6_SCALES,
    _SCALES,
    NO_OUTPUT,
    NO_WEIGHT,
    PREFETCH_BYTES,
    Q6_DECODE_PREFETCH,
    Q6_SB_BYTES,
    QK_K,
    QUAD,
    SB_BYTES,
    SMALL_PASS_TOKENS,
    _finish,
    _load_one,
    _load_quad,
    _one,
    _q6_finish,
    _q6_one,
    _q6_quad,
    _q6_scales,
    _quad,
    _store_quad,
    _sub_block_sums,
)
from minfer.backends.cpu.simd import (
    add_i32x8,
    broadcast_i16_pair,
    madd_i16x16,
    prefetch,
    store_f32x8,
    zeros_f32x8,
    zeros_i32x8,
)
from minfer.backends.cpu.simd512 import (
    SPLIT_512,
    WIDE,
    add_i32x16,
    broadcast_4bytes_x16,
    dpbusd_x16,
    high_i32x8,
    low_i32x8,
    mul_i32x16,
    q4k_values_x16,
    q5k_values_x16,
    q6k_values_x16,
    s8_scales_x16,
    u8_scales_x16,
    zeros_i32x16,
)
from minfer.formats.quants import GGMLType


@njit(inline="always")
def _dots(w, k0, n, aq, ao):
    """Σ over registers ``w[k0 .. k0+n-1]`` against the activation quads from byte ``ao``: int32 per row."""
    d = dpbusd_x16(zeros_i32x16(), w[k0], broadcast_4bytes_x16(aq, ao))
    for k in range(1, n):
        d = dpbusd_x16(d, w[k0 + k], broadcast_4bytes_x16(aq, ao + 4 * k))
    return d


@njit(inline="always")
def _sub(s, w, sc, aq, ao):
    """``s`` plus one Q4_K/Q5_K sub-block's 32 products per row times the rows' scales ``sc``."""
    return add_i32x16(s, mul_i32x16(add_i32x16(_dots(w, 0, 4, aq, ao), _dots(w, 4, 4, aq, ao + 16)), sc))


@njit(inline="always")
def _values(packed, o, o2, j, five):
    if five:
        return q5k_values_x16(packed, o + 128 * j, o2 + 128 * j, o + 1024 + 32 * j, o2 + 1024 + 32 * j)
    return q4k_values_x16(packed, o + 128 * j, o2 + 128 * j)


@njit(inline="always")
def _pair_quad(acc, packed, o, o2, aq, ao, n_in, bp, bo, nb8, dq, do, nbk, five):
    """Four tokens through one super-block of two groups: ``acc`` holds the four tokens' accumulators of the
    group at ``o``, then those of the group at ``o2``."""
    s0 = s1 = s2 = s3 = zeros_i32x16()
    osc = _SCALES + _Q5_EXTRA * five
    for j in range(8):
        w = _values(packed, o, o2, j, five)
        sc = u8_scales_x16(packed, o + osc + 8 * j, o2 + osc + 8 * j)
        s0 = _sub(s0, w, sc, aq, ao + 32 * j)
        s1 = _sub(s1, w, sc, aq, ao + n_in + 32 * j)
        s2 = _sub(s2, w, sc, aq, ao + 2 * n_in + 32 * j)
        s3 = _sub(s3, w, sc, aq, ao + 3 * n_in + 32 * j)
    return (
        _finish(acc[0], low_i32x8(s0), packed, o, bp, bo, dq, do, five),
        _finish(acc[1], low_i32x8(s1), packed, o, bp, bo + nb8, dq, do + nbk, five),
        _finish(acc[2], low_i32x8(s2), packed, o, bp, bo + 2 * nb8, dq, do + 2 * nbk, five),
        _finish(acc[3], low_i32x8(s3), packed, o, bp, bo + 3 * nb8, dq, do + 3 * nbk, five),
        _finish(acc[4], high_i32x8(s0), packed, o2, bp, bo, dq, do, five),
        _finish(acc[5], high_i32x8(s1), packed, o2, bp, bo + nb8, dq, do + nbk, five),
        _finish(acc[6], high_i32x8(s2), packed, o2, bp, bo + 2 * nb8, dq, do + 2 * nbk, five),
        _finish(acc[7], high_i32x8(s3), packed, o2, bp, bo + 3 * nb8, dq, do + 3 * nbk, five),
    )


@njit(inline="always")
def _pair_one(a, b, packed, o, o2, aq, ao, bp, bo, dq, do, five):
    """One token through one super-block of two groups (``a``: the accumulator of the group at ``o``, ``b``:
    at ``o2``); decode, and a prompt's last tokens."""
    s = zeros_i32x16()
    osc = _SCALES + _Q5_EXTRA * five
    for j in range(8):
        s = _sub(s, _values(packed, o, o2, j, five), u8_scales_x16(packed, o + osc + 8 * j, o2 + osc + 8 * j),
                 aq, ao + 32 * j)
    return (_finish(a, low_i32x8(s), packed, o, bp, bo, dq, do, five),
            _finish(b, high_i32x8(s), packed, o2, bp, bo, dq, do, five))


@njit(inline="always")
def _pair_duo(a0, a1, b0, b1, packed, o, o2, aq, ao, n_in, bp, bo, nb8, dq, do, nbk, five):
    """Two consecutive tokens through one super-block of two groups, each weight register unpacked once
    (``a0``, ``a1``: the tokens' accumulators of the group at ``o``; ``b0``, ``b1``: at ``o2``)."""
    s0 = s1 = zeros_i32x16()
    osc = _SCALES + _Q5_EXTRA * five
    for j in range(8):
        w = _values(packed, o, o2, j, five)
        sc = u8_scales_x16(packed, o + osc + 8 * j, o2 + osc + 8 * j)
        s0 = _sub(s0, w, sc, aq, ao + 32 * j)
        s1 = _sub(s1, w, sc, aq, ao + n_in + 32 * j)
    return (_finish(a0, low_i32x8(s0), packed, o, bp, bo, dq, do, five),
            _finish(a1, low_i32x8(s1), packed, o, bp, bo + nb8, dq, do + nbk, five),
            _finish(b0, high_i32x8(s0), packed, o2, bp, bo, dq, do, five),
            _finish(b1, high_i32x8(s1), packed, o2, bp, bo + nb8, dq, do + nbk, five))


@njit(inline="always")
def _pair(pp, pa, pb, pc, oa, ob, oc, fa, fb, fc):
    """Pair ``pp`` of a call's weights a, b, c (each weight's groups 0-1, 2-3, ...; an odd last group is a
    pair of one): (its weight, its flat output (of ``fa``, ``fb``, ``fc``, made once per call: see
    kquant_rows8's ``_member``), the output's width, its first group, whether a second follows)."""
    i = np.int64(pp)
    na, nb, nc = oa.shape[1] // 8, ob.shape[1] // 8, oc.shape[1] // 8
    pa_n, pb_n = (na + 1) // 2, (nb + 1) // 2
    if i >= pa_n + pb_n:
        g = 2 * (i - pa_n - pb_n)
        return pc, fc, oc.shape[1], g, g + 1 < nc
    if i >= pa_n:
        g = 2 * (i - pa_n)
        return pb, fb, ob.shape[1], g, g + 1 < nb
    return pa, fa, oa.shape[1], 2 * i, 2 * i + 1 < na


@njit(inline="always")
def _n_pairs(oa, ob, oc):
    """How many pairs ``_pair`` numbers."""
    return (oa.shape[1] // 8 + 1) // 2 + (ob.shape[1] // 8 + 1) // 2 + (oc.shape[1] // 8 + 1) // 2

@njit(inline="always")
def _prefetch_block(packed, o, o2, two, n_bytes):
    """Ask for the super-block ``PREFETCH_BYTES`` past ``o`` (and past ``o2`` when ``two``)."""
    for c in range(0, n_bytes, 64):
        prefetch(packed, o + PREFETCH_BYTES + c)
        if two:
            prefetch(packed, o2 + PREFETCH_BYTES + c)


@njit(inline="always")
def _small_pass(packed, flat, n_out, g, two, og, og2, aq, dq, bp, n_tok, n_in, nbk, five):
    """One pair's rows for a pass of at most ``SMALL_PASS_TOKENS`` tokens, super-block-major."""
    nb8 = nbk * 8
    sb_bytes = SB_BYTES + _Q5_EXTRA * five
    n_quad = n_tok - n_tok % QUAD
    for b in range(nbk):
        o, o2 = og + b * sb_bytes, og2 + b * sb_bytes
        _prefetch_block(packed, o, o2, two, sb_bytes)
        first = b == 0
        for t in range(0, n_quad, QUAD):
            at, ao, bo, do = t * n_out + 8 * g, t * n_in + b * QK_K, t * nb8 + 8 * b, t * nbk + b
            a0, a1, a2, a3 = _load_quad(flat, at, n_out, first)
            if two:
                b0, b1, b2, b3 = _load_quad(flat, at + 8, n_out, first)
                acc = _pair_quad((a0, a1, a2, a3, b0, b1, b2, b3), packed, o, o2, aq, ao, n_in, bp, bo, nb8, dq,
                                 do, nbk, five)
                _store_quad(flat, at, n_out, acc[0], acc[1], acc[2], acc[3])
                _store_quad(flat, at + 8, n_out, acc[4], acc[5], acc[6], acc[7])
            else:
                a0, a1, a2, a3 = _quad(a0, a1, a2, a3, packed, o, aq, ao, n_in, bp, bo, nb8, dq, do, nbk, five)
                _store_quad(flat, at, n_out, a0, a1, a2, a3)
        t_rest = n_quad
        if two and n_tok - n_quad >= 2:  # two of the last three tokens on one unpacking of the weights
            t = n_quad
            at, ao, bo, do = t * n_out + 8 * g, t * n_in + b * QK_K, t * nb8 + 8 * b, t * nbk + b
            a0, a1, c0, c1 = _pair_duo(_load_one(flat, at, first), _load_one(flat, at + n_out, first),
                                       _load_one(flat, at + 8, first), _load_one(flat, at + n_out + 8, first),
                                       packed, o, o2, aq, ao, n_in, bp, bo, nb8, dq, do, nbk, five)
            store_f32x8(flat, at, a0)
            store_f32x8(flat, at + n_out, a1)
            store_f32x8(flat, at + 8, c0)
            store_f32x8(flat, at + n_out + 8, c1)
            t_rest += 2
        for t in range(t_rest, n_tok):
            at, ao, bo, do = t * n_out + 8 * g, t * n_in + b * QK_K, t * nb8 + 8 * b, t * nbk + b
            if two:
                a, c = _pair_one(_load_one(flat, at, first), _load_one(flat, at + 8, first), packed, o, o2, aq, ao,
                                 bp, bo, dq, do, five)
                store_f32x8(flat, at, a)
                store_f32x8(flat, at + 8, c)
            else:
                store_f32x8(flat, at, _one(_load_one(flat, at, first), packed, o, aq, ao, bp, bo, dq, do, five))


@njit(inline="always")
def _large_pass(packed, flat, n_out, g, two, og, og2, aq, dq, bp, t_first, n_tok, n_in, nbk, five):
    """One pair's rows for tokens ``t_first`` .. ``n_tok`` - 1 of a prompt, four tokens at a time (their
    accumulators in registers through the pair's super-blocks), then the last one to three alone."""
    nb8 = nbk * 8
    sb_bytes = SB_BYTES + _Q5_EXTRA * five
    n_quad = n_tok - (n_tok - t_first) % QUAD
    for t in range(t_first, n_quad, QUAD):
        if two:
            z = zeros_f32x8()
            acc = (z, z, z, z, z, z, z, z)
            for b in range(nbk):
                if t == t_first:  # the pair's weights come from memory once: ask for them ahead of the unpacking
                    _prefetch_block(packed, og + b * sb_bytes, og2 + b * sb_bytes, True, sb_bytes)
                acc = _pair_quad(acc, packed, og + b * sb_bytes, og2 + b * sb_bytes, aq, t * n_in + b * QK_K,
                                 n_in, bp, t * nb8 + 8 * b, nb8, dq, t * nbk + b, nbk, five)
            _store_quad(flat, t * n_out + 8 * g, n_out, acc[0], acc[1], acc[2], acc[3])
            _store_quad(flat, t * n_out + 8 * g + 8, n_out, acc[4], acc[5], acc[6], acc[7])
        else:
            a0 = a1 = a2 = a3 = zeros_f32x8()
            for b in range(nbk):
                a0, a1, a2, a3 = _quad(a0, a1, a2, a3, packed, og + b * sb_bytes, aq, t * n_in + b * QK_K, n_in,
                                       bp, t * nb8 + 8 * b, nb8, dq, t * nbk + b, nbk, five)
            _store_quad(flat, t * n_out + 8 * g, n_out, a0, a1, a2, a3)
    for t in range(n_quad, n_tok):  # the last (n_tok - t_first) % 4 tokens (the pair's weights are in cache by now)
        a = b = zeros_f32x8()
        for k in range(nbk):
            o, o2 = og + k * sb_bytes, og2 + k * sb_bytes
            ao, bo, do = t * n_in + k * QK_K, t * nb8 + 8 * k, t * nbk + k
            if two:
                a, b = _pair_one(a, b, packed, o, o2, aq, ao, bp, bo, dq, do, five)
            else:
                a = _one(a, packed, o, aq, ao, bp, bo, dq, do, five)
        store_f32x8(flat, t * n_out + 8 * g, a)
        if two:
            store_f32x8(flat, t * n_out + 8 * g + 8, b)


@njit(parallel=True, cache=True)
def _matmul_pairs(pa, pb, pc, aq, dq, bs, oa, ob, oc, five):
    """kquant_rows8's ``_matmul``, two groups per work item."""
    n_tok = oa.shape[0]
    n_in = aq.shape[0] // n_tok
    nbk = n_in // QK_K
    nb8 = nbk * 8
    sb_bytes = SB_BYTES + _Q5_EXTRA * five
    bp = _sub_block_sums(bs, n_tok * nb8)
    fa, fb, fc = oa.reshape(-1), ob.reshape(-1), oc.reshape(-1)  # once, not per item
    for pp in prange(_n_pairs(oa, ob, oc)):
        packed, flat, n_out, g, two = _pair(pp, pa, pb, pc, oa, ob, oc, fa, fb, fc)
        og = g * nbk * sb_bytes
        og2 = og + nbk * sb_bytes
        if n_tok <= SMALL_PASS_TOKENS:
            _small_pass(packed, flat, n_out, g, two, og, og2, aq, dq, bp, n_tok, n_in, nbk, five)
            continue
        _large_pass(packed, flat, n_out, g, two, og, og2, aq, dq, bp, 0, n_tok, n_in, nbk, five)


# --- Q6_K ------------------------------------------------------------------------------------------


@njit(inline="always")
def _q6_sub(s, u, sc, aq, ao):
    """``s`` plus one Q6_K sub-block's 16 products per row times the rows' scales ``sc``."""
    return add_i32x16(s, mul_i32x16(_dots(u, 0, 4, aq, ao), sc))


@njit(inline="always")
def _q6_pair_quad(acc, packed, o, o2, aq, ao, n_in, bs, bo, nb16, dq, do, nbk):
    """``_pair_quad`` for the Q6_K layout."""
    s0 = s1 = s2 = s3 = zeros_i32x16()
    m0 = m1 = m2 = m3 = n0 = n1 = n2 = n3 = zeros_i32x8()
    for i in range(8):
        osc, osc2 = o + _Q6_SCALES + 16 * i, o2 + _Q6_SCALES + 16 * i
        for h in range(2):
            u = q6k_values_x16(packed, o + 192 * i + 96 * h, o2 + 192 * i + 96 * h)
            sc = s8_scales_x16(packed, osc + h, osc2 + h)
            a = ao + 32 * i + 16 * h
            s0 = _q6_sub(s0, u, sc, aq, a)
            s1 = _q6_sub(s1, u, sc, aq, a + n_in)
            s2 = _q6_sub(s2, u, sc, aq, a + 2 * n_in)
            s3 = _q6_sub(s3, u, sc, aq, a + 3 * n_in)
        # the offset term per group, as the eight-row kernel computes it
        sm, sn = _q6_scales(packed, osc)[2], _q6_scales(packed, osc2)[2]
        m0 = add_i32x8(m0, madd_i16x16(sm, broadcast_i16_pair(bs, bo + 2 * i)))
        m1 = add_i32x8(m1, madd_i16x16(sm, broadcast_i16_pair(bs, bo + nb16 + 2 * i)))
        m2 = add_i32x8(m2, madd_i16x16(sm, broadcast_i16_pair(bs, bo + 2 * nb16 + 2 * i)))
        m3 = add_i32x8(m3, madd_i16x16(sm, broadcast_i16_pair(bs, bo + 3 * nb16 + 2 * i)))
        n0 = add_i32x8(n0, madd_i16x16(sn, broadcast_i16_pair(bs, bo + 2 * i)))
        n1 = add_i32x8(n1, madd_i16x16(sn, broadcast_i16_pair(bs, bo + nb16 + 2 * i)))
        n2 = add_i32x8(n2, madd_i16x16(sn, broadcast_i16_pair(bs, bo + 2 * nb16 + 2 * i)))
        n3 = add_i32x8(n3, madd_i16x16(sn, broadcast_i16_pair(bs, bo + 3 * nb16 + 2 * i)))
    return (
        _q6_finish(acc[0], low_i32x8(s0), m0, packed, o, dq, do),
        _q6_finish(acc[1], low_i32x8(s1), m1, packed, o, dq, do + nbk),
        _q6_finish(acc[2], low_i32x8(s2), m2, packed, o, dq, do + 2 * nbk),
        _q6_finish(acc[3], low_i32x8(s3), m3, packed, o, dq, do + 3 * nbk),
        _q6_finish(acc[4], high_i32x8(s0), n0, packed, o2, dq, do),
        _q6_finish(acc[5], high_i32x8(s1), n1, packed, o2, dq, do + nbk),
        _q6_finish(acc[6], high_i32x8(s2), n2, packed, o2, dq, do + 2 * nbk),
        _q6_finish(acc[7], high_i32x8(s3), n3, packed, o2, dq, do + 3 * nbk),
    )


@njit(inline="always")
def _q6_pair_duo(a0, a1, b0, b1, packed, o, o2, aq, ao, n_in, bs, bo, nb16, dq, do, nbk):
    """``_pair_duo`` for the Q6_K layout."""
    s0 = s1 = zeros_i32x16()
    m0 = m1 = n0 = n1 = zeros_i32x8()
    for i in range(8):
        osc, osc2 = o + _Q6_SCALES + 16 * i, o2 + _Q6_SCALES + 16 * i
        for h in range(2):
            u = q6k_values_x16(packed, o + 192 * i + 96 * h, o2 + 192 * i + 96 * h)
            sc = s8_scales_x16(packed, osc + h, osc2 + h)
            a = ao + 32 * i + 16 * h
            s0 = _q6_sub(s0, u, sc, aq, a)
            s1 = _q6_sub(s1, u, sc, aq, a + n_in)
        sm, sn = _q6_scales(packed, osc)[2], _q6_scales(packed, osc2)[2]
        m0 = add_i32x8(m0, madd_i16x16(sm, broadcast_i16_pair(bs, bo + 2 * i)))
        m1 = add_i32x8(m1, madd_i16x16(sm, broadcast_i16_pair(bs, bo + nb16 + 2 * i)))
        n0 = add_i32x8(n0, madd_i16x16(sn, broadcast_i16_pair(bs, bo + 2 * i)))
        n1 = add_i32x8(n1, madd_i16x16(sn, broadcast_i16_pair(bs, bo + nb16 + 2 * i)))
    return (_q6_finish(a0, low_i32x8(s0), m0, packed, o, dq, do),
            _q6_finish(a1, low_i32x8(s1), m1, packed, o, dq, do + nbk),
            _q6_finish(b0, high_i32x8(s0), n0, packed, o2, dq, do),
            _q6_finish(b1, high_i32x8(s1), n1, packed, o2, dq, do + nbk))


@njit(inline="always")
def _q6_pair_one(a, b, packed, o, o2, aq, ao, bs, bo, dq, do):
    """``_pair_one`` for the Q6_K layout."""
    s = zeros_i32x16()
    m = n = zeros_i32x8()
    for i in range(8):
        osc, osc2 = o + _Q6_SCALES + 16 * i, o2 + _Q6_SCALES + 16 * i
        for h in range(2):
            u = q6k_values_x16(packed, o + 192 * i + 96 * h, o2 + 192 * i + 96 * h)
            s = _q6_sub(s, u, s8_scales_x16(packed, osc + h, osc2 + h), aq, ao + 32 * i + 16 * h)
        m = add_i32x8(m, madd_i16x16(_q6_scales(packed, osc)[2], broadcast_i16_pair(bs, bo + 2 * i)))
        n = add_i32x8(n, madd_i16x16(_q6_scales(packed, osc2)[2], broadcast_i16_pair(bs, bo + 2 * i)))
    return (_q6_finish(a, low_i32x8(s), m, packed, o, dq, do),
            _q6_finish(b, high_i32x8(s), n, packed, o2, dq, do))


@njit(inline="always")
def _q6_small_pass(packed, flat, n_out, g, two, og, og2, aq, dq, bs, n_tok, n_in, nbk):
    """``_small_pass`` for the Q6_K layout."""
    nb16 = nbk * 16
    n_quad = n_tok - n_tok % QUAD
    for b in range(nbk):
        o, o2 = og + b * Q6_SB_BYTES, og2 + b * Q6_SB_BYTES
        if Q6_DECODE_PREFETCH:
            _prefetch_block(packed, o, o2, two, Q6_SB_BYTES)
        first = b == 0
        for t in range(0, n_quad, QUAD):
            at, ao, bo, do = t * n_out + 8 * g, t * n_in + b * QK_K, (t * nbk + b) * 16, t * nbk + b
            a0, a1, a2, a3 = _load_quad(flat, at, n_out, first)
            if two:
                b0, b1, b2, b3 = _load_quad(flat, at + 8, n_out, first)
                acc = _q6_pair_quad((a0, a1, a2, a3, b0, b1, b2, b3), packed, o, o2, aq, ao, n_in, bs, bo, nb16, dq,
                                    do, nbk)
                _store_quad(flat, at, n_out, acc[0], acc[1], acc[2], acc[3])
                _store_quad(flat, at + 8, n_out, acc[4], acc[5], acc[6], acc[7])
            else:
                a0, a1, a2, a3 = _q6_quad(a0, a1, a2, a3, packed, o, aq, ao, n_in, bs, bo, nb16, dq, do, nbk)
                _store_quad(flat, at, n_out, a0, a1, a2, a3)
        t_rest = n_quad
        if two and n_tok - n_quad >= 2:
            t = n_quad
            at, ao, bo, do = t * n_out + 8 * g, t * n_in + b * QK_K, (t * nbk + b) * 16, t * nbk + b
            a0, a1, c0, c1 = _q6_pair_duo(_load_one(flat, at, first), _load_one(flat, at + n_out, first),
                                          _load_one(flat, at + 8, first), _load_one(flat, at + n_out + 8, first),
                                          packed, o, o2, aq, ao, n_in, bs, bo, nb16, dq, do, nbk)
            store_f32x8(flat, at, a0)
            store_f32x8(flat, at + n_out, a1)
            store_f32x8(flat, at + 8, c0)
            store_f32x8(flat, at + n_out + 8, c1)
            t_rest += 2
        for t in range(t_rest, n_tok):
            at, ao, bo, do = t * n_out + 8 * g, t * n_in + b * QK_K, (t * nbk + b) * 16, t * nbk + b
            if two:
                a, c = _q6_pair_one(_load_one(flat, at, first), _load_one(flat, at + 8, first), packed, o, o2, aq,
                                    ao, bs, bo, dq, do)
                store_f32x8(flat, at, a)
                store_f32x8(flat, at + 8, c)
            else:
                store_f32x8(flat, at, _q6_one(_load_one(flat, at, first), packed, o, aq, ao, bs, bo, dq, do))


@njit(inline="always")
def _q6_large_pass(packed, flat, n_out, g, two, og, og2, aq, dq, bs, t_first, n_tok, n_in, nbk):
    """``_large_pass`` for the Q6_K layout."""
    nb16 = nbk * 16
    n_quad = n_tok - (n_tok - t_first) % QUAD
    for t in range(t_first, n_quad, QUAD):
        if two:
            z = zeros_f32x8()
            acc = (z, z, z, z, z, z, z, z)
            for b in range(nbk):
                if t == t_first:
                    _prefetch_block(packed, og + b * Q6_SB_BYTES, og2 + b * Q6_SB_BYTES, True, Q6_SB_BYTES)
                acc = _q6_pair_quad(acc, packed, og + b * Q6_SB_BYTES, og2 + b * Q6_SB_BYTES, aq,
                                    t * n_in + b * QK_K, n_in, bs, (t * nbk + b) * 16, nb16, dq, t * nbk + b, nbk)
            _store_quad(flat, t * n_out + 8 * g, n_out, acc[0], acc[1], acc[2], acc[3])
            _store_quad(flat, t * n_out + 8 * g + 8, n_out, acc[4], acc[5], acc[6], acc[7])
        else:
            a0 = a1 = a2 = a3 = zeros_f32x8()
            for b in range(nbk):
                a0, a1, a2, a3 = _q6_quad(a0, a1, a2, a3, packed, og + b * Q6_SB_BYTES, aq, t * n_in + b * QK_K,
                                          n_in, bs, (t * nbk + b) * 16, nb16, dq, t * nbk + b, nbk)
            _store_quad(flat, t * n_out + 8 * g, n_out, a0, a1, a2, a3)
    for t in range(n_quad, n_tok):
        a = b = zeros_f32x8()
        for k in range(nbk):
            o, o2 = og + k * Q6_SB_BYTES, og2 + k * Q6_SB_BYTES
            ao, bo, do = t * n_in + k * QK_K, (t * nbk + k) * 16, t * nbk + k
            if two:
                a, b = _q6_pair_one(a, b, packed, o, o2, aq, ao, bs, bo, dq, do)
            else:
                a = _q6_one(a, packed, o, aq, ao, bs, bo, dq, do)
        store_f32x8(flat, t * n_out + 8 * g, a)
        if two:
            store_f32x8(flat, t * n_out + 8 * g + 8, b)


@njit(parallel=True, cache=True)
def _matmul_q6_pairs(pa, pb, pc, aq, dq, bs, oa, ob, oc):
    """kquant_rows8's ``_matmul_q6_group``, two groups per work item."""
    n_tok = oa.shape[0]
    n_in = aq.shape[0] // n_tok
    nbk = n_in // QK_K
    fa, fb, fc = oa.reshape(-1), ob.reshape(-1), oc.reshape(-1)  # once, not per item
    for pp in prange(_n_pairs(oa, ob, oc)):
        packed, flat, n_out, g, two = _pair(pp, pa, pb, pc, oa, ob, oc, fa, fb, fc)
        og = g * nbk * Q6_SB_BYTES
        og2 = og + nbk * Q6_SB_BYTES
        if n_tok <= SMALL_PASS_TOKENS:
            _q6_small_pass(packed, flat, n_out, g, two, og, og2, aq, dq, bs, n_tok, n_in, nbk)
            continue
        _q6_large_pass(packed, flat, n_out, g, two, og, og2, aq, dq, bs, 0, n_tok, n_in, nbk)


# --- the kernels kquant_matmul calls ---------------------------------------------------------------


def _matmul_q4_k(packed: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray, out: np.ndarray,
                 pb: np.ndarray = NO_WEIGHT, ob: np.ndarray = NO_OUTPUT, pc: np.ndarray = NO_WEIGHT,
                 oc: np.ndarray = NO_OUTPUT) -> None:
    _matmul_pairs(packed, pb, pc, q, d, bsums, out, ob, oc, 0)


def _matmul_q5_k(packed: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray, out: np.ndarray,
                 pb: np.ndarray = NO_WEIGHT, ob: np.ndarray = NO_OUTPUT, pc: np.ndarray = NO_WEIGHT,
                 oc: np.ndarray = NO_OUTPUT) -> None:
    _matmul_pairs(packed, pb, pc, q, d, bsums, out, ob, oc, 1)


def _matmul_q6_k(packed: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray, out: np.ndarray,
                 pb: np.ndarray = NO_WEIGHT, ob: np.ndarray = NO_OUTPUT, pc: np.ndarray = NO_WEIGHT,
                 oc: np.ndarray = NO_OUTPUT) -> None:
    _matmul_q6_pairs(packed, pb, pc, q, d, bsums, out, ob, oc)


# Passes of up to this many tokens of Q4_K/Q5_K run on the eight-row kernels (the same bits), where the CPU
# splits 512-bit operations (simd512.SPLIT_512).
FEW_TOKENS_ON_EIGHT_ROWS = 3 if SPLIT_512 else 0
# Q6_K's passes of one and two tokens too. Zen 4, 2 threads, weights from memory, eight rows against pairs:
# 1-2 tokens 2048x8192 0.79-0.87x the time, 8192x2048 and the 49152x2048 output matrix 0.56-0.64x; at three
# tokens 8192x2048 still 0.67x but 2048x8192 1.12-1.22x, so three tokens stay on the pairs.
FEW_Q6_TOKENS_ON_EIGHT_ROWS = 2 if SPLIT_512 else 0


def _few_on_eight_rows(pairs: Callable[..., None], eight_rows: Callable[..., None], few: int) -> Callable[..., None]:
    """``pairs``, with passes of up to ``few`` tokens on ``eight_rows`` instead."""
    if not few:
        return pairs

    def matmul(packed: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray, out: np.ndarray,
               pb: np.ndarray = NO_WEIGHT, ob: np.ndarray = NO_OUTPUT, pc: np.ndarray = NO_WEIGHT,
               oc: np.ndarray = NO_OUTPUT) -> None:
        kernel = eight_rows if out.shape[0] <= few else pairs
        kernel(packed, q, d, bsums, out, pb, ob, pc, oc)

    return matmul


# the matmuls on these kernels alone, whatever the token count (tests compare them with the eight-row ones)
PAIRS = {GGMLType.Q4_K: _matmul_q4_k, GGMLType.Q5_K: _matmul_q5_k, GGMLType.Q6_K: _matmul_q6_k}

# the matmuls: these kernels, or the eight-row ones for a few tokens (kquant_amx's Q4_K outside the tiles too)
matmul_q4_k = _few_on_eight_rows(_matmul_q4_k, r8.REPACKED[GGMLType.Q4_K][1], FEW_TOKENS_ON_EIGHT_ROWS)
matmul_q5_k = _few_on_eight_rows(_matmul_q5_k, r8.REPACKED[GGMLType.Q5_K][1], FEW_TOKENS_ON_EIGHT_ROWS)
matmul_q6_k = _few_on_eight_rows(_matmul_q6_k, r8.REPACKED[GGMLType.Q6_K][1], FEW_Q6_TOKENS_ON_EIGHT_ROWS)

# kquant_rows8.REPACKED, with the matmuls on these kernels where the CPU has AVX-512 VNNI
REPACKED = {
    GGMLType.Q4_K: (r8.REPACKED[GGMLType.Q4_K][0], matmul_q4_k),
    GGMLType.Q5_K: (r8.REPACKED[GGMLType.Q5_K][0], matmul_q5_k),
    GGMLType.Q6_K: (r8.REPACKED[GGMLType.Q6_K][0], matmul_q6_k),
} if WIDE else r8.REPACKED
