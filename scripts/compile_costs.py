"""CPU seconds each compile job takes on an empty numba cache (the ``estimate_s`` of the jobs in
``minfer/backends/cpu/kernel_jobs.py`` and ``minfer/runtime/sampling/__init__.py``).

    python scripts/compile_costs.py              # the default model's jobs
    python scripts/compile_costs.py --all        # every job

Runs the jobs one after another in this process, in a fresh NUMBA_CACHE_DIR, so a kernel shared by two
jobs is counted in the first. CPU time, not wall time: on a shared machine it is the steadier figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every job, not only the default model's")
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    if "NUMBA_CACHE_DIR" not in os.environ:  # numba reads it at import: re-run with a fresh one
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="minfer-compile-costs-")
        os.execv(sys.executable, [sys.executable, *sys.argv])
    from minfer.backends.cpu import kernel_jobs
    from minfer.runtime.sampling import compile_jobs as sampling_jobs

    if args.all:
        jobs = kernel_jobs.all_jobs() + sampling_jobs(batched=True)
    else:  # the jobs of the default model's plans, read from its fused graph (nothing compiled yet)
        from minfer.backends.cpu.backend import CPUBackend
        from minfer.graph.fusion import fuse
        from minfer.models.model import TransformerModel
        from minfer.pull import resolve_model

        model = TransformerModel.from_path(resolve_model(args.model))
        graph = fuse(model.build_graph(8, 1, 512), CPUBackend(kernels="fast").quantized_input)
        jobs = kernel_jobs.jobs_for(graph.nodes) + kernel_jobs.cache_jobs("f32") + sampling_jobs()
    print(f"cache: {os.environ['NUMBA_CACHE_DIR']}", file=sys.stderr)
    total = 0.0
    for job in jobs:
        c0, t0 = time.process_time(), time.perf_counter()
        job.run()
        cpu = time.process_time() - c0
        total += cpu
        print(f"{job.name:40s} cpu {cpu:6.2f} s  wall {time.perf_counter() - t0:6.2f} s  (estimate {job.estimate_s})")
    print(f"{'total':40s} cpu {total:6.2f} s   load average {open('/proc/loadavg').read().split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
