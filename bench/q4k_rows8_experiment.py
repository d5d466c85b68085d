"""Experiment, not an engine kernel: how fast could Q4_K prefill be with VNNI's one vpdpbusd per 32 products?

(The engine's Q4_K now runs on a rows-in-lanes layout of its own, ``minfer.backends.cpu.kquant_rows8``,
with pmaddubsw pair sums and the scales in pmaddwd; this file measures the vpdpbusd + vpmulld variant of
that layout on VNNI CPUs, against the engine's kernel (the repacked one) on the same weights.)

    python bench/q4k_rows8_experiment.py [--tokens 128] [--threads 1 2]

The engine's K-quant kernels keep, per (row, token, super-block), eight int32 lanes that mix the eight
sub-blocks (each lane: values 4i..4i+3 of every 32-value chunk, times that chunk's scale) and add them in
float32 lane by lane; the decode (GEMV) and prefill (GEMM) kernels share that arithmetic, so a token's
logits are the same bits in a prompt or alone. That layout needs a scale multiply per 32 products
(pmaddubsw + pmaddwd, or pmaddubsw + vpdpwssd with VNNI): at least two multiply instructions per 32
multiply-adds.

This file measures the other layout, llama.cpp's "repacked" one: eight weight rows side by side in one
register (4 consecutive values of each), activations broadcast 4 bytes at a time, so one vpdpbusd does
32 multiply-adds with no scale; each 32-value sub-block's exact int32 sum is then scaled once (vpmulld)
and the super-block's exact integer total S, and its min term M (vpdpwssd on Q8_K's bsums), enter
float32 once each: ``acc = fma(float(S), d d_x, acc); acc = fma(float(M), -(dmin d_x), acc)``. Adopting
it would change decode's arithmetic too (the bit-identity of GEMV and GEMM must hold), which is the
decode kernels' business: hence an experiment here, run on VNNI CPUs only, checked against the float64
reference before it is timed, and printed against the engine's kernel on the same weights.
"""

from __future__ import annotations

import argparse
import sys
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import simd
from minfer.backends.cpu.simd import (
    LL_I8,
    LL_I16,
    LL_I32,
    V8F,
    V8I,
    V32B,
    array_data,
    f32x8,
    ir_call,
    ir_fmadd,
    ir_half_to_float,
    ir_load,
    ir_plus,
    ir_splat,
    splat_constant,
)
from minfer.formats.kquants import KQUANT_DEQUANTIZERS, k4_scales_mins
from minfer.formats.quants import GGMLType
from minfer.formats.tensors import WeightTensor

T = 4  # tokens per register tile (8 spills: 8 x 3 accumulators do not fit 32 registers)
SB_BYTES = 1024 + 64 + 128 + 32  # one super-block of 8 rows: quants, scales, min pairs, d and dmin (f16)


def repack(raw: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q4_K rows -> per (group of 8 rows, super-block) SB_BYTES: for sub-block j, four 32-byte registers
    [row (8), k (4)] with step p (values 4p..4p+3) in the low nibbles and step p + 4 in the high ones;
    then the scales u8 [j, row], the mins as int16 pairs [i, row, (m_2i, m_2i+1)], d and dmin f16 [row]."""
    nbk = n_in // 256
    g = n_out // 8
    b = raw.reshape(g, 8, nbk, 144)
    qs = b[..., 16:144].reshape(g, 8, nbk, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=4).reshape(g, 8, nbk, 8, 32)  # [g, row, b, j=2c+h, l]
    steps = q.reshape(g, 8, nbk, 8, 8, 4)  # [g, row, b, j, step, k]
    packed_q = steps[:, :, :, :, :4] | (steps[:, :, :, :, 4:] << 4)  # [g, row, b, j, p, k]
    packed_q = packed_q.transpose(0, 2, 3, 4, 1, 5).reshape(g, nbk, 1024)
    sc, mn = k4_scales_mins(b[..., 4:16].reshape(-1, 12))
    sc = sc.reshape(g, 8, nbk, 8).transpose(0, 2, 3, 1).reshape(g, nbk, 64).astype(np.uint8)
    mn = mn.reshape(g, 8, nbk, 4, 2).transpose(0, 2, 3, 1, 4).astype(np.int16).reshape(g, nbk, 64)
    dd = b[..., 0:4].reshape(g, 8, nbk, 2, 2).transpose(0, 2, 3, 1, 4).reshape(g, nbk, 32)
    out = np.concatenate([packed_q, sc, mn.view(np.uint8).reshape(g, nbk, 128), dd], axis=2)
    return np.ascontiguousarray(out).reshape(-1)


def _tup(n: int) -> types.UniTuple:
    return types.UniTuple(f32x8, n)


@intrinsic
def _zeros8(typingctx):
    def codegen(context, builder, sig, args):
        return context.make_tuple(builder, _tup(T), [ir.Constant(V8F, [0.0] * 8)] * T)

    return _tup(T)(), codegen


@intrinsic
def _sb_step(typingctx, accs, w, po, aq, ao, n_in, bp, bpo, bpst, dx, dxo):
    """One super-block of 8 rows x T tokens: accs (T x f32x8, lanes = rows) updated."""
    sig = _tup(T)(accs, w, po, aq, ao, n_in, bp, bpo, bpst, dx, dxo)

    def codegen(context, builder, sig, args):
        b = builder
        ta = sig.args

        def ix(k):
            return context.cast(b, args[k], ta[k], types.intp)

        acc = cgutils.unpack_tuple(b, args[0], T)
        wb, ab, bb, db = (array_data(context, b, ta[k], args[k]) for k in (1, 3, 6, 9))
        po, ao, n_in, bpo, bpst, dxo = (ix(k) for k in (2, 4, 5, 7, 8, 10))
        a_at = [b.add(ao, b.mul(n_in, ir.Constant(n_in.type, t))) for t in range(T)]

        def bcast(base, off):
            return b.bitcast(ir_splat(b, ir_load(b, base, off, LL_I32), 8), V8I)

        def dpbusd(c, u, a):
            return ir_call(b, "llvm.x86.avx512.vpdpbusd.256", V8I, [c, b.bitcast(u, V8I), a])

        zero = ir.Constant(V8I, [0] * 8)
        S = [zero] * T
        for j in range(8):
            sc = b.zext(ir_load(b, wb, ir_plus(b, po, 1024 + 8 * j), ir.VectorType(LL_I8, 8)), V8I)
            part = [zero] * T
            for p in range(4):
                r = ir_load(b, wb, ir_plus(b, po, 128 * j + 32 * p), V32B)
                lo = b.and_(r, splat_constant(V32B, 15))
                hi = b.and_(b.bitcast(b.lshr(b.bitcast(r, ir.VectorType(LL_I16, 16)),
                                             splat_constant(ir.VectorType(LL_I16, 16), 4)), V32B),
                            splat_constant(V32B, 15))
                for t in range(T):
                    part[t] = dpbusd(part[t], lo, bcast(ab, ir_plus(b, a_at[t], 32 * j + 4 * p)))
                    part[t] = dpbusd(part[t], hi, bcast(ab, ir_plus(b, a_at[t], 32 * j + 4 * p + 16)))
            for t in range(T):
                S[t] = b.add(S[t], b.mul(part[t], sc))
        out = list(acc)
        halves = ir_half_to_float(b, ir_load(b, wb, ir_plus(b, po, 1024 + 64 + 128), ir.VectorType(LL_I16, 16)))
        d = b.shuffle_vector(halves, halves, ir.Constant(ir.VectorType(LL_I32, 8), list(range(8))))
        dmin = b.shuffle_vector(halves, halves, ir.Constant(ir.VectorType(LL_I32, 8), list(range(8, 16))))
        ndmin = b.fmul(dmin, ir.Constant(V8F, [-1.0] * 8))
        mins = [b.bitcast(ir_load(b, wb, ir_plus(b, po, 1024 + 64 + 32 * i), V32B), V8I) for i in range(4)]
        for t in range(T):
            bo = b.add(bpo, b.mul(bpst, ir.Constant(bpst.type, t)))
            m = zero
            for i in range(4):
                m = ir_call(b, "llvm.x86.avx512.vpdpwssd.256", V8I, [m, mins[i], bcast(bb, ir_plus(b, bo, 4 * i))])
            nbk = b.lshr(bpst, ir.Constant(bpst.type, 4))
            dxt = ir_splat(b, ir_load(b, db, b.add(dxo, b.mul(nbk, ir.Constant(nbk.type, t))), simd.LL_F32), 8)
            out[t] = ir_fmadd(b, b.sitofp(S[t], V8F), b.fmul(d, dxt), out[t])
            out[t] = ir_fmadd(b, b.sitofp(m, V8F), b.fmul(ndmin, dxt), out[t])
        return context.make_tuple(b, _tup(T), out)

    return sig, codegen


@njit(parallel=True)
def gemm(packed, aq, bp, dx, nbk, out):
    """out[n_tok, n_out] for whole groups of 8 rows and whole tiles of T tokens (the experiment's shapes).
    bp: Q8_K's bsums added in pairs (one int16 per 32 values) as bytes; dx: d per token and super-block."""
    n_tok, n_out = out.shape
    n_in = nbk * 256
    flat = out.reshape(-1)
    for g in prange(n_out // 8):
        for t0 in range(0, n_tok, T):
            accs = _zeros8()
            for blk in range(nbk):
                po = (g * nbk + blk) * SB_BYTES
                accs = _sb_step(accs, packed, po, aq, t0 * n_in + blk * 256, n_in, bp, (t0 * nbk + blk) * 16,
                                nbk * 16, dx, t0 * nbk + blk)
            for t in range(T):
                simd.store_f32x8(flat, (t0 + t) * n_out + 8 * g, accs[t])


def best(fn, clock, seconds=0.3) -> float:
    """Best seconds per call by ``clock`` (process CPU time at 1 thread: robust on a shared machine)."""
    fn()
    b = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or b == float("inf"):
        t = clock()
        fn()
        b = min(b, clock() - t)
    return b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    if not simd.VNNI:
        sys.exit("this experiment needs AVX-512 VNNI + VL (or AVX-VNNI) and MINFER_VNNI unset")
    from minfer.testing.kquant_bench import make_weight

    rng = np.random.default_rng(0)
    n_tok = args.tokens - args.tokens % T
    for n_out, n_in in [(2048, 2048), (8192, 2048), (2048, 8192)]:
        w = make_weight(GGMLType.Q4_K, n_out, n_in, rng)
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        xq = km.quantize_activations_q8_k(x)
        nbk = n_in // 256
        packed = repack(np.ascontiguousarray(w.data), n_out, n_in)
        bs = xq.bsums.astype(np.int32)
        bp = (bs[..., 0::2] + bs[..., 1::2]).astype(np.int16).reshape(-1).view(np.uint8)
        dx = np.ascontiguousarray(xq.d.reshape(-1))
        aq = xq._q
        out = np.empty((n_tok, n_out), np.float32)
        gemm(packed, aq, bp, dx, nbk, out)
        wd = KQUANT_DEQUANTIZERS[GGMLType.Q4_K](w.data, n_in).astype(np.float64)
        exact = xq.dequantize().astype(np.float64) @ wd.T
        rel = np.max(np.abs(out - exact) / (np.abs(xq.dequantize()).astype(np.float64) @ np.abs(wd).T))
        engine = np.empty_like(out)
        km.matmul(x, WeightTensor("w", GGMLType.Q4_K, (n_out, n_in), w.data), engine, xq)
        rel_engine = np.max(np.abs(engine - exact) / (np.abs(xq.dequantize()).astype(np.float64) @ np.abs(wd).T))
        prep = km.prepare(w)
        for th in args.threads:
            numba.set_num_threads(th)
            clock = time.process_time if th == 1 else time.perf_counter
            te = best(lambda: km.matmul(x, prep, engine, xq), clock)  # noqa: B023
            tn = best(lambda: gemm(packed, aq, bp, dx, nbk, out), clock)  # noqa: B023
            gf = 2.0 * n_tok * n_out * n_in / 1e9
            kind = "CPU" if th == 1 else "wall"
            print(f"Q4_K {n_out}x{n_in} {n_tok} tok {th} thr ({kind} time): engine {gf / te:6.1f} GFLOP/s, "
                  f"rows8 experiment {gf / tn:6.1f} GFLOP/s (x{te / tn:.2f}); "
                  f"max error / Σ|terms|: {rel:.1e} (engine {rel_engine:.1e})")


if __name__ == "__main__":
    main()
