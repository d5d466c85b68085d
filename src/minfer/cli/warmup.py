"""``minfer warmup``: compile the kernels a model (or every model) needs ahead of the first run, into numba's
on-disk cache (``NUMBA_CACHE_DIR`` or the package's ``__pycache__``): for container images and CI."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from minfer.cli.options import add_model_argument, add_threads_flag

CACHE_TYPES = ("f32", "f16", "q8_0")


def add_parsers(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    p = add_parser("warmup", help="compile the kernels ahead of the first run (for images and CI)",
                   description="Compile the kernels MODEL needs (loading it and generating two tokens, the way "
                   "`minfer run` does) into numba's on-disk cache ($NUMBA_CACHE_DIR, else the package's "
                   "__pycache__), so that later runs start in about a second. With --all, every kernel for "
                   "every model: each block type's matmul, every vector op, every cache type, the server's "
                   "batches.")
    add_model_argument(p)
    p.add_argument("--all", action="store_true", help="compile every kernel, whatever the model (MODEL is not read)")
    p.add_argument("--cache-type", action="append", choices=[*CACHE_TYPES, "all"], default=None,
                   help="KV cache cells to prepare for (repeatable; default f32; 'all': every type)")
    p.add_argument("--server", action="store_true",
                   help="also the kernels of `minfer serve` (batches mixing requests, the batched sampler)")
    add_threads_flag(p)
    p.set_defaults(handler=cmd_warmup)


def _cache_types(args: argparse.Namespace) -> list[str]:
    chosen = args.cache_type or ["f32"]
    return list(CACHE_TYPES) if "all" in chosen else list(dict.fromkeys(chosen))


def cmd_warmup(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.all:
        from minfer.backends.cpu import kernel_jobs
        from minfer.compiling import compile_jobs
        from minfer.runtime.sampling import compile_jobs as sampling_jobs

        jobs = kernel_jobs.all_jobs(CACHE_TYPES) + sampling_jobs(batched=True)
        compile_jobs(jobs)
        print(f"minfer: {len(jobs)} kernel groups ready ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        return 0
    import minfer
    from minfer.runtime.engine import EngineConfig

    # a server's engine: two padded slots, so that its batches mix sequences as `minfer serve`'s do
    config = EngineConfig(n_slots=2, batch_size=64) if args.server else None
    for cache_type in _cache_types(args):
        model = minfer.load(args.model, n_ctx=512, threads=args.threads, cache_type=cache_type, engine_config=config)
        model.generate("Hello", max_tokens=2)  # every kernel of a run, the sampler's included
    print(f"minfer: kernels for {args.model} ready ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0
