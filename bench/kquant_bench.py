"""Benchmark the Q5_0/Q5_1/K-quant matmul kernels against dequantize + numpy, with Q4_1 (quant_matmul) as a yardstick;
with ``--machine``, every fast matmul type against the machine's own measured limits.

    python bench/kquant_bench.py [--threads 1 2] [--tokens 1 128] [--seconds 0.3] [--types Q4_K Q6_K ...]
    python bench/kquant_bench.py --machine [--threads 1 2] [--tokens 128] [--shapes 2048x2048 8192x2048 ...]

``--machine`` (issue 18's kernel figures): per type (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, F16 by default) and
shape (default 2048x2048, 8192x2048, 2048x8192):

* GEMV (1 token): the read bandwidth the kernel reaches on weights that do not fit in the cache (copies of the
  matrix, ``--working-set`` MiB in all, default max(256, 4 x L3), one after another as a decode step walks its
  layers), bytes read = the weight bytes the kernel reads (Q4_1 / Q8_0: their repacked copy), as a fraction of
  the machine's read bandwidth measured at that thread count (:mod:`minfer.tools.machine`);
* GEMM (``--tokens`` > 1, default 128): GFLOP/s (2 x tokens x n_out x n_in per call, activations quantized in
  the call), weights warm in the cache, as a fraction of the measured float32 FMA peak (the integer paths'
  int8 peak is 4x that where the CPU has VNNI: the fraction printed is of the float32 peak, say so).

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
from minfer.formats.gguf_file import GGUFTensor
from minfer.formats.kquants import KQUANT_DEQUANTIZERS
from minfer.formats.quants import DEQUANTIZERS

SHAPES = [(576, 576), (1536, 576), (576, 1536), (2048, 2048)]
TYPES = ["Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
MACHINE_TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "F16"]
MACHINE_SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192)]
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


def make_weight(t: GGMLType, n_out: int, n_in: int, rng: np.random.Generator) -> GGUFTensor:
    if t == GGMLType.F16:
        raw = (rng.standard_normal((n_out, n_in), dtype=np.float32) * 0.05).astype(np.float16).view(np.uint8)
    elif t in F16_AT:
        nb = n_in // block_size(t)
        raw = rng.integers(0, 256, (n_out, nb, type_size(t)), dtype=np.uint8)
        for off in F16_AT[t]:
            scale = (rng.uniform(0.5, 2.0, (n_out, nb)) * 1e-3).astype(np.float16)
            raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(n_out, nb, 2)
        raw = raw.reshape(n_out, -1)
    else:
        w = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.05
        raw = gq.quantize(w, t).view(np.uint8).reshape(n_out, -1)
    raw.flags.writeable = False
    return GGUFTensor("w", t, (n_out, n_in), raw)


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


def _kernel(t: GGMLType):
    """(the module whose matmul runs ``t``, its weight preparation, its activation quantizer or None)."""
    if qm.supports(t):
        return qm, qm.prepare, None if t in (GGMLType.F16, GGMLType.F32, GGMLType.BF16) else qm.quantize_activations
    return km, km.prepare, km.quantize_activations_q8_k if t in F16_AT else qm.quantize_activations


def _bytes_read(prepared) -> int:
    rows8 = getattr(prepared, "rows8", None)
    return int(rows8.nbytes if rows8 is not None else prepared.flat.nbytes)


def gemv_bandwidth(t: GGMLType, n_out: int, n_in: int, working_set: int, seconds: float) -> tuple[float, int]:
    """(bytes/s a 1-token matmul reads weights at, over copies filling ``working_set`` bytes; weight bytes)."""
    rng = np.random.default_rng(0)
    mod, prep, quant = _kernel(t)
    w = make_weight(t, n_out, n_in, rng)
    one = prep(w)
    nbytes = _bytes_read(one)
    n_copies = max(1, working_set // nbytes)
    copies = [one] + [prep(GGUFTensor("w", t, w.shape, w.data.copy())) for _ in range(n_copies - 1)]
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    out = np.empty((1, n_out), np.float32)
    xq = quant(x) if quant is not None else None  # decode shares one quantization across q/k/v and gate/up

    def walk() -> None:
        for c in copies:
            mod.matmul(x, c, out, xq)

    per_walk = best_time(walk, seconds)
    return nbytes * len(copies) / per_walk, nbytes


def gemm_rate(t: GGMLType, n_out: int, n_in: int, n_tok: int, seconds: float) -> float:
    """FLOP/s of an ``n_tok``-token matmul (activations quantized in the call), weights warm."""
    rng = np.random.default_rng(0)
    mod, prep, _ = _kernel(t)
    w = prep(make_weight(t, n_out, n_in, rng))
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    out = np.empty((n_tok, n_out), np.float32)
    return 2.0 * n_tok * n_out * n_in / best_time(partial(mod.matmul, x, w, out), seconds)


def bench_machine(types: list[GGMLType], shapes: list[tuple[int, int]], threads: list[int], tokens: list[int],
                  seconds: float, working_set: int) -> list[dict]:
    """The ``--machine`` tables: GEMV bandwidth fraction and GEMM GFLOP/s against the peak, per type and shape."""
    from minfer.tools import machine

    name, lanes, vnni = machine.instruction_set(machine.cpu_flags())
    rows = []
    for n_threads in threads:
        numba.set_num_threads(n_threads)
        bw = machine.measure_read_bandwidth(n_threads)
        peak = machine.measure_fma_peak(n_threads)
        print(f"\n=== {n_threads} thread(s): measured read bandwidth {bw / 1e9:.1f} GB/s, float32 FMA peak "
              f"{peak / 1e9:.0f} GFLOP/s ({name}, {lanes} lanes{', VNNI: int8 peak ~4x' if vnni else ''}) ===")
        print(f"{'type':<5} {'shape':<10} {'weights':>9} {'GEMV GB/s':>10} {'of bw':>6}"
              + "".join(f" {f'GEMM{n} GFLOP/s':>16} {'of peak':>7}" for n in tokens if n > 1))
        for t in types:
            for n_out, n_in in shapes:
                if n_in % block_size(t):
                    continue
                rate, nbytes = gemv_bandwidth(t, n_out, n_in, working_set, seconds)
                row_ = {"type": t.name, "shape": f"{n_out}x{n_in}", "threads": n_threads, "weight_bytes": nbytes,
                        "gemv_bytes_s": rate, "gemv_fraction": rate / bw, "read_bandwidth": bw, "fma_peak": peak}
                cells = ""
                for n in tokens:
                    if n > 1:
                        g = gemm_rate(t, n_out, n_in, n, seconds)
                        row_[f"gemm{n}_flop_s"] = g
                        cells += f" {g / 1e9:16.1f} {g / peak:7.0%}"
                rows.append(row_)
                print(f"{t.name:<5} {n_out}x{n_in:<5} {nbytes / 2**20:7.1f}Mi {rate / 1e9:10.1f} {rate / bw:6.0%}"
                      + cells)
    return rows


def _shape(text: str) -> tuple[int, int]:
    a, _, b = text.lower().partition("x")
    return int(a), int(b)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="default: 1 128 (--machine: 128)")
    p.add_argument("--seconds", type=float, default=0.3, help="measuring time per row")
    p.add_argument("--types", nargs="+", default=None, choices=sorted(set(TYPES) | set(MACHINE_TYPES)))
    p.add_argument("--machine", action="store_true", help="GEMV bandwidth and GEMM GFLOP/s against the machine")
    p.add_argument("--shapes", nargs="+", type=_shape, default=None, metavar="OUTxIN", help="--machine's shapes")
    p.add_argument("--working-set", type=int, default=None, metavar="MiB",
                   help="--machine: GEMV weights walked per pass (default: max(256, 4 x L3))")
    args = p.parse_args(argv)
    if args.machine:
        from minfer.tools.machine import l3_bytes

        ws = (args.working_set << 20) if args.working_set else max(256 << 20, 4 * l3_bytes())
        bench_machine([GGMLType[n] for n in args.types or MACHINE_TYPES], args.shapes or MACHINE_SHAPES,
                      args.threads, args.tokens or [128], args.seconds, ws)
        return
    args.tokens = args.tokens or [1, 128]
    args.types = args.types or TYPES
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
