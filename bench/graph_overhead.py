"""Per-token Python overhead of executing a decode step's graph (SmolLM2 by default).

Runs the one-token plan as is, then the same plan with every kernel replaced by a no-op: the second
time is what the scheduler itself costs per token (the loop over prepared steps), the first the whole
step. Also times ForwardRunner.forward (input checks, plan lookup, output copy) around it.

    python bench/graph_overhead.py [MODEL] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import minfer


def best_of(fn, reps: int = 200) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    model = minfer.load(a.model, n_ctx=256, threads=a.threads)
    runner = model.runner
    plan = runner.plan(1, 1)
    plan.inputs["tokens"][:] = 1
    plan.inputs["positions"][:] = 10
    plan.inputs["rows"][:] = model.kv.rows(np.array([10]))  # (its block taken, as the runner does)
    with model.backend.running():
        full = best_of(plan.run)
        kernels = [s.fn for s in plan.steps]
        for s in plan.steps:
            s.fn = lambda *args: None
        dispatch = best_of(plan.run)
        for s, fn in zip(plan.steps, kernels, strict=True):
            s.fn = fn
    forward = best_of(lambda: runner.forward([1], [10]))
    n = len(plan.steps)
    print(f"{model.path.name}: {n} steps per decode token, {a.threads} threads")
    print(f"  forward() per token:        {forward * 1e3:8.3f} ms  ({1 / forward:.0f} t/s)")
    print(f"  plan.run() per token:       {full * 1e3:8.3f} ms")
    print(f"  scheduler loop alone:       {dispatch * 1e3:8.3f} ms  ({dispatch / n * 1e6:.2f} us per step, "
          f"{dispatch / full:.1%} of the step)")
    print(f"  forward() around the plan:  {(forward - full) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
