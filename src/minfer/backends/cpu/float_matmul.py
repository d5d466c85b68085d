"""Fast ``out = x @ W^T`` for float weights (F32, F16, BF16) read as their raw bytes.

Plain f32 dot products on the unquantized activations, eight lanes at a time, weights widened to f32 in
registers, then the fixed-order horizontal sum of the quantized matmuls (``simd.hsum_folded``), plus a
scalar tail when ``n_in % 8 != 0``. Decode (one token) runs 4 weight rows per pass sharing the activation
loads, the next rows prefetched; prefill runs one weight row against tiles of 8 tokens. A token's row of
output is the same float operations alone or inside a prompt, at any thread count (see
:mod:`~minfer.backends.cpu.quant_matmul`, whose :func:`~minfer.backends.cpu.quant_matmul.matmul` is the
entry point for these weights too).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from minfer.backends.cpu.matmul_tiles import GEMM_ROWS, GEMM_TOKENS, PREFETCH_ROWS, as_f32_2d, store_tile
from minfer.backends.cpu.simd import (
    LL_F32,
    LL_I16,
    LL_I32,
    as_intp,
    f32x8,
    fma_f32x8,
    hsum_folded,
    ir_half_to_float,
    is_1d,
    load_f32x8,
    prefetch,
    zeros_f32x8,
)
from minfer.formats.quants import GGMLType

# Float weights stay raw bytes; ``kind`` (0: F32, 1: F16, 2: BF16) picks how to widen them. It is a
# runtime value rather than a compile-time type so that the three types share one compiled kernel
# (three specializations cost ~10 s of JIT on a cold cache); the test is loop-invariant, so LLVM moves it
# out of the loops (unswitching) and the inner loops carry no branch.
_KIND_F32, _KIND_F16, _KIND_BF16 = 0, 1, 2
WIDENING = {GGMLType.F32: _KIND_F32, GGMLType.F16: _KIND_F16, GGMLType.BF16: _KIND_BF16}  # type -> kind


def _load_widened(context, builder, sig, args, n: int | None):
    """n (or one, when None) weights from element ``i`` of the raw bytes, widened to float32."""
    arr = context.make_array(sig.args[0])(context, builder, args[0])
    kind = context.cast(builder, args[1], sig.args[1], types.intp)
    idx = as_intp(context, builder, args[2], sig.args[2])
    f32 = ir.VectorType(LL_F32, n) if n else LL_F32
    i16 = ir.VectorType(LL_I16, n) if n else LL_I16
    result = cgutils.alloca_once(builder, f32)
    is_f32 = builder.icmp_signed("==", kind, ir.Constant(kind.type, _KIND_F32))
    with builder.if_else(is_f32) as (f32_case, half_case):
        with f32_case:
            p = builder.gep(arr.data, [builder.mul(idx, ir.Constant(idx.type, 4))], inbounds=True)
            builder.store(builder.load(builder.bitcast(p, ir.PointerType(f32)), align=1), result)
        with half_case:
            p = builder.gep(arr.data, [builder.mul(idx, ir.Constant(idx.type, 2))], inbounds=True)
            raw = builder.load(builder.bitcast(p, ir.PointerType(i16)), align=1)
            as_f16 = ir_half_to_float(builder, raw)
            i32 = ir.VectorType(LL_I32, n) if n else LL_I32
            sixteen = ir.Constant(i32, [16] * n) if n else ir.Constant(i32, 16)
            as_bf16 = builder.bitcast(builder.shl(builder.zext(raw, i32), sixteen), f32)
            is_f16 = builder.icmp_signed("==", kind, ir.Constant(kind.type, _KIND_F16))
            builder.store(builder.select(is_f16, as_f16, as_bf16), result)
    return builder.load(result)


@intrinsic
def _load_w8(typingctx, w, kind, i):
    """Eight float weights w[i:i+8] (element index into raw bytes of ``kind``), as float32."""
    if not is_1d(w):
        return None
    return f32x8(w, kind, i), lambda context, builder, sig, args: _load_widened(context, builder, sig, args, 8)


@intrinsic
def _load_w(typingctx, w, kind, i):
    """One float weight w[i], as float32."""
    if not is_1d(w):
        return None
    return types.float32(w, kind, i), lambda context, builder, sig, args: _load_widened(
        context, builder, sig, args, None
    )


@njit(inline="always")
def _row_float(w, kind, o, n, x, xo):
    """One float row (elements from ``o``) against one token (``x[xo:xo+n]``)."""
    acc = zeros_f32x8()
    n8 = n - n % 8
    for k in range(0, n8, 8):
        acc = fma_f32x8(acc, _load_w8(w, kind, o + k), load_f32x8(x, xo + k))
    s = hsum_folded(acc)
    for k in range(n8, n):
        s += _load_w(w, kind, o + k) * x[xo + k]
    return s


@njit(parallel=True, cache=True)
def _gemv_float(w, kind, x, out):
    """w: flat raw float weights of ``kind``, x float32[n_in], out float32[1, n_out]."""
    n_out = out.shape[1]
    n = x.shape[0]
    n8 = n - n % 8
    n_pass = n_out // 4
    esize = 4 if kind == _KIND_F32 else 2
    for p in prange(n_pass):
        r0 = 4 * p
        acc0, acc1, acc2, acc3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
        o = r0 * n
        # ``w`` is raw bytes while ``o`` counts weights: the prefetch runs in bytes. The pass's four rows
        # are contiguous, so one linear stream PREFETCH_ROWS rows ahead covers them (4 rows x 8 weights:
        # 64 bytes for f16/bf16, 128 for f32 per iteration). It ran in weights until 2026-12 and so
        # fetched rows already read: F16 decode streamed ~3x slower than the quantized types.
        pf = (o + PREFETCH_ROWS * n) * esize
        step = 32 * esize
        for k in range(0, n8, 8):
            prefetch(w, pf)
            prefetch(w, pf + step - 64)  # f32: the second line (f16: the same one again)
            pf += step
            xv = load_f32x8(x, k)
            acc0 = fma_f32x8(acc0, _load_w8(w, kind, o + k), xv)
            acc1 = fma_f32x8(acc1, _load_w8(w, kind, o + n + k), xv)
            acc2 = fma_f32x8(acc2, _load_w8(w, kind, o + 2 * n + k), xv)
            acc3 = fma_f32x8(acc3, _load_w8(w, kind, o + 3 * n + k), xv)
        s0, s1, s2, s3 = hsum_folded(acc0), hsum_folded(acc1), hsum_folded(acc2), hsum_folded(acc3)
        for k in range(n8, n):
            s0 += _load_w(w, kind, o + k) * x[k]
            s1 += _load_w(w, kind, o + n + k) * x[k]
            s2 += _load_w(w, kind, o + 2 * n + k) * x[k]
            s3 += _load_w(w, kind, o + 3 * n + k) * x[k]
        out[0, r0], out[0, r0 + 1], out[0, r0 + 2], out[0, r0 + 3] = s0, s1, s2, s3
    for r in range(4 * n_pass, n_out):
        out[0, r] = _row_float(w, kind, r * n, n, x, 0)


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
                a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
                a4, a5, a6, a7 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
                o = r * n
                xo = t0 * n
                for k in range(0, n8, 8):
                    wv = _load_w8(w, kind, o + k)
                    a0 = fma_f32x8(a0, wv, load_f32x8(x, xo + k))
                    a1 = fma_f32x8(a1, wv, load_f32x8(x, xo + n + k))
                    a2 = fma_f32x8(a2, wv, load_f32x8(x, xo + 2 * n + k))
                    a3 = fma_f32x8(a3, wv, load_f32x8(x, xo + 3 * n + k))
                    a4 = fma_f32x8(a4, wv, load_f32x8(x, xo + 4 * n + k))
                    a5 = fma_f32x8(a5, wv, load_f32x8(x, xo + 5 * n + k))
                    a6 = fma_f32x8(a6, wv, load_f32x8(x, xo + 6 * n + k))
                    a7 = fma_f32x8(a7, wv, load_f32x8(x, xo + 7 * n + k))
                if n8 == n:
                    store_tile(out, t0, r, a0, a1, a2, a3, a4, a5, a6, a7)
                else:
                    # the scalar tail must follow the horizontal sum, as in _row_float
                    s = np.empty(GEMM_TOKENS, np.float32)
                    s[0], s[1], s[2], s[3] = hsum_folded(a0), hsum_folded(a1), hsum_folded(a2), hsum_folded(a3)
                    s[4], s[5], s[6], s[7] = hsum_folded(a4), hsum_folded(a5), hsum_folded(a6), hsum_folded(a7)
                    for c in range(GEMM_TOKENS):
                        v = s[c]
                        for k in range(n8, n):
                            v += _load_w(w, kind, o + k) * x[xo + c * n + k]
                        out[t0 + c, r] = v
        for t in range(n_full, n_tok):
            for r in range(r0, r1):
                out[t, r] = _row_float(w, kind, r * n, n, x, t * n)


def matmul(flat: np.ndarray, kind: int, x: np.ndarray, out: np.ndarray) -> None:
    """``out[n_tok, n_out] = x @ W^T``, ``flat`` the raw weights of ``kind`` (:data:`WIDENING`), ``out``
    C-contiguous."""
    (_gemv_float if out.shape[0] == 1 else _gemm_float)(flat, kind, as_f32_2d(x).reshape(-1), out)
