"""Q5_0 weights repacked at load into groups of eight rows: decode and prefill on one integer arithmetic.

Q5_0 is what llama.cpp writes for the K-quant rows whose length is not a multiple of 256 (SmolLM2-360M's
960, Qwen2.5-0.5B's 896, SmolLM2-135M's 576): in a "Q4_K_M" file of those shapes most of the matmul
weights are Q5_0. Its row-by-row kernel (``kquant_matmul._matmul_q5``) unpacks each block once per
row and per eight tokens; here a block of eight rows is one set of registers that serves every token.

Layout (per group of eight rows and block of 32 values: 176 bytes, the file's 8 x 22, one stream)
    ``[0, 128)``   nibbles ``[j (4), row (8), i (4)]``: the low nibble holds value ``4 j + i`` of the row,
                   the high nibble value ``4 (j + 4) + i``
    ``[128, 160)`` fifth bits, one 32-bit word per chunk ``c`` (8): bit ``4 row + i`` is the fifth bit of
                   value ``4 c + i`` of the row
    ``[160, 176)`` the eight rows' ``d`` as float16
so chunk ``c``'s register (four consecutive values of each of eight rows, lane = row) is a nibble load,
and the fifth bits OR'd in under a mask (one masked OR on AVX-512).

Arithmetic
    Each value is kept unsigned, ``u = q + 16`` (0..31), so one ``vpdpbusd`` (unsigned by signed) does four
    products of eight rows against four activation bytes broadcast; ``Σ q a = Σ u a - 16 Σ a`` exactly,
    with ``-16 Σ a`` of each token's block computed once per call and used as the sum's starting value.
    Without VNNI the same integers come from ``pmaddubsw`` (four chunks' int16 pair sums at a time: at most
    4 x 2 x 31 x 127 < 2^15) and ``pmaddwd``. Every row and token then does, block after block,
    ``acc = fma(float(Σ q a), d_w d_x, acc)``: the same float operations for one token (decode) or many
    (prefill), on eight lanes or on the sixteen of ``_pairs`` (AVX-512: two groups side by side), at any
    thread count. Tests hold all of them to the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from minfer.backends.cpu.simd import (
    LL_I1,
    LL_I32,
    V8I,
    V16S,
    V32B,
    VNNI,
    add_i16x16,
    add_i32x8,
    broadcast_4bytes,
    dot_u8s8,
    dpbusd,
    fma_i32x8,
    hsum_i32x8,
    i8x32,
    i32x8,
    ir_splat,
    is_1d,
    load_bytes32,
    load_element,
    load_f32x8,
    load_halves8,
    mul_f32x8,
    pairs_u8s8,
    prefetch,
    splat_at,
    splat_constant,
    store_f32x8,
    widen_pairs,
    zeros_f32x8,
    zeros_i32x8,
)
from minfer.backends.cpu.simd512 import (
    V16I,
    V32S,
    V64B,
    WIDE,
    add_i32x16,
    broadcast_4bytes_x16,
    dpbusd_x16,
    fma_i32x16,
    halves_x16,
    i8x64,
    i32x16,
    ir_join,
    load_f32x16,
    mul_f32x16,
    splat_at_x16,
    store_f32x16,
    zeros_i32x16,
)

LL_I64 = ir.IntType(64)
QK = 32
GROUP_BLOCK = 176  # bytes per group of eight rows and block of 32 values
_BITS, _SCALES = 128, 160  # offsets in a group's block
TOKENS = 64  # tokens per pass over a group's weights in memory: their activations stay in L2
PREFETCH = 2048  # decode streams the weights from DRAM: fetch this many bytes ahead


def supports(n_out: int, n_in: int) -> bool:
    """Whether a Q5_0 weight of this shape takes the repacked layout (whole groups of eight rows)."""
    return n_out > 0 and n_out % 8 == 0 and n_in > 0 and n_in % QK == 0


# ---------------------------------------------------------------------------------------------------
# Intrinsics: a group's values as registers
# ---------------------------------------------------------------------------------------------------


def _or_fifth_bits(builder: ir.IRBuilder, nib: ir.Value, bits: ir.Value, vty: ir.VectorType) -> ir.Value:
    """``nib | 16`` in the lanes whose bit is set in the integer ``bits`` (bit k: lane k)."""
    mask = builder.bitcast(bits, ir.VectorType(LL_I1, vty.count))
    return builder.or_(nib, builder.select(mask, splat_constant(vty, 16), splat_constant(vty, 0)))


@intrinsic
def _values8(typingctx, packed, o):
    """The eight value registers (chunk c: values 4c..4c+3 of the eight rows, 0..31) of the group's block
    at byte ``o``."""
    if not is_1d(packed):
        return None
    tup = types.UniTuple(i8x32, 8)

    def codegen(context, builder, sig, args):
        def at(delta, vty):
            index = builder.add(args[1], ir.Constant(args[1].type, delta))
            return load_element(context, builder, sig.args[0], args[0], index, sig.args[1], vty)

        regs = []
        for c in range(8):
            v = at(32 * (c % 4), V16S)
            if c >= 4:
                v = builder.lshr(v, splat_constant(V16S, 4))
            nib = builder.and_(builder.bitcast(v, V32B), splat_constant(V32B, 15))
            regs.append(_or_fifth_bits(builder, nib, at(_BITS + 4 * c, LL_I32), V32B))
        return context.make_tuple(builder, tup, regs)

    return tup(packed, o), codegen


@intrinsic
def _values16(typingctx, packed, o, o2):
    """``_values8`` of two groups (blocks at ``o`` and ``o2``), one in each half of eight 512-bit registers."""
    if not is_1d(packed):
        return None
    tup = types.UniTuple(i8x64, 8)

    def codegen(context, builder, sig, args):
        def at(k, delta, vty):
            index = builder.add(args[k], ir.Constant(args[k].type, delta))
            return load_element(context, builder, sig.args[0], args[0], index, sig.args[k], vty)

        regs = []
        for c in range(8):
            v = ir_join(builder, at(1, 32 * (c % 4), V16S), at(2, 32 * (c % 4), V16S))
            if c >= 4:
                v = builder.lshr(v, splat_constant(V32S, 4))
            nib = builder.and_(builder.bitcast(v, V64B), splat_constant(V64B, 15))
            lo = builder.zext(at(1, _BITS + 4 * c, LL_I32), LL_I64)
            hi = builder.zext(at(2, _BITS + 4 * c, LL_I32), LL_I64)
            bits = builder.or_(lo, builder.shl(hi, ir.Constant(LL_I64, 32)))
            regs.append(_or_fifth_bits(builder, nib, bits, V64B))
        return context.make_tuple(builder, tup, regs)

    return tup(packed, o, o2), codegen


def _splat_i32(lanes: int, vec: types.Type, vty: ir.VectorType):
    @intrinsic
    def splat(typingctx, arr, i):
        if not (is_1d(arr) and arr.dtype == types.int32):
            return None

        def codegen(context, builder, sig, args):
            return ir_splat(builder, load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                                                  LL_I32), lanes)

        return vec(arr, i), codegen

    return splat


_splat_i32x8 = _splat_i32(8, i32x8, V8I)  # arr[i] of an int32 array in every lane
_splat_i32x16 = _splat_i32(16, i32x16, V16I)


# ---------------------------------------------------------------------------------------------------
# One block of a group against one token
# ---------------------------------------------------------------------------------------------------


@njit(inline="always")
def _block(w, start, aq, ao):
    """Eight int32 lanes: ``start`` + lane r = Σ u a over one block of row r against the activation block at
    byte ``ao``; exact."""
    if VNNI:  # two chains of four (integer sums: any order gives the same result)
        s = dpbusd(start, w[0], broadcast_4bytes(aq, ao))
        r = dpbusd(zeros_i32x8(), w[1], broadcast_4bytes(aq, ao + 4))
        s = dpbusd(s, w[2], broadcast_4bytes(aq, ao + 8))
        r = dpbusd(r, w[3], broadcast_4bytes(aq, ao + 12))
        s = dpbusd(s, w[4], broadcast_4bytes(aq, ao + 16))
        r = dpbusd(r, w[5], broadcast_4bytes(aq, ao + 20))
        s = dpbusd(s, w[6], broadcast_4bytes(aq, ao + 24))
        return add_i32x8(s, dpbusd(r, w[7], broadcast_4bytes(aq, ao + 28)))
    # int16 pair sums of four chunks at a time stay below 2^15
    p = pairs_u8s8(w[0], broadcast_4bytes(aq, ao))
    p = add_i16x16(p, pairs_u8s8(w[1], broadcast_4bytes(aq, ao + 4)))
    p = add_i16x16(p, pairs_u8s8(w[2], broadcast_4bytes(aq, ao + 8)))
    p = add_i16x16(p, pairs_u8s8(w[3], broadcast_4bytes(aq, ao + 12)))
    q = pairs_u8s8(w[4], broadcast_4bytes(aq, ao + 16))
    q = add_i16x16(q, pairs_u8s8(w[5], broadcast_4bytes(aq, ao + 20)))
    q = add_i16x16(q, pairs_u8s8(w[6], broadcast_4bytes(aq, ao + 24)))
    q = add_i16x16(q, pairs_u8s8(w[7], broadcast_4bytes(aq, ao + 28)))
    return add_i32x8(start, add_i32x8(widen_pairs(p), widen_pairs(q)))


@njit(inline="always")
def _block16(w, start, aq, ao):
    """``_block`` for sixteen rows (two groups, ``_values16``); the same integers."""
    s = dpbusd_x16(start, w[0], broadcast_4bytes_x16(aq, ao))
    r = dpbusd_x16(zeros_i32x16(), w[1], broadcast_4bytes_x16(aq, ao + 4))
    s = dpbusd_x16(s, w[2], broadcast_4bytes_x16(aq, ao + 8))
    r = dpbusd_x16(r, w[3], broadcast_4bytes_x16(aq, ao + 12))
    s = dpbusd_x16(s, w[4], broadcast_4bytes_x16(aq, ao + 16))
    r = dpbusd_x16(r, w[5], broadcast_4bytes_x16(aq, ao + 20))
    s = dpbusd_x16(s, w[6], broadcast_4bytes_x16(aq, ao + 24))
    return add_i32x16(s, dpbusd_x16(r, w[7], broadcast_4bytes_x16(aq, ao + 28)))


@njit(inline="always")
def _corrections(aq, n_blocks):
    """``-16 Σ a`` of each activation block (what the weights' +16 adds to Σ q a), as int32."""
    corr = np.empty(n_blocks, np.int32)
    ones = load_bytes32(np.ones(QK, np.uint8), 0)
    for i in range(n_blocks):
        corr[i] = -16 * hsum_i32x8(dot_u8s8(ones, load_bytes32(aq, QK * i)))
    return corr


@njit(inline="always")
def _prefetch_block(packed, p):
    prefetch(packed, p + PREFETCH)
    prefetch(packed, p + PREFETCH + 64)
    prefetch(packed, p + PREFETCH + 128)


# ---------------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------------


@njit(inline="always")
def _decode_group(packed, o, nb, aq, ds, corr, flat, g):
    """Group ``g`` (its blocks from byte ``o``) against one token, the accumulators in a register."""
    a = zeros_f32x8()
    for b in range(nb):
        p = o + b * GROUP_BLOCK
        _prefetch_block(packed, p)
        s = _block(_values8(packed, p), _splat_i32x8(corr, b), aq, b * QK)
        a = fma_i32x8(a, s, mul_f32x8(load_halves8(packed, p + _SCALES), splat_at(ds, 2 * b)))
    store_f32x8(flat, 8 * g, a)


@njit(inline="always")
def _group_prefill(packed, o, nb, aq, ds, corr, acc, h, n_tok, flat, n_out, g):
    """Group ``g`` against ``n_tok`` > 1 tokens, ``TOKENS`` at a time, block after block (each block's
    registers serve all of them), with its accumulators at ``acc[h:]``."""
    n_in = nb * QK
    for t0 in range(0, n_tok, TOKENS):
        t1 = min(n_tok, t0 + TOKENS)
        for i in range(h, h + 8 * (t1 - t0)):
            acc[i] = np.float32(0.0)
        for b in range(nb):
            p = o + b * GROUP_BLOCK
            if t0 == 0:  # the first pass over the group's blocks reads them from memory
                _prefetch_block(packed, p)
            w = _values8(packed, p)
            wd = load_halves8(packed, p + _SCALES)
            for t in range(t0, t1):
                k = h + 8 * (t - t0)
                s = _block(w, _splat_i32x8(corr, t * nb + b), aq, t * n_in + b * QK)
                scale = mul_f32x8(wd, splat_at(ds, 2 * (t * nb + b)))
                store_f32x8(acc, k, fma_i32x8(load_f32x8(acc, k), s, scale))
        for t in range(t0, t1):
            store_f32x8(flat, t * n_out + 8 * g, load_f32x8(acc, h + 8 * (t - t0)))


@njit(inline="always")
def _member(i, per, pa, pb, pc, oa, ob, oc):
    """Work item ``i`` of a call's weights a, b, c (in that order) at ``per`` groups of eight rows per item:
    (its weight, its flat output, the output's width, the item's first group in that weight)."""
    i = np.int64(i)  # a prange index may be unsigned: minus a signed count it would be a float
    na = (oa.shape[1] // 8 + per - 1) // per
    nb = (ob.shape[1] // 8 + per - 1) // per
    if i >= na + nb:
        return pc, oc.reshape(-1), oc.shape[1], per * (i - na - nb)
    if i >= na:
        return pb, ob.reshape(-1), ob.shape[1], per * (i - na)
    return pa, oa.reshape(-1), oa.shape[1], per * i


@njit(inline="always")
def _items(per, oa, ob, oc):
    """The work items of a call at ``per`` groups per item."""
    n = 0
    for width in (oa.shape[1], ob.shape[1], oc.shape[1]):
        n += (width // 8 + per - 1) // per
    return n


@njit(parallel=True, cache=True)
def _rows8(pa, aq, ds, oa, pb, ob, pc, oc):
    """``oa[n_tok, n_a]`` for a Q5_0 weight repacked by :func:`repack` (``n_a`` a multiple of 8): ``aq`` the
    int8 activations (``n_tok * n_in``), ``ds`` their (d, d Σa) pairs per block (quant_matmul's); and
    ``ob`` from ``pb``, ``oc`` from ``pc`` in the same parallel loop (weights that read the same
    activations: q/k/v, gate/up), or outputs of no columns where there are none. Each group of eight
    rows is the same operations whichever call it is in."""
    n_tok = oa.shape[0]
    nb = aq.shape[0] // n_tok // QK
    corr = _corrections(aq, n_tok * nb)
    n_items = _items(1, oa, ob, oc)
    span = 0 if n_tok == 1 else 8 * min(n_tok, TOKENS)
    acc = np.empty(n_items * span, np.float32)  # each group's accumulators (one allocation per call)
    for i in prange(n_items):
        packed, flat, n_out, g = _member(i, 1, pa, pb, pc, oa, ob, oc)
        o = g * nb * GROUP_BLOCK
        if n_tok == 1:
            _decode_group(packed, o, nb, aq, ds, corr, flat, g)
        else:
            _group_prefill(packed, o, nb, aq, ds, corr, acc, i * span, n_tok, flat, n_out, g)


@njit(parallel=True, cache=True)
def _pairs(pa, aq, ds, oa, pb, ob, pc, oc):
    """``_rows8`` for ``n_tok`` > 1 on 512-bit registers (``simd512.WIDE`` only): two groups per work item,
    one in each half of a register, lane for lane the same operations (an odd last group: ``_rows8``'s)."""
    n_tok = oa.shape[0]
    nb = aq.shape[0] // n_tok // QK
    n_in = nb * QK
    corr = _corrections(aq, n_tok * nb)
    n_items = _items(2, oa, ob, oc)
    span = 16 * min(n_tok, TOKENS)
    acc = np.empty(n_items * span, np.float32)
    for item in prange(n_items):
        packed, flat, n_out, g = _member(item, 2, pa, pb, pc, oa, ob, oc)
        o = g * nb * GROUP_BLOCK
        h = item * span
        if g + 1 == n_out // 8:
            _group_prefill(packed, o, nb, aq, ds, corr, acc, h, n_tok, flat, n_out, g)
            continue
        o2 = o + nb * GROUP_BLOCK
        for t0 in range(0, n_tok, TOKENS):
            t1 = min(n_tok, t0 + TOKENS)
            for i in range(h, h + 16 * (t1 - t0)):
                acc[i] = np.float32(0.0)
            for b in range(nb):
                p, p2 = o + b * GROUP_BLOCK, o2 + b * GROUP_BLOCK
                if t0 == 0:
                    _prefetch_block(packed, p)
                    _prefetch_block(packed, p2)
                w = _values16(packed, p, p2)
                wd = halves_x16(packed, p + _SCALES, p2 + _SCALES)
                for t in range(t0, t1):
                    k = h + 16 * (t - t0)
                    s = _block16(w, _splat_i32x16(corr, t * nb + b), aq, t * n_in + b * QK)
                    scale = mul_f32x16(wd, splat_at_x16(ds, 2 * (t * nb + b)))
                    store_f32x16(acc, k, fma_i32x16(load_f32x16(acc, k), s, scale))
            for t in range(t0, t1):  # groups g and g + 1 are columns 8 g .. 8 g + 15
                store_f32x16(flat, t * n_out + 8 * g, load_f32x16(acc, h + 16 * (t - t0)))


# the absent weights and outputs of a call with fewer than three
NO_WEIGHT = np.empty(0, np.uint8)
NO_OUTPUT = np.empty((0, 0), np.float32)


def kernel(n_tok: int) -> Callable[..., None]:
    """The kernel for a call of ``n_tok`` tokens, ``(pa, aq, ds, oa, pb, ob, pc, oc)``: the 512-bit pairs
    for a prefill where the CPU has them (the same bits as the eight-row kernel's)."""
    return _pairs if WIDE and n_tok > 1 else _rows8


def matmul(packed: np.ndarray, aq: np.ndarray, ds: np.ndarray, out: np.ndarray) -> None:
    """``out[n_tok, n_out]`` from one repacked weight (see ``_rows8``)."""
    kernel(out.shape[0])(packed, aq, ds, out, NO_WEIGHT, NO_OUTPUT, NO_WEIGHT, NO_OUTPUT)


# ---------------------------------------------------------------------------------------------------
# Repacking (at load; parallel over groups)
# ---------------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _repack_kernel(raw, rb, packed):
    """:func:`repack_reference`'s layout from the flat raw rows (``rb`` bytes each), groups in parallel.
    The file's byte j of a block packs values j (low nibble) and j + 16 (high): chunk j // 4's and chunk
    j // 4 + 4's, so the nibble bytes move whole."""
    nb = rb // 22
    n_groups = packed.shape[0] // (nb * GROUP_BLOCK)
    for g in prange(n_groups):
        for b in range(nb):
            po = (g * nb + b) * GROUP_BLOCK
            for k in range(_BITS, _SCALES):
                packed[po + k] = 0
            for r in range(8):
                src = (8 * g + r) * rb + b * 22
                packed[po + _SCALES + 2 * r] = raw[src]
                packed[po + _SCALES + 2 * r + 1] = raw[src + 1]
                qh = (np.uint32(raw[src + 2]) | (np.uint32(raw[src + 3]) << 8) | (np.uint32(raw[src + 4]) << 16)
                      | (np.uint32(raw[src + 5]) << 24))
                for j in range(16):
                    c, i = j // 4, j % 4
                    packed[po + 32 * c + 4 * r + i] = raw[src + 6 + j]
                    bit = np.uint8(1 << (4 * (r % 2) + i))
                    if (qh >> j) & 1:
                        packed[po + _BITS + 4 * c + r // 2] |= bit
                    if (qh >> (j + 16)) & 1:
                        packed[po + _BITS + 4 * (c + 4) + r // 2] |= bit


def repack(data: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q5_0 rows [n_out, n_in] (``supports``) -> the layout of :func:`repack_reference`, by the compiled kernel."""
    nb = n_in // QK
    packed = np.empty(n_out // 8 * nb * GROUP_BLOCK, np.uint8)
    _repack_kernel(np.ascontiguousarray(data).reshape(-1), nb * 22, packed)
    return packed


def repack_reference(data: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q5_0 rows [n_out, n_in] (raw blocks of 22 bytes: f16 d, u32 qh, 16 nibble bytes) -> per group of eight
    rows and block, the 176 bytes the module's docstring lays out."""
    nb = n_in // QK
    g = n_out // 8
    blocks = np.ascontiguousarray(data).reshape(g, 8, nb, 22)
    nibbles = blocks[..., 6:].reshape(g, 8, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, 128)  # [j, row, i]
    qh = blocks[..., 2:6].copy().view("<u4")[..., 0]  # [g, row, b]
    fifth = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [g, row, b, value]
    fifth = fifth.reshape(g, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, 8, 32)  # [g, b, c, 4 row + i]
    bits = np.packbits(fifth.astype(np.uint8), axis=-1, bitorder="little").reshape(g, nb, 32)
    scales = blocks[..., 0:2].transpose(0, 2, 1, 3).reshape(g, nb, 16)
    return np.ascontiguousarray(np.concatenate((nibbles, bits, scales), axis=2)).reshape(-1)
