"""Prefill (GEMM) kernel rates at the shapes of 1-2B models, with the VNNI paths on and off, paired.

    python bench/gemm_bench.py [--types Q4_K Q6_K Q8_0 ...] [--tokens 128 512] [--threads 1 2] [--rounds 3] [--cpu-time]

The shapes are SmolLM2-1.7B's (n_out x n_in): 2048x2048 (attention), 8192x2048 (ffn gate/up), 2048x8192
(ffn down). Weights are random valid blocks (kquant_bench's), activations Gaussian, quantized once
outside the timed call (the model shares them between matmuls), so these are the kernels' own rates.

A/B: ``MINFER_VNNI`` is read once, when the kernels compile, so each side runs in its own interpreter
with its own numba cache (``$TMPDIR/minfer-gemm-bench-vnni{0,1}``; the first round compiles). Rounds
alternate A and B and each figure is the best of a round's repeats; the ratio is taken round by round
and the median printed (the machine may be shared: state its load). ``--side`` runs one side alone.

GFLOP/s counts 2 * n_tok * n_out * n_in per call. The peak printed beside it is the integer dot-product
rate of the instruction set in use per core at the clock ``--ghz`` (default: /proc/cpuinfo's MHz):
AVX2 pmaddubsw+pmaddwd 32 multiply-adds per 256-bit pair of instructions, about one pair per cycle
on two ports (64 "flop"/cycle); VNNI's vpdpbusd 32 per instruction at two per cycle (128 per cycle).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = [(2048, 2048), (8192, 2048), (2048, 8192)]
TYPES = ["Q4_K", "Q6_K", "Q5_K", "Q8_0", "Q4_0", "Q4_1"]


def clock_ghz() -> float:
    try:
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
        return max(mhz) / 1000 if mhz else 3.0
    except OSError:
        return 3.0


def best_cpu_time(fn, seconds: float) -> float:
    """Minimum process CPU seconds per call: on a machine shared by other processes, the time this one
    ran (time slices taken by others do not count). Meaningful at 1 thread; at more, idle workers' spin
    would count."""
    fn()
    best = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or best == float("inf"):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def run_side(types: list[str], tokens: list[int], threads: list[int], seconds: float, cpu: bool) -> dict[str, float]:
    """GFLOP/s per ``type shape n_tok threads`` in this interpreter (its MINFER_VNNI)."""
    import numba
    import numpy as np

    from minfer.testing.kquant_bench import best_time, make_weight

    if cpu:
        best_time = best_cpu_time  # noqa: F811

    from minfer.backends.cpu import kquant_matmul as km
    from minfer.backends.cpu import quant_matmul as qm
    from minfer.formats.block_types import GGMLType

    rng = np.random.default_rng(0)
    res: dict[str, float] = {}
    for name in types:
        t = GGMLType[name]
        is_k = km.supports(t)
        mod = km if is_k else qm
        for n_out, n_in in SHAPES:
            w = mod.prepare(make_weight(t, n_out, n_in, rng))
            for n_tok in tokens:
                x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
                xq = km.quantize_activations_q8_k(x) if t.name.endswith("_K") else qm.quantize_activations(x)
                out = np.empty((n_tok, n_out), np.float32)
                for th in threads:
                    numba.set_num_threads(th)
                    s = best_time(lambda: mod.matmul(x, w, out, xq), seconds)  # noqa: B023
                    res[f"{name} {n_out}x{n_in} {n_tok} {th}"] = 2.0 * n_tok * n_out * n_in / s / 1e9
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"], choices=TYPES)
    p.add_argument("--tokens", type=int, nargs="+", default=[128])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seconds", type=float, default=0.3, help="measuring time per figure")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ghz", type=float, default=None)
    p.add_argument("--side", choices=["0", "1"], help="run one side (MINFER_VNNI value) and print JSON")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by process CPU seconds, not wall time (a shared machine; use with --threads 1)")
    args = p.parse_args()
    if args.side is not None:
        print(json.dumps(run_side(args.types, args.tokens, args.threads, args.seconds, args.cpu_time)))
        return
    ghz = args.ghz or clock_ghz()
    src = str(Path(__file__).parents[1] / "src")
    rounds: dict[str, list[dict[str, float]]] = {"0": [], "1": []}
    for r in range(args.rounds + 1):  # round 0 compiles (or loads the caches) and is not counted
        for side in ("0", "1"):
            env = dict(os.environ, MINFER_VNNI=side,
                       NUMBA_CACHE_DIR=str(Path(tempfile.gettempdir()) / f"minfer-gemm-bench-vnni{side}"))
            env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
            cmd = [sys.executable, __file__, "--side", side, "--types", *args.types, "--seconds",
                   str(args.seconds if r else 0.01), "--tokens", *map(str, args.tokens),
                   "--threads", *map(str, args.threads), *(["--cpu-time"] if args.cpu_time else [])]
            t = time.perf_counter()
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            if r:
                rounds[side].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r} side MINFER_VNNI={side}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
    from minfer.backends.cpu import simd

    clock = "process CPU time" if args.cpu_time else "wall time"
    print(f"load average {os.getloadavg()[0]:.2f}; clock {ghz:.2f} GHz; this CPU has VNNI: {simd.VNNI or 'no'}; "
          f"timed by {clock}")
    print("peak per core: AVX2 ~64 flop/cycle, VNNI ~128 flop/cycle (integer dot products; see the docstring)")
    print(f"{'type shape tokens threads':<32} {'AVX2 GF/s':>10} {'VNNI GF/s':>10} {'ratio':>6} "
          f"{'% AVX2 peak':>11} {'% VNNI peak':>11}")
    for key in rounds["0"][0]:
        a = [rd[key] for rd in rounds["0"]]
        b = [rd[key] for rd in rounds["1"]]
        ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
        th = int(key.split()[-1])
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{key:<32} {ma:10.1f} {mb:10.1f} {ratio:6.2f} {100 * ma / (64 * ghz * th):10.0f}% "
              f"{100 * mb / (128 * ghz * th):10.0f}%")


if __name__ == "__main__":
    main()
