"""Fast numba versions of the vector ops: RMSNorm (+ gain), add, mul, scale, SiLU/SwiGLU, GELU/GEGLU, RoPE, KV
store, attention.

Each function here computes what its namesake in ``reference.py`` computes, on the same arrays (2-D float32
``[tokens, width]`` activations, 1-D int32 positions, float32 K/V regions ``[n_ctx, n_kv_head * head_dim]``),
and may write in place where the reference allows it (``out is x``; otherwise ``out`` must not overlap
the inputs). Shapes and position bounds are checked inside the kernels, which return an error code that
the Python wrapper turns into the engine's error (a numpy ``positions.max()`` in Python would cost more
than a decode-sized kernel).

Numerics (what ``tests/test_vec_kernels.py`` holds)
    * No ``fastmath``: every float operation is plain IEEE, so a kernel's result is decided by its source,
      not by what LLVM chooses to vectorize nor by the CPU having FMA. Reductions are written as a fixed
      number of lanes combined in a fixed tree, with explicit SIMD values (small LLVM IR intrinsics
      below) where LLVM would not vectorize them by itself: 8 float32 lanes for dot products, 8 float64
      lanes for the RMSNorm sum of squares, 4 float64 lanes for the softmax sum.
    * RMSNorm: float64 sum of squares (products of float32 are exact in float64), then the reference's
      float32 steps ``1/sqrt(f32(mean) + eps)``, ``x * scale``, ``* gain``. Only the float64 summation
      order differs from numpy's; measured: identical results, at most 1 ulp in principle.
    * RoPE: cos/sin tables computed by numpy with the reference's own expressions (float64 angles cast to
      float32), the reference's float32 ``x0*c - x1*s`` / ``x0*s + x1*c``: bit-identical.
    * add / mul: bit-identical (one float32 operation per element).
    * exp (SiLU, softmax): float32 Cody-Waite reduction + degree-6 polynomial, within 1 ulp of the
      correctly rounded value (numpy's float32 exp is within 2 ulp of it); SiLU/SwiGLU agree with the
      reference within a few ulp. GELU (tanh form) uses the same exp, ``x / (1 + exp(-2u))`` for the
      reference's ``0.5 x (1 + tanh(u))``; they agree within a few ulp (absolutely ~1e-7 |x| where
      1 + tanh(u) cancels, for x below about -3).
    * scale: one float32 multiply per element, bit-identical.
    * attention: float32 dot products, scores ``* f32(scale)``, row max subtracted, float32 exp, float64
      sum, weights ``e * f32(1/sum)``, float32 weighted sum of V rows in key order. Rows beyond a token's
      window ``pos[t] + 1`` are never read (nor, in a sliding-window layer of width W, rows before
      ``pos[t] - W + 1``): whatever sits there (NaN, garbage) cannot leak, and their weights are exactly
      0 as in the reference.

Determinism
    Every output element is computed by one fixed sequence of float operations, never by a reduction
    across threads. The row-wise ops are serial. Attention splits the work into (kv head, query-head
    subset, token block) units that follow the thread count, and a decode step over a long window into
    (kv head, key chunk) units; but a (token, head) result is the same operations whatever unit it falls
    in: its scores are computed one by one, its softmax by one thread over the whole row, and its
    weighted sum of V per key chunk of ``ATTN_KEY_CHUNK`` rows, the chunk sums then added in order by one
    thread. So the output is bit-identical at any thread count, and a decode step gives bit-identical
    output to the same token inside a prefill.

Threads
    Only attention is ``parallel=True``: it is the one op where the work (up to tens of ms in a long
    prefill) dwarfs the ~1.3 µs a parallel call costs here. The row-wise ops at decode size take well
    under a microsecond of work (a serial ``@njit`` call costs ~0.14 µs), and at prefill size a few tens
    to hundreds of µs against a prefill of a second; parallel versions also compile ~3x slower
    (``cache=True`` pays that once per install, but a fresh checkout's tests pay it). The row-wise kernels
    release the GIL (``nogil=True``): a caller that wants them on several threads can give each thread
    a block of rows (``x[r0:r1]``), which gives the same bits since rows are independent.

Call :func:`warmup` once at backend creation: it compiles (or, thanks to ``cache=True``, loads from
``__pycache__``) every signature the engine uses, so the first token does not pay for JIT compilation.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.extending import intrinsic, models, register_model

from minfer.backends.cpu.quant_matmul import _F16C, _half_to_float
from minfer.errors import ContextOverflowError

F32 = np.float32
U = np.uint64  # unsigned array index: no negative-index wraparound code (see _rms_norm_group)

# (module constants are compiled into the kernels: changing one at run time has no effect)
# attention work unit: the query heads of one kv head (or a subset) over this many consecutive tokens
ATTN_TOKEN_BLOCK = 16
# attention key block: K/V rows used by every (token, head) pair of a unit while they sit in L1
# (64 rows x 64 floats = 16 KiB of K, then of V)
ATTN_KEY_BLOCK = 64
# attention key chunk (a multiple of ATTN_KEY_BLOCK): the weighted sum of V rows is summed per chunk of
# this many keys, then the chunk sums are added in order. A decode step hands different chunks to
# different threads (one token has too few heads to keep two threads busy on whole heads); a prefill
# sums the same chunks the same way, so both give the same bits.
ATTN_KEY_CHUNK = 256


# ---------------------------------------------------------------------------------------------------------
# What numba cannot say by itself, as small LLVM IR intrinsics: bit casts (exp's 2^k) and SIMD values
# (8 float32 or float64 lanes carried in ordinary local variables) for the reductions that LLVM would
# otherwise leave scalar. Loads and stores take (row, col) of a 2-D array with contiguous rows.

_EXP_SHIFTER = F32(12582912.0)  # 1.5 * 2^23: adding it rounds a float32 to an integer held in the low bits
_EXP_SHIFTER_BITS = int(_EXP_SHIFTER.view(np.int32))


@intrinsic
def _scale_by_pow2(typingctx, y, t):
    """``y * 2^k`` where ``t = k + 1.5 * 2^23`` (k in the low mantissa bits of t), as two factors
    ``2^(k >> 1) * 2^(k - (k >> 1))`` so that k down to -150 (subnormal results) and up to 128 (inf)
    stay exact. Written as LLVM IR because numba widens int32 arithmetic to int64 and has no bit casts;
    in IR it vectorizes with the loop around it."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        yv, tv = args
        i32 = ir.IntType(32)
        k = builder.sub(builder.bitcast(tv, i32), ir.Constant(i32, _EXP_SHIFTER_BITS))
        k1 = builder.ashr(k, ir.Constant(i32, 1))
        k2 = builder.sub(k, k1)
        s1 = builder.bitcast(builder.shl(builder.add(k1, ir.Constant(i32, 127)), ir.Constant(i32, 23)), ir.FloatType())
        s2 = builder.bitcast(builder.shl(builder.add(k2, ir.Constant(i32, 127)), ir.Constant(i32, 23)), ir.FloatType())
        return builder.fmul(builder.fmul(yv, s1), s2)

    return sig, codegen


class _F32x8Type(types.Type):
    """Eight float32 lanes carried in a numba local variable (an LLVM ``<8 x float>`` value)."""

    def __init__(self) -> None:
        super().__init__(name="vec_kernels.f32x8")


_f32x8 = _F32x8Type()
_V8F = ir.VectorType(ir.FloatType(), 8)


@register_model(_F32x8Type)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, _V8F)


@intrinsic
def _vzero8(typingctx):
    return _f32x8(), lambda context, builder, sig, args: ir.Constant(_V8F, [0.0] * 8)


def _row_ptr(context, builder, sig, args, vty=_V8F, itemsize=4):
    """Address of ``arr[row, col]`` (args 0..2) as ``vty*``, from the row stride in bytes."""
    a = context.make_array(sig.args[0])(context, builder, args[0])
    r = context.cast(builder, args[1], sig.args[1], types.intp)
    c = context.cast(builder, args[2], sig.args[2], types.intp)
    stride0 = builder.extract_value(a.strides, 0)
    byte_off = builder.add(builder.mul(r, stride0), builder.mul(c, ir.Constant(r.type, itemsize)))
    p = builder.gep(builder.bitcast(a.data, ir.IntType(8).as_pointer()), [byte_off])
    return builder.bitcast(p, vty.as_pointer())


def _is_f32_2d(arr) -> bool:
    return isinstance(arr, types.Array) and arr.ndim == 2 and arr.dtype == types.float32


def _is_f16_bits_2d(arr) -> bool:
    """A 2-D uint16 array: float16 K/V cells seen as their bit patterns (numba has no float16 arrays)."""
    return isinstance(arr, types.Array) and arr.ndim == 2 and arr.dtype == types.uint16


@intrinsic
def _vload8(typingctx, arr, row, col):
    """``arr[row, col:col+8]`` of a 2-D float32 array whose rows are contiguous (inner stride 4 bytes,
    which callers check): one unaligned vector load, no bounds check (callers own the bounds). A uint16
    array holds float16 bit patterns (K/V cells of an f16 cache): its eight values are widened to float32,
    exactly, so a kernel reading them computes what it computes on their float32 copy."""
    if _is_f16_bits_2d(arr):
        def codegen16(context, builder, sig, args):
            h = builder.load(_row_ptr(context, builder, sig, args, ir.VectorType(ir.IntType(16), 8), 2), align=2)
            return _half_to_float(builder, h)

        return _f32x8(arr, row, col), codegen16
    if not _is_f32_2d(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_row_ptr(context, builder, sig, args), align=4)

    return _f32x8(arr, row, col), codegen


@intrinsic
def _at32(typingctx, arr, row, col):
    """``arr[row, col]`` as float32, for the float32 and float16-bits arrays ``_vload8`` reads (no bounds
    check: the vector loops' scalar tails)."""
    if _is_f16_bits_2d(arr):
        def codegen16(context, builder, sig, args):
            return _half_to_float(builder, builder.load(_row_ptr(context, builder, sig, args, ir.IntType(16), 2)))

        return types.float32(arr, row, col), codegen16
    if not _is_f32_2d(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_row_ptr(context, builder, sig, args, ir.FloatType()))

    return types.float32(arr, row, col), codegen


@intrinsic
def _vstore8(typingctx, arr, row, col, v):
    """``arr[row, col:col+8] = v`` (same contract as ``_vload8``)."""
    if not (_is_f32_2d(arr) and v == _f32x8):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[3], _row_ptr(context, builder, sig, args), align=4)
        return context.get_dummy_value()

    return types.none(arr, row, col, v), codegen


@intrinsic
def _vsplat8(typingctx, x):
    """float32 x in all eight lanes."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        v = builder.insert_element(ir.Constant(_V8F, ir.Undefined), args[0], ir.Constant(i32, 0))
        return builder.shuffle_vector(v, ir.Constant(_V8F, ir.Undefined), ir.Constant(ir.VectorType(i32, 8), [0] * 8))

    return _f32x8(x), codegen


@intrinsic
def _vmuladd8(typingctx, acc, a, b):
    """``acc + a * b`` lane by lane, rounded twice (no FMA: results do not depend on the CPU)."""
    if not (acc == _f32x8 and a == _f32x8 and b == _f32x8):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], builder.fmul(args[1], args[2]))

    return _f32x8(acc, a, b), codegen


@intrinsic
def _hsum8(typingctx, v):
    """``((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))``, the tree every 8-lane sum here uses."""
    if v != _f32x8:
        return None

    def codegen(context, builder, sig, args):
        lane = [builder.extract_element(args[0], ir.Constant(ir.IntType(32), i)) for i in range(8)]
        p = [builder.fadd(lane[2 * i], lane[2 * i + 1]) for i in range(4)]
        return builder.fadd(builder.fadd(p[0], p[1]), builder.fadd(p[2], p[3]))

    return types.float32(v), codegen


@intrinsic
def _store_hsum8x4_scaled(typingctx, out, row, col, scale, a, b, c, d):
    """``out[row, col:col+4] = [tree(a), tree(b), tree(c), tree(d)] * scale``, where tree is the fixed
    8-lane sum of ``_hsum8``: the same float operations as four ``_hsum8`` calls, four vectors at a time
    with shuffles (pairs of lanes, then pairs of pairs, then the two halves)."""
    if not (_is_f32_2d(out) and scale == types.float32 and a == b == c == d == _f32x8):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)

        def shuf(x, y, idx):
            return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(i32, len(idx)), idx))

        even, odd = list(range(0, 16, 2)), list(range(1, 16, 2))
        va, vb, vc, vd = args[4:]
        ab = builder.fadd(shuf(va, vb, even), shuf(va, vb, odd))  # [a01 a23 a45 a67 b01 b23 b45 b67]
        cd = builder.fadd(shuf(vc, vd, even), shuf(vc, vd, odd))
        r = builder.fadd(shuf(ab, cd, even), shuf(ab, cd, odd))  # [a0123 a4567 b0123 b4567 c.. c.. d.. d..]
        sums = builder.fadd(shuf(r, r, [0, 2, 4, 6]), shuf(r, r, [1, 3, 5, 7]))  # [a b c d]
        v4 = ir.VectorType(ir.FloatType(), 4)
        sv = builder.insert_element(ir.Constant(v4, ir.Undefined), args[3], ir.Constant(i32, 0))
        sv = builder.shuffle_vector(sv, ir.Constant(v4, ir.Undefined), ir.Constant(ir.VectorType(i32, 4), [0] * 4))
        p = builder.bitcast(_row_ptr(context, builder, sig, args), v4.as_pointer())
        builder.store(builder.fmul(sums, sv), p, align=4)
        return context.get_dummy_value()

    return types.none(out, row, col, scale, a, b, c, d), codegen


class _F64Lanes(types.Type):
    """float64 lanes in one LLVM vector (``<n x double>``): 8 for the RMSNorm sum of squares, 4 for the
    attention softmax's sum."""

    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        super().__init__(name=f"vec_kernels.f64x{lanes}")


@register_model(_F64Lanes)
class _F64LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type: _F64Lanes) -> None:
        super().__init__(dmm, fe_type, ir.VectorType(ir.DoubleType(), fe_type.lanes))


_f64x8, _f64x4 = _F64Lanes(8), _F64Lanes(4)
_V8D, _V4D = ir.VectorType(ir.DoubleType(), 8), ir.VectorType(ir.DoubleType(), 4)


@intrinsic
def _dzero8(typingctx):
    return _f64x8(), lambda context, builder, sig, args: ir.Constant(_V8D, [0.0] * 8)


@intrinsic
def _dsumsq8(typingctx, acc, v):
    """``acc + double(v) * double(v)`` lane by lane (the products of float32 values are exact in float64)."""
    if not (acc == _f64x8 and v == _f32x8):
        return None

    def codegen(context, builder, sig, args):
        d = builder.fpext(args[1], _V8D)
        return builder.fadd(args[0], builder.fmul(d, d))

    return _f64x8(acc, v), codegen


@intrinsic
def _dhsum8(typingctx, v):
    """The float64 version of ``_hsum8``'s tree."""
    if v != _f64x8:
        return None

    def codegen(context, builder, sig, args):
        lane = [builder.extract_element(args[0], ir.Constant(ir.IntType(32), i)) for i in range(8)]
        p = [builder.fadd(lane[2 * i], lane[2 * i + 1]) for i in range(4)]
        return builder.fadd(builder.fadd(p[0], p[1]), builder.fadd(p[2], p[3]))

    return types.float64(v), codegen


_V4F = ir.VectorType(ir.FloatType(), 4)


@intrinsic
def _dzero4(typingctx):
    return _f64x4(), lambda context, builder, sig, args: ir.Constant(_V4D, [0.0] * 4)


@intrinsic
def _dpairs4(typingctx, v):
    """(l0 + l1) + (l2 + l3) of a four-lane float64 vector."""
    if v != _f64x4:
        return None

    def codegen(context, builder, sig, args):
        lane = [builder.extract_element(args[0], ir.Constant(ir.IntType(32), i)) for i in range(4)]
        return builder.fadd(builder.fadd(lane[0], lane[1]), builder.fadd(lane[2], lane[3]))

    return types.float64(v), codegen


# ---------------------------------------------------------------------------------------------------------
# building blocks, inlined into the loops that call them
#
# Every kernel uses error_model="numpy": float division by zero then gives inf/nan as in numpy instead of
# a check that raises ZeroDivisionError, and that check would keep LLVM from vectorizing any loop that
# divides (SiLU).


@njit(cache=True, error_model="numpy", inline="always")
def _exp32(x):
    """float32 exp, within 1 ulp of the correctly rounded value, branch-free so that loops vectorize.

    numba's ``np.exp`` on float32 calls libm once per element (no SVML here), ~4x slower than this. The
    clamps keep 2^k in range: below -104 the result rounds to +0 (as expf does), above 89 to inf; NaN
    passes through (comparisons with NaN are false).
    """
    x = F32(89.0) if x > F32(89.0) else x
    x = F32(-104.0) if x < F32(-104.0) else x
    t = x * F32(1.44269504088896341) + _EXP_SHIFTER  # k = round(x / ln 2) in the low mantissa bits
    kf = t - _EXP_SHIFTER
    r = x - kf * F32(0.693359375)  # Cody-Waite: ln 2 split so kf * hi is exact
    r = r - kf * F32(-2.12194440e-4)
    y = F32(1.9875691500e-4)  # Cephes expf polynomial on |r| <= ln2 / 2
    y = y * r + F32(1.3981999507e-3)
    y = y * r + F32(8.3334519073e-3)
    y = y * r + F32(4.1665795894e-2)
    y = y * r + F32(1.6666665459e-1)
    y = y * r + F32(5.0000001201e-1)
    y = y * (r * r) + r + F32(1.0)
    return _scale_by_pow2(y, t)


@njit(cache=True, error_model="numpy", inline="always")
def _dot(a, ar, a0, b, br, b0, n):
    """float32 ``sum(a[ar, a0:a0+n] * b[br, b0:b0+n])``: lane l of an 8-wide vector sums the products at
    i = l mod 8 in order, the lanes are combined in a fixed tree, a scalar tail adds i >= n - n mod 8."""
    acc = _vzero8()
    i = 0
    while i + 8 <= n:
        acc = _vmuladd8(acc, _vload8(a, ar, a0 + i), _vload8(b, br, b0 + i))
        i += 8
    s = _hsum8(acc)
    while i < n:
        s += a[ar, a0 + i] * _at32(b, br, b0 + i)
        i += 1
    return s


# ---------------------------------------------------------------------------------------------------------
# RMSNorm (with or without gain)


@njit(cache=True, error_model="numpy")
def _rms_norm_group(x, r, c0, gain, has_gain, eps32, width, inplace, out):
    """Normalize ``x[r, c0:c0+width]`` into ``out`` (or into x when ``inplace``).

    Sum of squares in float64, 8 lanes (lane l takes i = l mod 8 in order) then the fixed tree, then a
    scalar tail. (Indices written ``U(...)`` are unsigned: numba then skips its negative-index wraparound,
    which would otherwise keep LLVM from vectorizing loops that start at an offset.)
    """
    acc = _dzero8()
    i = 0
    while i + 8 <= width:
        acc = _dsumsq8(acc, _vload8(x, r, c0 + i))
        i += 8
    ss = _dhsum8(acc)
    while i < width:
        v = np.float64(x[r, U(c0 + i)])
        ss += v * v
        i += 1
    # the reference's float32 steps, each rounded where numpy rounds: f32(mean), + eps, sqrt, 1 / .
    # sqrt and 1/ are done in float64 and rounded to float32 after each one: that equals the float32
    # operation exactly (double rounding is innocuous for + - * / sqrt when 53 >= 2 * 24 + 2)
    ms = F32(ss / width)
    root = F32(np.sqrt(np.float64(ms + eps32)))
    scale = F32(1.0 / np.float64(root))
    # separate in-place loops: with out and x the same array LLVM's overlap check would fall back to scalar
    if has_gain:
        if inplace:
            for i in range(width):
                x[r, U(c0 + i)] = (x[r, U(c0 + i)] * scale) * gain[i]
        else:
            for i in range(width):
                out[r, U(c0 + i)] = (x[r, U(c0 + i)] * scale) * gain[i]
    elif inplace:
        for i in range(width):
            x[r, U(c0 + i)] = x[r, U(c0 + i)] * scale
    else:
        for i in range(width):
            out[r, U(c0 + i)] = x[r, U(c0 + i)] * scale


@njit(cache=True, error_model="numpy", nogil=True)
def _rms_norm_kernel(x, gain, has_gain, eps, width, out):
    """Returns -1 when done, -2 when the shapes do not fit, -3 when x's rows are not contiguous (nothing
    written then). ``out`` is either ``x`` itself or an array that does not overlap it."""
    rows, cols = x.shape
    if width < 1 or cols % width or out.shape[0] != rows or out.shape[1] != cols:
        return -2
    if has_gain and gain.shape[0] != width:
        return -2
    if x.strides[1] != 4:
        return -3  # the sum of squares loads 8 consecutive floats of a row
    eps32 = F32(eps)
    n_groups = cols // width
    inplace = x.ctypes.data == out.ctypes.data
    for r in range(rows):
        for g in range(n_groups):
            _rms_norm_group(x, r, g * width, gain, has_gain, eps32, width, inplace, out)
    return -1


_NO_GAIN = np.zeros(1, F32)


def _rms_norm_error(name: str, code: int, x: np.ndarray, gain: np.ndarray | None, width: int, out: np.ndarray):
    if code == -3:
        return ValueError(f"{name}: x must have contiguous rows (inner stride 4 bytes)")
    want = "" if gain is None else f", gain {gain.shape} of {width} values"
    return ValueError(f"{name}: x {x.shape} / out {out.shape} must be equal, rows a multiple of {width}{want}")


def rms_norm(x: np.ndarray, eps: float, width: int, out: np.ndarray) -> None:
    """``out = x / sqrt(mean(x^2) + eps)`` over every group of ``width`` values; ``out`` may be ``x``."""
    code = _rms_norm_kernel(x, _NO_GAIN, False, eps, width, out)
    if code != -1:
        raise _rms_norm_error("rms_norm", code, x, None, width, out)


def rms_norm_mul(x: np.ndarray, gain: np.ndarray, eps: float, width: int, out: np.ndarray) -> None:
    """RMSNorm fused with the gain multiply (``gain`` has ``width`` values); ``out`` may be ``x``."""
    code = _rms_norm_kernel(x, gain, True, eps, width, out)
    if code != -1:
        raise _rms_norm_error("rms_norm_mul", code, x, gain, width, out)


# ---------------------------------------------------------------------------------------------------------
# elementwise: add, mul, silu, swiglu. Kernels take 2-D x/out and a y that is either the same shape or a 1-D
# vector broadcast over every row (a bias or a gain; its length must divide the row length).


@njit(cache=True, error_model="numpy")
def _binary_row(op, x, y, r, inplace, out):
    """Row r of ``x op y`` (op 0: +, 1: *), y the same shape or a 1-D vector repeated along the row."""
    n = x.shape[1]
    if y.ndim == 2:
        if inplace:  # own loops: with out and x the same array LLVM's overlap check would fall back to scalar
            if op == 0:
                for i in range(n):
                    x[r, i] = x[r, i] + y[r, i]
            else:
                for i in range(n):
                    x[r, i] = x[r, i] * y[r, i]
        elif op == 0:
            for i in range(n):
                out[r, i] = x[r, i] + y[r, i]
        else:
            for i in range(n):
                out[r, i] = x[r, i] * y[r, i]
    else:
        m = y.shape[0]
        for c0 in range(0, n, m):
            if inplace:
                if op == 0:
                    for i in range(m):
                        x[r, U(c0 + i)] = x[r, U(c0 + i)] + y[i]
                else:
                    for i in range(m):
                        x[r, U(c0 + i)] = x[r, U(c0 + i)] * y[i]
            elif op == 0:
                for i in range(m):
                    out[r, U(c0 + i)] = x[r, U(c0 + i)] + y[i]
            else:
                for i in range(m):
                    out[r, U(c0 + i)] = x[r, U(c0 + i)] * y[i]


@njit(cache=True, error_model="numpy", nogil=True)
def _binary_kernel(op, x, y, out):
    """Returns -1 when done, -2 when the shapes do not fit (nothing written then). ``out`` is either
    ``x`` itself or an array that does not overlap it (y may be anything)."""
    rows, cols = x.shape
    if out.shape[0] != rows or out.shape[1] != cols:
        return -2
    if y.ndim == 2:
        if y.shape[0] != rows or y.shape[1] != cols:
            return -2
    elif y.shape[0] < 1 or cols % y.shape[0]:
        return -2
    inplace = x.ctypes.data == out.ctypes.data
    for r in range(rows):
        _binary_row(op, x, y, r, inplace, out)
    return -1


def add(x: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    """``out = x + y`` (y the same shape, or a 1-D bias broadcast over rows); ``out`` may be ``x``."""
    if _binary_kernel(0, x, y, out) != -1:
        raise ValueError(f"add: shapes x {x.shape}, y {y.shape}, out {out.shape} do not fit")


def mul(x: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    """``out = x * y`` (y the same shape, or a 1-D gain broadcast over rows/heads); ``out`` may be ``x``."""
    if _binary_kernel(1, x, y, out) != -1:
        raise ValueError(f"mul: shapes x {x.shape}, y {y.shape}, out {out.shape} do not fit")


@njit(cache=True, error_model="numpy")
def _swiglu_row(gate, up, has_up, r, where, out):
    """The reference's float32 steps: silu = x / (1 + exp(-x)), then * up. ``where``: 0 out is its own
    array, 1 out is gate, 2 out is up (own loops: LLVM's overlap check would fall back to scalar)."""
    n = gate.shape[1]
    if not has_up:
        if where == 1:
            for i in range(n):
                g = gate[r, i]
                gate[r, i] = g / (F32(1.0) + _exp32(-g))
        else:
            for i in range(n):
                g = gate[r, i]
                out[r, i] = g / (F32(1.0) + _exp32(-g))
    elif where == 1:
        for i in range(n):
            g = gate[r, i]
            gate[r, i] = (g / (F32(1.0) + _exp32(-g))) * up[r, i]
    elif where == 2:
        for i in range(n):
            g = gate[r, i]
            up[r, i] = (g / (F32(1.0) + _exp32(-g))) * up[r, i]
    else:
        for i in range(n):
            g = gate[r, i]
            out[r, i] = (g / (F32(1.0) + _exp32(-g))) * up[r, i]


@njit(cache=True, error_model="numpy", nogil=True)
def _swiglu_kernel(gate, up, has_up, out):
    """Returns -1 when done, -2 when the shapes do not fit (nothing written then). ``out`` is gate, up,
    or an array that overlaps neither."""
    rows, cols = gate.shape
    if out.shape[0] != rows or out.shape[1] != cols or up.shape[0] != rows or up.shape[1] != cols:
        return -2
    where = 1 if out.ctypes.data == gate.ctypes.data else (2 if has_up and out.ctypes.data == up.ctypes.data else 0)
    for r in range(rows):
        _swiglu_row(gate, up, has_up, r, where, out)
    return -1


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """``out = silu(gate) * up``; ``out`` may be ``gate`` or ``up``."""
    if _swiglu_kernel(gate, up, True, out) != -1:
        raise ValueError(f"swiglu: shapes gate {gate.shape}, up {up.shape}, out {out.shape} must be equal")


def silu(x: np.ndarray, out: np.ndarray) -> None:
    """``out = x * sigmoid(x)`` computed as the reference does, ``x / (1 + exp(-x))``; ``out`` may be ``x``."""
    if _swiglu_kernel(x, x, False, out) != -1:
        raise ValueError(f"silu: shapes x {x.shape}, out {out.shape} must be equal")


# GELU (tanh approximation, Gemma's ``gelu_pytorch_tanh``) and GEGLU = gelu(gate) * up.
# 0.5 x (1 + tanh(u)) is computed as x / (1 + exp(-2u)) (the same function: 1 + tanh(u) = 2 / (1 + e^-2u)),
# with the float32 exp above; u = sqrt(2/pi) * (x + 0.044715 x^3) in the reference's float32 steps.
_GELU_BETA = F32(0.7978845608028654)  # sqrt(2 / pi)
_GELU_KAPPA = F32(0.044715)


@njit(cache=True, error_model="numpy", inline="always")
def _gelu32(x):
    u = _GELU_BETA * (x + _GELU_KAPPA * (x * x * x))
    return x / (F32(1.0) + _exp32(F32(-2.0) * u))


@njit(cache=True, error_model="numpy")
def _geglu_row(gate, up, has_up, r, where, out):
    """``gelu(gate) * up`` for row r; ``where`` as in ``_swiglu_row`` (0 own array, 1 gate, 2 up)."""
    n = gate.shape[1]
    if not has_up:
        if where == 1:
            for i in range(n):
                gate[r, i] = _gelu32(gate[r, i])
        else:
            for i in range(n):
                out[r, i] = _gelu32(gate[r, i])
    elif where == 1:
        for i in range(n):
            gate[r, i] = _gelu32(gate[r, i]) * up[r, i]
    elif where == 2:
        for i in range(n):
            up[r, i] = _gelu32(gate[r, i]) * up[r, i]
    else:
        for i in range(n):
            out[r, i] = _gelu32(gate[r, i]) * up[r, i]


@njit(cache=True, error_model="numpy", nogil=True)
def _geglu_kernel(gate, up, has_up, out):
    """Returns -1 when done, -2 when the shapes do not fit (nothing written then)."""
    rows, cols = gate.shape
    if out.shape[0] != rows or out.shape[1] != cols or up.shape[0] != rows or up.shape[1] != cols:
        return -2
    where = 1 if out.ctypes.data == gate.ctypes.data else (2 if has_up and out.ctypes.data == up.ctypes.data else 0)
    for r in range(rows):
        _geglu_row(gate, up, has_up, r, where, out)
    return -1


def geglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """``out = gelu(gate) * up`` (tanh GELU); ``out`` may be ``gate`` or ``up``."""
    if _geglu_kernel(gate, up, True, out) != -1:
        raise ValueError(f"geglu: shapes gate {gate.shape}, up {up.shape}, out {out.shape} must be equal")


def gelu(x: np.ndarray, out: np.ndarray) -> None:
    """``out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``; ``out`` may be ``x``."""
    if _geglu_kernel(x, x, False, out) != -1:
        raise ValueError(f"gelu: shapes x {x.shape}, out {out.shape} must be equal")


@njit(cache=True, error_model="numpy", nogil=True)
def _scale_kernel(x, s, out):
    """``out = x * f32(s)``; -1 when done, -2 when the shapes differ."""
    rows, cols = x.shape
    if out.shape[0] != rows or out.shape[1] != cols:
        return -2
    s32 = F32(s)
    if out.ctypes.data == x.ctypes.data:  # own loop: an overlap check would keep LLVM scalar
        for r in range(rows):
            for i in range(cols):
                x[r, i] = x[r, i] * s32
    else:
        for r in range(rows):
            for i in range(cols):
                out[r, i] = x[r, i] * s32
    return -1


def scale(x: np.ndarray, s: float, out: np.ndarray) -> None:
    """``out = x * s`` with ``s`` rounded to float32 (one float32 multiply per element); ``out`` may be ``x``."""
    if _scale_kernel(x, s, out) != -1:
        raise ValueError(f"scale: shapes x {x.shape}, out {out.shape} must be equal")


# ---------------------------------------------------------------------------------------------------------
# RoPE


@njit(cache=True, error_model="numpy", inline="always")
def _rope_head(src, dst, t, b, row, cos, sin, half, neox):
    """Rotate the head at column b of token t: the reference's float32 ``x0*c - x1*s``, ``x0*s + x1*c``.

    Inlined by numba, so that for in-place calls (``src`` and ``dst`` the same array) LLVM sees one array
    and vectorizes without the overlap check that would send it to the scalar loop."""
    if neox:  # pairs (i, i + n_rot/2)
        for i in range(half):
            x0 = src[t, U(b + i)]
            x1 = src[t, U(b + half + i)]
            c = cos[row, i]
            s = sin[row, i]
            dst[t, U(b + i)] = x0 * c - x1 * s
            dst[t, U(b + half + i)] = x0 * s + x1 * c
    else:  # pairs (2i, 2i + 1)
        for i in range(half):
            x0 = src[t, U(b + 2 * i)]
            x1 = src[t, U(b + 2 * i + 1)]
            c = cos[row, i]
            s = sin[row, i]
            dst[t, U(b + 2 * i)] = x0 * c - x1 * s
            dst[t, U(b + 2 * i + 1)] = x0 * s + x1 * c


@njit(cache=True, error_model="numpy")
def _rope_row(x, t, row, cos, sin, n_head, head_dim, n_rot, neox, inplace, out):
    """Rotate every head of token t by table row ``row``; dims from n_rot on are copied unchanged."""
    half = n_rot // 2
    for h in range(n_head):
        b = h * head_dim
        if inplace:
            _rope_head(x, x, t, b, row, cos, sin, half, neox)
        else:
            _rope_head(x, out, t, b, row, cos, sin, half, neox)
            for i in range(n_rot, head_dim):
                out[t, U(b + i)] = x[t, U(b + i)]


@njit(cache=True, error_model="numpy", nogil=True)
def _rope_kernel(x, positions, cos, sin, direct, n_head, head_dim, n_rot, neox, out):
    """Returns -1 when done, -2 on a geometry mismatch, else the first token whose table row is missing.

    ``direct``: the tables hold one row per token (row t) instead of one row per position (row pos[t]).
    Nothing is written unless every check passes, so the caller can grow the table and call again.
    """
    nt = x.shape[0]
    if (
        x.shape[1] != n_head * head_dim
        or out.shape[0] != nt
        or out.shape[1] != x.shape[1]
        or positions.shape[0] != nt
        or n_rot % 2
        or n_rot > head_dim
        or cos.shape[1] < n_rot // 2
    ):
        return -2
    for t in range(nt):
        row = np.int64(t) if direct else np.int64(positions[t])
        if row < 0 or row >= cos.shape[0]:
            return t
    inplace = x.ctypes.data == out.ctypes.data
    for t in range(nt):
        row = np.int64(t) if direct else np.int64(positions[t])
        _rope_row(x, t, row, cos, sin, n_head, head_dim, n_rot, neox, inplace, out)
    return -1


class RopeTable:
    """cos/sin of RoPE angles for positions ``0..n_pos-1`` of one geometry, shared by q and k of every layer.

    Computed by numpy with the reference's expressions (``reference.rope_freqs`` and
    ``reference.rope_cos_sin``: float64 angles ``pos * freq``, ``cos``/``sin`` times the YaRN magnitude,
    cast to float32), so a row is bit-identical to what the reference computes for that position. The
    table grows (doubling) when a position beyond it shows up. The keyword arguments are RoPE scaling
    (see :class:`~minfer.graph.ir.RopeMeta`).
    """

    def __init__(
        self,
        head_dim: int,
        n_rot: int,
        freq_base: float,
        freq_scale: float,
        n_pos: int = 4096,
        *,
        freq_factors: tuple[float, ...] | None = None,
        ext_factor: float = 0.0,
        corr_dims: tuple[float, float] = (0.0, 0.0),
        mscale: float = 1.0,
    ) -> None:
        from minfer.backends.cpu.reference import rope_freqs
        from minfer.graph.ir import RopeMeta, RopeStyle

        if n_rot % 2 or not 0 < n_rot <= head_dim:
            raise ValueError(f"RoPE: n_rot {n_rot} must be even and in 1..head_dim ({head_dim})")
        if freq_factors is not None and len(freq_factors) != n_rot // 2:
            raise ValueError(f"RoPE: {len(freq_factors)} frequency factors for {n_rot // 2} rotating pairs")
        self.head_dim = head_dim
        self.n_rot = n_rot
        meta = RopeMeta(
            n_head=1, head_dim=head_dim, n_rot=n_rot, freq_base=freq_base, freq_scale=freq_scale, style=RopeStyle.NEOX,
            freq_factors=freq_factors, ext_factor=ext_factor, corr_dims=corr_dims, mscale=mscale,
        )
        self.freqs = rope_freqs(meta)  # float64 [n_rot/2]
        self.mscale = mscale
        self._lock = threading.Lock()
        self.cos, self.sin = self.cos_sin(np.arange(max(1, n_pos)))

    @staticmethod
    def key(meta: Any) -> tuple:
        """What decides a table's contents: metas with equal keys can share one table."""
        return (meta.head_dim, meta.n_rot, float(meta.freq_base), float(meta.freq_scale), meta.freq_factors,
                float(meta.ext_factor), tuple(meta.corr_dims), float(meta.mscale))

    @classmethod
    def from_meta(cls, meta: Any, n_pos: int = 4096) -> RopeTable:
        return cls(meta.head_dim, meta.n_rot, meta.freq_base, meta.freq_scale, n_pos, freq_factors=meta.freq_factors,
                   ext_factor=meta.ext_factor, corr_dims=tuple(meta.corr_dims), mscale=meta.mscale)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 cos/sin ``[len(positions), n_rot/2]`` for these positions, exactly as the reference computes."""
        from minfer.backends.cpu.reference import rope_cos_sin

        return rope_cos_sin(self.freqs, self.mscale, positions)

    def _grow(self, positions: np.ndarray) -> None:
        need = int(positions.max()) + 1
        with self._lock:
            n = self.cos.shape[0]
            if need > n:
                while n < need:
                    n *= 2
                cos, sin = self.cos_sin(np.arange(n))
                self.cos, self.sin = cos, sin  # readers see either the old or the new pair, both valid

    def apply(self, x: np.ndarray, positions: np.ndarray, n_head: int, neox: bool, out: np.ndarray) -> None:
        """RoPE of ``x [tokens, n_head*head_dim]`` at ``positions`` into ``out`` (which may be ``x``)."""
        cos, sin = self.cos, self.sin
        code = _rope_kernel(x, positions, cos, sin, False, n_head, self.head_dim, self.n_rot, neox, out)
        if code == -1:
            return
        if code == -2:
            raise ValueError(
                f"rope: x {x.shape}, positions {positions.shape}, out {out.shape} do not fit n_head {n_head} "
                f"x head_dim {self.head_dim}, n_rot {self.n_rot}"
            )
        if int(positions.min()) < 0:
            # a negative position has no table row: use tables computed for exactly these positions
            cos, sin = self.cos_sin(positions)
            code = _rope_kernel(x, positions, cos, sin, True, n_head, self.head_dim, self.n_rot, neox, out)
        else:
            self._grow(positions)
            code = _rope_kernel(x, positions, self.cos, self.sin, False, n_head, self.head_dim, self.n_rot, neox, out)
        assert code == -1, code


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    n_head: int,
    head_dim: int,
    n_rot: int,
    freq_base: float,
    freq_scale: float,
    neox: bool,
    out: np.ndarray,
) -> None:
    """RoPE in place or into ``out``; NEOX pairs (i, i + n_rot/2), otherwise (2i, 2i+1).

    Builds a table for these positions on every call; a caller that runs many RoPEs (the backend) keeps
    a :class:`RopeTable` and calls its ``apply``.
    """
    n_pos = int(np.abs(positions).max()) + 1 if positions.size else 1
    RopeTable(head_dim, n_rot, freq_base, freq_scale, n_pos=n_pos).apply(x, positions, n_head, neox, out)


# ---------------------------------------------------------------------------------------------------------
# KV store


@intrinsic
def _as_cell(typingctx, region, x):
    """float32 ``x`` as a cell of ``region``: itself in a float32 region, its float16 bit pattern (rounded
    to nearest even, as numpy's astype rounds) in a uint16 one."""
    if _is_f16_bits_2d(region) and x == types.float32:
        def codegen16(context, builder, sig, args):
            return builder.bitcast(builder.fptrunc(args[1], ir.HalfType()), ir.IntType(16))

        return types.uint16(region, x), codegen16
    if _is_f32_2d(region) and x == types.float32:
        return types.float32(region, x), lambda context, builder, sig, args: args[1]
    return None


@njit(cache=True, error_model="numpy", nogil=True)
def _kv_store_kernel(k, v, positions, k_region, v_region):
    """Returns -1 when stored, -2 on a shape mismatch, else the first token whose position is outside the
    context (nothing is written then)."""
    nt = k.shape[0]
    n_ctx = k_region.shape[0]
    if (
        v.shape[0] != nt
        or positions.shape[0] != nt
        or k.shape[1] != k_region.shape[1]
        or v.shape[1] != v_region.shape[1]
        or v_region.shape[0] != n_ctx
    ):
        return -2
    for t in range(nt):
        if positions[t] < 0 or positions[t] >= n_ctx:
            return t
    for t in range(nt):
        p = positions[t]
        for i in range(k.shape[1]):
            k_region[p, i] = _as_cell(k_region, k[t, i])
        for i in range(v.shape[1]):
            v_region[p, i] = _as_cell(v_region, v[t, i])
    return -1


def _kv_store_numpy(k, v, positions, k_region, v_region) -> int:
    """``_kv_store_kernel`` in numpy, for float16 regions on a CPU without F16C."""
    n_ctx, nt = k_region.shape[0], k.shape[0]
    if v.shape[0] != nt or positions.shape[0] != nt or k.shape[1:] != k_region.shape[1:] or \
            v.shape[1:] != v_region.shape[1:] or v_region.shape[0] != n_ctx:
        return -2
    bad = np.flatnonzero((positions < 0) | (positions >= n_ctx))
    if bad.size:
        return int(bad[0])
    k_region[positions] = k
    v_region[positions] = v
    return -1


def kv_store(
    k: np.ndarray,
    v: np.ndarray,
    positions: np.ndarray,
    k_region: np.ndarray,
    v_region: np.ndarray,
    layer: int | None = None,
) -> None:
    """Write token t's K/V rows at row ``positions[t]`` of the layer's regions (positions are data).
    float16 regions (an f16 cache) get the rows rounded to nearest even, as numpy's astype rounds them."""
    k_cells, v_cells = _kv_cells(k_region, v_region, "kv_store")
    if k_cells.dtype == np.uint16 and not _F16C:  # LLVM would call a runtime helper that numba does not link
        code = _kv_store_numpy(k, v, positions, k_region, v_region)
    else:
        code = _kv_store_kernel(k, v, positions, k_cells, v_cells)
    if code == -1:
        return
    where = "" if layer is None else f"layer {layer}: "
    if code == -2:
        raise ValueError(
            f"{where}kv_store: k {k.shape}, v {v.shape}, positions {positions.shape} do not fit the regions "
            f"{k_region.shape} / {v_region.shape}"
        )
    raise ContextOverflowError(
        f"{where}KV store position {int(positions[code])} (token {code}) is outside the context of "
        f"{k_region.shape[0]} positions"
    )


# ---------------------------------------------------------------------------------------------------------
# attention


@njit(cache=True, error_model="numpy")
def _attn_scores(q, t, qo, kr, ko, j0, j1, hdk, scale32, sc, row):
    """``sc[row, j] = dot(q[t, qo:qo+hdk], kr[j, ko:ko+hdk]) * scale`` for j in j0..j1-1.

    Four keys per pass share the q loads; a key's score is the same float operations (8 lanes over the
    head dim, then the fixed tree) whether it is computed in a group of four or alone.
    """
    j = j0
    if hdk % 8 == 0:
        while j + 4 <= j1:
            a0 = a1 = a2 = a3 = _vzero8()
            for c in range(0, hdk, 8):
                qv = _vload8(q, t, qo + c)
                a0 = _vmuladd8(a0, qv, _vload8(kr, j, ko + c))
                a1 = _vmuladd8(a1, qv, _vload8(kr, j + 1, ko + c))
                a2 = _vmuladd8(a2, qv, _vload8(kr, j + 2, ko + c))
                a3 = _vmuladd8(a3, qv, _vload8(kr, j + 3, ko + c))
            _store_hsum8x4_scaled(sc, row, j, scale32, a0, a1, a2, a3)
            j += 4
    while j < j1:
        sc[row, j] = _dot(q, t, qo, kr, j, ko, hdk) * scale32
        j += 1


@intrinsic
def _vmax8(typingctx, a, b):
    """Lane by lane ``a if a > b else b``."""
    if not (a == _f32x8 and b == _f32x8):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])

    return _f32x8(a, b), codegen


@intrinsic
def _hmax8(typingctx, v):
    """The largest of the eight lanes (exact in any order)."""
    if v != _f32x8:
        return None

    def codegen(context, builder, sig, args):
        lane = [builder.extract_element(args[0], ir.Constant(ir.IntType(32), i)) for i in range(8)]
        while len(lane) > 1:
            lane = [builder.select(builder.fcmp_ordered(">", lane[i], lane[i + 1]), lane[i], lane[i + 1])
                    for i in range(0, len(lane), 2)]
        return lane[0]

    return types.float32(v), codegen


@intrinsic
def _dadd4(typingctx, arr, row, col, acc):
    """``acc + double(arr[row, col:col+4])`` on four float64 lanes (same contract as ``_vload8``)."""
    if not (acc == _f64x4 and _is_f32_2d(arr)):
        return None

    def codegen(context, builder, sig, args):
        p = builder.bitcast(_row_ptr(context, builder, sig, args), _V4F.as_pointer())
        return builder.fadd(args[3], builder.fpext(builder.load(p, align=4), _V4D))

    return _f64x4(arr, row, col, acc), codegen


@njit(cache=True, error_model="numpy")
def _attn_softmax(sc, row, lo, n):
    """Scores ``sc[row, lo:n]`` -> weights in place: the reference's row max, float32 exp, float64 sum,
    ``e * f32(1/sum)``. The sum takes four lanes (lane l adds j = lo + l mod 4 in order), then
    (l0 + l1) + (l2 + l3), then the tail in order."""
    m = sc[row, lo]
    j = lo + 1
    if j + 8 <= n:
        mv = _vload8(sc, row, j)
        j += 8
        while j + 8 <= n:
            mv = _vmax8(_vload8(sc, row, j), mv)
            j += 8
        hm = _hmax8(mv)
        m = hm if hm > m else m
    while j < n:
        m = sc[row, U(j)] if sc[row, U(j)] > m else m
        j += 1
    for j in range(lo, n):
        sc[row, U(j)] = _exp32(sc[row, U(j)] - m)
    acc = _dzero4()
    j = lo
    while j + 4 <= n:
        acc = _dadd4(sc, row, j, acc)
        j += 4
    tot = _dpairs4(acc)
    while j < n:
        tot += np.float64(sc[row, U(j)])
        j += 1
    inv = F32(1.0 / tot)
    for j in range(lo, n):
        sc[row, U(j)] = sc[row, U(j)] * inv


@njit(cache=True, error_model="numpy")
def _attn_pv(sc, row, vr, vo, j0, j1, hdv, out, t, oo):
    """``out[t, oo:oo+hdv] += sum_{j0 <= j < j1} w_j * vr[j, vo:vo+hdv]``, each output value adding its
    products in key order (so splitting a chunk into key blocks changes nothing). 64 values per pass in
    eight vector accumulators (enough independent chains to hide the add latency), then 8, then 1."""
    d = 0
    while d + 64 <= hdv:
        c = oo + d
        o0 = _vload8(out, t, c)
        o1 = _vload8(out, t, c + 8)
        o2 = _vload8(out, t, c + 16)
        o3 = _vload8(out, t, c + 24)
        o4 = _vload8(out, t, c + 32)
        o5 = _vload8(out, t, c + 40)
        o6 = _vload8(out, t, c + 48)
        o7 = _vload8(out, t, c + 56)
        cv = vo + d
        for j in range(j0, j1):
            w = _vsplat8(sc[row, j])
            o0 = _vmuladd8(o0, w, _vload8(vr, j, cv))
            o1 = _vmuladd8(o1, w, _vload8(vr, j, cv + 8))
            o2 = _vmuladd8(o2, w, _vload8(vr, j, cv + 16))
            o3 = _vmuladd8(o3, w, _vload8(vr, j, cv + 24))
            o4 = _vmuladd8(o4, w, _vload8(vr, j, cv + 32))
            o5 = _vmuladd8(o5, w, _vload8(vr, j, cv + 40))
            o6 = _vmuladd8(o6, w, _vload8(vr, j, cv + 48))
            o7 = _vmuladd8(o7, w, _vload8(vr, j, cv + 56))
        _vstore8(out, t, c, o0)
        _vstore8(out, t, c + 8, o1)
        _vstore8(out, t, c + 16, o2)
        _vstore8(out, t, c + 24, o3)
        _vstore8(out, t, c + 32, o4)
        _vstore8(out, t, c + 40, o5)
        _vstore8(out, t, c + 48, o6)
        _vstore8(out, t, c + 56, o7)
        d += 64
    while d + 8 <= hdv:
        o0 = _vload8(out, t, oo + d)
        for j in range(j0, j1):
            o0 = _vmuladd8(o0, _vsplat8(sc[row, j]), _vload8(vr, j, vo + d))
        _vstore8(out, t, oo + d, o0)
        d += 8
    while d < hdv:
        acc = out[t, oo + d]
        for j in range(j0, j1):
            acc += sc[row, j] * _at32(vr, j, vo + d)
        out[t, oo + d] = acc
        d += 1


@njit(cache=True, error_model="numpy", inline="always")
def _window_start(p, window):
    """First row a token at position p reads: 0, or p - window + 1 in a sliding-window layer."""
    if window > 0 and p + 1 > window:
        return p + 1 - window
    return 0


@njit(cache=True, error_model="numpy")
def _attn_unit(q, kr, vr, pos, g, h0, h1, t0, t1, hdk, hdv, scale32, max_len, window, out):
    """Query heads h0..h1-1 (all reading kv head g) for tokens t0..t1-1: what one worker owns.

    Keys are taken in blocks of ``ATTN_KEY_BLOCK`` rows; each block of K (then of V) is used by every
    (token, head) pair of the unit while it sits in L1, instead of being streamed from L2/L3 once per
    query head and token. Every (token, head) result is the same float operations whatever the unit's
    shape, so the split into units (which follows the thread count) never changes a bit.

    ``window`` > 0 (sliding-window layers): token t reads only rows ``pos[t] - window + 1 .. pos[t]``;
    rows before are never read, as rows after ``pos[t]`` are not. Key blocks and chunks stay aligned to
    absolute rows, so a token's result is the same whichever other tokens share its unit.
    """
    nh = h1 - h0
    ko = g * hdk
    vo = g * hdv
    kend = 0
    kbeg = max_len
    for t in range(t0, t1):
        kend = max(kend, pos[t] + 1)  # the window is the mask: rows beyond pos[t] are never read
        kbeg = min(kbeg, _window_start(pos[t], window))
    kbeg -= kbeg % ATTN_KEY_BLOCK
    sc = np.empty(((t1 - t0) * nh, max_len), F32)
    for k0 in range(kbeg, kend, ATTN_KEY_BLOCK):
        k1 = min(kend, k0 + ATTN_KEY_BLOCK)
        for t in range(t0, t1):
            j0 = max(k0, _window_start(pos[t], window))
            j1 = min(k1, pos[t] + 1)
            for h in range(h0, h1):
                _attn_scores(q, t, h * hdk, kr, ko, j0, j1, hdk, scale32, sc, (t - t0) * nh + h - h0)
    for t in range(t0, t1):
        for h in range(h0, h1):
            _attn_softmax(sc, (t - t0) * nh + h - h0, _window_start(pos[t], window), pos[t] + 1)
            for d in range(h * hdv, (h + 1) * hdv):
                out[t, d] = F32(0.0)
    part = np.empty(((t1 - t0) * nh, hdv), F32)  # this chunk's sum of w_j v_j, per (token, head)
    for k0 in range(kbeg, kend, ATTN_KEY_BLOCK):
        k1 = min(kend, k0 + ATTN_KEY_BLOCK)
        for t in range(t0, t1):
            n = pos[t] + 1
            lo = _window_start(pos[t], window)
            if k0 >= n or k1 <= lo:
                continue
            j0 = max(k0, lo)
            j1 = min(k1, n)
            flush = (k0 + ATTN_KEY_BLOCK) % ATTN_KEY_CHUNK == 0 or j1 == n  # chunk or window ends here
            for h in range(h0, h1):
                row = (t - t0) * nh + h - h0
                if k0 % ATTN_KEY_CHUNK == 0 or k0 <= lo:  # a chunk starts, or the token's first block
                    for d in range(hdv):
                        part[row, d] = F32(0.0)
                _attn_pv(sc, row, vr, vo, j0, j1, hdv, part, row, 0)
                if flush:
                    for d in range(hdv):
                        out[t, h * hdv + d] += part[row, d]


@njit(cache=True, error_model="numpy", inline="always")
def _head_subsets(group, n_head_kv, n_blocks, n_threads):
    """(n_sub, per_sub): phase-0 units are (kv head, subset of its query heads, token block). A unit reads
    its K/V blocks once for all its heads; only when there are fewer (kv head, token block) pairs than
    threads are a group's heads split into ``n_sub`` subsets of ``per_sub``, so that every thread gets
    work. (Splitting sooner measured slower for decode, which is bound by reading K/V: a split reads them
    twice.)"""
    n_sub = 1
    if n_head_kv * n_blocks < n_threads:
        n_sub = min(group, (n_threads + n_head_kv * n_blocks - 1) // (n_head_kv * n_blocks))
    per_sub = (group + n_sub - 1) // n_sub
    return (group + per_sub - 1) // per_sub, per_sub


@njit(cache=True, error_model="numpy", inline="always")
def _unit_span(v, n_blocks, n_sub, per_sub, group):
    """(kv head g, query heads h0..h1-1, token block b) of phase-0 unit ``v`` of one run of tokens."""
    b = v % n_blocks
    s = (v // n_blocks) % n_sub
    g = v // (n_blocks * n_sub)
    # zigzag the token blocks (0, n-1, 1, n-2, ...): with causal windows their cost grows with the
    # token index, and any contiguous range of units (what a worker gets) then holds a balanced mix
    b = b // 2 if b % 2 == 0 else n_blocks - 1 - b // 2
    h0 = g * group + s * per_sub
    return g, h0, min(g * group + group, h0 + per_sub), b


@njit(cache=True, error_model="numpy")
def _attn_task(
    phase, u, n_blocks, n_sub, per_sub, n_chunks, group, q, kr, vr, pos, hdk, hdv, scale32, max_len, window, sc,
    part, out
):
    """Work unit u of a phase. Phase 0: everything for (kv head, head subset, token block) units.
    Phases 1-3 split one token's keys (see ``attention``): 1 scores of (kv head, key chunk), 2 softmax of
    one head, 3 the chunk sums of w_j v_j of (kv head, key chunk), each unit computing exactly what
    ``_attn_unit`` computes for those keys."""
    if phase == 0:
        g, h0, h1, b = _unit_span(u, n_blocks, n_sub, per_sub, group)
        t0 = b * ATTN_TOKEN_BLOCK
        t1 = min(q.shape[0], t0 + ATTN_TOKEN_BLOCK)
        _attn_unit(q, kr, vr, pos, g, h0, h1, t0, t1, hdk, hdv, scale32, max_len, window, out)
    elif phase == 2:
        _attn_softmax(sc, u, 0, max_len)
    else:
        g = u // n_chunks
        c = u % n_chunks
        c0 = c * ATTN_KEY_CHUNK
        c1 = min(max_len, c0 + ATTN_KEY_CHUNK)
        if phase == 3:
            for h in range(g * group, (g + 1) * group):
                for d in range(hdv):
                    part[h * n_chunks + c, d] = F32(0.0)
        for k0 in range(c0, c1, ATTN_KEY_BLOCK):  # key blocks shared by the group's heads while in L1
            k1 = min(c1, k0 + ATTN_KEY_BLOCK)
            for h in range(g * group, (g + 1) * group):
                if phase == 1:
                    _attn_scores(q, 0, h * hdk, kr, g * hdk, k0, k1, hdk, scale32, sc, h)
                else:
                    _attn_pv(sc, h, vr, g * hdv, k0, k1, hdv, part, h * n_chunks + c, 0)


@njit(cache=True, error_model="numpy", inline="always")
def _attn_geometry(q, k_region, v_region, positions, n_head, n_head_kv, hdk, hdv, window, out):
    """-1 when the operands fit each other, else the kernels' error code (-2, -3 or -4)."""
    nt = q.shape[0]
    if (
        n_head_kv < 1
        or window < 0
        or n_head % n_head_kv
        or hdk < 1
        or hdv < 1
        or q.shape[1] != n_head * hdk
        or out.shape[0] != nt
        or out.shape[1] != n_head * hdv
        or positions.shape[0] != nt
        or k_region.shape[1] != n_head_kv * hdk
        or v_region.shape[1] != n_head_kv * hdv
        or v_region.shape[0] != k_region.shape[0]
    ):
        return -2
    if q.strides[1] != 4 or out.strides[1] != 4 or k_region.strides[1] != k_region.itemsize or \
            v_region.strides[1] != v_region.itemsize:
        return -3  # the vector loads/stores move 8 consecutive values of a row
    if out.ctypes.data == q.ctypes.data:
        return -4  # out rows are accumulated in place while other workers still read q
    return -1


@njit(cache=True, error_model="numpy", parallel=True)
def _attn_kernel(
    q, k_region, v_region, positions, n_head, n_head_kv, hdk, hdv, scale, n_threads, phase, sc, part, window, out
):
    """Returns -1 when done, -2 on a geometry mismatch, -3 when rows are not contiguous, -4 when out is q,
    else the first token whose position is outside the regions (nothing is written then).

    ``phase`` 0 computes everything; 1, 2, 3 are the steps of a decode split by keys, which the caller
    runs in order with the scratch ``sc [n_head, window]`` and ``part [n_head * n_chunks, head_dim_v]``
    (phase 0 ignores them; they read every row 0..pos, so a caller splits only a token whose sliding
    ``window`` covers them all)."""
    nt = q.shape[0]
    n_ctx = k_region.shape[0]
    code = _attn_geometry(q, k_region, v_region, positions, n_head, n_head_kv, hdk, hdv, window, out)
    if code != -1:
        return code
    max_len = 0
    for t in range(nt):
        p = positions[t]
        if p < 0 or p >= n_ctx:
            return t
        max_len = max(max_len, p + 1)
    group = n_head // n_head_kv
    n_blocks = (nt + ATTN_TOKEN_BLOCK - 1) // ATTN_TOKEN_BLOCK
    n_chunks = (max_len + ATTN_KEY_CHUNK - 1) // ATTN_KEY_CHUNK
    scale32 = F32(scale)
    # the thread count comes from the caller: numba's get_num_threads inside a kernel would keep it out of
    # the on-disk cache
    n_sub, per_sub = _head_subsets(group, n_head_kv, n_blocks, n_threads)
    if phase == 0:
        n_units = n_head_kv * n_sub * n_blocks
    elif phase == 2:
        n_units = n_head
    else:
        if nt != 1 or sc.shape[0] != n_head or sc.shape[1] < max_len or part.shape[0] != n_head * n_chunks:
            return -2
        if part.shape[1] != hdv:
            return -2
        n_units = n_head_kv * n_chunks
    for u in prange(n_units):
        _attn_task(
            phase,
            u,
            n_blocks,
            n_sub,
            per_sub,
            n_chunks,
            group,
            q,
            k_region,
            v_region,
            positions,
            hdk,
            hdv,
            scale32,
            max_len,
            window,
            sc,
            part,
            out,
        )
    if phase == 3:  # each head adds its chunk sums in chunk order, as _attn_unit does
        for h in range(n_head):
            for d in range(hdv):
                acc = F32(0.0)
                for c in range(n_chunks):
                    acc += part[h * n_chunks + c, d]
                out[0, h * hdv + d] = acc
    return -1


@njit(cache=True, error_model="numpy", parallel=True)
def _attn_rows_kernel(
    q, k_region, v_region, positions, rows, n_head, n_head_kv, hdk, hdv, scale, n_threads, window, out
):
    """Attention for tokens of several sequences sharing regions, in one parallel loop: token t reads the
    rows ``rows[t] - positions[t]`` (its sequence's position 0) up to ``rows[t]``.

    Tokens are taken in runs that share their first row (a sequence's tokens, consecutive in the batch);
    each run is split into the same (kv head, head subset, token block) units as ``_attn_kernel``'s
    phase 0, on a view of the regions starting at the run's first row, so every (token, head) result is
    bit-identical to attending that sequence alone. Returns as ``_attn_kernel`` does (-1 when done), the
    first bad token when a row is outside the regions or before its position."""
    nt = q.shape[0]
    n_ctx = k_region.shape[0]
    code = _attn_geometry(q, k_region, v_region, positions, n_head, n_head_kv, hdk, hdv, window, out)
    if code != -1:
        return code
    if rows.shape[0] != nt:
        return -2
    run_start = np.empty(nt + 1, np.int64)  # runs of tokens with one first row: run_start[i]..run_start[i+1]
    n_runs = 0
    max_len = 0
    for t in range(nt):
        p = positions[t]
        r = rows[t]
        if p < 0 or r < p or r >= n_ctx:
            return t
        max_len = max(max_len, p + 1)
        if t == 0 or r - p != rows[t - 1] - positions[t - 1]:
            run_start[n_runs] = t
            n_runs += 1
    run_start[n_runs] = nt
    group = n_head // n_head_kv
    n_blocks_all = 0
    for i in range(n_runs):
        n_blocks_all += (run_start[i + 1] - run_start[i] + ATTN_TOKEN_BLOCK - 1) // ATTN_TOKEN_BLOCK
    n_sub, per_sub = _head_subsets(group, n_head_kv, n_blocks_all, n_threads)
    unit_end = np.empty(n_runs, np.int64)  # units of runs 0..i end before unit_end[i]
    n_units = 0
    for i in range(n_runs):
        n_units += n_head_kv * n_sub * ((run_start[i + 1] - run_start[i] + ATTN_TOKEN_BLOCK - 1) // ATTN_TOKEN_BLOCK)
        unit_end[i] = n_units
    scale32 = F32(scale)
    for u in prange(n_units):
        i = 0
        while unit_end[i] <= u:
            i += 1
        t_first = run_start[i]
        n_blocks = (run_start[i + 1] - t_first + ATTN_TOKEN_BLOCK - 1) // ATTN_TOKEN_BLOCK
        g, h0, h1, b = _unit_span(u - (unit_end[i] - n_head_kv * n_sub * n_blocks), n_blocks, n_sub, per_sub, group)
        t0 = t_first + b * ATTN_TOKEN_BLOCK
        t1 = min(run_start[i + 1], t0 + ATTN_TOKEN_BLOCK)
        base = rows[t_first] - positions[t_first]
        _attn_unit(
            q, k_region[base:], v_region[base:], positions, g, h0, h1, t0, t1, hdk, hdv, scale32, max_len, window, out
        )
    return -1


_NO_SCRATCH = np.zeros((1, 1), F32)


def _attention_split_by_keys(
    q, k_region, v_region, positions, n_head, n_head_kv, head_dim_k, head_dim_v, scale, n_threads, out
) -> int:
    """One token's attention as three kernel calls split by keys; -5 when its window fits one key chunk
    (or its position is not valid: the single-step path then reports it), else the kernel's code."""
    n = int(positions[0]) + 1
    n_chunks = (n + ATTN_KEY_CHUNK - 1) // ATTN_KEY_CHUNK
    if n_chunks < 2 or n > k_region.shape[0]:
        return -5
    sc = np.empty((n_head, n), F32)
    part = np.empty((n_head * n_chunks, head_dim_v), F32)
    code = -1
    for phase in (1, 2, 3):
        code = _attn_kernel(
            q,
            k_region,
            v_region,
            positions,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            scale,
            n_threads,
            phase,
            sc,
            part,
            0,
            out,
        )
        if code != -1:
            break
    return code


def attention(
    q: np.ndarray,
    k_region: np.ndarray,
    v_region: np.ndarray,
    positions: np.ndarray,
    n_head: int,
    n_head_kv: int,
    head_dim_k: int,
    head_dim_v: int,
    scale: float,
    out: np.ndarray,
    window: int = 0,
) -> None:
    """Causal GQA attention: token t reads cached rows ``0..pos[t]``; query head h reads kv head h // group.
    With ``window`` > 0 (a sliding-window layer) only the rows ``pos[t] - window + 1 .. pos[t]``.

    ``out`` ``[tokens, n_head * head_dim_v]`` must not overlap ``q``. Runs on numba's threads (``numba.
    set_num_threads``); the result does not depend on their number.

    A decode step (one token) whose window spans several key chunks runs as three parallel steps split
    by keys (scores, softmax, chunk sums): one token has too few heads to keep the threads busy on whole
    heads. Its result is bit-identical to the single-step path's.
    """
    k_region, v_region = _kv_cells(k_region, v_region)
    n_threads = get_num_threads()
    code = -5
    if q.shape[0] == 1 and n_threads > 1 and (window == 0 or int(positions[0]) < window):
        code = _attention_split_by_keys(
            q, k_region, v_region, positions, n_head, n_head_kv, head_dim_k, head_dim_v, scale, n_threads, out
        )
    if code == -5:
        code = _attn_kernel(
            q,
            k_region,
            v_region,
            positions,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            scale,
            n_threads,
            0,
            _NO_SCRATCH,
            _NO_SCRATCH,
            window,
            out,
        )
    if code != -1:
        _raise_attention_error(code, q, k_region, v_region, positions, n_head, n_head_kv, head_dim_k, head_dim_v, out)


def attention_rows(
    q: np.ndarray,
    k_region: np.ndarray,
    v_region: np.ndarray,
    positions: np.ndarray,
    rows: np.ndarray,
    n_head: int,
    n_head_kv: int,
    head_dim_k: int,
    head_dim_v: int,
    scale: float,
    out: np.ndarray,
    window: int = 0,
) -> None:
    """:func:`attention` for a batch mixing sequences of one cache: token t sits at region row
    ``rows[t]`` and position ``positions[t]`` of a sequence whose position 0 is row
    ``rows[t] - positions[t]``, and reads that sequence's rows only. One parallel call serves every
    sequence; each token's result is bit-identical to :func:`attention` on its sequence's rows alone."""
    if rows.shape != positions.shape:
        raise ValueError(f"attention: {rows.shape[0]} rows for {positions.shape[0]} positions")
    k_region, v_region = _kv_cells(k_region, v_region)
    code = _attn_rows_kernel(
        q, k_region, v_region, positions, rows, n_head, n_head_kv, head_dim_k, head_dim_v, scale, get_num_threads(),
        window, out,
    )
    if code == -1:
        return
    if code >= 0 and 0 <= int(rows[code]) < k_region.shape[0]:
        raise ValueError(f"attention: token {code} at row {int(rows[code])} has position {int(positions[code])} "
                         "before its sequence's first row")
    _raise_attention_error(code, q, k_region, v_region, positions, n_head, n_head_kv, head_dim_k, head_dim_v, out)


def _kv_cells(k_region: np.ndarray, v_region: np.ndarray, what: str = "attention") -> tuple[np.ndarray, np.ndarray]:
    """The K/V regions as the kernels take them: float32, or float16 as uint16 bit patterns (converted in
    the kernels, so an f16 cache needs no float32 copy of its window); ``what`` names the caller in the
    error."""
    if k_region.dtype != v_region.dtype or k_region.dtype not in (np.float32, np.float16):
        raise ValueError(f"{what}: the K/V regions must both be float32 or both float16, got {k_region.dtype} "
                         f"and {v_region.dtype}")
    if k_region.dtype == np.float16:
        return k_region.view(np.uint16), v_region.view(np.uint16)
    return k_region, v_region


def _raise_attention_error(
    code: int, q, k_region, v_region, positions, n_head, n_head_kv, head_dim_k, head_dim_v, out
) -> None:
    if code == -3:
        raise ValueError("attention: q, the K/V regions and out must have contiguous rows")
    if code == -4:
        raise ValueError("attention: out must not be q (it is written while q is read)")
    if code == -2:
        raise ValueError(
            f"attention: q {q.shape}, regions {k_region.shape} / {v_region.shape}, positions {positions.shape}, "
            f"out {out.shape} do not fit n_head {n_head}, n_head_kv {n_head_kv}, head dims {head_dim_k}/{head_dim_v}"
        )
    raise ContextOverflowError(
        f"attention: position {int(positions[code])} (token {code}) is outside the KV regions of "
        f"{k_region.shape[0]} positions"
    )


# ---------------------------------------------------------------------------------------------------------
# warmup


def warmup() -> None:
    """Compile (or load from the on-disk cache) every kernel signature the engine uses.

    Signatures: float32 C-contiguous 2-D activations and regions, 1-D float32 gains/biases, 1-D int32
    positions, Python int/float/bool scalars. Anything else (int64 positions, non-contiguous views)
    still works but compiles its own specialization on first use.
    """
    x = np.ones((2, 16), F32)
    out = np.empty_like(x)
    rms_norm(x, 1e-5, 16, out)
    rms_norm_mul(x, x[0], 1e-5, 16, out)
    add(x, x, out)
    add(x, x[0], out)
    mul(x, x, out)
    mul(x, x[0], out)
    swiglu(x, x, out)
    silu(x, out)
    geglu(x, x, out)
    gelu(x, out)
    scale(x, 2.0, out)
    pos = np.zeros(2, np.int32)
    RopeTable(8, 8, 10000.0, 1.0, n_pos=2).apply(x, pos, 2, True, np.empty_like(x))
    regions = np.zeros((4, 16), F32), np.zeros((4, 16), F32)
    kv_store(x, x, pos, *regions)
    attention(x, *regions, pos, 2, 2, 8, 8, 0.5, np.empty_like(x))
    attention(x, *regions, pos, 2, 2, 8, 8, 0.5, np.empty_like(x), window=1)
    for window in (0, 1):
        attention_rows(x, *regions, pos, np.array([0, 2], np.int32), 2, 2, 8, 8, 0.5, np.empty_like(x), window)
