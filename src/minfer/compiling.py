"""Compiling numba kernels before their first call: named jobs, which of them numba's on-disk cache lacks,
compiling the missing ones (over several processes when the CPU has cores to spare), and the events that
let the command line say so.

numba compiles a kernel on its first call and keeps the machine code in its cache (``__pycache__`` or
``NUMBA_CACHE_DIR``), keyed by source file, function, argument types and CPU. A cold cache costs tens of
seconds per model; a warm one loads each kernel in milliseconds. So that a first run neither stalls in
silence nor compiles what it never calls, whoever runs kernels (the CPU backend, the sampler) describes each
one as a :class:`CompileJob`: a module-level function that calls the kernel on tiny inputs of the argument
types the engine passes. A :class:`KernelCompiler` collects the jobs a model and its features need and,
when they are about to be called, compiles the cold ones together (:meth:`KernelCompiler.flush`).

Events (numba's own event bus, :mod:`numba.core.event`, so that no layer below the command line prints):

* :data:`BATCH_EVENT`, around a batch of cold jobs: data ``{"label", "jobs", "estimate_s", "workers"}``
  (``label`` says what they are for, e.g. ``"Q4_1, Q8_0"``);
* :data:`JOB_EVENT`, when one job of the batch is compiled: data ``{"job", "done", "total"}``.

Compiling is CPU-bound and single-threaded inside numba (one global compiler lock per process), so a batch
is spread over worker processes (``python -m minfer.compiling``), each compiling its share into the shared
on-disk cache; this process then loads their kernels from the cache. It compiles nothing itself: numba keeps
what a compile built (LLVM modules, typing and lowering state) resident, ~300 MiB on a K-quant model, where
loading the same kernels from the cache costs a tenth of that. ``MINFER_COMPILE_WORKERS`` caps the processes
(default: the usable cores, at most 4). A worker that fails costs nothing but time: whatever it did not write
is compiled here.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minfer.errors import BadRequestError

BATCH_EVENT = "minfer:compile"
JOB_EVENT = "minfer:compile-job"
MAX_DEFAULT_WORKERS = 4
# a batch whose estimate is below this compiles in one worker: starting each (importing numba and the kernel
# modules) costs about a second of CPU
PARALLEL_MIN_ESTIMATE_S = 4.0


@dataclass(frozen=True)
class CompileJob:
    """One kernel (or a few that are always used together) to compile ahead of its first call.

    ``target`` ``"module:function"`` compiles it when called with ``args`` (JSON-serialisable, so that a
    worker process can run it); ``kernels`` are the numba dispatchers it compiles, ``"module:attribute"``,
    which say whether the cache already holds it; ``estimate_s`` is the CPU time it took to compile on a
    2-core x86 machine (AVX-512), for the notice; ``what`` names what needs it (a block type, a cache type,
    ``"sampling"``)."""

    name: str
    target: str
    what: str
    kernels: tuple[str, ...]
    estimate_s: float
    args: tuple[Any, ...] = ()

    def run(self) -> None:
        module, function = self.target.split(":")
        getattr(importlib.import_module(module), function)(*self.args)

    def cached(self) -> bool:
        """Whether numba's on-disk cache holds every kernel of this job for this CPU (a job whose
        dispatchers cannot be asked counts as cold: compiling it is then announced, and loads if it was
        cached after all)."""
        try:
            return all(_has_cache_entry(_resolve(k)) for k in self.kernels)
        except (AttributeError, ImportError, OSError, EOFError, ValueError):
            return False


def _resolve(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _has_cache_entry(dispatcher: Any) -> bool:
    # numba's FunctionCache keeps one index file per function (every signature compiled, stale entries
    # dropped when the source changed); not a public API, hence the broad fallback in CompileJob.cached
    cache = dispatcher._cache
    index = cache._cache_file._load_index()
    magic = dispatcher.targetctx.codegen().magic_tuple()
    return any(key[1] == magic for key in index)


def compile_workers() -> int:
    """How many processes a batch may use: ``MINFER_COMPILE_WORKERS``, else the usable cores (at most 4)."""
    raw = os.environ.get("MINFER_COMPILE_WORKERS")
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise BadRequestError(f"MINFER_COMPILE_WORKERS must be a positive integer, got {raw!r}")
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_WORKERS))


def _shares(jobs: Sequence[CompileJob], n: int) -> list[list[CompileJob]]:
    """``jobs`` split into ``n`` shares of about equal estimated time (longest first, each to the lightest
    share); share 0 gets the first and longest job."""
    shares: list[list[CompileJob]] = [[] for _ in range(n)]
    load = [0.0] * n
    for job in sorted(jobs, key=lambda j: -j.estimate_s):
        i = min(range(n), key=lambda k: load[k])
        shares[i].append(job)
        load[i] += job.estimate_s
    return [s for s in shares if s]


@dataclass
class KernelCompiler:
    """The jobs a backend and its engine need, compiled together the first time they are about to run.

    ``need`` adds jobs (each name once); ``flush`` compiles the pending cold ones as one batch (announced by
    :data:`BATCH_EVENT`) and loads the warm ones from the cache. ``workers`` caps the processes
    (:func:`compile_workers` when None)."""

    workers: int | None = None
    _pending: dict[str, CompileJob] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)

    def need(self, jobs: Iterable[CompileJob]) -> None:
        for job in jobs:
            if job.name not in self._done:
                self._pending.setdefault(job.name, job)

    def flush(self) -> None:
        jobs = list(self._pending.values())
        self._pending.clear()
        if jobs:
            compile_jobs(jobs, self.workers)
            self._done.update(j.name for j in jobs)


def compile_jobs(jobs: Sequence[CompileJob], workers: int | None = None) -> None:
    """Compile (or load from numba's cache) every job; the cold ones as one announced batch, spread over
    up to ``workers`` processes."""
    cold = [j for j in jobs if not j.cached()]
    if cold:
        _compile_batch(cold, compile_workers() if workers is None else workers)
    for job in jobs:  # the warm ones, and the workers' share: loads from the cache (or compiles what is missing)
        job.run()


def _compile_batch(cold: Sequence[CompileJob], workers: int) -> None:
    from numba.core import event

    total_s = sum(j.estimate_s for j in cold)
    n = min(workers, len(cold)) if total_s >= PARALLEL_MIN_ESTIMATE_S else 1
    shares = _shares(cold, n)
    # the estimate: the largest share (they run side by side), plus a worker's start
    estimate = max(sum(j.estimate_s for j in s) for s in shares) + 1.0
    # the label names the block types when there are any (what a user recognises: "Q4_1, Q8_0"), else
    # what the jobs serve ("the q8_0 cache", "sampling")
    whats = list(dict.fromkeys(j.what for j in cold))
    types = [w for w in whats if w.isupper() or w[:1].isupper() and "_" in w]
    what = ", ".join(types or whats)
    data = {"label": what, "jobs": len(cold), "estimate_s": estimate, "workers": len(shares)}
    done = [0]
    lock = threading.Lock()

    def finished(name: str) -> None:
        with lock:
            done[0] += 1
            event.broadcast(event.Event(JOB_EVENT, event.EventStatus.END,
                                        data={"job": name, "done": done[0], "total": len(cold)}))

    with event.trigger_event(BATCH_EVENT, data=data):
        # every share compiles in a child: LLVM's compile keeps ~300 MiB of this process resident for its
        # lifetime (modules, typing and lowering state), while loading the children's kernels from the cache
        # costs what a warm start does; a child that cannot start leaves its share to this process
        procs = []
        for share in shares:
            try:
                procs.append(_start_worker(share, finished))
            except OSError:
                for job in share:
                    job.run()
                    finished(job.name)
        try:
            for proc, reader in procs:
                reader.join()
                proc.wait()
        finally:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _start_worker(share: Sequence[CompileJob], finished: Any) -> tuple[subprocess.Popen[str], threading.Thread]:
    spec = json.dumps([{"name": j.name, "target": j.target, "args": list(j.args)} for j in share])
    # the worker must import this very copy of minfer: numba's cache is keyed by the source files' paths
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(
        [sys.executable, "-m", "minfer.compiling", spec], env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # one line per job the worker compiled
            if line.strip():
                finished(line.strip())

    reader = threading.Thread(target=read, name="minfer-compile-worker", daemon=True)
    reader.start()
    return proc, reader


def _worker(spec: str) -> int:
    """A worker process: compile each job of ``spec`` into the on-disk cache, printing its name when done."""
    for item in json.loads(spec):
        job = CompileJob(item["name"], item["target"], "", (), 0.0, tuple(item["args"]))
        job.run()
        print(item["name"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
