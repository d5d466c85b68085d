"""Fast ``out = x @ W^T`` on raw GGML blocks: numba kernels that never build the f32 weight matrix.

Supported weight types: F32, F16, BF16 (float path) and Q8_0, Q4_0, Q4_1 (integer path).

Integer path (what llama.cpp does in ``ggml_vec_dot_q4_0_q8_0`` / ``q4_1_q8_1`` / ``q8_0_q8_0``)
    The activations are quantized once per call (or once for several matmuls sharing an input, see
    :func:`quantize_activations`) to blocks of 32 int8 with a float32 scale: ``d = amax / 127``,
    ``q = roundf(x * (1/d))`` exactly like ``quantize_row_q8_0_ref``/``q8_1_ref``, and the block sum
    ``d * Σq`` that Q4_1's offset needs. Unlike llama.cpp we keep ``d`` and ``d * Σq`` in float32 rather
    than rounding them to f16 (free here, and slightly more accurate). A weight block against an
    activation block is then an integer dot product, kept in eight int32 lanes:

    * Q4_1 (``w = d_w * n + m``, ``n`` in 0..15): ``d_w d_x Σ n a + m (d_x Σ a)``;
    * Q4_0 (``w = d_w (n - 8)``): ``d_w d_x Σ (n - 8) a``, the ``-8 Σ a`` folded in as integers;
    * Q8_0 (``w = d_w q``): ``d_w d_x Σ q a``.

    Q4_0: the eight int32 lanes are converted to float and accumulated with one fused multiply-add per
    block (scale ``d_w * d_x``); the row's result is a fixed-order horizontal sum of the eight lanes.
    Q4_1 and Q8_0 run on copies repacked at load into groups of eight rows (see ``_q4_1_rows8``,
    ``_q8_0_rows8``): a block's integer sum is exact, and each row does ``acc = fma(float(Σ n a), d_w d_x,
    acc)`` block after block (Q4_1 then ``acc = fma(m, d_x Σa, acc)``).

Float path (F32, F16, BF16 weights)
    Plain f32 dot products on the unquantized activations, eight lanes at a time, weights widened to f32
    in registers, then the same fixed-order horizontal sum (plus a scalar tail when ``n_in % 8 != 0``).

Determinism
    Every output element is produced by one worker running one fixed sequence of float operations, and
    that sequence does not depend on the thread count, on the tile an element falls in, nor on how many
    tokens are in the call: a token's row of output is bit-identical whether it is computed alone
    (GEMV) or inside a prompt (GEMM), at any thread count. Tests hold both.

How the loops are shaped (measured, see ``bench/matmul_bench.py``)
    numba cannot express SIMD integer dot products by itself (its integers widen to int64 and LLVM then
    leaves the loop scalar), so the block-level operations are small LLVM intrinsics written below with
    llvmlite: SIMD vector *values* that numba code carries in ordinary local variables. On x86 with AVX2
    they lower to the same instructions as llama.cpp's AVX2 kernels (``vpmaddubsw`` + ``vpmaddwd``,
    ``vcvtph2ps`` for the f16 scales); elsewhere a generic LLVM vector formulation computes the same
    integer lanes. Q4_0 decode (one token) runs 4 weight rows per pass sharing the activation loads;
    prefill runs one weight row against 8 tokens, unpacking each weight block once per 8 tokens. Q4_1
    and Q8_0 run eight rows per register for any number of tokens (one pmaddubsw serves eight rows).
    Q4_1 against the row-by-row kernels (kept in the bench as variants): 8 tokens ~20% faster, 2-4
    tokens ~2x, prompts of 64+ tokens ~1.7x; one token 10-20% slower in the matmuls alone (it streams the
    same bytes), which end to end (tg128) was lost in the noise. Q8_0 (SmolLM2's 49152x576 output head,
    caches flushed between calls): 8 tokens 3.6 ms against 4.0 ms, one token the same (1.3 ms).
"""

from __future__ import annotations

import mmap
import os
import platform
from collections.abc import Callable
from typing import Any

import llvmlite.binding as llb
import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from minfer.errors import ModelError
from minfer.formats.gguf_file import GGUFTensor
from minfer.formats.quants import GGMLType

QK = 32  # values per block of every integer-path type (and of the activation quantization)
GEMM_TOKENS = 8  # prefill tile: tokens sharing one unpacked weight block
GEMM_ROWS = 16  # prefill work item: weight rows owned by one worker per item
GEMV_ROWS = 4  # decode: weight rows computed per pass, sharing activation loads
PREFETCH_ROWS = 16  # decode: how far ahead (in weight rows) to prefetch

_BLOCK_BYTES = {GGMLType.Q8_0: 34, GGMLType.Q4_0: 18, GGMLType.Q4_1: 20}
_FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
_INT_TYPES = tuple(_BLOCK_BYTES)


# ---------------------------------------------------------------------------------------------------
# SIMD values for numba
# ---------------------------------------------------------------------------------------------------


def _target_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with ``feature`` (the host unless NUMBA_CPU_NAME/FEATURES say)."""
    feats = numba.config.CPU_FEATURES
    if feats:
        return f"+{feature}" in feats.split(",")
    if numba.config.CPU_NAME not in (None, "", "host"):
        return False  # a named target CPU (portable cache): do not assume host extensions
    return bool(llb.get_host_cpu_features().get(feature, False))


_X86 = platform.machine().lower() in ("x86_64", "amd64")
# x86 AVX2: pmaddubsw/pmaddwd/psignb directly (LLVM does not form them from the generic IR below).
# MINFER_GENERIC_SIMD=1 forces the generic integer formulation, the one other CPUs run (tests compare
# the two bit for bit).
_AVX2 = _X86 and _target_has("avx2") and not os.environ.get("MINFER_GENERIC_SIMD")
# Fused multiply-add for the per-block accumulation (one rounding); every ARM64 CPU has it.
_FMA = _target_has("fma") if _X86 else True
# Hardware f16 -> f32 (x86 F16C, every ARM64); without it LLVM would call a runtime helper that numba
# does not link (NUMBA_CPU_NAME=generic failed with "Symbol not found: __extendhfsf2").
_F16C = _target_has("f16c") if _X86 else True

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F16, _F32 = ir.HalfType(), ir.FloatType()


class _VecType(types.Type):
    """A SIMD register's worth of values, an LLVM vector: lives in registers, never in memory."""

    def __init__(self, kind: str, lanes: int) -> None:
        self.kind = kind
        self.lanes = lanes
        super().__init__(name=f"vec_{kind}x{lanes}")

    def llvm_type(self) -> ir.VectorType:
        return ir.VectorType({"f32": _F32, "i32": _I32, "i16": _I16, "i8": _I8}[self.kind], self.lanes)


@register_model(_VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type: _VecType) -> None:
        super().__init__(dmm, fe_type, fe_type.llvm_type())


f32x8 = _VecType("f32", 8)
f32x2 = _VecType("f32", 2)
i32x8 = _VecType("i32", 8)
i8x32 = _VecType("i8", 32)
i16x16 = _VecType("i16", 16)
_V8F, _V2F, _V8I, _V32B = f32x8.llvm_type(), f32x2.llvm_type(), i32x8.llvm_type(), i8x32.llvm_type()
_V16S = i16x16.llvm_type()


def _idx(context, builder, val, ty):
    return context.cast(builder, val, ty, types.intp)


def _elem_ptr(context, builder, arr_ty, arr, index, index_ty, vty):
    """Pointer to ``vty`` at element ``index`` of a contiguous 1D array (no bounds check: callers own it)."""
    a = context.make_array(arr_ty)(context, builder, arr)
    p = builder.gep(a.data, [_idx(context, builder, index, index_ty)], inbounds=True)
    return builder.bitcast(p, ir.PointerType(vty))


def _load(context, builder, arr_ty, arr, index, index_ty, vty):
    return builder.load(_elem_ptr(context, builder, arr_ty, arr, index, index_ty, vty), align=1)


def _shuffle_idx(n: int, f) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, n), [f(i) for i in range(n)])


def _splat(builder, x, n: int):
    vt = ir.VectorType(x.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), _shuffle_idx(n, lambda i: 0))


def _call(builder, name: str, ret, args):
    fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(ret, [a.type for a in args]))
    return builder.call(fn, args)


def _fmadd(builder, a, b, c):
    if _FMA:
        return _call(builder, f"llvm.fma.v{a.type.count}f32", a.type, [a, b, c])
    return builder.fadd(builder.fmul(a, b), c)


def _sum_quads(builder, p):
    """<32 x i32> -> <8 x i32>, lane i = p[4i] + p[4i+1] + p[4i+2] + p[4i+3] (pmaddubsw+pmaddwd's layout)."""
    s = None
    for k in range(4):
        part = builder.shuffle_vector(p, p, _shuffle_idx(8, lambda i, k=k: 4 * i + k))
        s = part if s is None else builder.add(s, part)
    return s


def _is_1d(a) -> bool:
    return isinstance(a, types.Array) and a.ndim == 1


def _dot_u8s8_ir(builder, q, a):
    """Lane i = Σ_{k<4} q[4i+k] * a[4i+k] with q unsigned and small enough that pairs fit int16."""
    if _AVX2:
        ones = ir.Constant(ir.VectorType(_I16, 16), [1] * 16)
        p16 = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16), [q, a])
        return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I, [p16, ones])
    v32 = ir.VectorType(_I32, 32)
    return _sum_quads(builder, builder.mul(builder.zext(q, v32), builder.sext(a, v32)))


@intrinsic
def _prefetch(typingctx, arr, i):
    """Hint the cache to fetch element ``i`` of ``arr``; never faults, so ``i`` may run past the end."""
    if not _is_1d(arr):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        p = builder.gep(a.data, [_idx(context, builder, args[1], sig.args[1])])  # no inbounds: may be past
        p = builder.bitcast(p, ir.PointerType(_I8))
        fnty = ir.FunctionType(ir.VoidType(), [p.type, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read, keep in all cache levels, data cache
        builder.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(arr, i), codegen


@intrinsic
def _vzero8(typingctx):
    """Eight float32 zeros."""
    return f32x8(), lambda context, builder, sig, args: ir.Constant(_V8F, [0.0] * 8)


@intrinsic
def _vzero2(typingctx):
    """Two float32 zeros."""
    return f32x2(), lambda context, builder, sig, args: ir.Constant(_V2F, [0.0] * 2)


@intrinsic
def _vsplat8(typingctx, x):
    """x in all eight lanes."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), 8)

    return f32x8(x), codegen


@intrinsic
def _vload8(typingctx, arr, i):
    """arr[i:i+8] of a float32 array."""
    if not (_is_1d(arr) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return _load(context, builder, sig.args[0], args[0], args[1], sig.args[1], _V8F)

    return f32x8(arr, i), codegen


@intrinsic
def _vload2(typingctx, arr, i):
    """arr[i:i+2] of a float32 array."""
    if not (_is_1d(arr) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return _load(context, builder, sig.args[0], args[0], args[1], sig.args[1], _V2F)

    return f32x2(arr, i), codegen


def _half_to_float(builder, h):
    """IEEE half bit patterns (i16, scalar or vector) to float32, exactly."""
    n = h.type.count if isinstance(h.type, ir.VectorType) else None
    f32 = ir.VectorType(_F32, n) if n else _F32
    if _F16C:
        return builder.fpext(builder.bitcast(h, ir.VectorType(_F16, n) if n else _F16), f32)
    # Bit arithmetic (F. Giesen's half_to_float): move exponent and mantissa into place and rebias;
    # Inf/NaN get the maximal exponent; zeros and subnormals are renormalized by one exact subtraction.
    i32 = ir.VectorType(_I32, n) if n else _I32

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


def _f16x4(context, builder, sig, args):
    # Four halves from one 8-byte load: x86 converts them straight from memory (one vcvtph2ps) where a
    # lone half costs an insert plus the conversion. Callers only read blocks' leading scales, and every
    # block is at least 18 bytes long, so the 8 bytes never leave the block.
    h = _load(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.VectorType(_I16, 4))
    return _half_to_float(builder, h)


@intrinsic
def _f16(typingctx, raw, off):
    """The little-endian float16 at byte offset ``off`` of a uint8 block array, as float32."""
    if not _is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(_f16x4(context, builder, sig, args), ir.Constant(_I32, 0))

    return types.float32(raw, off), codegen


@intrinsic
def _vf16x2(typingctx, raw, off):
    """The two float16 at byte offset ``off`` (Q4_1's d and m), as float32."""
    if not _is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        v = _f16x4(context, builder, sig, args)
        return builder.shuffle_vector(v, v, _shuffle_idx(2, lambda i: i))

    return f32x2(raw, off), codegen


@intrinsic
def _vbytes(typingctx, raw, off):
    """The 32 bytes at byte offset ``off`` of an int8/uint8 array."""
    if not _is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        return _load(context, builder, sig.args[0], args[0], args[1], sig.args[1], _V32B)

    return i8x32(raw, off), codegen


@intrinsic
def _vnibbles(typingctx, raw, off):
    """The 32 nibbles (0..15) packed in the 16 bytes at ``off``: byte j's low nibble is value j, high j+16."""
    if not _is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        # the 16 bytes in both halves of a 256-bit register, the upper half shifted right by 4 (one
        # variable shift on 32-bit lanes), then masked: fewer instructions than unpacking two halves
        v16 = ir.VectorType(_I8, 16)
        b = _load(context, builder, sig.args[0], args[0], args[1], sig.args[1], v16)
        both = builder.bitcast(builder.shuffle_vector(b, b, _shuffle_idx(32, lambda i: i % 16)), _V8I)
        shifted = builder.lshr(both, ir.Constant(_V8I, [0] * 4 + [4] * 4))
        return builder.and_(builder.bitcast(shifted, _V32B), ir.Constant(_V32B, [15] * 32))

    return i8x32(raw, off), codegen


@intrinsic
def _vdot_u8s8(typingctx, q, a):
    """Eight int32 lanes, lane i = Σ_{k<4} q[4i+k] a[4i+k]; q unsigned 0..15, a signed."""

    def codegen(context, builder, sig, args):
        return _dot_u8s8_ir(builder, args[0], args[1])

    return i32x8(i8x32, i8x32), codegen


@intrinsic
def _vdot_s8s8(typingctx, w, a):
    """Eight int32 lanes, lane i = Σ_{k<4} w[4i+k] a[4i+k], both signed; a must not hold -128."""

    def codegen(context, builder, sig, args):
        w, a = args
        if _AVX2:
            # llama.cpp's trick: |w| * (a * sign(w)) fits pmaddubsw (unsigned x signed) exactly; pair sums
            # are at most 2 * 128 * 127 < 2^15 so nothing saturates.
            aw = _call(builder, "llvm.abs.v32i8", _V32B, [w, ir.Constant(ir.IntType(1), 0)])
            sa = _call(builder, "llvm.x86.avx2.psign.b", _V32B, [a, w])
            return _dot_u8s8_ir(builder, aw, sa)
        v32 = ir.VectorType(_I32, 32)
        return _sum_quads(builder, builder.mul(builder.sext(w, v32), builder.sext(a, v32)))

    return i32x8(i8x32, i8x32), codegen


@intrinsic
def _vq4_0_offset(typingctx, a):
    """Eight int32 lanes, lane i = 8 Σ_{k<4} a[4i+k]: what Q4_0's ``-8`` removes from Σ n a."""

    def codegen(context, builder, sig, args):
        ones = ir.Constant(_V32B, [1] * 32)
        s = _dot_u8s8_ir(builder, ones, args[0])
        return builder.shl(s, ir.Constant(_V8I, [3] * 8))

    return i32x8(i8x32), codegen


@intrinsic
def _vstore_i(typingctx, arr, i, v):
    """arr[i:i+8] = v for an int32 array (a scratch of per-tile integer lanes)."""
    if not (_is_1d(arr) and arr.dtype == types.int32):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _V8I), align=4)
        return context.get_dummy_value()

    return types.none(arr, i, i32x8), codegen


@intrinsic
def _vload_i(typingctx, arr, i):
    """arr[i:i+8] of an int32 array."""
    if not (_is_1d(arr) and arr.dtype == types.int32):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _V8I), align=4)

    return i32x8(arr, i), codegen


@intrinsic
def _visub(typingctx, a, b):
    """a - b, int32 lanes."""
    return i32x8(i32x8, i32x8), lambda context, builder, sig, args: builder.sub(args[0], args[1])


@intrinsic
def _vfma_i(typingctx, acc, v, scale):
    """acc + float(v) * scale, one rounding per lane where the CPU fuses multiply-add."""

    def codegen(context, builder, sig, args):
        return _fmadd(builder, builder.sitofp(args[1], _V8F), args[2], args[0])

    return f32x8(f32x8, i32x8, f32x8), codegen


@intrinsic
def _vfma(typingctx, acc, a, b):
    """acc + a * b on eight float32 lanes."""
    return f32x8(f32x8, f32x8, f32x8), lambda context, builder, sig, args: _fmadd(builder, args[1], args[2], args[0])


@intrinsic
def _vmul8(typingctx, a, b):
    return f32x8(f32x8, f32x8), lambda context, builder, sig, args: builder.fmul(args[0], args[1])


@intrinsic
def _vadd8(typingctx, a, b):
    return f32x8(f32x8, f32x8), lambda context, builder, sig, args: builder.fadd(args[0], args[1])


@intrinsic
def _vmul2(typingctx, a, b):
    return f32x2(f32x2, f32x2), lambda context, builder, sig, args: builder.fmul(args[0], args[1])


@intrinsic
def _vadd2(typingctx, a, b):
    return f32x2(f32x2, f32x2), lambda context, builder, sig, args: builder.fadd(args[0], args[1])


@intrinsic
def _vlane(typingctx, v, i):
    """Lane i (a compile-time constant in practice) of a float32 vector."""
    if not (isinstance(v, _VecType) and v.kind == "f32" and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], builder.trunc(_idx(context, builder, args[1], sig.args[1]), _I32))

    return types.float32(v, i), codegen


@intrinsic
def _vhsum(typingctx, v):
    """Σ of the eight lanes in a fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7))."""

    def codegen(context, builder, sig, args):
        v = args[0]
        h = builder.fadd(
            builder.shuffle_vector(v, v, _shuffle_idx(4, lambda i: i)),
            builder.shuffle_vector(v, v, _shuffle_idx(4, lambda i: i + 4)),
        )
        h = builder.fadd(
            builder.shuffle_vector(h, h, _shuffle_idx(2, lambda i: i)),
            builder.shuffle_vector(h, h, _shuffle_idx(2, lambda i: i + 2)),
        )
        return builder.fadd(
            builder.extract_element(h, ir.Constant(_I32, 0)), builder.extract_element(h, ir.Constant(_I32, 1))
        )

    return types.float32(f32x8), codegen



# -- Q4_1 in groups of eight rows (see _q4_1_rows8) ------------------------------------------------


@intrinsic
def _vbcast4(typingctx, arr, off):
    """The 4 bytes at byte offset ``off`` of an int8 array, repeated in all eight 32-bit lanes."""
    if not _is_1d(arr):
        return None

    def codegen(context, builder, sig, args):
        v = _load(context, builder, sig.args[0], args[0], args[1], sig.args[1], _I32)
        return builder.bitcast(_splat(builder, v, 8), _V32B)

    return i8x32(arr, off), codegen


def _nibbles_ir(context, builder, sig, args, high: bool):
    v = _load(context, builder, sig.args[0], args[0], args[1], sig.args[1], _V16S)
    if high:
        v = builder.lshr(v, ir.Constant(_V16S, [4] * 16))
    return builder.and_(builder.bitcast(v, _V32B), ir.Constant(_V32B, [15] * 32))


@intrinsic
def _vhalves8(typingctx, raw, off):
    """The eight little-endian float16 at byte offset ``off`` of a uint8 array, as float32 (exact)."""
    if not _is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        h = _load(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.VectorType(_I16, 8))
        return _half_to_float(builder, h)

    return f32x8(raw, off), codegen

@intrinsic
def _vlow_nibbles(typingctx, raw, off):
    """The low nibbles (0..15) of the 32 bytes at ``off``."""
    if not _is_1d(raw):
        return None
    return i8x32(raw, off), lambda context, builder, sig, args: _nibbles_ir(context, builder, sig, args, False)


@intrinsic
def _vhigh_nibbles(typingctx, raw, off):
    """The high nibbles (0..15) of the 32 bytes at ``off``."""
    if not _is_1d(raw):
        return None
    return i8x32(raw, off), lambda context, builder, sig, args: _nibbles_ir(context, builder, sig, args, True)


@intrinsic
def _vpairs_u8s8(typingctx, q, a):
    """Sixteen int16 lanes, lane i = q[2i] a[2i] + q[2i+1] a[2i+1]; q 0..15, a -127..127 (no saturation)."""

    def codegen(context, builder, sig, args):
        if _AVX2:
            return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16S, [args[0], args[1]])
        v32 = ir.VectorType(_I16, 32)
        p = builder.mul(builder.zext(args[0], v32), builder.sext(args[1], v32))
        even = builder.shuffle_vector(p, p, _shuffle_idx(16, lambda i: 2 * i))
        odd = builder.shuffle_vector(p, p, _shuffle_idx(16, lambda i: 2 * i + 1))
        return builder.add(even, odd)

    return i16x16(i8x32, i8x32), codegen


@intrinsic
def _vadd16(typingctx, a, b):
    return i16x16(i16x16, i16x16), lambda context, builder, sig, args: builder.add(args[0], args[1])


@intrinsic
def _vwiden_pairs(typingctx, p):
    """Eight int32 lanes, lane i = p[2i] + p[2i+1]."""

    def codegen(context, builder, sig, args):
        if _AVX2:
            return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I, [args[0], ir.Constant(_V16S, [1] * 16)])
        w = builder.sext(args[0], ir.VectorType(_I32, 16))
        even = builder.shuffle_vector(w, w, _shuffle_idx(8, lambda i: 2 * i))
        odd = builder.shuffle_vector(w, w, _shuffle_idx(8, lambda i: 2 * i + 1))
        return builder.add(even, odd)

    return i32x8(i16x16), codegen


@intrinsic
def _vihsum(typingctx, v):
    """The exact sum of the eight int32 lanes."""

    def codegen(context, builder, sig, args):
        lane = [builder.extract_element(args[0], ir.Constant(_I32, i)) for i in range(8)]
        total = lane[0]
        for x in lane[1:]:
            total = builder.add(total, x)
        return total

    return types.int32(i32x8), codegen


@intrinsic
def _fma1(typingctx, a, b, c):
    """``a * b + c`` on float32 scalars, one rounding where the CPU fuses (as ``_vfma`` lane by lane)."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        if _FMA:
            return _call(builder, "llvm.fma.f32", _F32, list(args))
        return builder.fadd(builder.fmul(args[0], args[1]), args[2])

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _vstore8(typingctx, arr, i, v):
    """arr[i:i+8] = v for a float32 array."""
    if not (_is_1d(arr) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _V8F), align=4)
        return context.get_dummy_value()

    return types.none(arr, i, f32x8), codegen


# Float weights stay raw bytes; ``kind`` (0: F32, 1: F16, 2: BF16) picks how to widen them. It is a
# runtime value rather than a compile-time type so that the three types share one compiled kernel
# (three specializations cost ~10 s of JIT on a cold cache); the test is loop-invariant, so LLVM moves it
# out of the loops (unswitching) and the inner loops carry no branch.
_KIND_F32, _KIND_F16, _KIND_BF16 = 0, 1, 2


def _load_widened(context, builder, sig, args, n: int | None):
    """n (or one, when None) weights from element ``i`` of the raw bytes, widened to float32."""
    arr = context.make_array(sig.args[0])(context, builder, args[0])
    kind = context.cast(builder, args[1], sig.args[1], types.intp)
    idx = _idx(context, builder, args[2], sig.args[2])
    f32 = ir.VectorType(_F32, n) if n else _F32
    i16 = ir.VectorType(_I16, n) if n else _I16
    result = cgutils.alloca_once(builder, f32)
    is_f32 = builder.icmp_signed("==", kind, ir.Constant(kind.type, _KIND_F32))
    with builder.if_else(is_f32) as (f32_case, half_case):
        with f32_case:
            p = builder.gep(arr.data, [builder.mul(idx, ir.Constant(idx.type, 4))], inbounds=True)
            builder.store(builder.load(builder.bitcast(p, ir.PointerType(f32)), align=1), result)
        with half_case:
            p = builder.gep(arr.data, [builder.mul(idx, ir.Constant(idx.type, 2))], inbounds=True)
            raw = builder.load(builder.bitcast(p, ir.PointerType(i16)), align=1)
            as_f16 = _half_to_float(builder, raw)
            i32 = ir.VectorType(_I32, n) if n else _I32
            sixteen = ir.Constant(i32, [16] * n) if n else ir.Constant(i32, 16)
            as_bf16 = builder.bitcast(builder.shl(builder.zext(raw, i32), sixteen), f32)
            is_f16 = builder.icmp_signed("==", kind, ir.Constant(kind.type, _KIND_F16))
            builder.store(builder.select(is_f16, as_f16, as_bf16), result)
    return builder.load(result)


@intrinsic
def _vload_w(typingctx, w, kind, i):
    """Eight float weights w[i:i+8] (element index into raw bytes of ``kind``), as float32."""
    if not _is_1d(w):
        return None
    return f32x8(w, kind, i), lambda context, builder, sig, args: _load_widened(context, builder, sig, args, 8)


@intrinsic
def _load_w(typingctx, w, kind, i):
    """One float weight w[i], as float32."""
    if not _is_1d(w):
        return None
    return types.float32(w, kind, i), lambda context, builder, sig, args: _load_widened(
        context, builder, sig, args, None
    )


# ---------------------------------------------------------------------------------------------------
# Activation quantization
# ---------------------------------------------------------------------------------------------------


class QuantizedActivations:
    """Activations ``x[n_tok, n_in]`` as Q8 blocks of 32: ``x ≈ d * q`` per block.

    ``q``: int8 ``[n_tok, n_in]``, values in -127..127. ``ds``: float32 ``[n_tok, n_in // 32, 2]``
    holding ``(d, d * Σq)`` per block (the second is Q4_1's offset term, llama.cpp's ``block_q8_1.s``).
    Both are views of flat buffers that the kernels take directly (no view is built per call).
    """

    __slots__ = ("q", "ds", "_q", "_ds")

    def __init__(self, n_tok: int, n_in: int, take: Callable[[str, int, Any], np.ndarray] | None = None) -> None:
        # ``take(part, elements, dtype)``: where the flat buffers come from (a plan's shared arena)
        take = take or (lambda part, n, dtype: np.empty(n, dtype))
        self._q = take("q", n_tok * n_in, np.int8)
        self._ds = take("ds", n_tok * (n_in // QK) * 2, np.float32)
        self.q = self._q.reshape(n_tok, n_in)
        self.ds = self._ds.reshape(n_tok, n_in // QK, 2)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape


@intrinsic
def _block_amax(typingctx, x, o):
    """max |x[o:o+32]| of a flat float32 array, in vector registers (max is exact in any order)."""
    if not (_is_1d(x) and x.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        v32f = ir.VectorType(_F32, QK)
        a = _call(builder, "llvm.fabs.v32f32", v32f, [_load(context, builder, sig.args[0], args[0], args[1],
                                                             sig.args[1], v32f)])
        while a.type.count > 1:  # halves: 16, 8, 4, 2, 1 lanes
            n = a.type.count // 2
            lo = builder.shuffle_vector(a, a, _shuffle_idx(n, lambda i: i))
            hi = builder.shuffle_vector(a, a, _shuffle_idx(n, lambda i, n=n: i + n))
            a = builder.select(builder.fcmp_ordered(">", hi, lo), hi, lo)
        return builder.extract_element(a, ir.Constant(_I32, 0))

    return types.float32(x, o), codegen


@intrinsic
def _quantize_block(typingctx, x, xo, inv, q, qo):
    """``q[qo:qo+32] = roundf(x[xo:xo+32] * inv)`` (int8; flat float32 ``x``, int8 ``q``) and the sum of
    the 32 integers, in vector registers. roundf (half away from zero, llama.cpp's ``roundf``) is taken as
    rint (half to even) corrected on exact halves: ``v - rint(v)`` is exact, and where it is ±0.5 the
    result is ``v + copysign(0.5, v)``, itself exact. The same integers as ``floor(|v| + 0.5)`` with v's
    sign, for every float32 v (checked against it on random and tie-heavy blocks)."""
    if not (_is_1d(x) and _is_1d(q) and x.dtype == types.float32 and inv == types.float32):
        return None

    def codegen(context, builder, sig, args):
        v32f = ir.VectorType(_F32, QK)
        xv = _load(context, builder, sig.args[0], args[0], args[1], sig.args[1], v32f)
        v = builder.fmul(xv, _splat(builder, args[2], QK))
        r = _call(builder, "llvm.rint.v32f32", v32f, [v])
        diff = _call(builder, "llvm.fabs.v32f32", v32f, [builder.fsub(v, r)])
        half = ir.Constant(v32f, [0.5] * QK)
        away = builder.fadd(v, _call(builder, "llvm.copysign.v32f32", v32f, [half, v]))
        r = builder.select(builder.fcmp_ordered("==", diff, half), away, r)
        qi = builder.fptosi(r, ir.VectorType(_I32, QK))
        builder.store(builder.trunc(qi, _V32B), _elem_ptr(context, builder, sig.args[3], args[3], args[4],
                                                          sig.args[4], _V32B), align=1)
        total = _sum_quads(builder, qi)  # 8 lanes of 4, then the 8 lanes: exact integers
        lanes = [builder.extract_element(total, ir.Constant(_I32, i)) for i in range(8)]
        acc = lanes[0]
        for lane in lanes[1:]:
            acc = builder.add(acc, lane)
        return acc

    return types.int32(x, xo, inv, q, qo), codegen


@njit(inline="always")
def _quantize_token(x, q, ds, t, n_in):
    """Token ``t`` of the flat ``x [n_tok * n_in]`` into the flat ``q`` and ``ds [n_tok * n_blocks * 2]``."""
    nb = n_in // QK
    for b in range(nb):
        o = t * n_in + b * QK
        d = _block_amax(x, o) / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        total = _quantize_block(x, o, inv, q, o)
        ds[2 * (t * nb + b)] = d
        ds[2 * (t * nb + b) + 1] = d * np.float32(total)


@njit(cache=True)
def _quantize_serial(x, q, ds, n_in):
    for t in range(x.shape[0] // n_in):
        _quantize_token(x, q, ds, t, n_in)


@njit(parallel=True, cache=True)
def _quantize_parallel(x, q, ds, n_in):
    for t in prange(x.shape[0] // n_in):
        _quantize_token(x, q, ds, t, n_in)


_PARALLEL_QUANTIZE_TOKENS = 16  # below this a parallel launch costs more than the work


def quantize_activations(x: np.ndarray, out: QuantizedActivations | None = None) -> QuantizedActivations:
    """Quantize float32 activations ``x[n_tok, n_in]`` (``n_in`` a multiple of 32) to Q8 blocks.

    The result can be shared by every matmul that reads the same ``x`` (q/k/v, gate/up). Pass ``out``
    (of the same shape) to reuse its buffers instead of allocating.
    """
    x = _as_f32_2d(x)
    n_tok, n_in = x.shape
    if n_in % QK:
        raise ModelError(f"cannot quantize activations of width {n_in}: not a multiple of {QK}")
    if out is None or out.q.shape != x.shape:
        out = QuantizedActivations(n_tok, n_in)
    kernel = _quantize_parallel if n_tok >= _PARALLEL_QUANTIZE_TOKENS else _quantize_serial
    kernel(x.reshape(-1), out._q, out._ds, n_in)
    return out


# ---------------------------------------------------------------------------------------------------
# Per-block steps, shared by decode and prefill so that both run the same float operations
# ---------------------------------------------------------------------------------------------------
# ``w`` is the whole weight tensor as one flat uint8 array, ``o`` a block's byte offset; ``a`` the 32
# activation int8 of the matching block; ``dx`` its scale.


@njit(inline="always")
def _step_q4_0(acc, w, o, a, off8, dx):
    """Q4_0: acc += (Σn·a - 8Σa) lanes * (d_w d_x); exact integers up to the scale."""
    vi = _visub(_vdot_u8s8(_vnibbles(w, o + 2), a), off8)
    return _vfma_i(acc, vi, _vsplat8(_f16(w, o) * dx))


@njit(inline="always")
def _row_q4_0(w, o, nb, aq, ao, ds, do):
    acc = _vzero8()
    for b in range(nb):
        a = _vbytes(aq, ao + QK * b)
        acc = _step_q4_0(acc, w, o + 18 * b, a, _vq4_0_offset(a), ds[do + 2 * b])
    return _vhsum(acc)


@njit(inline="always")
def _row_float(w, kind, o, n, x, xo):
    """One float row (elements from ``o``) against one token (``x[xo:xo+n]``)."""
    acc = _vzero8()
    n8 = n - n % 8
    for k in range(0, n8, 8):
        acc = _vfma(acc, _vload_w(w, kind, o + k), _vload8(x, xo + k))
    s = _vhsum(acc)
    for k in range(n8, n):
        s += _load_w(w, kind, o + k) * x[xo + k]
    return s


# ---------------------------------------------------------------------------------------------------
# Decode: one token (GEMV), GEMV_ROWS weight rows per pass sharing each activation block's loads
# ---------------------------------------------------------------------------------------------------
# Arguments: w flat uint8 raw blocks, rb bytes per row, aq int8[n_in], ds float32[2 * n_blocks],
# out float32[1, n_out] (the same flat arguments as prefill, so the caller builds no views).
# Each prange iteration owns four whole rows; the last 1..3 rows run after the parallel loop.
#
# Decode streams every weight once from DRAM (SmolLM2's 92 MiB exceed the L3), and four interleaved
# row streams defeat the hardware prefetcher: without help one thread read only ~7 GB/s on the
# 49152x576 output head (measured with the row-by-row Q8_0 kernel, now a bench variant). Each pass
# therefore prefetches the bytes it will need PREFETCH_ROWS rows ahead (the four rows of a pass are
# contiguous, consumed at 4 blocks per iteration), which tripled that.


@njit(parallel=True, cache=True)
def _gemv_q4_0(w, rb, aq, ds, out):
    n_out = out.shape[1]
    nb = aq.shape[0] // QK
    n_pass = n_out // 4
    for p in prange(n_pass):
        r0 = 4 * p
        acc0, acc1, acc2, acc3 = _vzero8(), _vzero8(), _vzero8(), _vzero8()
        o = r0 * rb
        pf = o + PREFETCH_ROWS * rb
        for b in range(nb):
            _prefetch(w, pf)
            _prefetch(w, pf + 64)
            pf += 72
            a = _vbytes(aq, QK * b)
            off8 = _vq4_0_offset(a)
            dx = ds[2 * b]
            acc0 = _step_q4_0(acc0, w, o, a, off8, dx)
            acc1 = _step_q4_0(acc1, w, o + rb, a, off8, dx)
            acc2 = _step_q4_0(acc2, w, o + 2 * rb, a, off8, dx)
            acc3 = _step_q4_0(acc3, w, o + 3 * rb, a, off8, dx)
            o += 18
        out[0, r0] = _vhsum(acc0)
        out[0, r0 + 1] = _vhsum(acc1)
        out[0, r0 + 2] = _vhsum(acc2)
        out[0, r0 + 3] = _vhsum(acc3)
    for r in range(4 * n_pass, n_out):
        out[0, r] = _row_q4_0(w, r * rb, nb, aq, 0, ds, 0)


@njit(parallel=True, cache=True)
def _gemv_float(w, kind, x, out):
    """w: flat raw float weights of ``kind``, x float32[n_in], out float32[1, n_out]."""
    n_out = out.shape[1]
    n = x.shape[0]
    n8 = n - n % 8
    n_pass = n_out // 4
    for p in prange(n_pass):
        r0 = 4 * p
        acc0, acc1, acc2, acc3 = _vzero8(), _vzero8(), _vzero8(), _vzero8()
        o = r0 * n
        pf = o + PREFETCH_ROWS * n
        for k in range(0, n8, 8):
            _prefetch(w, pf)  # 4 rows x 8 weights: 64 bytes (f16, bf16) or 128 (f32) per iteration
            _prefetch(w, pf + 16)
            pf += 32
            xv = _vload8(x, k)
            acc0 = _vfma(acc0, _vload_w(w, kind, o + k), xv)
            acc1 = _vfma(acc1, _vload_w(w, kind, o + n + k), xv)
            acc2 = _vfma(acc2, _vload_w(w, kind, o + 2 * n + k), xv)
            acc3 = _vfma(acc3, _vload_w(w, kind, o + 3 * n + k), xv)
        s0, s1, s2, s3 = _vhsum(acc0), _vhsum(acc1), _vhsum(acc2), _vhsum(acc3)
        for k in range(n8, n):
            s0 += _load_w(w, kind, o + k) * x[k]
            s1 += _load_w(w, kind, o + n + k) * x[k]
            s2 += _load_w(w, kind, o + 2 * n + k) * x[k]
            s3 += _load_w(w, kind, o + 3 * n + k) * x[k]
        out[0, r0], out[0, r0 + 1], out[0, r0 + 2], out[0, r0 + 3] = s0, s1, s2, s3
    for r in range(4 * n_pass, n_out):
        out[0, r] = _row_float(w, kind, r * n, n, x, 0)


# ---------------------------------------------------------------------------------------------------
# Prefill: many tokens (GEMM). Work item = GEMM_ROWS weight rows (one worker owns them); inside it,
# tiles of GEMM_TOKENS tokens: each weight block is unpacked once and used against all 8 tokens.
# Tokens past the last whole tile run the decode row functions (same operations, same results).
# ---------------------------------------------------------------------------------------------------
# Arguments: w flat uint8, rb, aq int8[n_tok * n_in] flat, ds float32[n_tok * n_blocks * 2] flat,
# out float32[n_tok, n_out].


@njit(inline="always")
def _tile_scales(ds, n_full, nb):
    """Every whole tile's activation block scales, laid out for the inner loop, computed once per call.

    ``d_b[((tile * nb + block) * 8 + token) * 8 + lane]``: the scale d_x repeated in 8 lanes, so that the
    per-pair product d_w * d_x is one vector multiply with a plain 256-bit load. (Given a scalar, LLVM
    multiplies first and broadcasts after: one more instruction per pair, and the pairs are the whole
    cost: prefill ran 1.5x slower that way.) ``s_t[(tile * nb + block) * 8 + token]``: d_x Σq, whose
    8 tokens one load serves (Q4_1's offset term).
    """
    d_b = np.empty(n_full * nb * 8, np.float32)
    s_t = np.empty(n_full * nb, np.float32)
    for t in range(n_full):
        base = (t // GEMM_TOKENS) * nb * GEMM_TOKENS + t % GEMM_TOKENS
        for b in range(nb):
            i = base + b * GEMM_TOKENS
            d = ds[(t * nb + b) * 2]
            for lane in range(8):
                d_b[i * 8 + lane] = d
            s_t[i] = ds[(t * nb + b) * 2 + 1]
    return d_b, s_t


@njit(inline="always")
def _store_tile(out, t0, r, a0, a1, a2, a3, a4, a5, a6, a7):
    out[t0, r] = _vhsum(a0)
    out[t0 + 1, r] = _vhsum(a1)
    out[t0 + 2, r] = _vhsum(a2)
    out[t0 + 3, r] = _vhsum(a3)
    out[t0 + 4, r] = _vhsum(a4)
    out[t0 + 5, r] = _vhsum(a5)
    out[t0 + 6, r] = _vhsum(a6)
    out[t0 + 7, r] = _vhsum(a7)


@njit(parallel=True, cache=True)
def _gemm_q4_0(w, rb, aq, ds, out):
    n_tok, n_out = out.shape
    n_in = aq.shape[0] // n_tok
    nb = n_in // QK
    n_full = n_tok - n_tok % GEMM_TOKENS
    d_b, _ = _tile_scales(ds, n_full, nb)
    # the tiles' -8 Σa lanes (Q4_0's offset), computed once per call rather than once per weight row
    off = np.empty(n_full * nb * 8, np.int32)
    for t in range(n_full):
        for b in range(nb):
            i = ((t // GEMM_TOKENS) * nb + b) * GEMM_TOKENS + t % GEMM_TOKENS
            _vstore_i(off, i * 8, _vq4_0_offset(_vbytes(aq, t * n_in + b * QK)))
    for g in prange((n_out + GEMM_ROWS - 1) // GEMM_ROWS):
        r0 = g * GEMM_ROWS
        r1 = min(n_out, r0 + GEMM_ROWS)
        for t0 in range(0, n_full, GEMM_TOKENS):
            tb = t0 * nb
            for r in range(r0, r1):
                a0, a1, a2, a3 = _vzero8(), _vzero8(), _vzero8(), _vzero8()
                a4, a5, a6, a7 = _vzero8(), _vzero8(), _vzero8(), _vzero8()
                o = r * rb
                ao = t0 * n_in
                for b in range(nb):
                    q = _vnibbles(w, o + 2)
                    dw = _vsplat8(_f16(w, o))
                    c = tb + b * GEMM_TOKENS
                    k = c * 8  # c indexes [tile, block, token]; 8 lanes each
                    v0 = _visub(_vdot_u8s8(q, _vbytes(aq, ao)), _vload_i(off, k))
                    v1 = _visub(_vdot_u8s8(q, _vbytes(aq, ao + n_in)), _vload_i(off, k + 8))
                    v2 = _visub(_vdot_u8s8(q, _vbytes(aq, ao + 2 * n_in)), _vload_i(off, k + 16))
                    v3 = _visub(_vdot_u8s8(q, _vbytes(aq, ao + 3 * n_in)), _vload_i(off, k + 24))
                    v4 = _visub(_vdot_u8s8(q, _vbytes(aq, ao + 4 * n_in)), _vload_i(off, k + 32))
                    v5 = _visub(_vdot_u8s8(q, _vbytes(aq, ao + 5 * n_in)), _vload_i(off, k + 40))
                    v6 = _visub(_vdot_u8s8(q, _vbytes(aq, ao + 6 * n_in)), _vload_i(off, k + 48))
                    v7 = _visub(_vdot_u8s8(q, _vbytes(aq, ao + 7 * n_in)), _vload_i(off, k + 56))
                    a0 = _vfma_i(a0, v0, _vmul8(dw, _vload8(d_b, 8 * c)))
                    a1 = _vfma_i(a1, v1, _vmul8(dw, _vload8(d_b, 8 * c + 8)))
                    a2 = _vfma_i(a2, v2, _vmul8(dw, _vload8(d_b, 8 * c + 16)))
                    a3 = _vfma_i(a3, v3, _vmul8(dw, _vload8(d_b, 8 * c + 24)))
                    a4 = _vfma_i(a4, v4, _vmul8(dw, _vload8(d_b, 8 * c + 32)))
                    a5 = _vfma_i(a5, v5, _vmul8(dw, _vload8(d_b, 8 * c + 40)))
                    a6 = _vfma_i(a6, v6, _vmul8(dw, _vload8(d_b, 8 * c + 48)))
                    a7 = _vfma_i(a7, v7, _vmul8(dw, _vload8(d_b, 8 * c + 56)))
                    o += 18
                    ao += QK
                _store_tile(out, t0, r, a0, a1, a2, a3, a4, a5, a6, a7)
        for t in range(n_full, n_tok):
            for r in range(r0, r1):
                out[t, r] = _row_q4_0(w, r * rb, nb, aq, t * n_in, ds, t * nb * 2)


@njit(parallel=True, cache=True)
def _gemm_float(w, kind, x, out):
    """w: flat raw float weights of ``kind``, x float32[n_tok * n_in] flat, out float32[n_tok, n_out]."""
    n_tok, n_out = out.shape
    n = x.shape[0] // n_tok
    n8 = n - n % 8
    n_full = n_tok - n_tok % GEMM_TOKENS
    for g in prange((n_out + GEMM_ROWS - 1) // GEMM_ROWS):
        r0 = g * GEMM_ROWS
        r1 = min(n_out, r0 + GEMM_ROWS)
        for t0 in range(0, n_full, GEMM_TOKENS):
            for r in range(r0, r1):
                a0, a1, a2, a3 = _vzero8(), _vzero8(), _vzero8(), _vzero8()
                a4, a5, a6, a7 = _vzero8(), _vzero8(), _vzero8(), _vzero8()
                o = r * n
                xo = t0 * n
                for k in range(0, n8, 8):
                    wv = _vload_w(w, kind, o + k)
                    a0 = _vfma(a0, wv, _vload8(x, xo + k))
                    a1 = _vfma(a1, wv, _vload8(x, xo + n + k))
                    a2 = _vfma(a2, wv, _vload8(x, xo + 2 * n + k))
                    a3 = _vfma(a3, wv, _vload8(x, xo + 3 * n + k))
                    a4 = _vfma(a4, wv, _vload8(x, xo + 4 * n + k))
                    a5 = _vfma(a5, wv, _vload8(x, xo + 5 * n + k))
                    a6 = _vfma(a6, wv, _vload8(x, xo + 6 * n + k))
                    a7 = _vfma(a7, wv, _vload8(x, xo + 7 * n + k))
                if n8 == n:
                    _store_tile(out, t0, r, a0, a1, a2, a3, a4, a5, a6, a7)
                else:
                    # the scalar tail must follow the horizontal sum, as in _row_float
                    s = np.empty(GEMM_TOKENS, np.float32)
                    s[0], s[1], s[2], s[3] = _vhsum(a0), _vhsum(a1), _vhsum(a2), _vhsum(a3)
                    s[4], s[5], s[6], s[7] = _vhsum(a4), _vhsum(a5), _vhsum(a6), _vhsum(a7)
                    for c in range(GEMM_TOKENS):
                        v = s[c]
                        for k in range(n8, n):
                            v += _load_w(w, kind, o + k) * x[xo + c * n + k]
                        out[t0 + c, r] = v
        for t in range(n_full, n_tok):
            for r in range(r0, r1):
                out[t, r] = _row_float(w, kind, r * n, n, x, t * n)


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------
# Q4_1 in groups of eight rows: the weights are repacked once (see _repack_q4_1) so that one 256-bit
# register holds four consecutive values of each of eight rows; four activation bytes broadcast to all
# lanes then give eight rows' products in one pmaddubsw. The int16 pair sums of a block's eight such
# steps are added exactly (at most 16 products of 15 x 127 per lane: 30480 < 2^15), widened once, and
# converted once: per token and block that is ~20 vector operations for eight rows, against ~40 in the
# row-by-row tile. Every row and token then does, in block order, ``acc = fma(float(Σqa), d_w d_x,
# acc); acc = fma(m, d_x Σa, acc)`` (the block's integer sum is exact): the same float operations for
# any number of tokens (decode or prefill), any thread count, and for the rows past the last whole
# group, which take _q4_1_row_exact on the raw blocks.
#
# Up to ROWS8_REGISTER_TOKENS tokens (decode, a batch of decodes) go four at a time through a group's
# blocks, their eight-row accumulators held in registers from the first block to the last (then one at
# a time for the last n_tok % 4): the four tokens' independent chains sit side by side in one loop body,
# where the CPU overlaps them. More tokens (prefill) take one pass per block over up to ROWS8_TOKENS
# tokens with the accumulators in memory, which unpacks each block's nibbles once for all of them.
# Measured on SmolLM2's shapes, cold weights, 2 threads (old/new paired, median): 8 tokens 10-20%
# faster in registers, 4 tokens 13-43%; 16 and 32 tokens even or 6% slower, 64 tokens 8% slower on
# 576x1536. (Q8_0 keeps the memory path: its sign trick needs 16 weight registers, and four register
# accumulators measured even at 8 tokens, 15% slower at 64.)
# ---------------------------------------------------------------------------------------------------
ROWS8_QUAD = 4  # tokens whose accumulators stay in registers through one pass over a group's blocks
ROWS8_REGISTER_TOKENS = 8  # the most tokens that take the register path
ROWS8_TOKENS = 64  # tokens per pass over a group's weights in memory: their activations stay in L2
# decode streams the weights from DRAM: fetch this many bytes of the repacked copy ahead
ROWS8_PREFETCH = 2048


@intrinsic
def _vsplat_at(typingctx, arr, i):
    """arr[i] of a float32 array in all eight lanes (no negative-index wraparound: callers own ``i``)."""
    if not (_is_1d(arr) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, _load(context, builder, sig.args[0], args[0], args[1], sig.args[1], _F32), 8)

    return f32x8(arr, i), codegen


@njit(inline="always")
def _rows8_weights(packed, o):
    """A group's block at byte ``o`` of the repacked copy, as one tuple: its eight nibble registers (four
    consecutive values of each row), then the rows' d and m; the bytes a few blocks ahead are prefetched
    (decode streams the weights from DRAM). (One flat tuple, indexed: numba's parallel-loop analysis
    rejects unpacking a nested one.)"""
    _prefetch(packed, o + ROWS8_PREFETCH)
    _prefetch(packed, o + ROWS8_PREFETCH + 64)
    _prefetch(packed, o + ROWS8_PREFETCH + 128)
    return (
        _vlow_nibbles(packed, o), _vhigh_nibbles(packed, o), _vlow_nibbles(packed, o + 32),
        _vhigh_nibbles(packed, o + 32), _vlow_nibbles(packed, o + 64), _vhigh_nibbles(packed, o + 64),
        _vlow_nibbles(packed, o + 96), _vhigh_nibbles(packed, o + 96),
        _vhalves8(packed, o + 128), _vhalves8(packed, o + 144),
    )


@njit(inline="always")
def _rows8_block(w, aq, ao):
    """Eight int32 lanes: lane r = Σ q a over one block of row r (registers 0..7 of _rows8_weights)
    against the activation block at byte ``ao``; exact."""
    p = _vpairs_u8s8(w[0], _vbcast4(aq, ao))
    p = _vadd16(p, _vpairs_u8s8(w[1], _vbcast4(aq, ao + 4)))
    p = _vadd16(p, _vpairs_u8s8(w[2], _vbcast4(aq, ao + 8)))
    p = _vadd16(p, _vpairs_u8s8(w[3], _vbcast4(aq, ao + 12)))
    p = _vadd16(p, _vpairs_u8s8(w[4], _vbcast4(aq, ao + 16)))
    p = _vadd16(p, _vpairs_u8s8(w[5], _vbcast4(aq, ao + 20)))
    p = _vadd16(p, _vpairs_u8s8(w[6], _vbcast4(aq, ao + 24)))
    p = _vadd16(p, _vpairs_u8s8(w[7], _vbcast4(aq, ao + 28)))
    return _vwiden_pairs(p)


@njit(inline="always")
def _q4_1_row_exact(raw, o, nb, aq, ao, ds, do):
    """One Q4_1 row (raw blocks from byte ``o``) against one token, with the row groups' arithmetic."""
    acc = np.float32(0.0)
    for b in range(nb):
        isum = _vihsum(_vdot_u8s8(_vnibbles(raw, o + 20 * b + 4), _vbytes(aq, ao + QK * b)))
        acc = _fma1(np.float32(isum), _f16(raw, o + 20 * b) * ds[do + 2 * b], acc)
        acc = _fma1(_f16(raw, o + 20 * b + 2), ds[do + 2 * b + 1], acc)
    return acc


@njit(inline="always")
def _q4_1_rows8_step(acc, w, aq, ao, ds, do):
    """``acc`` (eight rows of one token) after one block: ``w`` from _rows8_weights, the token's
    activation block at byte ``ao`` of ``aq`` and its (d, d Σa) at ``ds[do]``."""
    acc = _vfma_i(acc, _rows8_block(w, aq, ao), _vmul8(w[8], _vsplat_at(ds, do)))
    return _vfma(acc, w[9], _vsplat_at(ds, do + 1))


@njit(parallel=True, cache=True)
def _q4_1_rows8(packed, raw, rb, aq, ds, out):
    """``out[n_tok, n_out]`` for a Q4_1 weight: ``packed`` from _repack_q4_1 (whole groups of eight rows),
    ``raw`` the original blocks (rows past the last whole group)."""
    n_tok, n_out = out.shape
    nb = rb // 20
    n_in = nb * QK
    n_groups = n_out // 8
    in_registers = n_tok <= ROWS8_REGISTER_TOKENS
    span = 0 if in_registers else 8 * min(n_tok, ROWS8_TOKENS)
    acc = np.empty(n_groups * span, np.float32)  # each group's accumulators (one allocation per call)
    flat = out.reshape(-1)
    for g in prange(n_groups):
        o = g * nb * 160
        if in_registers:
            t = 0
            while t + ROWS8_QUAD <= n_tok:
                a0 = a1 = a2 = a3 = _vzero8()
                for b in range(nb):
                    w = _rows8_weights(packed, o + b * 160)
                    ao = t * n_in + b * QK
                    do = (t * nb + b) * 2
                    a0 = _q4_1_rows8_step(a0, w, aq, ao, ds, do)
                    a1 = _q4_1_rows8_step(a1, w, aq, ao + n_in, ds, do + 2 * nb)
                    a2 = _q4_1_rows8_step(a2, w, aq, ao + 2 * n_in, ds, do + 4 * nb)
                    a3 = _q4_1_rows8_step(a3, w, aq, ao + 3 * n_in, ds, do + 6 * nb)
                _vstore8(flat, t * n_out + 8 * g, a0)
                _vstore8(flat, (t + 1) * n_out + 8 * g, a1)
                _vstore8(flat, (t + 2) * n_out + 8 * g, a2)
                _vstore8(flat, (t + 3) * n_out + 8 * g, a3)
                t += ROWS8_QUAD
            while t < n_tok:  # decode, and the last n_tok % 4 tokens
                a0 = _vzero8()
                for b in range(nb):
                    w = _rows8_weights(packed, o + b * 160)
                    a0 = _q4_1_rows8_step(a0, w, aq, t * n_in + b * QK, ds, (t * nb + b) * 2)
                _vstore8(flat, t * n_out + 8 * g, a0)
                t += 1
            continue
        h = g * span
        for t0 in range(0, n_tok, ROWS8_TOKENS):
            t1 = min(n_tok, t0 + ROWS8_TOKENS)
            for i in range(h, h + 8 * (t1 - t0)):
                acc[i] = np.float32(0.0)
            for b in range(nb):
                w = _rows8_weights(packed, o + b * 160)
                for t in range(t0, t1):
                    k = h + 8 * (t - t0)
                    _vstore8(acc, k, _q4_1_rows8_step(_vload8(acc, k), w, aq, t * n_in + b * QK, ds, (t * nb + b) * 2))
            for t in range(t0, t1):
                _vstore8(flat, t * n_out + 8 * g, _vload8(acc, h + 8 * (t - t0)))
    for r in range(8 * n_groups, n_out):  # the last 1..7 rows
        for t in range(n_tok):
            out[t, r] = _q4_1_row_exact(raw, r * rb, nb, aq, t * n_in, ds, t * nb * 2)


def _repack_q4_1(data: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q4_1 rows [n_out, n_in] (raw blocks of 20 bytes: f16 d, f16 m, 16 bytes of nibbles with value j in
    byte j's low and value j + 16 in its high nibble) -> the layout of _q4_1_rows8 for the whole groups
    of 8 rows: per group and block, 160 bytes (the same 20 per row and block as the file, one stream):

    * 128 bytes ``[chunk c (4), row (8), i (4)]`` holding value 8c + i of the row in the low nibble and
      value 8c + 4 + i in the high one (chunk c's low nibbles: four consecutive values of each row, as
      are its high nibbles);
    * the eight rows' d, then their m, as float16 (16 + 16 bytes)."""
    nb = n_in // QK
    g = n_out // 8
    blocks = data[: 8 * g].reshape(g, 8, nb, 20)
    qs = blocks[..., 4:20]
    values = np.concatenate((qs & 15, qs >> 4), axis=3)  # [g, row, block, value k]
    v = values.transpose(0, 2, 1, 3).reshape(g, nb, 8, 4, 8).transpose(0, 1, 3, 2, 4)  # [g, block, c, row, j]
    nibbles = (v[..., :4] | (v[..., 4:] << 4)).astype(np.uint8).reshape(g, nb, 128)
    scales = blocks[..., 0:4].reshape(g, 8, nb, 2, 2).transpose(0, 2, 3, 1, 4).reshape(g, nb, 32)  # d x8, m x8
    return np.ascontiguousarray(np.concatenate((nibbles, scales), axis=2)).reshape(-1)


# ---------------------------------------------------------------------------------------------------
# Q8_0 in groups of eight rows, as Q4_1: a repacked copy (see _repack_q8_0) holds in one 256-bit
# register four consecutive values of each of eight rows; four activation bytes broadcast to all lanes
# then give eight rows' products per register with llama.cpp's sign trick (|w| * (a * sign(w)) in one
# pmaddubsw: pairs at most 2 * 128 * 127 < 2^15), widened to int32 at once (two such pairs would not
# fit int16). A block's integer sum is exact; every row and token then does ``acc = fma(float(Σqa),
# d_w d_x, acc)`` block after block: the same float operations for any number of tokens, any thread
# count, and for the rows past the last whole group (_q8_0_row_exact on the raw blocks). Per token and
# block that is ~35 vector operations for eight rows, against ~56 in the row-by-row tile.
# ---------------------------------------------------------------------------------------------------


@intrinsic
def _viadd(typingctx, a, b):
    """a + b, int32 lanes."""
    return i32x8(i32x8, i32x8), lambda context, builder, sig, args: builder.add(args[0], args[1])


@njit(inline="always")
def _q8_rows8_weights(packed, o):
    """A group's block at byte ``o`` of the repacked Q8_0 copy: its eight value registers (four
    consecutive values of each row), then the rows' d; the bytes a few blocks ahead are prefetched."""
    _prefetch(packed, o + ROWS8_PREFETCH)
    _prefetch(packed, o + ROWS8_PREFETCH + 64)
    _prefetch(packed, o + ROWS8_PREFETCH + 128)
    _prefetch(packed, o + ROWS8_PREFETCH + 192)
    _prefetch(packed, o + ROWS8_PREFETCH + 256)
    return (
        _vbytes(packed, o), _vbytes(packed, o + 32), _vbytes(packed, o + 64), _vbytes(packed, o + 96),
        _vbytes(packed, o + 128), _vbytes(packed, o + 160), _vbytes(packed, o + 192), _vbytes(packed, o + 224),
        _vhalves8(packed, o + 256),
    )


@njit(inline="always")
def _q8_rows8_block(w, aq, ao):
    """Eight int32 lanes: lane r = Σ q a over one block of row r against the activation block at byte
    ``ao``; exact."""
    s = _vdot_s8s8(w[0], _vbcast4(aq, ao))
    s = _viadd(s, _vdot_s8s8(w[1], _vbcast4(aq, ao + 4)))
    s = _viadd(s, _vdot_s8s8(w[2], _vbcast4(aq, ao + 8)))
    s = _viadd(s, _vdot_s8s8(w[3], _vbcast4(aq, ao + 12)))
    s = _viadd(s, _vdot_s8s8(w[4], _vbcast4(aq, ao + 16)))
    s = _viadd(s, _vdot_s8s8(w[5], _vbcast4(aq, ao + 20)))
    s = _viadd(s, _vdot_s8s8(w[6], _vbcast4(aq, ao + 24)))
    return _viadd(s, _vdot_s8s8(w[7], _vbcast4(aq, ao + 28)))


@njit(inline="always")
def _q8_0_row_exact(raw, o, nb, aq, ao, ds, do):
    """One Q8_0 row (raw blocks from byte ``o``) against one token, with the row groups' arithmetic."""
    acc = np.float32(0.0)
    for b in range(nb):
        isum = _vihsum(_vdot_s8s8(_vbytes(raw, o + 34 * b + 2), _vbytes(aq, ao + QK * b)))
        acc = _fma1(np.float32(isum), _f16(raw, o + 34 * b) * ds[do + 2 * b], acc)
    return acc


@njit(parallel=True, cache=True)
def _q8_0_rows8(packed, raw, rb, aq, ds, out):
    """``out[n_tok, n_out]`` for a Q8_0 weight: ``packed`` from _repack_q8_0 (whole groups of eight rows),
    ``raw`` the original blocks (rows past the last whole group)."""
    n_tok, n_out = out.shape
    nb = rb // 34
    n_in = nb * QK
    n_groups = n_out // 8
    span = 0 if n_tok == 1 else 8 * min(n_tok, ROWS8_TOKENS)
    acc = np.empty(n_groups * span, np.float32)  # each group's accumulators (one allocation per call)
    flat = out.reshape(-1)
    for g in prange(n_groups):
        o = g * nb * 272
        if n_tok == 1:  # decode: the accumulator stays in a register
            a = _vzero8()
            for b in range(nb):
                w = _q8_rows8_weights(packed, o + b * 272)
                a = _vfma_i(a, _q8_rows8_block(w, aq, b * QK), _vmul8(w[8], _vsplat_at(ds, 2 * b)))
            _vstore8(flat, 8 * g, a)
            continue
        h = g * span
        for t0 in range(0, n_tok, ROWS8_TOKENS):
            t1 = min(n_tok, t0 + ROWS8_TOKENS)
            for i in range(h, h + 8 * (t1 - t0)):
                acc[i] = np.float32(0.0)
            for b in range(nb):
                w = _q8_rows8_weights(packed, o + b * 272)
                for t in range(t0, t1):
                    k = h + 8 * (t - t0)
                    isum = _q8_rows8_block(w, aq, t * n_in + b * QK)
                    _vstore8(acc, k, _vfma_i(_vload8(acc, k), isum, _vmul8(w[8], _vsplat_at(ds, (t * nb + b) * 2))))
            for t in range(t0, t1):
                _vstore8(flat, t * n_out + 8 * g, _vload8(acc, h + 8 * (t - t0)))
    for r in range(8 * n_groups, n_out):  # the last 1..7 rows
        for t in range(n_tok):
            out[t, r] = _q8_0_row_exact(raw, r * rb, nb, aq, t * n_in, ds, t * nb * 2)


def _repack_q8_0(data: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q8_0 rows [n_out, n_in] (raw blocks of 34 bytes: f16 d, 32 int8 values) -> the layout of
    _q8_0_rows8 for the whole groups of 8 rows: per group and block, 272 bytes (the same 34 per row and
    block as the file, one stream): 256 bytes ``[chunk c (8), row (8), i (4)]`` holding value 4c + i of
    the row, then the eight rows' d as float16 (16 bytes)."""
    nb = n_in // QK
    g = n_out // 8
    blocks = data[: 8 * g].reshape(g, 8, nb, 34)
    values = blocks[..., 2:].reshape(g, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, 256)  # [g, b, c, row, i]
    scales = blocks[..., 0:2].transpose(0, 2, 1, 3).reshape(g, nb, 16)
    return np.ascontiguousarray(np.concatenate((values, scales), axis=2)).reshape(-1)

# Q4_1 and Q8_0 run their row-group kernels (_q4_1_rows8, _q8_0_rows8) for any number of tokens
_GEMV = {GGMLType.Q4_1: None, GGMLType.Q4_0: _gemv_q4_0, GGMLType.Q8_0: None}
_GEMM = {GGMLType.Q4_1: None, GGMLType.Q4_0: _gemm_q4_0, GGMLType.Q8_0: None}
# the row-group kernels and repacking of the types that have them
_ROWS8 = {GGMLType.Q4_1: (_q4_1_rows8, _repack_q4_1), GGMLType.Q8_0: (_q8_0_rows8, _repack_q8_0)}
_FLOAT_KIND = {GGMLType.F32: _KIND_F32, GGMLType.F16: _KIND_F16, GGMLType.BF16: _KIND_BF16}


def supports(ggml_type: GGMLType) -> bool:
    """Whether :func:`matmul` has a kernel for weights of this type."""
    return ggml_type in _BLOCK_BYTES or ggml_type in _FLOAT_KIND


def _as_f32_2d(x: np.ndarray) -> np.ndarray:
    if x.ndim != 2:
        raise ValueError(f"activations must be 2D [n_tok, n_in], got shape {x.shape}")
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    return x


class _Prepared:
    """What the kernels need from one weight tensor, computed once per tensor (a decode step calls
    matmul ~200 times on the same tensors: building views and checking sizes each time would cost
    about as much as the small matmuls themselves)."""

    __slots__ = ("tensor", "flat", "arg", "n_out", "n_in", "gemv", "gemm", "rows8", "rows8_kernel")

    def __init__(self, w: GGUFTensor) -> None:
        t = w.ggml_type
        if not supports(t):
            supported = ", ".join(s.name for s in (*_FLOAT_TYPES, *_INT_TYPES))
            raise ModelError(f"{w.name}: no fast matmul for ggml type {t.name} (supported: {supported})")
        if len(w.shape) != 2:
            raise ModelError(f"{w.name}: a matmul weight must be 2D, got shape {w.shape}")
        n_out, n_in = w.shape
        if t in _BLOCK_BYTES:
            if n_in % QK:
                raise ModelError(f"{w.name}: rows of {n_in} values are not whole {t.name} blocks of {QK}")
            rb = n_in // QK * _BLOCK_BYTES[t]
        else:
            rb = n_in * (4 if t == GGMLType.F32 else 2)
        data = w.data
        if data.dtype != np.uint8 or data.size != n_out * rb:
            raise ModelError(
                f"{w.name}: {data.size} bytes of data for a {t.name} tensor of shape {w.shape}, expected {n_out * rb}"
            )
        # A flat read-only view: weights are mmapped read-only, so one compiled flavor serves everyone.
        flat = np.ascontiguousarray(data).reshape(-1).view()
        flat.flags.writeable = False
        self.tensor = w
        self.flat = flat
        # the kernels' second argument: bytes per row for blocks, the widening kind for float weights
        self.arg = _FLOAT_KIND.get(t, rb)
        self.n_out, self.n_in = n_out, n_in
        self.gemv = _GEMV.get(t, _gemv_float)
        self.gemm = _GEMM.get(t, _gemm_float)
        # Q4_1 and Q8_0 run on a repacked copy (both decode and prefill); the raw pages are then given back
        self.rows8 = self.rows8_kernel = None
        if t in _ROWS8:
            self.rows8_kernel, repack = _ROWS8[t]
            self.rows8 = repack(data.reshape(n_out, rb), n_out, n_in)
            if n_out % 8 == 0:
                release_file_pages(data)


def release_file_pages(data: np.ndarray) -> None:
    """Give back the resident pages of ``data`` when it is a view of a read-only file mapping (a GGUF
    tensor that was copied into another layout): they are dropped from this process, not from the file,
    and a later read faults them in again. Memory of any other kind is left alone."""
    base = data
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, mmap.mmap) or not hasattr(base, "madvise"):
        return
    start = data.ctypes.data - np.frombuffer(base, np.uint8).ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # only whole pages inside the tensor
    last = (start + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        base.madvise(mmap.MADV_DONTNEED, first, last - first)


def prepare(w: GGUFTensor) -> _Prepared:
    """What :func:`matmul` needs from a weight, computed once: pass the result instead of the tensor to
    skip that work on every call (the backend prepares each weight when it binds a plan)."""
    return _Prepared(w)


def check_operands(x: np.ndarray, w: GGUFTensor, out: np.ndarray, n_in: int, n_out: int) -> int:
    """The number of tokens, after checking ``x [n_tok, n_in]`` and ``out`` float32 ``[n_tok, n_out]``
    against weight ``w`` (shared by every fast matmul module)."""
    if x.ndim != 2 or x.shape[1] != n_in:
        raise ModelError(f"{w.name}: activations of shape {x.shape} do not match a weight of shape {w.shape}")
    n_tok = x.shape[0]
    if out.shape != (n_tok, n_out) or out.dtype != np.float32:
        raise ModelError(f"{w.name}: output must be float32 {(n_tok, n_out)}, got {out.dtype} {out.shape}")
    return n_tok


def matmul(x: np.ndarray, w: GGUFTensor | _Prepared, out: np.ndarray, xq: QuantizedActivations | None = None) -> None:
    """``out[n_tok, n_out] = x[n_tok, n_in] @ W^T`` with ``W`` (shape ``(n_out, n_in)``) read as raw blocks.

    ``xq`` is ``quantize_activations(x)`` computed once by the caller when several quantized matmuls
    share ``x``; without it the activations are quantized here. Float weight types ignore it.
    ``out`` must be float32 ``[n_tok, n_out]``; it is written, never read.
    """
    p = w if isinstance(w, _Prepared) else _Prepared(w)
    w = p.tensor
    n_tok = check_operands(x, w, out, p.n_in, p.n_out)
    if n_tok == 0 or p.n_out == 0:
        return
    dst = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
    if p.gemv is _gemv_float:
        (p.gemv if n_tok == 1 else p.gemm)(p.flat, p.arg, _as_f32_2d(x).reshape(-1), dst)
    else:
        if xq is None:
            xq = quantize_activations(x)
        elif xq.q.shape != x.shape:
            raise ModelError(f"{w.name}: quantized activations of shape {xq.q.shape} do not match x {x.shape}")
        if p.rows8 is not None:
            p.rows8_kernel(p.rows8, p.flat, p.arg, xq._q, xq._ds, dst)
        else:
            (p.gemv if n_tok == 1 else p.gemm)(p.flat, p.arg, xq._q, xq._ds, dst)
    if dst is not out:
        out[...] = dst


def warmup() -> None:
    """Compile (or load from numba's on-disk cache) every kernel, so no call pays for compilation later."""
    rng = np.random.default_rng(0)
    n_in, n_out = 64, 5
    for n_tok in (1, GEMM_TOKENS + 1):
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        out = np.empty((n_tok, n_out), np.float32)
        xq = quantize_activations(x)
        for t in _INT_TYPES:
            raw = np.zeros((n_out, n_in // QK * _BLOCK_BYTES[t]), np.uint8)
            matmul(x, GGUFTensor("warmup", t, (n_out, n_in), raw), out, xq)
        for t in _FLOAT_KIND:
            raw = np.zeros((n_out, n_in), np.float32 if t == GGMLType.F32 else np.uint16).view(np.uint8)
            matmul(x, GGUFTensor("warmup", t, (n_out, n_in), raw), out)
    big = rng.standard_normal((_PARALLEL_QUANTIZE_TOKENS, n_in)).astype(np.float32)
    quantize_activations(big)
