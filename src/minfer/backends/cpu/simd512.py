"""512-bit registers (AVX-512 with VNNI): the vector types and intrinsics of the K-quant kernels that carry
two groups of eight rows side by side, one group in each 256-bit half (:mod:`kquant_rows16`).

The groups lie apart in memory (each group's layout is :mod:`kquant_rows8`'s), so a register is two
32-byte loads joined (LLVM makes that one load and one ``vinserti64x4`` from memory); everything after the
loads is one instruction for sixteen rows. Only the integer work is wide: a group's float accumulators
stay eight lanes, so each group gets the very float operations of the eight-row kernels.

``WIDE`` says whether the CPU has what these need (AVX-512 F, BW and VNNI: ``vpdpbusd`` on zmm,
``vpmulld``, byte shifts and masks); ``MINFER_AVX512=0`` keeps the 256-bit kernels (tests compare the two
bit for bit: the integers are exact either way). Like ``MINFER_VNNI``, it changes compiled code: give such
a process its own ``NUMBA_CACHE_DIR``.
"""

from __future__ import annotations

import os

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from minfer.backends.cpu.simd import (
    LL_F32,
    LL_I8,
    LL_I16,
    LL_I32,
    VNNI,
    VecType,
    element_pointer,
    f32x8,
    i32x8,
    ir_call,
    ir_fmadd,
    ir_half_to_float,
    ir_splat,
    is_1d,
    is_f32_rows,
    load_element,
    shuffle_mask,
    splat_constant,
    target_cpu_name,
    target_has,
)

WIDE = VNNI and os.environ.get("MINFER_AVX512", "1") != "0" and all(
    target_has(f) for f in ("avx512f", "avx512bw", "avx512vnni"))


# CPUs that run a 512-bit operation as two 256-bit halves (AMD Zen 4), where the Q4_K/Q5_K pairs do not
# pay in passes of a few tokens: there a decode's weights stream from memory at 10-17 GB/s on the pairs
# and 20-30 GB/s on the eight-row kernels (1.7B shapes, 1-2 threads; 3 tokens 1.3-1.45x, 4 tokens even).
# Sapphire Rapids ran the pairs' decode faster than the eight-row kernels'.
SPLIT_512 = target_cpu_name() == "znver4"

i32x16 = VecType("i32", 16)
i8x64 = VecType("i8", 64)
V16I, V64B = i32x16.llvm_type(), i8x64.llvm_type()
V32S = ir.VectorType(LL_I16, 32)
_V8B, _V16S = ir.VectorType(LL_I8, 8), ir.VectorType(LL_I16, 16)


def ir_join(builder: ir.IRBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """``lo`` in the low half, ``hi`` in the high half of a vector of twice their lanes."""
    n = lo.type.count
    return builder.shuffle_vector(lo, hi, shuffle_mask(2 * n, lambda i: i))


def _load_pair(context, builder, sig, args, at: int, at2: int, delta: int, vty: ir.VectorType) -> ir.Value:
    """``vty`` at byte ``args[at] + delta`` joined with ``vty`` at ``args[at2] + delta`` of array ``args[0]``."""

    def load(k):
        index = builder.add(args[k], ir.Constant(args[k].type, delta))
        return load_element(context, builder, sig.args[0], args[0], index, sig.args[k], vty)

    return ir_join(builder, load(at), load(at2))


def _nibbles(builder: ir.IRBuilder, v: ir.Value, high: bool) -> ir.Value:
    """The low (or high) nibbles of the bytes of ``v`` (int16 lanes: 16-bit shifts, then a byte mask)."""
    if high:
        v = builder.lshr(v, splat_constant(V32S, 4))
    return builder.and_(builder.bitcast(v, V64B), splat_constant(V64B, 15))


def _bits_to(builder: ir.IRBuilder, h: ir.Value, src: int, dst: int, mask: int) -> ir.Value:
    """Bits ``src..`` of each byte of ``h`` (int16 lanes) moved to ``dst..`` and masked by ``mask``: 16-bit
    shifts, then a byte mask, so that no bit of the neighbouring byte stays."""
    if dst > src:
        h = builder.shl(h, splat_constant(V32S, dst - src))
    elif src > dst:
        h = builder.lshr(h, splat_constant(V32S, src - dst))
    return builder.and_(builder.bitcast(h, V64B), splat_constant(V64B, mask))


@intrinsic
def q4k_values_x16(typingctx, raw, off, off2):
    """Q4_K's sub-block of two groups (``kquant_rows8._chunks`` at ``off`` and at ``off2``): eight registers,
    each four consecutive values of sixteen rows."""
    if not is_1d(raw):
        return None
    tup = types.UniTuple(i8x64, 8)

    def codegen(context, builder, sig, args):
        regs = []
        for c in range(4):
            v = _load_pair(context, builder, sig, args, 1, 2, 32 * c, _V16S)
            regs += [_nibbles(builder, v, False), _nibbles(builder, v, True)]
        return context.make_tuple(builder, tup, regs)

    return tup(raw, off, off2), codegen


@intrinsic
def q5k_values_x16(typingctx, raw, off, off2, hb, hb2):
    """Q5_K's sub-block of two groups (``kquant_rows8._chunks5``): the nibbles at ``off``/``off2`` with each
    value's fifth bit (bit m of the bytes at ``hb``/``hb2`` for register m) as bit 4."""
    if not is_1d(raw):
        return None
    tup = types.UniTuple(i8x64, 8)

    def codegen(context, builder, sig, args):
        h = _load_pair(context, builder, sig, args, 3, 4, 0, _V16S)
        regs = []
        for m in range(8):
            v = _load_pair(context, builder, sig, args, 1, 2, 32 * (m // 2), _V16S)
            regs.append(builder.or_(_nibbles(builder, v, m % 2 == 1), _bits_to(builder, h, m, 4, 0x10)))
        return context.make_tuple(builder, tup, regs)

    return tup(raw, off, off2, hb, hb2), codegen


@intrinsic
def q6k_values_x16(typingctx, raw, off, off2):
    """Q6_K's sub-block of two groups (``kquant_rows8._q6_values``): four registers of values 0..63."""
    if not is_1d(raw):
        return None
    tup = types.UniTuple(i8x64, 4)

    def codegen(context, builder, sig, args):
        n0, n1, h = (_load_pair(context, builder, sig, args, 1, 2, d, _V16S) for d in (0, 32, 64))
        lows = [_nibbles(builder, n0, False), _nibbles(builder, n0, True),
                _nibbles(builder, n1, False), _nibbles(builder, n1, True)]
        return context.make_tuple(builder, tup, [builder.or_(lo, _bits_to(builder, h, 2 * m, 4, 0x30))
                                                 for m, lo in enumerate(lows)])

    return tup(raw, off, off2), codegen


def _scales(signed: bool, stride: int):
    @intrinsic
    def scales(typingctx, raw, off, off2):
        if not is_1d(raw):
            return None

        def codegen(context, builder, sig, args):
            if stride == 1:
                v = _load_pair(context, builder, sig, args, 1, 2, 0, _V8B)
            else:  # every other byte of 16: one sub-block's scales among a pair's
                w = _load_pair(context, builder, sig, args, 1, 2, 0, ir.VectorType(LL_I8, 16))
                v = builder.shuffle_vector(w, w, shuffle_mask(16, lambda i: stride * i))
            return builder.sext(v, V16I) if signed else builder.zext(v, V16I)

        return i32x16(raw, off, off2), codegen

    return scales


# the unsigned scale bytes at ``off`` and ``off2`` (eight each: one per row) in sixteen int32 lanes
u8_scales_x16 = _scales(signed=False, stride=1)
# the signed scales of the even (odd: from ``off + 1``) sub-block of a pair, ``[row (8), (sc_2i, sc_2i+1)]``
s8_scales_x16 = _scales(signed=True, stride=2)


@intrinsic
def broadcast_4bytes_x16(typingctx, arr, off):
    """The 4 bytes at byte offset ``off`` of an int8 array, repeated in all sixteen 32-bit lanes."""
    if not is_1d(arr):
        return None

    def codegen(context, builder, sig, args):
        v = load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], LL_I32)
        return builder.bitcast(ir_splat(builder, v, 16), V64B)

    return i8x64(arr, off), codegen


@intrinsic
def dpbusd_x16(typingctx, acc, u, a):
    """``acc`` + lane i = Σ_{k<4} u[4i+k] a[4i+k] (u unsigned bytes, a signed), exact: one vpdpbusd."""
    if not (acc == i32x16 and u == i8x64 and a == i8x64):
        return None

    def codegen(context, builder, sig, args):
        return ir_call(builder, "llvm.x86.avx512.vpdpbusd.512", V16I,
                       [args[0], builder.bitcast(args[1], V16I), builder.bitcast(args[2], V16I)])

    return i32x16(acc, u, a), codegen


@intrinsic
def zeros_i32x16(typingctx):
    return i32x16(), lambda context, builder, sig, args: ir.Constant(V16I, [0] * 16)


@intrinsic
def add_i32x16(typingctx, a, b):
    return i32x16(i32x16, i32x16), lambda context, builder, sig, args: builder.add(args[0], args[1])


@intrinsic
def mul_i32x16(typingctx, a, b):
    """a * b, int32 lanes (vpmulld; the low 32 bits, exact where the product fits)."""
    return i32x16(i32x16, i32x16), lambda context, builder, sig, args: builder.mul(args[0], args[1])


def _half(high: bool):
    @intrinsic
    def half(typingctx, v):
        if v != i32x16:
            return None

        def codegen(context, builder, sig, args):
            return builder.shuffle_vector(args[0], args[0], shuffle_mask(8, lambda i: i + 8 * high))

        return i32x8(v), codegen

    return half


low_i32x8, high_i32x8 = _half(False), _half(True)  # the first group's eight lanes, the second's


# --- float32 on sixteen lanes (lane for lane the operations of two eight-lane registers) -------------------

f32x16 = VecType("f32", 16)
V16F = f32x16.llvm_type()


@intrinsic
def zeros_f32x16(typingctx):
    return f32x16(), lambda context, builder, sig, args: ir.Constant(V16F, [0.0] * 16)


@intrinsic
def load_f32x16(typingctx, arr, i):
    """arr[i:i+16] of a float32 array."""
    if not (is_1d(arr) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], V16F)

    return f32x16(arr, i), codegen


@intrinsic
def store_f32x16(typingctx, arr, i, v):
    """arr[i:i+16] = v for a float32 array."""
    if not (is_1d(arr) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], V16F),
                      align=4)
        return context.get_dummy_value()

    return types.none(arr, i, f32x16), codegen


@intrinsic
def splat_at_x16(typingctx, arr, i):
    """arr[i] of a float32 array in all sixteen lanes."""
    if not (is_1d(arr) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        x = load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], LL_F32)
        return ir_splat(builder, x, 16)

    return f32x16(arr, i), codegen


@intrinsic
def mul_f32x16(typingctx, a, b):
    return f32x16(f32x16, f32x16), lambda context, builder, sig, args: builder.fmul(args[0], args[1])


@intrinsic
def fma_i32x16(typingctx, acc, v, scale):
    """acc + float(v) * scale for int32 lanes v (``simd.fma_i32x8`` on sixteen lanes)."""

    def codegen(context, builder, sig, args):
        return ir_fmadd(builder, builder.sitofp(args[1], V16F), args[2], args[0])

    return f32x16(f32x16, i32x16, f32x16), codegen


@intrinsic
def fma_f32x16(typingctx, acc, a, b):
    """acc + a * b on sixteen float32 lanes (``simd.fma_f32x8`` on sixteen lanes)."""
    if not (acc == f32x16 and a == f32x16 and b == f32x16):
        return None
    return f32x16(acc, a, b), lambda context, builder, sig, args: ir_fmadd(builder, args[1], args[2], args[0])


@intrinsic
def halves_x16(typingctx, raw, off, off2):
    """The eight float16 at byte ``off`` and the eight at ``off2`` of a uint8 array, as float32 (exact)."""
    if not is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        return ir_half_to_float(builder, _load_pair(context, builder, sig, args, 1, 2, 0, ir.VectorType(LL_I16, 8)))

    return f32x16(raw, off, off2), codegen


@intrinsic
def bytes_x16(typingctx, raw, off, off2):
    """Eight registers: the 32 bytes at ``off + 32 c`` joined with those at ``off2 + 32 c`` (c = 0..7)."""
    if not is_1d(raw):
        return None
    tup = types.UniTuple(i8x64, 8)

    def codegen(context, builder, sig, args):
        regs = [_load_pair(context, builder, sig, args, 1, 2, 32 * c, ir.VectorType(LL_I8, 32)) for c in range(8)]
        return context.make_tuple(builder, tup, regs)

    return tup(raw, off, off2), codegen


@intrinsic
def bytes_128_x16(typingctx):
    """64 bytes of 0x80: read unsigned by ``dpbusd_x16``, 128 x Σ of a signed operand's quads."""
    return i8x64(), lambda context, builder, sig, args: splat_constant(V64B, 0x80)


@intrinsic
def neg_i32x16(typingctx, v):
    if v != i32x16:
        return None
    return i32x16(v), lambda context, builder, sig, args: builder.neg(args[0])


# --- float32 rows on sixteen lanes (attention: portable LLVM vectors, two 256-bit registers without AVX-512) ---


def _f32_row_pointer(context, builder, sig, args, at: int, vty: ir.Type) -> ir.Value:
    """Address of ``arr[args[at], args[at + 1]]`` (``arr`` = args[0]) as ``vty*``."""
    a = context.make_array(sig.args[0])(context, builder, args[0])
    r = context.cast(builder, args[at], sig.args[at], types.intp)
    c = context.cast(builder, args[at + 1], sig.args[at + 1], types.intp)
    byte_off = builder.add(builder.mul(r, builder.extract_value(a.strides, 0)), builder.mul(c, ir.Constant(r.type, 4)))
    return builder.bitcast(builder.gep(builder.bitcast(a.data, LL_I8.as_pointer()), [byte_off]), vty.as_pointer())


_V8F = ir.VectorType(LL_F32, 8)


@intrinsic
def load_row_f32x16(typingctx, arr, row, col):
    """``arr[row, col:col+16]`` of a 2-D float32 array with contiguous rows."""
    if not is_f32_rows(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_f32_row_pointer(context, builder, sig, args, 1, V16F), align=4)

    return f32x16(arr, row, col), codegen


@intrinsic
def store_row_f32x16(typingctx, arr, row, col, v):
    """``arr[row, col:col+16] = v``."""
    if not (is_f32_rows(arr) and v == f32x16):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[3], _f32_row_pointer(context, builder, sig, args, 1, V16F), align=4)
        return context.get_dummy_value()

    return types.none(arr, row, col, v), codegen


@intrinsic
def load_rows_f32x16(typingctx, arr, ra, ca, rb, cb):
    """``arr[ra, ca:ca+8]`` in the low eight lanes, ``arr[rb, cb:cb+8]`` in the high eight."""
    if not is_f32_rows(arr):
        return None

    def codegen(context, builder, sig, args):
        lo = builder.load(_f32_row_pointer(context, builder, sig, args, 1, _V8F), align=4)
        hi = builder.load(_f32_row_pointer(context, builder, sig, args, 3, _V8F), align=4)
        return ir_join(builder, lo, hi)

    return f32x16(arr, ra, ca, rb, cb), codegen


@intrinsic
def broadcast_row_f32x16(typingctx, arr, row, col):
    """``arr[row, col:col+8]`` in both halves (one broadcast load on AVX-512)."""
    if not is_f32_rows(arr):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(_f32_row_pointer(context, builder, sig, args, 1, _V8F), align=4)
        return ir_join(builder, v, v)

    return f32x16(arr, row, col), codegen


@intrinsic
def splat_f32x16(typingctx, x):
    """x (any float, as float32) in all sixteen lanes."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        return ir_splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), 16)

    return f32x16(x), codegen


@intrinsic
def muladd_f32x16(typingctx, acc, a, b):
    """``acc + a * b`` lane by lane, rounded twice (``simd.muladd_f32x8`` on sixteen lanes)."""
    if not (acc == f32x16 and a == f32x16 and b == f32x16):
        return None
    return f32x16(acc, a, b), lambda context, builder, sig, args: builder.fadd(args[0], builder.fmul(args[1], args[2]))


def _f32_half(high: bool):
    @intrinsic
    def half(typingctx, v):
        if v != f32x16:
            return None

        def codegen(context, builder, sig, args):
            return builder.shuffle_vector(args[0], args[0], shuffle_mask(8, lambda i: i + 8 * high))

        return f32x8(v), codegen

    return half


low_f32x8, high_f32x8 = _f32_half(False), _f32_half(True)
