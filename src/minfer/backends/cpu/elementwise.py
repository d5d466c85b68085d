"""Fast numba versions of the elementwise ops: add, mul, scale, SiLU/SwiGLU, GELU/GEGLU, and the float32
exp they (and the attention softmax) use.

The contract of every vector kernel (here, ``norms``, ``rope``, ``attention``): each function computes what
its namesake in ``reference.py`` computes, on the same arrays (2-D float32 ``[tokens, width]``
activations, 1-D int32 positions, float32 K/V regions ``[n_ctx, n_kv_head * head_dim]``), and may write in
place where the reference allows it (``out is x``; otherwise ``out`` must not overlap the inputs). Shapes
and position bounds are checked inside the kernels, which return an error code that the Python wrapper
turns into the engine's error (a numpy ``positions.max()`` in Python would cost more than a decode-sized
kernel).

Numerics (what ``tests/test_vec_kernels.py`` holds)
    * No ``fastmath`` in any vector kernel: every float operation is plain IEEE, so a kernel's result is
      decided by its source, not by what LLVM chooses to vectorize nor by the CPU having FMA. Reductions
      are written as a fixed number of lanes combined in a fixed tree, with explicit SIMD values
      (:mod:`~minfer.backends.cpu.simd`) where LLVM would not vectorize them by itself: 8 float32 lanes
      for dot products, 8 float64 lanes for the RMSNorm sum of squares, 4 float64 lanes for the softmax
      sum.
    * add / mul: bit-identical (one float32 operation per element).
    * exp (SiLU, softmax): float32 Cody-Waite reduction + degree-6 polynomial, within 1 ulp of the
      correctly rounded value (numpy's float32 exp is within 2 ulp of it); SiLU/SwiGLU agree with the
      reference within a few ulp. GELU (tanh form) uses the same exp, ``x / (1 + exp(-2u))`` for the
      reference's ``0.5 x (1 + tanh(u))``; they agree within a few ulp (absolutely ~1e-7 |x| where
      1 + tanh(u) cancels, for x below about -3).
    * scale: one float32 multiply per element, bit-identical.

Threads
    The row-wise ops (these, RMSNorm, RoPE, the KV store) are serial, except SwiGLU and GEGLU from
    ``PARALLEL_ROWS`` rows on (a prompt), whose rows are shared among the threads: at 512 tokens they took
    5-6% of a prefill on one core (1.5 ms for SmolLM2-135M's 512 x 1536, cold from the matmuls), and two
    threads halve that; attention is ``parallel=True``.
    At decode size they take well under a microsecond of work (a serial ``@njit`` call costs ~0.14 µs,
    a parallel one ~1.3 µs here), and at prefill size a few tens to hundreds of µs against a prefill of
    a second; parallel versions also compile ~3x slower (``cache=True`` pays that once per install, but a
    fresh checkout's tests pay it). The row-wise kernels release the GIL (``nogil=True``): a caller that
    wants them on several threads can give each thread a block of rows (``x[r0:r1]``), which gives the
    same bits since rows are independent.

Every kernel uses error_model="numpy": float division by zero then gives inf/nan as in numpy instead of a
check that raises ZeroDivisionError, and that check would keep LLVM from vectorizing any loop that
divides (SiLU).

Call :func:`warmup` once at backend creation (as every kernel module's): it compiles (or, thanks to
``cache=True``, loads from ``__pycache__``) every signature the engine uses, so the first token does not
pay for JIT compilation.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from minfer.backends.cpu.reference import GELU_BETA, GELU_KAPPA
from minfer.backends.cpu.simd import F32, LL_F32, LL_I32, U

PARALLEL_ROWS = 16  # rows from which SwiGLU and GEGLU run on every thread

# ---------------------------------------------------------------------------------------------------------
# float32 exp

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

        def c(v: int) -> ir.Constant:
            return ir.Constant(LL_I32, v)

        k = builder.sub(builder.bitcast(tv, LL_I32), c(_EXP_SHIFTER_BITS))
        k1 = builder.ashr(k, c(1))
        k2 = builder.sub(k, k1)
        s1 = builder.bitcast(builder.shl(builder.add(k1, c(127)), c(23)), LL_F32)
        s2 = builder.bitcast(builder.shl(builder.add(k2, c(127)), c(23)), LL_F32)
        return builder.fmul(builder.fmul(yv, s1), s2)

    return sig, codegen


@njit(cache=True, error_model="numpy", inline="always")
def exp32(x):
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
                gate[r, i] = g / (F32(1.0) + exp32(-g))
        else:
            for i in range(n):
                g = gate[r, i]
                out[r, i] = g / (F32(1.0) + exp32(-g))
    elif where == 1:
        for i in range(n):
            g = gate[r, i]
            gate[r, i] = (g / (F32(1.0) + exp32(-g))) * up[r, i]
    elif where == 2:
        for i in range(n):
            g = gate[r, i]
            up[r, i] = (g / (F32(1.0) + exp32(-g))) * up[r, i]
    else:
        for i in range(n):
            g = gate[r, i]
            out[r, i] = (g / (F32(1.0) + exp32(-g))) * up[r, i]


@njit(cache=True, error_model="numpy", inline="always")
def _gated_where(gate, up, has_up, out):
    """-2 when the shapes of a gated activation's operands do not fit, else where ``out`` is: 1 gate, 2 up, 0
    an array that overlaps neither."""
    rows, cols = gate.shape
    if out.shape[0] != rows or out.shape[1] != cols or up.shape[0] != rows or up.shape[1] != cols:
        return -2
    return 1 if out.ctypes.data == gate.ctypes.data else (2 if has_up and out.ctypes.data == up.ctypes.data else 0)


@njit(cache=True, error_model="numpy", nogil=True)
def _swiglu_kernel(gate, up, has_up, out):
    """Returns -1 when done, -2 when the shapes do not fit (nothing written then). ``out`` is gate, up,
    or an array that overlaps neither."""
    where = _gated_where(gate, up, has_up, out)
    if where == -2:
        return -2
    for r in range(gate.shape[0]):
        _swiglu_row(gate, up, has_up, r, where, out)
    return -1


@njit(cache=True, error_model="numpy", parallel=True)
def _swiglu_parallel(gate, up, has_up, out):
    """``_swiglu_kernel`` with the rows shared among the threads (the same operations on each row)."""
    where = _gated_where(gate, up, has_up, out)
    if where == -2:
        return -2
    for r in prange(gate.shape[0]):
        _swiglu_row(gate, up, has_up, r, where, out)
    return -1


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """``out = silu(gate) * up``; ``out`` may be ``gate`` or ``up``."""
    kernel = _swiglu_parallel if gate.shape[0] >= PARALLEL_ROWS else _swiglu_kernel
    if kernel(gate, up, True, out) != -1:
        raise ValueError(f"swiglu: shapes gate {gate.shape}, up {up.shape}, out {out.shape} must be equal")


def silu(x: np.ndarray, out: np.ndarray) -> None:
    """``out = x * sigmoid(x)`` computed as the reference does, ``x / (1 + exp(-x))``; ``out`` may be ``x``."""
    if _swiglu_kernel(x, x, False, out) != -1:
        raise ValueError(f"silu: shapes x {x.shape}, out {out.shape} must be equal")


# GELU (tanh approximation, Gemma's ``gelu_pytorch_tanh``) and GEGLU = gelu(gate) * up.
# 0.5 x (1 + tanh(u)) is computed as x / (1 + exp(-2u)) (the same function: 1 + tanh(u) = 2 / (1 + e^-2u)),
# with the float32 exp above; u = sqrt(2/pi) * (x + 0.044715 x^3) in the reference's float32 steps.


@njit(cache=True, error_model="numpy", inline="always")
def _gelu32(x):
    u = GELU_BETA * (x + GELU_KAPPA * (x * x * x))
    return x / (F32(1.0) + exp32(F32(-2.0) * u))


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
    where = _gated_where(gate, up, has_up, out)
    if where == -2:
        return -2
    for r in range(gate.shape[0]):
        _geglu_row(gate, up, has_up, r, where, out)
    return -1


@njit(cache=True, error_model="numpy", parallel=True)
def _geglu_parallel(gate, up, has_up, out):
    """``_geglu_kernel`` with the rows shared among the threads."""
    where = _gated_where(gate, up, has_up, out)
    if where == -2:
        return -2
    for r in prange(gate.shape[0]):
        _geglu_row(gate, up, has_up, r, where, out)
    return -1


def geglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """``out = gelu(gate) * up`` (tanh GELU); ``out`` may be ``gate`` or ``up``."""
    kernel = _geglu_parallel if gate.shape[0] >= PARALLEL_ROWS else _geglu_kernel
    if kernel(gate, up, True, out) != -1:
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


def warmup() -> None:
    """Compile (or load from the on-disk cache) every signature the engine uses: float32 C-contiguous 2-D
    activations, 1-D float32 gains/biases, Python floats. Anything else (non-contiguous views) still works
    but compiles its own specialization on first use."""
    x = np.ones((2, 16), F32)
    out = np.empty_like(x)
    add(x, x, out)
    add(x, x[0], out)
    mul(x, x, out)
    mul(x, x[0], out)
    swiglu(x, x, out)
    silu(x, out)
    geglu(x, x, out)
    many = np.ones((PARALLEL_ROWS, 16), F32)
    swiglu(many, many, many)
    geglu(many, many, many)
    gelu(x, out)
    scale(x, 2.0, out)
