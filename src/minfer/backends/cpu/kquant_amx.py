"""Q4_K and Q6_K prefill on AMX tiles (where :func:`amx.usable`), from :mod:`kquant_rows16`'s pairs of
groups: the same integers and the same float steps, so the same bits as the 512-bit and eight-row kernels.

Why the tiles pay here: a Q4_K row's dot product over a super-block is S = Σ_j sc_j Σ_k q_jk a_k, with
6-bit integer sub-block scales sc_j. Written sc_j = 16 h_j + l_j (l_j < 16, h_j < 4), S is the sum of two
plain int8 products over the whole super-block, S = A . (q l) + 16 A . (q h), and q l <= 225, q h <= 45
fit unsigned bytes. So each pair of groups gets two weight panels (q l and q h, in the tiles' VNNI order)
built once per call, and a super-block of 16 tokens is eight ``tdpbsud`` of 16 x 64 x 16 (K = 64: two
sub-blocks each) into two int32 tiles, stored once: S = lo + 16 hi (exact: |S| < 2^31), then the eight-row
kernels' float finish for both groups at once (``_finish16``: their operations lane for lane).

Q6_K the same way: its value u - 32 (-32..31) times a signed 8-bit sub-block scale sc, written in base 8
with digits -3..4 (sc = d0 + 8 d1 + 64 d2), is three signed byte panels ((u - 32) d fits -128..124), and
S - 32 M (the eight-row kernel's sum and offset term) = C0 + 8 C1 + 64 C2 from three int32 tiles.

A weight's odd last group, and the last ``n_tok % 16`` tokens, run on the 512-bit kernel's code; passes of
fewer than ``AMX_TOKENS`` tokens (decode among them) do not use the tiles.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from minfer.backends.cpu import amx
from minfer.backends.cpu import kquant_rows16 as r16
from minfer.backends.cpu.kquant_rows8 import (
    _D,
    _MINS,
    _Q6_D,
    _Q6_SCALES,
    _SCALES,
    NO_OUTPUT,
    NO_WEIGHT,
    Q6_SB_BYTES,
    QK_K,
    SB_BYTES,
    _sub_block_sums,
)
from minfer.backends.cpu.kquant_rows16 import _large_pass, _n_pairs, _pair, _q6_large_pass, _values
from minfer.backends.cpu.simd import LL_I8, LL_I16, LL_I32, element_pointer, ir_call, ir_splat, is_1d, load_element
from minfer.backends.cpu.simd512 import (
    V16I,
    WIDE,
    _load_pair,
    fma_i32x16,
    halves_x16,
    i8x64,
    i32x16,
    load_f32x16,
    mul_f32x16,
    q6k_values_x16,
    s8_scales_x16,
    splat_at_x16,
    store_f32x16,
    u8_scales_x16,
    zeros_f32x16,
)
from minfer.formats.quants import GGMLType

AMX_TOKENS = 32  # the fewest tokens a pass runs on the tiles (below, building the panels does not pay)
TILE_TOKENS = 16
_STEP_BYTES = 2048  # one K = 64 step of a pair's panels: 16 rows x 64 bytes of q l, then of q h
# tiles: 0 and 1 the int32 sums against q l and q h, 2 the activations, 3 and 4 the two panels' step
CONFIG = amx.config({0: (16, 64), 1: (16, 64), 2: (16, 64), 3: (16, 64), 4: (16, 64)})

_zero_lo, _zero_hi = amx.tile_zero(0), amx.tile_zero(1)
_load_acts, _load_lo, _load_hi = amx.tile_load(2), amx.tile_load(3), amx.tile_load(4)
_dot_lo, _dot_hi = amx.tile_dot(0, 2, 3, b_signed=False), amx.tile_dot(1, 2, 4, b_signed=False)
_store_lo, _store_hi = amx.tile_store(0), amx.tile_store(1)
_tile_config = amx.tile_config


def _scaled(high: bool):
    @intrinsic
    def scaled(typingctx, w, sc):
        """The 64 bytes of ``w`` (sixteen rows' four values, each < 16) times their row's ``sc & 15``
        (``high``: ``sc >> 4``), as int32 lanes: one multiply per row, since no byte's product (<= 225)
        carries into the next byte."""
        if not (w == i8x64 and sc == i32x16):
            return None

        def codegen(context, builder, sig, args):
            if high:
                part = builder.lshr(args[1], ir.Constant(V16I, [4] * 16))
            else:
                part = builder.and_(args[1], ir.Constant(V16I, [15] * 16))
            return builder.mul(builder.bitcast(args[0], V16I), part)

        return i32x16(w, sc), codegen

    return scaled


_scaled_low, _scaled_high = _scaled(False), _scaled(True)


@intrinsic
def _store64(typingctx, arr, at, v):
    """``v``'s 64 bytes (sixteen int32 lanes or 64 bytes) at byte ``at`` of a uint8 array."""
    if not (is_1d(arr) and v in (i32x16, i8x64)):
        return None

    def codegen(context, builder, sig, args):
        vty = args[2].type
        builder.store(args[2], element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], vty),
                      align=1)
        return context.get_dummy_value()

    return types.void(arr, at, v), codegen


@intrinsic
def _load_i32x16(typingctx, arr, i):
    """arr[i:i+16] of an int32 array."""
    if not (is_1d(arr) and arr.dtype == types.int32):
        return None

    def codegen(context, builder, sig, args):
        return load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], V16I)

    return i32x16(arr, i), codegen


@intrinsic
def _low_plus_16_high(typingctx, lo, hi):
    """lo + 16 hi on int32 lanes (exact: see the module's bound)."""
    if not (lo == i32x16 and hi == i32x16):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], builder.shl(args[1], ir.Constant(V16I, [4] * 16)))

    return i32x16(lo, hi), codegen


@intrinsic
def _mins_term_x16(typingctx, raw, off, off2, bp, bo):
    """kquant_rows8's min term for both groups of a pair against one token's sub-block sums ``bp[bo:bo + 8]``:
    Σ_{i<4} pmaddwd(the 16 min bytes at ``off + 16 i`` joined with those at ``off2 + 16 i``, the sums
    ``bp[bo + 2 i], bp[bo + 2 i + 1]`` in every pair of int16 lanes), the same int32 per lane (exact)."""
    if not (is_1d(raw) and is_1d(bp) and bp.dtype == types.int16):
        return None

    def codegen(context, builder, sig, args):
        v32s = ir.VectorType(LL_I16, 32)
        m = None
        for i in range(4):
            mins = builder.zext(_load_pair(context, builder, sig, args, 1, 2, 16 * i, ir.VectorType(LL_I8, 16)), v32s)
            at = builder.add(args[4], ir.Constant(args[4].type, 2 * i))
            pair = load_element(context, builder, sig.args[3], args[3], at, sig.args[4], LL_I32)
            sums = builder.bitcast(ir_splat(builder, pair, 16), v32s)
            prod = ir_call(builder, "llvm.x86.avx512.pmaddw.d.512", V16I, [mins, sums])
            m = prod if m is None else builder.add(m, prod)
        return m

    return i32x16(raw, off, off2, bp, bo), codegen


@njit(inline="always")
def _finish16(acc, s, packed, o, o2, bp, bo, dq, do):
    """kquant_rows8's ``_finish`` for both groups of a pair (the group at ``o`` in the low eight lanes), lane
    for lane the same operations."""
    m = _mins_term_x16(packed, o + _MINS, o2 + _MINS, bp, bo)
    dx = splat_at_x16(dq, do)
    acc = fma_i32x16(acc, s, mul_f32x16(halves_x16(packed, o + _D, o2 + _D), dx))
    return fma_i32x16(acc, m, mul_f32x16(halves_x16(packed, o + _D + 16, o2 + _D + 16), dx))


@njit(inline="always")
def _build_panels(packed, og, og2, nbk, panel):
    """The pair's two panels: per super-block b and K = 64 step (sub-blocks 2 i and 2 i + 1), the 16 rows of
    q l (each sub-block's eight registers of sixteen rows' four values), then those of q h."""
    for b in range(nbk):
        o, o2 = og + b * SB_BYTES, og2 + b * SB_BYTES
        for j in range(8):
            w = _values(packed, o, o2, j, 0)
            sc = u8_scales_x16(packed, o + _SCALES + 8 * j, o2 + _SCALES + 8 * j)
            at = (4 * b + j // 2) * _STEP_BYTES + (j % 2) * 512
            for c in range(8):
                _store64(panel, at + 64 * c, _scaled_low(w[c], sc))
                _store64(panel, at + 1024 + 64 * c, _scaled_high(w[c], sc))


@njit(parallel=True, cache=True)
def _matmul_tiles(pa, pb, pc, aq, dq, bs, oa, ob, oc, cfg):
    """kquant_rows16's ``_matmul_pairs`` for Q4_K with whole 16-token tiles of whole pairs on AMX."""
    n_tok = oa.shape[0]
    n_in = aq.shape[0] // n_tok
    nbk = n_in // QK_K
    nb8 = nbk * 8
    bp = _sub_block_sums(bs, n_tok * nb8)
    n_tiled = n_tok - n_tok % TILE_TOKENS
    fa, fb, fc = oa.reshape(-1), ob.reshape(-1), oc.reshape(-1)  # once, not per item
    for pp in prange(_n_pairs(oa, ob, oc)):
        packed, flat, n_out, g, two = _pair(pp, pa, pb, pc, oa, ob, oc, fa, fb, fc)
        og = g * nbk * SB_BYTES
        og2 = og + nbk * SB_BYTES
        rest = 0
        if two:
            _tile_config(cfg)  # each work item may run on any thread: load the configuration here
            panel = np.empty(4 * nbk * _STEP_BYTES, np.uint8)
            _build_panels(packed, og, og2, nbk, panel)
            sums = np.empty(2 * 256, np.int32)
            for t0 in range(0, n_tiled, TILE_TOKENS):
                for b in range(nbk):
                    _zero_lo()
                    _zero_hi()
                    for i in range(4):
                        _load_acts(aq, t0 * n_in + b * QK_K + 64 * i, n_in)
                        _load_lo(panel, (4 * b + i) * _STEP_BYTES, 64)
                        _dot_lo()
                        _load_hi(panel, (4 * b + i) * _STEP_BYTES + 1024, 64)
                        _dot_hi()
                    _store_lo(sums, 0, 64)
                    _store_hi(sums, 256, 64)
                    o, o2 = og + b * SB_BYTES, og2 + b * SB_BYTES
                    for t in range(TILE_TOKENS):
                        tt = t0 + t
                        at = tt * n_out + 8 * g
                        acc = zeros_f32x16() if b == 0 else load_f32x16(flat, at)
                        s = _low_plus_16_high(_load_i32x16(sums, 16 * t), _load_i32x16(sums, 256 + 16 * t))
                        store_f32x16(flat, at, _finish16(acc, s, packed, o, o2, bp, tt * nb8 + 8 * b, dq, tt * nbk + b))
            rest = n_tiled
        _large_pass(packed, flat, n_out, g, two, og, og2, aq, dq, bp, rest, n_tok, n_in, nbk, 0)


def _matmul_q4_k(packed: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray, out: np.ndarray,
                 pb: np.ndarray = NO_WEIGHT, ob: np.ndarray = NO_OUTPUT, pc: np.ndarray = NO_WEIGHT,
                 oc: np.ndarray = NO_OUTPUT) -> None:
    if out.shape[0] >= AMX_TOKENS and amx.usable():
        _matmul_tiles(packed, pb, pc, q, d, bsums, out, ob, oc, CONFIG)
    else:
        r16.matmul_q4_k(packed, q, d, bsums, out, pb, ob, pc, oc)


# --- Q6_K ------------------------------------------------------------------------------------------
_Q6_STEP_BYTES = 3072  # one K = 64 step (four sub-blocks of 16) of a pair's three panels, 1024 bytes each
# tiles: 0, 1 and 5 the int32 sums against the three digit panels, 2 the activations, 3, 4 and 6 the panels
Q6_CONFIG = amx.config({t: (16, 64) for t in range(7)})
_q6_zero0, _q6_zero1, _q6_zero2 = amx.tile_zero(0), amx.tile_zero(1), amx.tile_zero(5)
_q6_load0, _q6_load1, _q6_load2 = amx.tile_load(3), amx.tile_load(4), amx.tile_load(6)
_q6_dot0, _q6_dot1, _q6_dot2 = amx.tile_dot(0, 2, 3), amx.tile_dot(1, 2, 4), amx.tile_dot(5, 2, 6)
_q6_store0, _q6_store1, _q6_store2 = amx.tile_store(0), amx.tile_store(1), amx.tile_store(5)


def _digit_bytes(k: int):
    @intrinsic
    def digit_bytes(typingctx, u, sc):
        """Each byte u (0..63) of sixteen rows' four values as (u - 32) times base-8 digit ``k`` (-3..4) of its
        row's scale ``sc`` (sc = d0 + 8 d1 + 64 d2): signed bytes, exact (-128..124)."""
        if not (u == i8x64 and sc == i32x16):
            return None

        def codegen(context, builder, sig, args):
            def c(v: int) -> ir.Constant:
                return ir.Constant(V16I, [v] * 16)

            rest = args[1]
            for _ in range(k + 1):
                digit = builder.sub(builder.and_(builder.add(rest, c(3)), c(7)), c(3))
                rest = builder.ashr(builder.sub(rest, digit), c(3))
            v64s = ir.VectorType(LL_I16, 64)
            d16 = builder.trunc(digit, ir.VectorType(LL_I16, 16))
            rows = ir.Constant(ir.VectorType(LL_I32, 64), [i // 4 for i in range(64)])  # byte i: row i // 4
            per_byte = builder.shuffle_vector(d16, d16, rows)
            w = builder.sext(builder.sub(args[0], ir.Constant(ir.VectorType(LL_I8, 64), [32] * 64)), v64s)
            return builder.trunc(builder.mul(w, per_byte), ir.VectorType(LL_I8, 64))

        return i8x64(u, sc), codegen

    return digit_bytes


_digit0, _digit1, _digit2 = _digit_bytes(0), _digit_bytes(1), _digit_bytes(2)


@intrinsic
def _digits_sum(typingctx, c0, c1, c2):
    """c0 + 8 c1 + 64 c2 on int32 lanes (exact: |S - 32 M| < 2^31)."""
    if not (c0 == i32x16 and c1 == i32x16 and c2 == i32x16):
        return None

    def codegen(context, builder, sig, args):
        def shl(v, n):
            return builder.shl(v, ir.Constant(V16I, [n] * 16))

        return builder.add(builder.add(args[0], shl(args[1], 3)), shl(args[2], 6))

    return i32x16(c0, c1, c2), codegen


@njit(inline="always")
def _build_q6_panels(packed, og, og2, nbk, panel):
    """The pair's three digit panels: per super-block and K = 64 step (sub-blocks 4 i .. 4 i + 3, each four
    registers of sixteen rows' four values), 1024 bytes of digit 0, then of digit 1, then of digit 2."""
    for b in range(nbk):
        o, o2 = og + b * Q6_SB_BYTES, og2 + b * Q6_SB_BYTES
        for sb in range(16):
            u = q6k_values_x16(packed, o + 96 * sb, o2 + 96 * sb)
            at_sc = _Q6_SCALES + 16 * (sb // 2) + sb % 2
            sc = s8_scales_x16(packed, o + at_sc, o2 + at_sc)
            at = (4 * b + sb // 4) * _Q6_STEP_BYTES + (sb % 4) * 256
            for c in range(4):
                _store64(panel, at + 64 * c, _digit0(u[c], sc))
                _store64(panel, at + 1024 + 64 * c, _digit1(u[c], sc))
                _store64(panel, at + 2048 + 64 * c, _digit2(u[c], sc))


@njit(parallel=True, cache=True)
def _matmul_q6_tiles(pa, pb, pc, aq, dq, bs, oa, ob, oc, cfg):
    """kquant_rows16's ``_matmul_q6_pairs`` with whole 16-token tiles of whole pairs on AMX."""
    n_tok = oa.shape[0]
    n_in = aq.shape[0] // n_tok
    nbk = n_in // QK_K
    n_tiled = n_tok - n_tok % TILE_TOKENS
    fa, fb, fc = oa.reshape(-1), ob.reshape(-1), oc.reshape(-1)  # once, not per item
    for pp in prange(_n_pairs(oa, ob, oc)):
        packed, flat, n_out, g, two = _pair(pp, pa, pb, pc, oa, ob, oc, fa, fb, fc)
        og = g * nbk * Q6_SB_BYTES
        og2 = og + nbk * Q6_SB_BYTES
        rest = 0
        if two:
            _tile_config(cfg)
            panel = np.empty(4 * nbk * _Q6_STEP_BYTES, np.uint8)
            _build_q6_panels(packed, og, og2, nbk, panel)
            sums = np.empty(3 * 256, np.int32)
            for t0 in range(0, n_tiled, TILE_TOKENS):
                for b in range(nbk):
                    _q6_zero0()
                    _q6_zero1()
                    _q6_zero2()
                    for i in range(4):
                        at = (4 * b + i) * _Q6_STEP_BYTES
                        _load_acts(aq, t0 * n_in + b * QK_K + 64 * i, n_in)
                        _q6_load0(panel, at, 64)
                        _q6_dot0()
                        _q6_load1(panel, at + 1024, 64)
                        _q6_dot1()
                        _q6_load2(panel, at + 2048, 64)
                        _q6_dot2()
                    _q6_store0(sums, 0, 64)
                    _q6_store1(sums, 256, 64)
                    _q6_store2(sums, 512, 64)
                    o, o2 = og + b * Q6_SB_BYTES, og2 + b * Q6_SB_BYTES
                    for t in range(TILE_TOKENS):
                        tt = t0 + t
                        at = tt * n_out + 8 * g
                        acc = zeros_f32x16() if b == 0 else load_f32x16(flat, at)
                        s = _digits_sum(_load_i32x16(sums, 16 * t), _load_i32x16(sums, 256 + 16 * t),
                                        _load_i32x16(sums, 512 + 16 * t))
                        scale = mul_f32x16(halves_x16(packed, o + _Q6_D, o2 + _Q6_D), splat_at_x16(dq, tt * nbk + b))
                        store_f32x16(flat, at, fma_i32x16(acc, s, scale))  # kquant_rows8's _q6_finish, 16 lanes
            rest = n_tiled
        _q6_large_pass(packed, flat, n_out, g, two, og, og2, aq, dq, bs, rest, n_tok, n_in, nbk)


def _matmul_q6_k(packed: np.ndarray, q: np.ndarray, d: np.ndarray, bsums: np.ndarray, out: np.ndarray,
                 pb: np.ndarray = NO_WEIGHT, ob: np.ndarray = NO_OUTPUT, pc: np.ndarray = NO_WEIGHT,
                 oc: np.ndarray = NO_OUTPUT) -> None:
    if out.shape[0] >= AMX_TOKENS and amx.usable():
        _matmul_q6_tiles(packed, pb, pc, q, d, bsums, out, ob, oc, Q6_CONFIG)
    else:
        r16.matmul_q6_k(packed, q, d, bsums, out, pb, ob, pc, oc)


# kquant_rows16.REPACKED, with Q4_K's and Q6_K's prefill on the tiles where they run (decided per call: the
# probe runs at the first pass long enough to use them)
REPACKED = {
    **r16.REPACKED,
    GGMLType.Q4_K: (r16.REPACKED[GGMLType.Q4_K][0], _matmul_q4_k),
    GGMLType.Q6_K: (r16.REPACKED[GGMLType.Q6_K][0], _matmul_q6_k),
} if WIDE else r16.REPACKED
