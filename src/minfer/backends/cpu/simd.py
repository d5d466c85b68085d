"""The SIMD layer of every numba kernel file: what the target CPU has, SIMD vector types that numba code
carries in ordinary local variables, and the small LLVM IR intrinsics on them.

numba cannot say these things by itself: its integers widen to int64 (LLVM then leaves integer dot
products scalar), it has no bit casts, and LLVM does not vectorize a float reduction whose order we fix.
So the operations the kernels are made of are written here with llvmlite, in two forms:

* intrinsics, called from ``@njit`` code. Flat 1-D arrays take an element index (``load_f32x8(a, i)``);
  2-D arrays with contiguous rows take ``(row, col)`` (``load_row_f32x8(a, r, c)``, which also widens the
  float16 bit patterns of a uint16 array). None of them checks bounds: callers own the bounds.
* ``ir_*`` emitters, which take an llvmlite builder: the pieces of the intrinsics above, and of the ones
  that kernel files write for their block formats (the k-quant decoders emit whole super-blocks).

Runtime feature selection: on x86 with AVX2 the integer dot products are ``vpmaddubsw`` + ``vpmaddwd``
(LLVM does not form them from generic IR); elsewhere, or with ``MINFER_GENERIC_SIMD=1``, a generic LLVM
vector formulation computes the same integer lanes (tests compare the two bit for bit). Where the CPU
also has VNNI (AVX-512 VNNI + VL, or AVX-VNNI), the prefill kernels fuse a dot product and its
accumulation into one ``vpdpbusd`` / ``vpdpwssd`` (``ir_dpbusd``, ``ir_dpwssd``; ``MINFER_VNNI=0`` turns
that off), again with the same integers. FMA and F16C are used only where the target has them, so no
kernel executes an instruction the CPU lacks.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import llvmlite.binding as llb
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

if TYPE_CHECKING:  # annotations only
    from numba.core.base import BaseContext
    from numba.core.typing.templates import Signature

F32 = np.float32
U = np.uint64  # unsigned array index: numba then emits no negative-index wraparound, which would keep
# LLVM from vectorizing loops that start at an offset (see norms._rms_norm_group)


def target_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with ``feature`` (the host unless NUMBA_CPU_NAME/FEATURES say)."""
    feats = numba.config.CPU_FEATURES
    if feats:
        return f"+{feature}" in feats.split(",")
    if numba.config.CPU_NAME not in (None, "", "host"):
        return False  # a named target CPU (portable cache): do not assume host extensions
    return bool(llb.get_host_cpu_features().get(feature, False))


def target_cpu_name() -> str:
    """The CPU numba compiles for: ``NUMBA_CPU_NAME`` where set (a portable cache), else the host's (LLVM's
    name: ``znver4``, ``sapphirerapids``, ...)."""
    name = numba.config.CPU_NAME
    return llb.get_host_cpu_name() if name in (None, "", "host") else name


X86 = platform.machine().lower() in ("x86_64", "amd64")
# x86 AVX2: pmaddubsw/pmaddwd/psignb directly (LLVM does not form them from the generic IR below).
# MINFER_GENERIC_SIMD=1 forces the generic integer formulation, the one other CPUs run (tests compare
# the two bit for bit).
AVX2 = X86 and target_has("avx2") and not os.environ.get("MINFER_GENERIC_SIMD")
# Integer dot products with accumulation in one instruction (vpdpbusd: u8 x s8 quads, vpdpwssd: int16
# pairs, both into int32 lanes without saturation) on 256-bit registers: AVX-512 VNNI with AVX-512VL, or
# AVX-VNNI (the same LLVM intrinsics; LLVM picks the VEX encoding where only AVX-VNNI is there). Used by
# the prefill (multi-token) kernels only where the CPU has them; MINFER_VNNI=0 keeps the AVX2 sequences
# (tests compare the two bit for bit: the integer results are exact either way). Like
# MINFER_GENERIC_SIMD, it changes compiled code: give such a process its own NUMBA_CACHE_DIR.
VNNI = AVX2 and os.environ.get("MINFER_VNNI", "1") != "0" and (
    target_has("avxvnni") or (target_has("avx512vnni") and target_has("avx512vl"))
)
# Fused multiply-add for the per-block accumulation (one rounding); every ARM64 CPU has it.
FMA = target_has("fma") if X86 else True
# Hardware f16 -> f32 (x86 F16C, every ARM64); without it LLVM would call a runtime helper that numba
# does not link (NUMBA_CPU_NAME=generic failed with "Symbol not found: __extendhfsf2").
F16C = target_has("f16c") if X86 else True

LL_I1, LL_I8, LL_I16, LL_I32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32)
LL_F16, LL_F32, LL_F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()


# ---------------------------------------------------------------------------------------------------
# Vector types
# ---------------------------------------------------------------------------------------------------


class VecType(types.Type):
    """A SIMD register's worth of values, an LLVM vector: lives in registers, never in memory."""

    def __init__(self, kind: str, lanes: int) -> None:
        self.kind = kind
        self.lanes = lanes
        super().__init__(name=f"vec_{kind}x{lanes}")

    def llvm_type(self) -> ir.VectorType:
        lane = {"f32": LL_F32, "f64": LL_F64, "i32": LL_I32, "i16": LL_I16, "i8": LL_I8}[self.kind]
        return ir.VectorType(lane, self.lanes)


@register_model(VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type: VecType) -> None:
        super().__init__(dmm, fe_type, fe_type.llvm_type())


f32x8 = VecType("f32", 8)
f64x8 = VecType("f64", 8)  # the RMSNorm sum of squares
f64x4 = VecType("f64", 4)  # the attention softmax's sum
i32x8 = VecType("i32", 8)
i16x16 = VecType("i16", 16)
i8x32 = VecType("i8", 32)
V8F, V8I, V32B, V16S = f32x8.llvm_type(), i32x8.llvm_type(), i8x32.llvm_type(), i16x16.llvm_type()


def is_1d(a: types.Type) -> bool:
    return isinstance(a, types.Array) and a.ndim == 1


def is_f32_rows(arr: types.Type) -> bool:
    return isinstance(arr, types.Array) and arr.ndim == 2 and arr.dtype == types.float32


def is_f16_bits_rows(arr: types.Type) -> bool:
    """A 2-D uint16 array: float16 K/V cells seen as their bit patterns (numba has no float16 arrays)."""
    return isinstance(arr, types.Array) and arr.ndim == 2 and arr.dtype == types.uint16


# ---------------------------------------------------------------------------------------------------
# IR emitters
# ---------------------------------------------------------------------------------------------------


def as_intp(context: BaseContext, builder: ir.IRBuilder, val: ir.Value, ty: types.Type) -> ir.Value:
    return context.cast(builder, val, ty, types.intp)


def array_data(context: BaseContext, builder: ir.IRBuilder, arr_ty: types.Array, arr: ir.Value) -> ir.Value:
    """Data pointer of an array argument."""
    return context.make_array(arr_ty)(context, builder, arr).data


def ir_load(builder: ir.IRBuilder, base: ir.Value, index: ir.Value, ty: ir.Type) -> ir.Value:
    """``ty`` at element ``index`` of ``base`` (unaligned; callers keep every load inside its block)."""
    p = builder.gep(base, [index], inbounds=True)
    return builder.load(builder.bitcast(p, ty.as_pointer()), align=1)


def element_pointer(
    context: BaseContext, builder: ir.IRBuilder, arr_ty: types.Array, arr: ir.Value, index: ir.Value,
    index_ty: types.Type, vty: ir.Type,
) -> ir.Value:
    """Pointer to ``vty`` at element ``index`` of a contiguous 1D array (no bounds check: callers own it)."""
    p = builder.gep(array_data(context, builder, arr_ty, arr), [as_intp(context, builder, index, index_ty)],
                    inbounds=True)
    return builder.bitcast(p, ir.PointerType(vty))


def load_element(
    context: BaseContext, builder: ir.IRBuilder, arr_ty: types.Array, arr: ir.Value, index: ir.Value,
    index_ty: types.Type, vty: ir.Type,
) -> ir.Value:
    """``vty`` at element ``index`` of a 1D array argument."""
    return ir_load(builder, array_data(context, builder, arr_ty, arr), as_intp(context, builder, index, index_ty),
                   vty)


def ir_row_pointer(
    context: BaseContext, builder: ir.IRBuilder, sig: Signature, args: Sequence[ir.Value], vty: ir.Type = V8F,
    itemsize: int = 4,
) -> ir.Value:
    """Address of ``arr[row, col]`` (args 0..2) as ``vty*``, from the row stride in bytes."""
    a = context.make_array(sig.args[0])(context, builder, args[0])
    r = as_intp(context, builder, args[1], sig.args[1])
    c = as_intp(context, builder, args[2], sig.args[2])
    stride0 = builder.extract_value(a.strides, 0)
    byte_off = builder.add(builder.mul(r, stride0), builder.mul(c, ir.Constant(r.type, itemsize)))
    p = builder.gep(builder.bitcast(a.data, LL_I8.as_pointer()), [byte_off])
    return builder.bitcast(p, vty.as_pointer())


def ir_plus(builder: ir.IRBuilder, x: ir.Value, c: int) -> ir.Value:
    return x if c == 0 else builder.add(x, ir.Constant(x.type, c))


def splat_constant(vty: ir.VectorType, v: float) -> ir.Constant:
    return ir.Constant(vty, [v] * vty.count)


def shuffle_mask(n: int, f: Callable[[int], int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(LL_I32, n), [f(i) for i in range(n)])


def ir_splat(builder: ir.IRBuilder, x: ir.Value, n: int) -> ir.Value:
    vt = ir.VectorType(x.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(LL_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), shuffle_mask(n, lambda i: 0))


def ir_lane(builder: ir.IRBuilder, v: ir.Value, i: int) -> ir.Value:
    return builder.extract_element(v, ir.Constant(LL_I32, i))


def ir_call(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    """A call of the LLVM intrinsic ``name``."""
    fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(ret, [a.type for a in args]))
    return builder.call(fn, args)


def ir_fmadd(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """``a * b + c`` (float32, scalar or vector), one rounding where the CPU fuses multiply-add."""
    if FMA:
        name = f"llvm.fma.v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "llvm.fma.f32"
        return ir_call(builder, name, a.type, [a, b, c])
    return builder.fadd(builder.fmul(a, b), c)


def ir_sum_quads(builder: ir.IRBuilder, p: ir.Value) -> ir.Value:
    """<32 x i32> -> <8 x i32>, lane i = p[4i] + p[4i+1] + p[4i+2] + p[4i+3] (pmaddubsw+pmaddwd's layout)."""
    s = None
    for k in range(4):
        part = builder.shuffle_vector(p, p, shuffle_mask(8, lambda i, k=k: 4 * i + k))
        s = part if s is None else builder.add(s, part)
    return s


def ir_pair_sums(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """<2n x T> -> <n x T>, lane i = v[2i] + v[2i+1]."""
    n = v.type.count // 2
    even = builder.shuffle_vector(v, v, shuffle_mask(n, lambda i: 2 * i))
    odd = builder.shuffle_vector(v, v, shuffle_mask(n, lambda i: 2 * i + 1))
    return builder.add(even, odd)


def ir_maddubs(builder: ir.IRBuilder, u: ir.Value, a: ir.Value) -> ir.Value:
    """<32 x u8> x <32 x i8> -> <16 x i16> pair sums (pmaddubsw; our pairs never reach its saturation)."""
    if AVX2:
        return ir_call(builder, "llvm.x86.avx2.pmadd.ub.sw", V16S, [u, a])
    v32 = ir.VectorType(LL_I16, 32)
    return ir_pair_sums(builder, builder.mul(builder.zext(u, v32), builder.sext(a, v32)))


def ir_madd(builder: ir.IRBuilder, p: ir.Value, s: ir.Value) -> ir.Value:
    """<16 x i16> x <16 x i16> -> <8 x i32> pair sums (pmaddwd)."""
    if AVX2:
        return ir_call(builder, "llvm.x86.avx2.pmadd.wd", V8I, [p, s])
    v16 = ir.VectorType(LL_I32, 16)
    return ir_pair_sums(builder, builder.mul(builder.sext(p, v16), builder.sext(s, v16)))


def ir_dot_u8s8(builder: ir.IRBuilder, q: ir.Value, a: ir.Value) -> ir.Value:
    """Lane i = Σ_{k<4} q[4i+k] * a[4i+k] with q unsigned and small enough that pairs fit int16."""
    return ir_madd(builder, ir_maddubs(builder, q, a), splat_constant(V16S, 1))


def ir_dpbusd(builder: ir.IRBuilder, acc: ir.Value, u: ir.Value, a: ir.Value) -> ir.Value:
    """``acc`` + lane i = Σ_{k<4} u[4i+k] a[4i+k] (u unsigned bytes, a signed), exact: one vpdpbusd
    where the CPU has VNNI; else ``ir_dot_u8s8``, which needs pairs that fit int16 (callers keep u small,
    or use this only under ``VNNI``)."""
    if VNNI:
        return ir_call(builder, "llvm.x86.avx512.vpdpbusd.256", V8I,
                       [acc, builder.bitcast(u, V8I), builder.bitcast(a, V8I)])
    return builder.add(acc, ir_dot_u8s8(builder, u, a))


def ir_dpwssd(builder: ir.IRBuilder, acc: ir.Value, p: ir.Value, s: ir.Value) -> ir.Value:
    """``acc`` + lane i = p[2i] s[2i] + p[2i+1] s[2i+1] (int16 pairs), exact: one vpdpwssd where the CPU
    has VNNI, else pmaddwd and an add (the same integers: int32 adds wrap alike)."""
    if VNNI:
        return ir_call(builder, "llvm.x86.avx512.vpdpwssd.256", V8I,
                       [acc, builder.bitcast(p, V8I), builder.bitcast(s, V8I)])
    return builder.add(acc, ir_madd(builder, p, s))


def ir_abs_i8x32(builder: ir.IRBuilder, w: ir.Value) -> ir.Value:
    """|w| of 32 int8 lanes (-128 stays -128, read as 128 by pmaddubsw's unsigned operand)."""
    return ir_call(builder, "llvm.abs.v32i8", V32B, [w, ir.Constant(LL_I1, 0)])


def ir_dot_s8s8(builder: ir.IRBuilder, w: ir.Value, a: ir.Value, w_abs: ir.Value | None = None) -> ir.Value:
    """Eight int32 lanes, lane i = Σ_{k<4} w[4i+k] a[4i+k], both signed; a must not hold -128. ``w_abs``:
    ``ir_abs_i8x32(w)`` when the caller has it (it serves several activation vectors; AVX2 only)."""
    if AVX2:
        # llama.cpp's trick: |w| * (a * sign(w)) fits pmaddubsw (unsigned x signed) exactly; pair sums
        # are at most 2 * 128 * 127 < 2^15 so nothing saturates.
        if w_abs is None:
            w_abs = ir_abs_i8x32(builder, w)
        sa = ir_call(builder, "llvm.x86.avx2.psign.b", V32B, [a, w])
        return ir_dot_u8s8(builder, w_abs, sa)
    v32 = ir.VectorType(LL_I32, 32)
    return ir_sum_quads(builder, builder.mul(builder.sext(w, v32), builder.sext(a, v32)))


def ir_half_to_float(builder: ir.IRBuilder, h: ir.Value) -> ir.Value:
    """IEEE half bit patterns (i16, scalar or vector) to float32, exactly."""
    n = h.type.count if isinstance(h.type, ir.VectorType) else None
    f32 = ir.VectorType(LL_F32, n) if n else LL_F32
    if F16C:
        return builder.fpext(builder.bitcast(h, ir.VectorType(LL_F16, n) if n else LL_F16), f32)
    # Bit arithmetic (F. Giesen's half_to_float): move exponent and mantissa into place and rebias;
    # Inf/NaN get the maximal exponent; zeros and subnormals are renormalized by one exact subtraction.
    i32 = ir.VectorType(LL_I32, n) if n else LL_I32

    def c(v: int):
        return ir.Constant(i32, [v] * n) if n else ir.Constant(i32, v)

    wide = builder.zext(h, i32)
    o = builder.shl(builder.and_(wide, c(0x7FFF)), c(13))
    exp = builder.and_(o, c(0x7C00 << 13))
    o = builder.add(o, c((127 - 15) << 23))
    inf_nan = builder.add(o, c((128 - 16) << 23))
    magic = builder.bitcast(c(113 << 23), f32)
    denormal = builder.bitcast(builder.fsub(builder.bitcast(builder.add(o, c(1 << 23)), f32), magic), i32)
    o = builder.select(
        builder.icmp_unsigned("==", exp, c(0x7C00 << 13)),
        inf_nan,
        builder.select(builder.icmp_unsigned("==", exp, c(0)), denormal, o),
    )
    sign = builder.shl(builder.and_(wide, c(0x8000)), c(16))
    return builder.bitcast(builder.or_(o, sign), f32)


def ir_halves4(builder: ir.IRBuilder, base: ir.Value, index: ir.Value) -> ir.Value:
    """The four float16 at byte ``index`` of ``base``, as float32 x 4.

    x86 converts them straight from memory (one vcvtph2ps) where a lone half costs an insert plus the
    conversion. Callers only read blocks' leading scales, and every block is at least 18 bytes long, so
    the 8 bytes never leave the block."""
    return ir_half_to_float(builder, ir_load(builder, base, index, ir.VectorType(LL_I16, 4)))


def ir_unpack_nibbles(builder: ir.IRBuilder, b: ir.Value) -> ir.Value:
    """16 bytes -> the 32 nibbles (0..15) they pack: byte j's low nibble is value j, its high one j + 16.

    The 16 bytes in both halves of a 256-bit register, the upper half shifted right by 4 (one variable
    shift on 32-bit lanes), then masked: fewer instructions than unpacking two halves."""
    both = builder.bitcast(builder.shuffle_vector(b, b, shuffle_mask(32, lambda i: i % 16)), V8I)
    shifted = builder.lshr(both, ir.Constant(V8I, [0] * 4 + [4] * 4))
    return builder.and_(builder.bitcast(shifted, V32B), splat_constant(V32B, 15))


def ir_hsum_folded(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Σ of eight float32 lanes, halves folded: ((0+4)+(2+6)) + ((1+5)+(3+7)) (the matmuls' order)."""
    h = builder.fadd(
        builder.shuffle_vector(v, v, shuffle_mask(4, lambda i: i)),
        builder.shuffle_vector(v, v, shuffle_mask(4, lambda i: i + 4)),
    )
    h = builder.fadd(
        builder.shuffle_vector(h, h, shuffle_mask(2, lambda i: i)),
        builder.shuffle_vector(h, h, shuffle_mask(2, lambda i: i + 2)),
    )
    return builder.fadd(ir_lane(builder, h, 0), ir_lane(builder, h, 1))


def _ir_lane_tree(builder: ir.IRBuilder, v: ir.Value, combine: Callable[[ir.Value, ir.Value], ir.Value]) -> ir.Value:
    """The lanes of ``v`` combined pairwise in a fixed tree: ((l0 . l1) . (l2 . l3)) . ((l4 . l5) . ...)."""
    lane = [ir_lane(builder, v, i) for i in range(v.type.count)]
    while len(lane) > 1:
        lane = [combine(lane[i], lane[i + 1]) for i in range(0, len(lane), 2)]
    return lane[0]


def ir_isum(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """The exact sum of integer lanes, added in lane order."""
    lanes = [ir_lane(builder, v, i) for i in range(v.type.count)]
    total = lanes[0]
    for lane in lanes[1:]:
        total = builder.add(total, lane)
    return total


# ---------------------------------------------------------------------------------------------------
# Intrinsics on flat 1-D arrays (element indices)
# ---------------------------------------------------------------------------------------------------


@intrinsic
def prefetch(typingctx, arr, i):
    """Hint the cache to fetch element ``i`` of ``arr``; never faults, so ``i`` may run past the end."""
    if not is_1d(arr):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        p = builder.gep(a.data, [as_intp(context, builder, args[1], sig.args[1])])  # no inbounds: may be past
        p = builder.bitcast(p, ir.PointerType(LL_I8))
        fnty = ir.FunctionType(ir.VoidType(), [p.type, LL_I32, LL_I32, LL_I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read, keep in all cache levels, data cache
        builder.call(fn, [p, ir.Constant(LL_I32, 0), ir.Constant(LL_I32, 3), ir.Constant(LL_I32, 1)])
        return context.get_dummy_value()

    return types.none(arr, i), codegen


@intrinsic
def load_f32x8(typingctx, arr, i):
    """arr[i:i+8] of a float32 array."""
    if not (is_1d(arr) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], V8F)

    return f32x8(arr, i), codegen


@intrinsic
def store_f32x8(typingctx, arr, i, v):
    """arr[i:i+8] = v for a float32 array."""
    if not (is_1d(arr) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], V8F),
                      align=4)
        return context.get_dummy_value()

    return types.none(arr, i, f32x8), codegen


@intrinsic
def splat_at(typingctx, arr, i):
    """arr[i] of a float32 array in all eight lanes (no negative-index wraparound: callers own ``i``)."""
    if not (is_1d(arr) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return ir_splat(builder, load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], LL_F32), 8)

    return f32x8(arr, i), codegen


@intrinsic
def load_i32x8(typingctx, arr, i):
    """arr[i:i+8] of an int32 array."""
    if not (is_1d(arr) and arr.dtype == types.int32):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], V8I),
                            align=4)

    return i32x8(arr, i), codegen


@intrinsic
def store_i32x8(typingctx, arr, i, v):
    """arr[i:i+8] = v for an int32 array (a scratch of per-tile integer lanes)."""
    if not (is_1d(arr) and arr.dtype == types.int32):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], V8I),
                      align=4)
        return context.get_dummy_value()

    return types.none(arr, i, i32x8), codegen


@intrinsic
def load_half(typingctx, raw, off):
    """The little-endian float16 at byte offset ``off`` of a uint8 block array, as float32 (it reads the
    8 bytes from ``off``: see ``ir_halves4``)."""
    if not is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        v = ir_halves4(builder, array_data(context, builder, sig.args[0], args[0]),
                       as_intp(context, builder, args[1], sig.args[1]))
        return ir_lane(builder, v, 0)

    return types.float32(raw, off), codegen


@intrinsic
def load_halves8(typingctx, raw, off):
    """The eight little-endian float16 at byte offset ``off`` of a uint8 array, as float32 (exact)."""
    if not is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        h = load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.VectorType(LL_I16, 8))
        return ir_half_to_float(builder, h)

    return f32x8(raw, off), codegen


@intrinsic
def load_bytes32(typingctx, raw, off):
    """The 32 bytes at byte offset ``off`` of an int8/uint8 array."""
    if not is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        return load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], V32B)

    return i8x32(raw, off), codegen


@intrinsic
def broadcast_4bytes(typingctx, arr, off):
    """The 4 bytes at byte offset ``off`` of an int8 array, repeated in all eight 32-bit lanes."""
    if not is_1d(arr):
        return None

    def codegen(context, builder, sig, args):
        v = load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], LL_I32)
        return builder.bitcast(ir_splat(builder, v, 8), V32B)

    return i8x32(arr, off), codegen


@intrinsic
def load_nibbles32(typingctx, raw, off):
    """The 32 nibbles (0..15) packed in the 16 bytes at ``off``: byte j's low nibble is value j, high j+16."""
    if not is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        b = load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.VectorType(LL_I8, 16))
        return ir_unpack_nibbles(builder, b)

    return i8x32(raw, off), codegen


def _nibbles_of_32_bytes(context, builder, sig, args, high: bool):
    v = load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], V16S)
    if high:
        v = builder.lshr(v, splat_constant(V16S, 4))
    return builder.and_(builder.bitcast(v, V32B), splat_constant(V32B, 15))


@intrinsic
def low_nibbles32(typingctx, raw, off):
    """The low nibbles (0..15) of the 32 bytes at ``off``."""
    if not is_1d(raw):
        return None
    return i8x32(raw, off), lambda context, builder, sig, args: _nibbles_of_32_bytes(context, builder, sig, args, False)


@intrinsic
def high_nibbles32(typingctx, raw, off):
    """The high nibbles (0..15) of the 32 bytes at ``off``."""
    if not is_1d(raw):
        return None
    return i8x32(raw, off), lambda context, builder, sig, args: _nibbles_of_32_bytes(context, builder, sig, args, True)


# ---------------------------------------------------------------------------------------------------
# Intrinsics on 2-D arrays with contiguous rows (row, col): float32, or float16 bit patterns as uint16
# ---------------------------------------------------------------------------------------------------


@intrinsic
def load_row_f32x8(typingctx, arr, row, col):
    """``arr[row, col:col+8]`` of a 2-D float32 array whose rows are contiguous (inner stride 4 bytes,
    which callers check): one unaligned vector load. A uint16 array holds float16 bit patterns (K/V cells
    of an f16 cache): its eight values are widened to float32, exactly, so a kernel reading them computes
    what it computes on their float32 copy."""
    if is_f16_bits_rows(arr):
        def codegen16(context, builder, sig, args):
            p = ir_row_pointer(context, builder, sig, args, ir.VectorType(LL_I16, 8), 2)
            return ir_half_to_float(builder, builder.load(p, align=2))

        return f32x8(arr, row, col), codegen16
    if not is_f32_rows(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(ir_row_pointer(context, builder, sig, args), align=4)

    return f32x8(arr, row, col), codegen


@intrinsic
def row_value_f32(typingctx, arr, row, col):
    """``arr[row, col]`` as float32, for the arrays ``load_row_f32x8`` reads (no bounds check: the vector
    loops' scalar tails)."""
    if is_f16_bits_rows(arr):
        def codegen16(context, builder, sig, args):
            return ir_half_to_float(builder, builder.load(ir_row_pointer(context, builder, sig, args, LL_I16, 2)))

        return types.float32(arr, row, col), codegen16
    if not is_f32_rows(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(ir_row_pointer(context, builder, sig, args, LL_F32))

    return types.float32(arr, row, col), codegen


@intrinsic
def store_row_f32x8(typingctx, arr, row, col, v):
    """``arr[row, col:col+8] = v`` (same contract as ``load_row_f32x8``)."""
    if not (is_f32_rows(arr) and v == f32x8):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[3], ir_row_pointer(context, builder, sig, args), align=4)
        return context.get_dummy_value()

    return types.none(arr, row, col, v), codegen


@intrinsic
def add_row_f64x4(typingctx, arr, row, col, acc):
    """``acc + double(arr[row, col:col+4])`` on four float64 lanes (same contract as ``load_row_f32x8``)."""
    if not (acc == f64x4 and is_f32_rows(arr)):
        return None

    def codegen(context, builder, sig, args):
        p = builder.bitcast(ir_row_pointer(context, builder, sig, args), ir.VectorType(LL_F32, 4).as_pointer())
        return builder.fadd(args[3], builder.fpext(builder.load(p, align=4), f64x4.llvm_type()))

    return f64x4(arr, row, col, acc), codegen


@intrinsic
def store_hsums4_scaled(typingctx, out, row, col, scale, a, b, c, d):
    """``out[row, col:col+4] = [tree(a), tree(b), tree(c), tree(d)] * scale``, where tree is the fixed
    8-lane sum of ``hsum_tree``: the same float operations as four ``hsum_tree`` calls, four vectors at a
    time with shuffles (pairs of lanes, then pairs of pairs, then the two halves)."""
    if not (is_f32_rows(out) and scale == types.float32 and a == b == c == d == f32x8):
        return None

    def codegen(context, builder, sig, args):
        def shuf(x, y, idx):
            return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(LL_I32, len(idx)), idx))

        even, odd = list(range(0, 16, 2)), list(range(1, 16, 2))
        va, vb, vc, vd = args[4:]
        ab = builder.fadd(shuf(va, vb, even), shuf(va, vb, odd))  # [a01 a23 a45 a67 b01 b23 b45 b67]
        cd = builder.fadd(shuf(vc, vd, even), shuf(vc, vd, odd))
        r = builder.fadd(shuf(ab, cd, even), shuf(ab, cd, odd))  # [a0123 a4567 b0123 b4567 c.. c.. d.. d..]
        sums = builder.fadd(shuf(r, r, [0, 2, 4, 6]), shuf(r, r, [1, 3, 5, 7]))  # [a b c d]
        v4 = ir.VectorType(LL_F32, 4)
        scale = ir_splat(builder, args[3], 4)
        p = builder.bitcast(ir_row_pointer(context, builder, sig, args), v4.as_pointer())
        builder.store(builder.fmul(sums, scale), p, align=4)
        return context.get_dummy_value()

    return types.none(out, row, col, scale, a, b, c, d), codegen


# ---------------------------------------------------------------------------------------------------
# Arithmetic on vector values
# ---------------------------------------------------------------------------------------------------


def _zeros(vec: VecType):
    """An intrinsic returning a vector of ``vec``'s lanes, all 0.0."""

    @intrinsic
    def zeros(typingctx):
        return vec(), lambda context, builder, sig, args: ir.Constant(vec.llvm_type(), [0.0] * vec.lanes)

    return zeros


zeros_f32x8, zeros_f64x8, zeros_f64x4 = _zeros(f32x8), _zeros(f64x8), _zeros(f64x4)


@intrinsic
def zeros_i32x8(typingctx):
    """Eight int32 lanes, all 0."""
    return i32x8(), lambda context, builder, sig, args: ir.Constant(V8I, [0] * 8)


@intrinsic
def splat_f32x8(typingctx, x):
    """x (any float, as float32) in all eight lanes."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        return ir_splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), 8)

    return f32x8(x), codegen


@intrinsic
def mul_f32x8(typingctx, a, b):
    return f32x8(f32x8, f32x8), lambda context, builder, sig, args: builder.fmul(args[0], args[1])


@intrinsic
def fma_f64(typingctx, a, b, c):
    """``a * b + c`` on float64 scalars, one rounding where the CPU fuses (as ``madd_wide_f64x8`` lane by lane)."""
    if not (a == types.float64 and b == types.float64 and c == types.float64):
        return None

    def codegen(context, builder, sig, args):
        if FMA:
            return ir_call(builder, "llvm.fma.f64", LL_F64, list(args))
        return builder.fadd(builder.fmul(args[0], args[1]), args[2])

    return types.float64(types.float64, types.float64, types.float64), codegen


@intrinsic
def madd_wide_f64x8(typingctx, acc, x, v):
    """``acc + double(x) * double(v)`` lane by lane, eight float32 values widened (exactly): one float64
    rounding where the CPU fuses multiply-add, else two (with a float32 ``x`` the product is exact, so the
    result is the same either way)."""
    if not (acc == f64x8 and isinstance(x, types.Float) and v == f32x8):
        return None

    def codegen(context, builder, sig, args):
        xs = ir_splat(builder, context.cast(builder, args[1], sig.args[1], types.float64), 8)
        wide = builder.fpext(args[2], f64x8.llvm_type())
        if FMA:
            return ir_call(builder, "llvm.fma.v8f64", wide.type, [xs, wide, args[0]])
        return builder.fadd(args[0], builder.fmul(xs, wide))

    return f64x8(acc, x, v), codegen


@intrinsic
def add_f64x8(typingctx, a, b):
    return f64x8(f64x8, f64x8), lambda context, builder, sig, args: builder.fadd(args[0], args[1])


@intrinsic
def store_f64x8(typingctx, arr, i, v):
    """arr[i:i+8] = v for a float64 array."""
    if not (is_1d(arr) and arr.dtype == types.float64 and v == f64x8):
        return None

    def codegen(context, builder, sig, args):
        p = element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1], f64x8.llvm_type())
        builder.store(args[2], p, align=8)
        return context.get_dummy_value()

    return types.none(arr, i, v), codegen


@intrinsic
def scaled_add_narrow_f32x8(typingctx, y, s, u):
    """``float32(double(y) + s * u)`` lane by lane (``s`` a float64 scalar, ``u`` float64 lanes): one rounding
    to float32 after the float64 arithmetic."""
    if not (y == f32x8 and s == types.float64 and u == f64x8):
        return None

    def codegen(context, builder, sig, args):
        wide = builder.fadd(builder.fpext(args[0], f64x8.llvm_type()), builder.fmul(ir_splat(builder, args[1], 8),
                                                                                    args[2]))
        return builder.fptrunc(wide, V8F)

    return f32x8(y, s, u), codegen


@intrinsic
def fma_f32x8(typingctx, acc, a, b):
    """acc + a * b on eight float32 lanes, one rounding per lane where the CPU fuses multiply-add."""
    return f32x8(f32x8, f32x8, f32x8), lambda context, builder, sig, args: ir_fmadd(builder, args[1], args[2], args[0])


@intrinsic
def fma_i32x8(typingctx, acc, v, scale):
    """acc + float(v) * scale for int32 lanes v, one rounding per lane where the CPU fuses multiply-add."""

    def codegen(context, builder, sig, args):
        return ir_fmadd(builder, builder.sitofp(args[1], V8F), args[2], args[0])

    return f32x8(f32x8, i32x8, f32x8), codegen


@intrinsic
def fma_f32(typingctx, a, b, c):
    """``a * b + c`` on float32 scalars, one rounding where the CPU fuses (as ``fma_f32x8`` lane by lane)."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None
    return types.float32(types.float32, types.float32, types.float32), lambda context, builder, sig, args: ir_fmadd(
        builder, *args
    )


@intrinsic
def muladd_f32x8(typingctx, acc, a, b):
    """``acc + a * b`` lane by lane, rounded twice (no FMA: results do not depend on the CPU)."""
    if not (acc == f32x8 and a == f32x8 and b == f32x8):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], builder.fmul(args[1], args[2]))

    return f32x8(acc, a, b), codegen


@intrinsic
def max_f32x8(typingctx, a, b):
    """Lane by lane ``a if a > b else b``."""
    if not (a == f32x8 and b == f32x8):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])

    return f32x8(a, b), codegen


@intrinsic
def sumsq_f64x8(typingctx, acc, v):
    """``acc + double(v) * double(v)`` lane by lane (the products of float32 values are exact in float64)."""
    if not (acc == f64x8 and v == f32x8):
        return None

    def codegen(context, builder, sig, args):
        d = builder.fpext(args[1], f64x8.llvm_type())
        return builder.fadd(args[0], builder.fmul(d, d))

    return f64x8(acc, v), codegen


@intrinsic
def hsum_folded(typingctx, v):
    """Σ of the eight lanes in ``ir_hsum_folded``'s order: ((0+4)+(2+6)) + ((1+5)+(3+7))."""
    return types.float32(f32x8), lambda context, builder, sig, args: ir_hsum_folded(builder, args[0])


@intrinsic
def hsum_tree(typingctx, v):
    """Σ of the lanes in adjacent pairs: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)) for 8 lanes,
    (v0 + v1) + (v2 + v3) for 4, the tree every vector-kernel sum uses (float32 or float64 lanes)."""
    if v not in (f32x8, f64x8, f64x4):
        return None
    lane = types.float32 if v.kind == "f32" else types.float64
    return lane(v), lambda context, builder, sig, args: _ir_lane_tree(builder, args[0], builder.fadd)


@intrinsic
def hmax_f32x8(typingctx, v):
    """The largest of the eight lanes (exact in any order)."""
    if v != f32x8:
        return None

    def codegen(context, builder, sig, args):
        return _ir_lane_tree(builder, args[0], lambda a, b: builder.select(builder.fcmp_ordered(">", a, b), a, b))

    return types.float32(v), codegen


@intrinsic
def add_i32x8(typingctx, a, b):
    """a + b, int32 lanes."""
    return i32x8(i32x8, i32x8), lambda context, builder, sig, args: builder.add(args[0], args[1])


@intrinsic
def sub_i32x8(typingctx, a, b):
    """a - b, int32 lanes."""
    return i32x8(i32x8, i32x8), lambda context, builder, sig, args: builder.sub(args[0], args[1])


@intrinsic
def add_i16x16(typingctx, a, b):
    return i16x16(i16x16, i16x16), lambda context, builder, sig, args: builder.add(args[0], args[1])


@intrinsic
def hsum_i32x8(typingctx, v):
    """The exact sum of the eight int32 lanes."""
    return types.int32(i32x8), lambda context, builder, sig, args: ir_isum(builder, args[0])


@intrinsic
def dot_u8s8(typingctx, q, a):
    """Eight int32 lanes, lane i = Σ_{k<4} q[4i+k] a[4i+k]; q unsigned 0..15, a signed."""
    return i32x8(i8x32, i8x32), lambda context, builder, sig, args: ir_dot_u8s8(builder, args[0], args[1])


@intrinsic
def dot_s8s8(typingctx, w, a):
    """Eight int32 lanes, lane i = Σ_{k<4} w[4i+k] a[4i+k], both signed; a must not hold -128."""
    return i32x8(i8x32, i8x32), lambda context, builder, sig, args: ir_dot_s8s8(builder, args[0], args[1])


@intrinsic
def pairs_u8s8(typingctx, q, a):
    """Sixteen int16 lanes, lane i = q[2i] a[2i] + q[2i+1] a[2i+1]; q 0..15, a -127..127 (no saturation)."""
    return i16x16(i8x32, i8x32), lambda context, builder, sig, args: ir_maddubs(builder, args[0], args[1])


@intrinsic
def widen_pairs(typingctx, p):
    """Eight int32 lanes, lane i = p[2i] + p[2i+1]."""
    return i32x8(i16x16), lambda context, builder, sig, args: ir_madd(builder, args[0], splat_constant(V16S, 1))


@intrinsic
def madd_i16x16(typingctx, p, s):
    """Eight int32 lanes, lane i = p[2i] s[2i] + p[2i+1] s[2i+1] (pmaddwd: exact for int16 operands)."""
    if not (p == i16x16 and s == i16x16):
        return None
    return i32x8(p, s), lambda context, builder, sig, args: ir_madd(builder, args[0], args[1])


@intrinsic
def scale_pairs8(typingctx, raw, off):
    """The 8 unsigned bytes at byte ``off`` of a uint8 array, byte r in int16 lanes 2r and 2r + 1: the
    multiplier that gives each of eight rows' int16 pair sums one per-row scale in ``madd_i16x16``."""
    if not is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        v = load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.VectorType(LL_I8, 8))
        w = builder.zext(v, V8I)
        return builder.bitcast(builder.or_(w, builder.shl(w, splat_constant(V8I, 16))), V16S)

    return i16x16(raw, off), codegen


@intrinsic
def load_u8_i16x16(typingctx, raw, off):
    """The 16 unsigned bytes at byte ``off`` of a uint8 array, widened to sixteen int16 lanes."""
    if not is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        v = load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.VectorType(LL_I8, 16))
        return builder.zext(v, V16S)

    return i16x16(raw, off), codegen


@intrinsic
def broadcast_i16_pair(typingctx, arr, i):
    """``arr[i], arr[i + 1]`` of an int16 array, repeated in all eight pairs of int16 lanes."""
    if not (is_1d(arr) and arr.dtype == types.int16):
        return None

    def codegen(context, builder, sig, args):
        v = load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], LL_I32)
        return builder.bitcast(ir_splat(builder, v, 8), V16S)

    return i16x16(arr, i), codegen


@intrinsic
def dpbusd(typingctx, acc, u, a):
    """``acc`` + lane i = Σ_{k<4} u[4i+k] a[4i+k], u unsigned bytes, a signed, exact (``ir_dpbusd``: one
    vpdpbusd under ``VNNI``; without it the pairs must fit int16)."""
    if not (acc == i32x8 and u == i8x32 and a == i8x32):
        return None
    return i32x8(acc, u, a), lambda context, builder, sig, args: ir_dpbusd(builder, *args)



@intrinsic
def bytes_128(typingctx):
    """32 bytes of 0x80: read unsigned by ``dpbusd``, 128 x Σ of a signed operand's quads."""
    return i8x32(), lambda context, builder, sig, args: splat_constant(V32B, 0x80)


@intrinsic
def neg_i32x8(typingctx, v):
    """-v, int32 lanes."""
    if v != i32x8:
        return None
    return i32x8(v), lambda context, builder, sig, args: builder.neg(args[0])


@intrinsic
def table16(typingctx, arr):
    """The 16 int8 entries of ``arr`` (a lookup table), repeated in both 128-bit halves of a register: the
    operand ``lookup16`` reads. Load it once, outside the loops."""
    if not (is_1d(arr) and arr.dtype == types.int8):
        return None

    def codegen(context, builder, sig, args):
        t = load_element(context, builder, sig.args[0], args[0], context.get_constant(types.intp, 0), types.intp,
                         ir.VectorType(LL_I8, 16))
        return builder.shuffle_vector(t, t, shuffle_mask(32, lambda i: i % 16))

    return i8x32(arr), codegen


def ir_lookup16(builder: ir.IRBuilder, idx: ir.Value, table: ir.Value) -> ir.Value:
    """Lane i = table[idx[i]] for indices 0..15 (``table`` as ``table16`` lays it out): one vpshufb on AVX2;
    elsewhere sixteen compare-and-selects, the same bytes."""
    if AVX2:
        return ir_call(builder, "llvm.x86.avx2.pshuf.b", V32B, [table, idx])
    out = ir.Constant(V32B, [0] * 32)
    for k in range(16):
        entry = ir_splat(builder, builder.extract_element(table, ir.Constant(LL_I32, k)), 32)
        out = builder.select(builder.icmp_unsigned("==", idx, splat_constant(V32B, k)), entry, out)
    return out


@intrinsic
def lookup16(typingctx, idx, table):
    """Lane i = table[idx[i]]: 32 nibbles (0..15) through a 16-entry int8 table (``table16``'s register)."""
    if not (idx == i8x32 and table == i8x32):
        return None
    return i8x32(idx, table), lambda context, builder, sig, args: ir_lookup16(builder, args[0], args[1])


@intrinsic
def lane_splat_f32x8(typingctx, v, i):
    """Lane ``i`` (0..7, a run-time index) of ``v`` in all eight lanes: one vpermps on AVX2."""
    if not (v == f32x8 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        index = builder.trunc(as_intp(context, builder, args[1], sig.args[1]), LL_I32)
        if AVX2:
            return ir_call(builder, "llvm.x86.avx2.permps", V8F, [args[0], ir_splat(builder, index, 8)])
        return ir_splat(builder, builder.extract_element(args[0], index), 8)

    return f32x8(v, i), codegen
