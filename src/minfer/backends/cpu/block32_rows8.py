"""Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and IQ4_XS weights repacked at load into groups of eight rows: decode and
prefill on one integer arithmetic.

These types have blocks of 32 values with one scale each and take Q8 activations (blocks of 32,
``quant_matmul.quantize_activations``). Q5_0 is what llama.cpp writes for the K-quant rows whose length is
not a multiple of 256 (SmolLM2-360M's 960, Qwen2.5-0.5B's 896, SmolLM2-135M's 576): in a "Q4_K_M" file of
those shapes most of the matmul weights are Q5_0. IQ4_NL and IQ4_XS map 4-bit indices through a table of
16 int8 values. Their row-by-row kernels unpack each block once per row and per few tokens; here a block
of eight rows is one set of registers that serves every token.

Layouts (per group of eight rows and block of 32 values; ``kind`` 0 Q5_0, 1 IQ4_NL, 2 IQ4_XS, 3 Q4_0, 4 Q4_1,
5 Q5_1)
    ``[0, 128)`` nibbles ``[j (4), row (8), i (4)]``: the low nibble holds value ``4 j + i`` of the row,
    the high nibble value ``4 (j + 4) + i`` (the files' byte j of a block packs values j and j + 16, so
    the bytes move whole), then
    * Q5_0 (176 bytes, the file's 8 x 22): ``[128, 160)`` the fifth bits, one 32-bit word per chunk ``c``
      (8) whose bit ``4 row + i`` is the fifth bit of value ``4 c + i``; ``[160, 176)`` the rows' f16 d;
    * IQ4_NL and Q4_0 (144 bytes, the file's 8 x 18): ``[128, 144)`` the rows' f16 d;
    * Q4_1 (160 bytes, the file's 8 x 20): ``[128, 144)`` the rows' f16 d, ``[144, 160)`` their f16 m;
    * Q5_1 (192 bytes, the file's 8 x 24): Q5_0's, then ``[176, 192)`` the rows' f16 m;
    * IQ4_XS (136 bytes): ``[128, 136)`` the rows' sub-block scales ``ls - 32`` as int8; after a group's
      eight blocks of a super-block, its rows' f16 d (16 bytes: 1104 per super-block, the file's 8 x 136
      plus 16).
    So chunk ``c``'s register (four consecutive values of each of eight rows, lane = row) is a nibble
    load, with the fifth bits OR'd in under a mask (Q5_0: one masked OR on AVX-512) or looked up in the
    table (IQ4: one ``vpshufb``).

Arithmetic
    Each value is made unsigned, ``u = q + 16`` (Q5_0: 0..31), ``q + 8`` (Q4_0; Q4_1's and Q5_1's are) or
    the table biased by +128 (IQ4, under VNNI), so one ``vpdpbusd`` (unsigned by signed) does four
    products of eight rows against four activation bytes broadcast; ``Σ q a = Σ u a - 16 Σ a`` (``- 8 Σ
    a``, ``- 128 Σ a``) exactly, with that term of each token's block computed once per call and used as
    the sum's starting value. Without VNNI the same integers come from ``pmaddubsw``: Q5_x's and Q4_x's
    four chunks' int16 pair sums at a time (at most 4 x 2 x 31 x 127 < 2^15) then ``pmaddwd``; IQ4's
    signed table with llama.cpp's sign trick (``|w| * (a * sign w)``). Every row and token then does,
    block after block, ``acc = fma(float(Σ q a), d_w d_x, acc)`` with the dequantizer's float32 block
    scale ``d_w`` (IQ4_XS: ``d * (ls - 32)``, exact): the same float operations for one token (decode) or
    many (prefill), on eight lanes or on the sixteen of ``_pairs`` (AVX-512: two groups side by side), at
    any thread count; Q4_1 and Q5_1 then add their offset, ``acc = fma(m, d_x Σa, acc)``. Tests hold all of them to
    the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from minfer.backends.cpu.simd import (
    LL_F32,
    LL_I1,
    LL_I8,
    LL_I32,
    V16S,
    V32B,
    VNNI,
    add_i16x16,
    add_i32x8,
    broadcast_4bytes,
    dot_s8s8,
    dot_u8s8,
    dpbusd,
    f32x8,
    fma_f32x8,
    fma_i32x8,
    hsum_i32x8,
    i8x32,
    i32x8,
    ir_call,
    ir_lookup16,
    ir_splat,
    is_1d,
    load_bytes32,
    load_element,
    load_f32x8,
    load_halves8,
    mul_f32x8,
    pairs_u8s8,
    prefetch,
    shuffle_mask,
    splat_at,
    splat_constant,
    store_f32x8,
    widen_pairs,
    zeros_f32x8,
    zeros_i32x8,
)
from minfer.backends.cpu.simd512 import (
    V16F,
    V64B,
    WIDE,
    add_i32x16,
    broadcast_4bytes_x16,
    dpbusd_x16,
    f32x16,
    fma_f32x16,
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
from minfer.formats.iquants import IQ4_VALUES
from minfer.formats.quants import GGMLType

LL_I64 = ir.IntType(64)
QK = 32
Q5_0, IQ4_NL, IQ4_XS, Q4_0, Q4_1, Q5_1 = 0, 1, 2, 3, 4, 5  # the kernels' ``kind``
KINDS = {GGMLType.Q5_0: Q5_0, GGMLType.IQ4_NL: IQ4_NL, GGMLType.IQ4_XS: IQ4_XS, GGMLType.Q4_0: Q4_0,
         GGMLType.Q4_1: Q4_1, GGMLType.Q5_1: Q5_1}
_FILE_BLOCK = (22, 18, 136, 18, 20, 24)  # bytes per row and block of the file (IQ4_XS: per super-block of 256)
GROUP_BLOCK = (176, 144, 136, 144, 160, 192)  # bytes per group of eight rows and block of 32 values
XS_SUPER = 8 * 136 + 16  # IQ4_XS: bytes per group and super-block (eight blocks, then the rows' d)
_SCALES = (160, 128, 128, 128, 128, 160)  # where a group's block keeps its scales (IQ4_XS: the sub-block scales)
_BITS = 128  # Q5_0's fifth bits
TOKENS = 64  # tokens per pass over a group's weights in memory: their activations stay in L2
PREFETCH = 2048  # decode streams the weights from DRAM: fetch this many bytes ahead
# the IQ4 table as the kernels look it up: biased by +128 under VNNI (vpdpbusd's unsigned operand)
IQ4_TABLE = ((IQ4_VALUES.astype(np.int16) + 128).astype(np.uint8).view(np.int8) if VNNI else IQ4_VALUES).copy()
# what the values' bias adds to Σ u a, per unit of Σ a: Q5_0's +16, Q4_0's +8, IQ4's +128 under VNNI (none
# without: the signed table)
_BIAS = (16, 128 if VNNI else 0, 128 if VNNI else 0, 8, 0, 0)


def supports(ggml_type: GGMLType, n_out: int, n_in: int) -> bool:
    """Whether a weight of this type and shape takes the repacked layout (whole groups of eight rows)."""
    if ggml_type not in KINDS or n_out <= 0 or n_out % 8 or n_in <= 0:
        return False
    return n_in % (256 if ggml_type == GGMLType.IQ4_XS else QK) == 0


# ---------------------------------------------------------------------------------------------------
# Intrinsics: a group's values and scales as registers
# ---------------------------------------------------------------------------------------------------


def _loader(context, builder, sig, args):
    """``load(k, delta, vty)``: ``vty`` at byte ``args[k] + delta`` of the array ``args[0]``."""
    def load(k, delta, vty):
        index = builder.add(args[k], ir.Constant(args[k].type, delta))
        return load_element(context, builder, sig.args[0], args[0], index, sig.args[k], vty)

    return load


def _nibbles(builder: ir.IRBuilder, v: ir.Value, c: int, vty: ir.VectorType) -> ir.Value:
    """Chunk ``c``'s nibbles from the 16-bit lanes ``v`` of its 32 (or 64) bytes: low for c < 4, else high."""
    if c >= 4:
        v = builder.lshr(v, splat_constant(v.type, 4))
    return builder.and_(builder.bitcast(v, vty), splat_constant(vty, 15))


def _or_fifth_bits(builder: ir.IRBuilder, nib: ir.Value, bits: ir.Value, vty: ir.VectorType) -> ir.Value:
    """``nib | 16`` in the lanes whose bit is set in the integer ``bits`` (bit k: lane k)."""
    mask = builder.bitcast(bits, ir.VectorType(LL_I1, vty.count))
    return builder.or_(nib, builder.select(mask, splat_constant(vty, 16), splat_constant(vty, 0)))


def _table_register(context, builder, sig, args, k: int, lanes: int) -> ir.Value:
    """The 16 int8 entries of the table ``args[k]`` repeated in every 128-bit lane of a ``lanes``-byte register."""
    t = load_element(context, builder, sig.args[k], args[k], ir.Constant(LL_I64, 0), types.int64,
                     ir.VectorType(LL_I8, 16))
    return builder.shuffle_vector(t, t, shuffle_mask(lanes, lambda i: i % 16))


def _lookup64(builder: ir.IRBuilder, idx: ir.Value, table: ir.Value) -> ir.Value:
    """``ir_lookup16`` on 64 lanes: one vpshufb on AVX-512 BW."""
    return ir_call(builder, "llvm.x86.avx512.pshuf.b.512", V64B, [table, idx])


def _values(how: str, wide: bool):
    """An intrinsic giving the eight value registers of a group's block (chunk c: values 4c..4c+3 of each
    row, lane = row): ``(packed, o, table)``, or ``(packed, o, o2, table)`` for two groups, one in each half
    of 512-bit registers (``wide``). ``how``: "q5" nibbles with the fifth bits (0..31), "q4" the nibbles
    (0..15), "iq4" the nibbles looked up in ``table`` (16 int8; the others ignore it)."""
    vty = V64B if wide else V32B
    tup = types.UniTuple(i8x64 if wide else i8x32, 8)

    def codegen(context, builder, sig, args):
        load = _loader(context, builder, sig, args)
        tv = _table_register(context, builder, sig, args, len(args) - 1, vty.count) if how == "iq4" else None
        regs = []
        for c in range(8):
            v = load(1, 32 * (c % 4), V16S)
            if wide:
                v = ir_join(builder, v, load(2, 32 * (c % 4), V16S))
            nib = _nibbles(builder, v, c, vty)
            if how == "q5":
                bits = load(1, _BITS + 4 * c, LL_I32)
                if wide:
                    hi = builder.zext(load(2, _BITS + 4 * c, LL_I32), LL_I64)
                    bits = builder.or_(builder.zext(bits, LL_I64), builder.shl(hi, ir.Constant(LL_I64, 32)))
                nib = _or_fifth_bits(builder, nib, bits, vty)
            elif how == "iq4":
                nib = _lookup64(builder, nib, tv) if wide else ir_lookup16(builder, nib, tv)
            regs.append(nib)
        return context.make_tuple(builder, tup, regs)

    if wide:
        @intrinsic
        def values16(typingctx, packed, o, o2, table):
            return (tup(packed, o, o2, table), codegen) if is_1d(packed) else None

        return values16

    @intrinsic
    def values8(typingctx, packed, o, table):
        return (tup(packed, o, table), codegen) if is_1d(packed) else None

    return values8


_q5_values8, _q5_values16 = _values("q5", False), _values("q5", True)
_q4_values8, _q4_values16 = _values("q4", False), _values("q4", True)  # Q4_0 and Q4_1
_iq4_values8, _iq4_values16 = _values("iq4", False), _values("iq4", True)


@intrinsic
def _int8_scales8(typingctx, packed, o):
    """The eight int8 at byte ``o`` as float32 lanes (IQ4_XS's ``ls - 32`` of eight rows)."""
    if not is_1d(packed):
        return None

    def codegen(context, builder, sig, args):
        v = _loader(context, builder, sig, args)(1, 0, ir.VectorType(LL_I8, 8))
        return builder.sitofp(v, ir.VectorType(LL_F32, 8))

    return f32x8(packed, o), codegen


@intrinsic
def _int8_scales16(typingctx, packed, o, o2):
    """``_int8_scales8`` of two groups."""
    if not is_1d(packed):
        return None

    def codegen(context, builder, sig, args):
        load = _loader(context, builder, sig, args)
        v = ir_join(builder, load(1, 0, ir.VectorType(LL_I8, 8)), load(2, 0, ir.VectorType(LL_I8, 8)))
        return builder.sitofp(v, V16F)

    return f32x16(packed, o, o2), codegen


@intrinsic
def _ones(typingctx):
    """32 bytes of 1 (``dot_u8s8`` with it sums a block's quads)."""
    return i8x32(), lambda context, builder, sig, args: splat_constant(V32B, 1)


def _splat_i32(lanes: int, vec: types.Type):
    @intrinsic
    def splat(typingctx, arr, i):
        if not (is_1d(arr) and arr.dtype == types.int32):
            return None

        def codegen(context, builder, sig, args):
            return ir_splat(builder, load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1],
                                                  LL_I32), lanes)

        return vec(arr, i), codegen

    return splat


_splat_i32x8 = _splat_i32(8, i32x8)  # arr[i] of an int32 array in every lane
_splat_i32x16 = _splat_i32(16, i32x16)


# ---------------------------------------------------------------------------------------------------
# Where a group's block lies, its values and scales, and one block against one token
# ---------------------------------------------------------------------------------------------------


@njit(inline="always")
def _group_bytes(kind, nb):
    """Bytes of one group of eight rows (``nb`` blocks)."""
    if kind == IQ4_XS:
        return nb // 8 * XS_SUPER
    return nb * GROUP_BLOCK[kind]


@njit(inline="always")
def _at(kind, og, b):
    """(first byte of block ``b`` of the group at byte ``og``, the byte of its rows' f16 d)."""
    if kind == IQ4_XS:
        s = og + b // 8 * XS_SUPER
        return s + b % 8 * GROUP_BLOCK[IQ4_XS], s + 8 * GROUP_BLOCK[IQ4_XS]
    p = og + b * GROUP_BLOCK[kind]
    return p, p + _SCALES[kind]


@njit(inline="always")
def _weights8(kind, packed, p, dp, table):
    """(the value registers, the rows' float32 scales, Q4_1's offsets m) of the group's block at ``p`` (d at
    ``dp``; the other kinds' m: unused)."""
    if kind == Q5_0 or kind == Q5_1:
        w = _q5_values8(packed, p, table)
    elif kind == Q4_0 or kind == Q4_1:
        w = _q4_values8(packed, p, table)
    else:
        w = _iq4_values8(packed, p, table)
    d = load_halves8(packed, dp)
    m = load_halves8(packed, dp + 16) if kind == Q4_1 or kind == Q5_1 else d
    if kind == IQ4_XS:
        d = mul_f32x8(_int8_scales8(packed, p + _SCALES[IQ4_XS]), d)
    return w, d, m


@njit(inline="always")
def _weights16(kind, packed, p, p2, dp, dp2, table):
    """``_weights8`` of two groups."""
    if kind == Q5_0 or kind == Q5_1:
        w = _q5_values16(packed, p, p2, table)
    elif kind == Q4_0 or kind == Q4_1:
        w = _q4_values16(packed, p, p2, table)
    else:
        w = _iq4_values16(packed, p, p2, table)
    d = halves_x16(packed, dp, dp2)
    m = halves_x16(packed, dp + 16, dp2 + 16) if kind == Q4_1 or kind == Q5_1 else d
    if kind == IQ4_XS:
        d = mul_f32x16(_int8_scales16(packed, p + _SCALES[IQ4_XS], p2 + _SCALES[IQ4_XS]), d)
    return w, d, m


@njit(inline="always")
def dot_block_vnni(start, w, aq, ao):
    """Eight int32 lanes: ``start`` + lane r = Σ u a over one block of eight rows (``w[0..7]``: value
    registers, chunk c four consecutive unsigned values of each row) against the activation block at byte
    ``ao`` of ``aq``: eight vpdpbusd (VNNI only) in two chains of four (integer sums: any order gives the
    same result)."""
    s = dpbusd(start, w[0], broadcast_4bytes(aq, ao))
    r = dpbusd(zeros_i32x8(), w[1], broadcast_4bytes(aq, ao + 4))
    s = dpbusd(s, w[2], broadcast_4bytes(aq, ao + 8))
    r = dpbusd(r, w[3], broadcast_4bytes(aq, ao + 12))
    s = dpbusd(s, w[4], broadcast_4bytes(aq, ao + 16))
    r = dpbusd(r, w[5], broadcast_4bytes(aq, ao + 20))
    s = dpbusd(s, w[6], broadcast_4bytes(aq, ao + 24))
    return add_i32x8(s, dpbusd(r, w[7], broadcast_4bytes(aq, ao + 28)))


@njit(inline="always")
def _block(kind, w, start, aq, ao):
    """Eight int32 lanes: ``start`` + lane r = Σ u a over one block of row r against the activation block at
    byte ``ao``; exact."""
    if VNNI:
        return dot_block_vnni(start, w, aq, ao)
    if kind == IQ4_NL or kind == IQ4_XS:  # IQ4's signed table: llama.cpp's sign trick, each chunk widened at once
        s = add_i32x8(dot_s8s8(w[0], broadcast_4bytes(aq, ao)), dot_s8s8(w[1], broadcast_4bytes(aq, ao + 4)))
        s = add_i32x8(s, add_i32x8(dot_s8s8(w[2], broadcast_4bytes(aq, ao + 8)),
                                   dot_s8s8(w[3], broadcast_4bytes(aq, ao + 12))))
        s = add_i32x8(s, add_i32x8(dot_s8s8(w[4], broadcast_4bytes(aq, ao + 16)),
                                   dot_s8s8(w[5], broadcast_4bytes(aq, ao + 20))))
        s = add_i32x8(s, add_i32x8(dot_s8s8(w[6], broadcast_4bytes(aq, ao + 24)),
                                   dot_s8s8(w[7], broadcast_4bytes(aq, ao + 28))))
        return add_i32x8(start, s)
    # Q5_0, Q4_0, Q4_1: int16 pair sums of four chunks at a time stay below 2^15
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
    """``_block`` for sixteen rows (two groups, ``_weights16``; VNNI only); the same integers."""
    s = dpbusd_x16(start, w[0], broadcast_4bytes_x16(aq, ao))
    r = dpbusd_x16(zeros_i32x16(), w[1], broadcast_4bytes_x16(aq, ao + 4))
    s = dpbusd_x16(s, w[2], broadcast_4bytes_x16(aq, ao + 8))
    r = dpbusd_x16(r, w[3], broadcast_4bytes_x16(aq, ao + 12))
    s = dpbusd_x16(s, w[4], broadcast_4bytes_x16(aq, ao + 16))
    r = dpbusd_x16(r, w[5], broadcast_4bytes_x16(aq, ao + 20))
    s = dpbusd_x16(s, w[6], broadcast_4bytes_x16(aq, ao + 24))
    return add_i32x16(s, dpbusd_x16(r, w[7], broadcast_4bytes_x16(aq, ao + 28)))


@njit(inline="always")
def _corrections(kind, aq, n_blocks):
    """``-bias Σ a`` of each activation block (what the values' bias adds to Σ u a), as int32."""
    corr = np.zeros(n_blocks, np.int32)
    bias = _BIAS[kind]
    if bias:
        for i in range(n_blocks):
            corr[i] = -bias * hsum_i32x8(dot_u8s8(_ones(), load_bytes32(aq, QK * i)))
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
def _decode_group(kind, table, packed, og, nb, aq, ds, corr, flat, g):
    """Group ``g`` (its blocks from byte ``og``) against one token, the accumulators in a register."""
    a = zeros_f32x8()
    for b in range(nb):
        p, dp = _at(kind, og, b)
        _prefetch_block(packed, p)
        w, d, m = _weights8(kind, packed, p, dp, table)
        a = fma_i32x8(a, _block(kind, w, _splat_i32x8(corr, b), aq, b * QK), mul_f32x8(d, splat_at(ds, 2 * b)))
        if kind == Q4_1 or kind == Q5_1:
            a = fma_f32x8(a, m, splat_at(ds, 2 * b + 1))
    store_f32x8(flat, 8 * g, a)


@njit(inline="always")
def _group_prefill(kind, table, packed, og, nb, aq, ds, corr, acc, h, n_tok, flat, n_out, g):
    """Group ``g`` against ``n_tok`` > 1 tokens, ``TOKENS`` at a time, block after block (each block's
    registers serve all of them), with its accumulators at ``acc[h:]``."""
    n_in = nb * QK
    for t0 in range(0, n_tok, TOKENS):
        t1 = min(n_tok, t0 + TOKENS)
        for i in range(h, h + 8 * (t1 - t0)):
            acc[i] = np.float32(0.0)
        for b in range(nb):
            p, dp = _at(kind, og, b)
            if t0 == 0:  # the first pass over the group's blocks reads them from memory
                _prefetch_block(packed, p)
            w, d, m = _weights8(kind, packed, p, dp, table)
            for t in range(t0, t1):
                k = h + 8 * (t - t0)
                s = _block(kind, w, _splat_i32x8(corr, t * nb + b), aq, t * n_in + b * QK)
                a = fma_i32x8(load_f32x8(acc, k), s, mul_f32x8(d, splat_at(ds, 2 * (t * nb + b))))
                if kind == Q4_1 or kind == Q5_1:
                    a = fma_f32x8(a, m, splat_at(ds, 2 * (t * nb + b) + 1))
                store_f32x8(acc, k, a)
        for t in range(t0, t1):
            store_f32x8(flat, t * n_out + 8 * g, load_f32x8(acc, h + 8 * (t - t0)))


@njit(inline="always")
def _member(i, per, pa, pb, pc, oa, ob, oc, fa, fb, fc):
    """Work item ``i`` of a call's weights a, b, c (in that order) at ``per`` groups of eight rows per item:
    (its weight, its flat output (``fa``, ``fb``, ``fc``: the outputs' flat views, made once per call), the
    output's width, the item's first group in that weight)."""
    i = np.int64(i)  # a prange index may be unsigned: minus a signed count it would be a float
    na = (oa.shape[1] // 8 + per - 1) // per
    nb = (ob.shape[1] // 8 + per - 1) // per
    if i >= na + nb:
        return pc, fc, oc.shape[1], per * (i - na - nb)
    if i >= na:
        return pb, fb, ob.shape[1], per * (i - na)
    return pa, fa, oa.shape[1], per * i


@njit(inline="always")
def _items(per, oa, ob, oc):
    """The work items of a call at ``per`` groups per item."""
    n = 0
    for width in (oa.shape[1], ob.shape[1], oc.shape[1]):
        n += (width // 8 + per - 1) // per
    return n


@njit(parallel=True, cache=True)
def _rows8(kind, table, aq, ds, pa, oa, pb, ob, pc, oc):
    """``oa[n_tok, n_a]`` for a weight repacked by :func:`repack` (``kind``; ``n_a`` a multiple of 8): ``table``
    the kernels' IQ4 table (``IQ4_TABLE``), ``aq`` the int8 activations (``n_tok * n_in``), ``ds`` their
    (d, d Σa) pairs per block (quant_matmul's); and ``ob`` from ``pb``, ``oc`` from ``pc`` in the same
    parallel loop (weights of one kind that read the same activations: q/k/v, gate/up), or outputs of no
    columns where there are none. Each group of eight rows is the same operations whichever call it is in."""
    n_tok = oa.shape[0]
    nb = aq.shape[0] // n_tok // QK
    corr = _corrections(kind, aq, n_tok * nb)
    n_items = _items(1, oa, ob, oc)
    if n_tok == 1 and n_items == oa.shape[1] // 8:  # a decode of one weight: no per-item choice of member
        # (~0.5 us of a 10 us decode matmul at SmolLM2-135M's shapes)
        fa = oa.reshape(-1)
        gb = _group_bytes(kind, nb)
        for i in prange(n_items):
            _decode_group(kind, table, pa, i * gb, nb, aq, ds, corr, fa, i)
        return
    span = 0 if n_tok == 1 else 8 * min(n_tok, TOKENS)
    acc = np.empty(n_items * span, np.float32)  # each group's accumulators (one allocation per call)
    # the outputs' flat views, made once: a view made per item (its reference counted by both threads) cost
    # ~1.3 us of a 9 us decode matmul at SmolLM2-135M's shapes
    fa, fb, fc = oa.reshape(-1), ob.reshape(-1), oc.reshape(-1)
    for i in prange(n_items):
        packed, flat, n_out, g = _member(i, 1, pa, pb, pc, oa, ob, oc, fa, fb, fc)
        og = g * _group_bytes(kind, nb)
        if n_tok == 1:
            _decode_group(kind, table, packed, og, nb, aq, ds, corr, flat, g)
        else:
            _group_prefill(kind, table, packed, og, nb, aq, ds, corr, acc, i * span, n_tok, flat, n_out, g)


@njit(parallel=True, cache=True)
def _pairs(kind, table, aq, ds, pa, oa, pb, ob, pc, oc):
    """``_rows8`` for ``n_tok`` > 1 on 512-bit registers (``simd512.WIDE`` only): two groups per work item,
    one in each half of a register, lane for lane the same operations (an odd last group: ``_rows8``'s)."""
    n_tok = oa.shape[0]
    nb = aq.shape[0] // n_tok // QK
    n_in = nb * QK
    gb = _group_bytes(kind, nb)
    corr = _corrections(kind, aq, n_tok * nb)
    n_items = _items(2, oa, ob, oc)
    span = 16 * min(n_tok, TOKENS)
    acc = np.empty(n_items * span, np.float32)
    fa, fb, fc = oa.reshape(-1), ob.reshape(-1), oc.reshape(-1)
    for item in prange(n_items):
        packed, flat, n_out, g = _member(item, 2, pa, pb, pc, oa, ob, oc, fa, fb, fc)
        og = g * gb
        h = item * span
        if g + 1 == n_out // 8:
            _group_prefill(kind, table, packed, og, nb, aq, ds, corr, acc, h, n_tok, flat, n_out, g)
            continue
        for t0 in range(0, n_tok, TOKENS):
            t1 = min(n_tok, t0 + TOKENS)
            for i in range(h, h + 16 * (t1 - t0)):
                acc[i] = np.float32(0.0)
            for b in range(nb):
                p, dp = _at(kind, og, b)
                p2, dp2 = _at(kind, og + gb, b)
                if t0 == 0:
                    _prefetch_block(packed, p)
                    _prefetch_block(packed, p2)
                w, d, m = _weights16(kind, packed, p, p2, dp, dp2, table)
                for t in range(t0, t1):
                    k = h + 16 * (t - t0)
                    s = _block16(w, _splat_i32x16(corr, t * nb + b), aq, t * n_in + b * QK)
                    a = fma_i32x16(load_f32x16(acc, k), s, mul_f32x16(d, splat_at_x16(ds, 2 * (t * nb + b))))
                    if kind == Q4_1 or kind == Q5_1:
                        a = fma_f32x16(a, m, splat_at_x16(ds, 2 * (t * nb + b) + 1))
                    store_f32x16(acc, k, a)
            for t in range(t0, t1):  # groups g and g + 1 are columns 8 g .. 8 g + 15
                store_f32x16(flat, t * n_out + 8 * g, load_f32x16(acc, h + 16 * (t - t0)))


# the absent weights and outputs of a call with fewer than three
NO_WEIGHT = np.empty(0, np.uint8)
NO_OUTPUT = np.empty((0, 0), np.float32)


def kernel(n_tok: int) -> Callable[..., None]:
    """The kernel for a call of ``n_tok`` tokens, ``(kind, table, aq, ds, pa, oa, pb, ob, pc, oc)``: the
    512-bit pairs for a prefill where the CPU has them (the same bits as the eight-row kernel's)."""
    return _pairs if WIDE and n_tok > 1 else _rows8


def matmul(kind: int, packed: np.ndarray, aq: np.ndarray, ds: np.ndarray, out: np.ndarray) -> None:
    """``out[n_tok, n_out]`` from one repacked weight (see ``_rows8``)."""
    kernel(out.shape[0])(kind, IQ4_TABLE, aq, ds, packed, out, NO_WEIGHT, NO_OUTPUT, NO_WEIGHT, NO_OUTPUT)


def bound_call(
    kind: int, packed: np.ndarray, aq: np.ndarray, ds: np.ndarray, out: np.ndarray,
    more: Sequence[tuple[np.ndarray, np.ndarray]] = (),
) -> Callable[[], None]:
    """``matmul`` bound to these arrays (a plan's call: the kernel chosen once), with up to two more (weight,
    output) pairs of the same kind computed in the same parallel loop (q/k/v, gate/up)."""
    members = [packed, out] + [a for pair in more for a in pair]
    members += [NO_WEIGHT, NO_OUTPUT] * (3 - len(members) // 2)
    run = kernel(out.shape[0])
    return lambda: run(kind, IQ4_TABLE, aq, ds, *members)


# ---------------------------------------------------------------------------------------------------
# Repacking (at load; parallel over groups)
# ---------------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _repack_kernel(kind, raw, rb, packed):
    """:func:`repack_reference`'s layout from the flat raw rows (``rb`` bytes each), groups in parallel.
    The files' byte j of a block's 16 index bytes packs values j (low nibble) and j + 16 (high): chunk
    j // 4's and chunk j // 4 + 4's, so those bytes move whole."""
    nb = rb // _FILE_BLOCK[kind] * (8 if kind == IQ4_XS else 1)
    gb = _group_bytes(kind, nb)
    n_groups = packed.shape[0] // gb
    for g in prange(n_groups):
        og = g * gb
        for b in range(nb):
            p, dp = _at(kind, og, b)
            if kind == Q5_0 or kind == Q5_1:
                for k in range(_BITS, _BITS + 32):
                    packed[p + k] = 0
            for r in range(8):
                row = (8 * g + r) * rb
                if kind == IQ4_XS:
                    sb = row + b // 8 * 136
                    ib = b % 8
                    if ib == 0:
                        packed[dp + 2 * r] = raw[sb]
                        packed[dp + 2 * r + 1] = raw[sb + 1]
                    low = (np.int32(raw[sb + 4 + ib // 2]) >> (4 * (ib % 2))) & 15
                    high = ((np.int32(raw[sb + 2]) | (np.int32(raw[sb + 3]) << 8)) >> (2 * ib)) & 3
                    packed[p + _SCALES[IQ4_XS] + r] = np.uint8(((low | (high << 4)) - 32) & 255)  # ls - 32
                    qs = sb + 8 + 16 * ib
                else:
                    src = row + b * _FILE_BLOCK[kind]
                    packed[dp + 2 * r] = raw[src]
                    packed[dp + 2 * r + 1] = raw[src + 1]
                    qs = src + (6 if kind == Q5_0 else 4 if kind == Q4_1 else 8 if kind == Q5_1 else 2)
                    if kind == Q4_1 or kind == Q5_1:  # m after d
                        packed[dp + 16 + 2 * r] = raw[src + 2]
                        packed[dp + 16 + 2 * r + 1] = raw[src + 3]
                for j in range(16):
                    c, i = j // 4, j % 4
                    packed[p + 32 * c + 4 * r + i] = raw[qs + j]
                if kind == Q5_0 or kind == Q5_1:
                    at = row + b * _FILE_BLOCK[kind] + (2 if kind == Q5_0 else 4)
                    qh = (np.uint32(raw[at]) | (np.uint32(raw[at + 1]) << 8)
                          | (np.uint32(raw[at + 2]) << 16) | (np.uint32(raw[at + 3]) << 24))
                    for j in range(16):
                        c, i = j // 4, j % 4
                        bit = np.uint8(1 << (4 * (r % 2) + i))
                        if (qh >> j) & 1:
                            packed[p + _BITS + 4 * c + r // 2] |= bit
                        if (qh >> (j + 16)) & 1:
                            packed[p + _BITS + 4 * (c + 4) + r // 2] |= bit


def repack(ggml_type: GGMLType, data: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Rows [n_out, n_in] of ``ggml_type`` (``supports``) -> the layout of :func:`repack_reference`, by the
    compiled kernel."""
    kind = KINDS[ggml_type]
    nb = n_in // QK
    packed = np.empty(n_out // 8 * (nb // 8 * XS_SUPER if kind == IQ4_XS else nb * GROUP_BLOCK[kind]), np.uint8)
    rb = nb * _FILE_BLOCK[kind] // (8 if kind == IQ4_XS else 1)
    _repack_kernel(kind, np.ascontiguousarray(data).reshape(-1), rb, packed)
    return packed


def _nibble_bytes(qs: np.ndarray) -> np.ndarray:
    """[g, 8 rows, nb, 16] index bytes -> [g, nb, 128] in the ``[j, row, i]`` order."""
    g, _, nb, _ = qs.shape
    return qs.reshape(g, 8, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, 128)


def _rows_f16(h: np.ndarray) -> np.ndarray:
    """[g, 8 rows, nb, 2] f16 bytes -> [g, nb, 16]: each block's eight rows' halves in row order."""
    g, _, nb, _ = h.shape
    return h.transpose(0, 2, 1, 3).reshape(g, nb, 16)


def repack_reference(ggml_type: GGMLType, data: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Rows [n_out, n_in] -> per group of eight rows, the bytes the module's docstring lays out (numpy)."""
    kind = KINDS[ggml_type]
    g = n_out // 8
    if kind == IQ4_XS:
        ns = n_in // 256
        sup = np.ascontiguousarray(data).reshape(g, 8, ns, 136)
        qs = sup[..., 8:].reshape(g, 8, ns * 8, 16)
        high = sup[..., 2:4].copy().view("<u2")[..., 0]  # [g, row, s]
        low = sup[..., 4:8]
        ib = np.arange(8)
        ls = ((low[..., ib // 2] >> (4 * (ib % 2))) & 15) | (((high[..., None] >> (2 * ib)) & 3) << 4)
        scales = (ls.astype(np.int16) - 32).astype(np.int8).view(np.uint8)  # [g, row, s, ib]
        scales = scales.reshape(g, 8, ns * 8).transpose(0, 2, 1)  # [g, block, row]
        blocks = np.concatenate((_nibble_bytes(qs), scales), axis=2).reshape(g, ns, 8 * 136)
        d = _rows_f16(sup[..., 0:2])  # [g, s, 16]
        return np.ascontiguousarray(np.concatenate((blocks, d), axis=2)).reshape(-1)
    nb = n_in // QK
    blocks = np.ascontiguousarray(data).reshape(g, 8, nb, _FILE_BLOCK[kind])
    d = _rows_f16(blocks[..., 0:2])
    if kind in (IQ4_NL, Q4_0):
        return np.ascontiguousarray(np.concatenate((_nibble_bytes(blocks[..., 2:]), d), axis=2)).reshape(-1)
    if kind == Q4_1:
        m = _rows_f16(blocks[..., 2:4])
        return np.ascontiguousarray(np.concatenate((_nibble_bytes(blocks[..., 4:]), d, m), axis=2)).reshape(-1)
    at = 2 if kind == Q5_0 else 4  # qh (Q5_1: after d and m)
    qh = blocks[..., at : at + 4].copy().view("<u4")[..., 0]  # [g, row, b]
    fifth = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [g, row, b, value]
    fifth = fifth.reshape(g, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, 8, 32)  # [g, b, c, 4 row + i]
    bits = np.packbits(fifth.astype(np.uint8), axis=-1, bitorder="little").reshape(g, nb, 32)
    parts = [_nibble_bytes(blocks[..., at + 4 :]), bits, d]
    if kind == Q5_1:
        parts.append(_rows_f16(blocks[..., 2:4]))
    return np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)
