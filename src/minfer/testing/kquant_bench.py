"""Benchmark the Q5_0/Q5_1/K-quant matmul kernels against dequantize + numpy, with Q4_1 (quant_matmul) as a yardstick.

    python bench/kquant_bench.py [--threads 1 2] [--tokens 1 128] [--seconds 0.3] [--types Q4_K Q6_K ...]
    python bench/kquant_bench.py --bandwidth [--threads 1 2] [--types Q4_K Q8_0 F16 ...] [--cpu-time]
    python bench/kquant_bench.py --peak [--threads 1 2] [--tokens 128] [--shapes 2048x2048 ...]

``--peak``: prefill (GEMM) against the machine's arithmetic. Per type (the ``--bandwidth`` types) and shape
(the ``--bandwidth`` shapes, or ``--shapes``), GFLOP/s of a ``--tokens``-token matmul (2 x tokens x n_out x
n_in per call, activations quantized in the call, weights warm in the cache) as a fraction of the float32
FMA peak measured at the same thread count (``minfer.tools.machine``: independent FMAs vectorized for the
host; where the CPU has VNNI the int8 dot-product peak is taken as 4x that, printed beside it).

``--bandwidth [--cpu-time --threads 1]``: decode (GEMV, one token) as a memory-bound kernel. For
each type and each of 2048x2048, 2048x8192 and 8192x2048, enough distinct copies of the weight to
fill BANDWIDTH_WORKING_SET (far past the L3, as a decode step's weights are) are multiplied one after
another: weight bytes per second over the copies, set against the machine's read bandwidth
(``minfer.tools.read_bandwidth``, a STREAM-like read) measured at the same thread count just before.
Both are the best of repeated passes. On a shared machine, wall-clock figures at 2 threads mostly
measure the other processes (a parallel call waits for its descheduled thread); ``--cpu-time`` times
one thread in its own CPU seconds instead (memory contention still counts).
Every type is covered: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, F16 by default (``--types`` picks others).

Shapes (n_out x n_in): SmolLM2-135M's 576x576 (attention), 1536x576 (ffn gate/up), 576x1536 (ffn down),
and a 2048x2048 square. K-quant rows must be whole 256-value super-blocks, so K-quants skip the shapes
with n_in = 576 (llama.cpp's quantizer gives such tensors a 32-block type instead).

Weights are random: Q4_1/Q5_0/Q5_1 quantized from Gaussian values with ``gguf``; K-quants (which gguf-py
cannot quantize) random valid blocks, random bytes with sane f16 scales (the kernels' work does not depend
on the values). Weights fit in the L3 here: these are compute rates, not DRAM-bound decode rates.

Per row: ms per call and GFLOP/s (2 * n_tok * n_out * n_in per call) for the kernel with activations
quantized once outside the call, the kernel including quantization, and "numpy": dequantize the whole
weight (the kquants reference dequantizer) then ``x @ W.T`` in BLAS. Timings are minima over batches.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numba
import numpy as np
from gguf import quants as gq

from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import quant_matmul as qm
from minfer.backends.cpu import simd
from minfer.formats.block_types import GGMLType, block_size, type_size
from minfer.formats.kquants import KQUANT_DEQUANTIZERS
from minfer.formats.quants import DEQUANTIZERS
from minfer.formats.tensors import WeightTensor

SHAPES = [(576, 576), (1536, 576), (576, 1536), (2048, 2048)]
TYPES = ["Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
BANDWIDTH_TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "F16"]
BANDWIDTH_SHAPES = [(2048, 2048), (2048, 8192), (8192, 2048)]  # (n_out, n_in)
BANDWIDTH_WORKING_SET = 384 * 2**20  # bytes of distinct weights per pass: ≫ L3
# byte offsets of each block's f16 scales (set to sane values in random K-quant blocks)
F16_AT = {
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}


def best_time(fn: Callable[[], None], seconds: float) -> float:
    """Minimum seconds per call over batches filling ``seconds``."""
    fn()
    t = time.perf_counter()
    fn()
    reps = max(1, int(0.02 / max(time.perf_counter() - t, 1e-7)))
    best = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or best == float("inf"):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def make_weight(t: GGMLType, n_out: int, n_in: int, rng: np.random.Generator) -> WeightTensor:
    if t in F16_AT:
        nb = n_in // block_size(t)
        raw = rng.integers(0, 256, (n_out, nb, type_size(t)), dtype=np.uint8)
        for off in F16_AT[t]:
            scale = (rng.uniform(0.5, 2.0, (n_out, nb)) * 1e-3).astype(np.float16)
            raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(n_out, nb, 2)
        raw = raw.reshape(n_out, -1)
    elif t == GGMLType.F16:
        raw = (rng.standard_normal((n_out, n_in)) * 0.05).astype(np.float16).view(np.uint8)
    else:
        w = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.05
        raw = gq.quantize(w, t).view(np.uint8).reshape(n_out, -1)
    raw.flags.writeable = False
    return WeightTensor("w", t, (n_out, n_in), raw)


def gflops(n_tok: int, n_out: int, n_in: int, s: float) -> float:
    return 2.0 * n_tok * n_out * n_in / s / 1e9


def row(label: str, n_tok: int, n_out: int, n_in: int, s: float, base: float | None = None) -> None:
    speedup = f"  x{base / s:6.1f} vs numpy" if base else ""
    print(f"  {label:<34} {s * 1e3:9.4f} ms  {gflops(n_tok, n_out, n_in, s):7.1f} GFLOP/s{speedup}")


# (type, shape, n_tok, threads) -> (kernel GFLOP/s with xq given, incl. quantization, numpy GFLOP/s)
SUMMARY: dict[tuple[str, str, int, int], tuple[float, float, float]] = {}


def bench(types: list[GGMLType], n_tok: int, seconds: float, n_threads: int) -> None:
    rng = np.random.default_rng(0)
    for n_out, n_in in SHAPES:
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        out = np.empty((n_tok, n_out), np.float32)
        for t in types:
            if n_in % block_size(t):
                continue
            w = make_weight(t, n_out, n_in, rng)
            print(f" {t.name} {n_out}x{n_in}, {n_tok} token(s)")
            deq = KQUANT_DEQUANTIZERS.get(t) or DEQUANTIZERS[t]

            def numpy_ref(w=w, deq=deq, x=x, n_in=n_in, out=out) -> None:
                np.matmul(x, deq(w.data, n_in).T, out=out)

            base = best_time(numpy_ref, seconds)
            row("numpy (dequantize + BLAS)", n_tok, n_out, n_in, base)
            mod = qm if t == GGMLType.Q4_1 else km
            if t in F16_AT:
                xq = km.quantize_activations_q8_k(x)
            else:
                xq = qm.quantize_activations(x)
            once = best_time(partial(mod.matmul, x, w, out, xq), seconds)
            row("kernel, activations quantized once", n_tok, n_out, n_in, once, base)
            full = best_time(partial(mod.matmul, x, w, out), seconds)
            row("kernel incl. quantization", n_tok, n_out, n_in, full, base)
            SUMMARY[(t.name, f"{n_out}x{n_in}", n_tok, n_threads)] = tuple(
                gflops(n_tok, n_out, n_in, v) for v in (once, full, base)
            )


def print_summary() -> None:
    """One line per type and shape: GFLOP/s of the kernel (activations quantized once / incl. quantization)
    and of numpy, per token count and thread count."""
    cols = sorted({(n_tok, th) for _, _, n_tok, th in SUMMARY})
    print("\nsummary, GFLOP/s: kernel (xq given) / kernel incl. quantization / numpy")
    print(f"{'type':<5} {'shape':<10}" + "".join(f" {f'{n} tok, {th} thr':>20}" for n, th in cols))
    for t, shape in dict.fromkeys((t, shape) for t, shape, _, _ in SUMMARY):
        cells = []
        for n_tok, th in cols:
            v = SUMMARY.get((t, shape, n_tok, th))
            cells.append(f" {v[0]:6.1f}/{v[1]:5.1f}/{v[2]:5.1f}" if v else f" {'':>20}")
        print(f"{t:<5} {shape:<10}" + "".join(f"{c:>21}" for c in cells))


def _module(t: GGMLType):
    return km if km.supports(t) else qm


def best_cpu_time(fn: Callable[[], None], seconds: float) -> float:
    """Minimum CPU seconds of this thread per call: on one numba thread the kernels run on the calling
    thread, so time spent descheduled (a shared machine) is not counted; memory contention still is."""
    fn()
    best = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or best == float("inf"):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def bench_bandwidth(types: list[GGMLType], threads: list[int], seconds: float, cpu_time: bool = False) -> None:
    """GEMV weight bytes/s per type, shape and thread count as a fraction of the measured read bandwidth
    (``cpu_time``: both measured in CPU time, one thread only)."""
    from minfer.tools.read_bandwidth import measure_read_bandwidth, read_once

    if cpu_time and threads != [1]:
        raise SystemExit("--cpu-time measures one thread only: pass --threads 1")

    rng = np.random.default_rng(0)
    table: dict[tuple[str, str, int], tuple[float, float]] = {}
    for t in types:
        for n_out, n_in in BANDWIDTH_SHAPES:
            w = make_weight(t, n_out, n_in, rng)
            copies = max(2, BANDWIDTH_WORKING_SET // w.nbytes)
            mod = _module(t)
            prepared = [mod.prepare(WeightTensor("w", t, w.shape, np.array(w.data))) for _ in range(copies)]
            x = rng.standard_normal((1, n_in)).astype(np.float32)
            out = np.empty((1, n_out), np.float32)
            if t in F16_AT:
                xq = km.quantize_activations_q8_k(x)
            elif t == GGMLType.F16:
                xq = None
            else:
                xq = qm.quantize_activations(x)

            def one_pass(prepared=prepared, mod=mod, x=x, out=out, xq=xq) -> None:
                for p in prepared:
                    mod.matmul(x, p, out, xq)

            for n_threads in threads:
                if cpu_time:
                    numba.set_num_threads(1)
                    buf = np.ones(512 * 2**20 // 4, np.float32)
                    peak = buf.nbytes / best_cpu_time(lambda buf=buf: read_once(buf, 1), seconds)
                    del buf
                    per_pass = best_cpu_time(one_pass, max(seconds, 0.5))
                else:
                    peak = measure_read_bandwidth(n_threads, seconds=seconds)
                    numba.set_num_threads(n_threads)
                    per_pass = best_time(one_pass, max(seconds, 0.5))
                rate = w.nbytes * copies / per_pass
                table[(t.name, f"{n_out}x{n_in}", n_threads)] = (rate, rate / peak)
                print(
                    f"  {t.name:<5} {n_out}x{n_in} {n_threads} thr: {rate / 1e9:6.2f} GB/s of weights,"
                    f" read bandwidth {peak / 1e9:6.2f} GB/s -> {rate / peak:6.1%}  ({copies} copies,"
                    f" {w.nbytes * copies / 2**20:.0f} MiB; load {open('/proc/loadavg').read().split()[0]})"
                )
            del prepared
    print("\nsummary: GEMV bandwidth fraction (weights GB/s / read GB/s at the same thread count)")
    print(f"{'type':<5}" + "".join(f" {f'{s[0]}x{s[1]} {th}t':>16}" for s in BANDWIDTH_SHAPES for th in threads))
    for t in types:
        cells = [table[(t.name, f"{a}x{b}", th)] for a, b in BANDWIDTH_SHAPES for th in threads]
        print(f"{t.name:<5}" + "".join(f" {f'{r / 1e9:5.1f} {f:5.0%}':>16}" for r, f in cells))


def gemm_rate(t: GGMLType, n_out: int, n_in: int, n_tok: int, seconds: float) -> float:
    """FLOP/s of an ``n_tok``-token matmul (activations quantized in the call), weights warm."""
    rng = np.random.default_rng(0)
    mod = _module(t)
    w = mod.prepare(make_weight(t, n_out, n_in, rng))
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    out = np.empty((n_tok, n_out), np.float32)
    return 2.0 * n_tok * n_out * n_in / best_time(partial(mod.matmul, x, w, out), seconds)


def bench_peak(types: list[GGMLType], shapes: list[tuple[int, int]], threads: list[int], tokens: list[int],
               seconds: float) -> list[dict]:
    """GEMM GFLOP/s per type, shape, token count and thread count against the measured float32 FMA peak."""
    from minfer.tools import machine

    name, lanes, vnni = machine.instruction_set(machine.cpu_flags())
    rows = []
    for n_threads in threads:
        numba.set_num_threads(n_threads)
        peak = machine.measure_fma_peak(n_threads)
        print(f"\n=== {n_threads} thread(s): float32 FMA peak {peak / 1e9:.0f} GFLOP/s (measured; {name}, "
              f"{lanes} lanes{f', int8 dot-product peak ~{4 * peak / 1e9:.0f} GOP/s (4x, derived)' if vnni else ''})"
              f"; load {open('/proc/loadavg').read().split()[0]} ===")
        for t in types:
            for n_out, n_in in shapes:
                if n_in % block_size(t):
                    continue
                for n in tokens:
                    g = gemm_rate(t, n_out, n_in, n, seconds)
                    rows.append({"type": t.name, "shape": f"{n_out}x{n_in}", "tokens": n, "threads": n_threads,
                                 "flop_s": g, "peak_flop_s": peak})
                    print(f"  {t.name:<5} {n_out}x{n_in} {n} tok: {g / 1e9:7.1f} GFLOP/s = {g / peak:5.1%} of the "
                          "float32 FMA peak" + (f", {g / (4 * peak):5.1%} of int8's" if vnni else ""))
    return rows


def _shape(text: str) -> tuple[int, int]:
    a, _, b = text.lower().partition("x")
    return int(a), int(b)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="default: 1 128 (--peak: 128)")
    p.add_argument("--seconds", type=float, default=0.3, help="measuring time per row")
    p.add_argument("--types", nargs="+", default=None, choices=sorted({*TYPES, *BANDWIDTH_TYPES}))
    p.add_argument("--bandwidth", action="store_true", help="decode GEMV bytes/s against the read bandwidth")
    p.add_argument("--cpu-time", action="store_true",
                   help="with --bandwidth --threads 1: time in this thread's CPU seconds (a shared machine)")
    p.add_argument("--peak", action="store_true", help="prefill GEMM GFLOP/s against the measured FMA peak")
    p.add_argument("--shapes", nargs="+", type=_shape, default=None, metavar="OUTxIN", help="--peak's shapes")
    args = p.parse_args(argv)
    if args.peak:
        bench_peak([GGMLType[n] for n in args.types or BANDWIDTH_TYPES], args.shapes or BANDWIDTH_SHAPES,
                   args.threads, args.tokens or [128], args.seconds)
        return
    if args.bandwidth:
        qm.warmup()
        km.warmup()
        print(f"x86 AVX2 path: {simd.AVX2}; load {open('/proc/loadavg').read().strip()}")
        bench_bandwidth(
            [GGMLType[n] for n in args.types or BANDWIDTH_TYPES], args.threads, max(args.seconds, 1.0), args.cpu_time
        )
        return
    args.types = args.types or TYPES
    args.tokens = args.tokens or [1, 128]
    t = time.perf_counter()
    qm.warmup()
    km.warmup()
    print(f"warmup (compile or load cache): {time.perf_counter() - t:.1f} s; x86 AVX2 path: {simd.AVX2}")
    types = [GGMLType[name] for name in args.types]
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        threadpool_limits = None
    for n_threads in args.threads:
        numba.set_num_threads(n_threads)
        limit = threadpool_limits(n_threads) if threadpool_limits else None
        try:
            print(f"\n=== {n_threads} thread(s) ===")
            for n_tok in args.tokens:
                bench(types, n_tok, args.seconds, n_threads)
        finally:
            if limit is not None:
                limit.unregister()
    print_summary()


if __name__ == "__main__":
    main()
