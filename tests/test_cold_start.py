"""A first run on an empty numba cache: it says at once that it compiles, compiles only what the model needs
(over two processes where the CPU has two cores), `minfer warmup` compiles ahead, and a warm run is silent.

Each test runs minfer in a subprocess with its own empty ``NUMBA_CACHE_DIR``, as a new user's first run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import fixture_dir

QWEN3 = str(fixture_dir("qwen3") / "model-f32.gguf")
NOTICE = "minfer: compiling kernels for"
# the bound for the notice: 3 s from start on an idle 2-core machine; a machine shared with other
# work gets that much more per runnable process beyond its cores (the load average says how many)
NOTICE_S = 3.0


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), **extra)
    env.pop("MINFER_COMPILE_WORKERS", None)
    env.update(extra)
    return env


def _contention() -> float:
    """How many times over the cores are asked for: 1 on an idle machine."""
    load = os.getloadavg()[0]
    return max(1.0, load / (os.cpu_count() or 1))


def test_an_empty_cache_is_announced_at_once_naming_the_block_type(tmp_path):
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minfer", "run", QWEN3, "-n", "1", "Hello"], env=_env(tmp_path / "numba"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        elapsed = time.monotonic() - start
    finally:  # the run (and its compile worker) is not needed past the notice
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert first.startswith(NOTICE), first
    assert "F32" in first and "first run only" in first, first  # the model's block type, an estimate
    assert elapsed < NOTICE_S * _contention(), f"the notice came after {elapsed:.1f} s"


@pytest.mark.slow
def test_warmup_compiles_ahead_then_runs_are_silent(tmp_path):
    env = _env(tmp_path / "numba")
    warm = subprocess.run([sys.executable, "-m", "minfer", "warmup", QWEN3], env=env, capture_output=True,
                          text=True, timeout=900)
    assert warm.returncode == 0, warm.stderr
    assert NOTICE in warm.stderr and "kernels compiled in" in warm.stderr, warm.stderr
    assert "ready" in warm.stderr.splitlines()[-1]
    for _ in range(2):  # a run after warmup, and a run after a run: no compile of any kind, no notice
        run = subprocess.run([sys.executable, "-m", "minfer", "run", QWEN3, "-n", "2", "--temp", "0", "Hello"],
                             env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert "compiling" not in run.stderr, run.stderr
        assert "generated 2 tokens" in run.stderr
    again = subprocess.run([sys.executable, "-m", "minfer", "warmup", QWEN3], env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0 and "compiling" not in again.stderr, again.stderr


_PARALLEL = """
import json, sys
from numba.core import event
from minfer import compiling
from minfer.backends.cpu import kernel_jobs
seen = []
class L(event.Listener):
    def on_start(self, ev): seen.append(("start", ev.kind, ev.data))
    def on_end(self, ev): seen.append(("end", ev.kind, ev.data))
for kind in (compiling.BATCH_EVENT, compiling.JOB_EVENT):
    event.register(kind, L())
compiling.PARALLEL_MIN_ESTIMATE_S = 0.0
jobs = [kernel_jobs.rope_job(), *kernel_jobs.cache_jobs("f32")[:1]]
before = [j.cached() for j in jobs]
compiling.compile_jobs(jobs, workers=2)
kernels = [compiling._resolve(k) for j in jobs for k in j.kernels]
misses = sum(sum(d._cache_misses.values()) for d in kernels)  # compiled in this process
hits = sum(sum(d._cache_hits.values()) for d in kernels)
print(json.dumps({"before": before, "after": [j.cached() for j in jobs], "seen": seen, "misses": misses,
                  "hits": hits}))
"""


def test_a_batch_is_spread_over_processes_into_the_shared_cache(tmp_path):
    r = subprocess.run([sys.executable, "-c", _PARALLEL], env=_env(tmp_path / "numba"), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["before"] == [False, False] and out["after"] == [True, True]
    kinds = [(s[0], s[1]) for s in out["seen"]]
    assert kinds[0] == ("start", "minfer:compile") and kinds[-1] == ("end", "minfer:compile")
    assert out["seen"][0][2]["workers"] == 2 and out["seen"][0][2]["jobs"] == 2
    done = sorted(s[2]["job"] for s in out["seen"] if s[1] == "minfer:compile-job")
    assert done == sorted(["rope", "kv_store:f32"])  # one from each worker
    # this process compiled nothing (a compile keeps LLVM's state resident): it loaded the workers' kernels
    assert out["misses"] == 0 and out["hits"] >= 2, out


def test_every_job_names_kernels_that_exist():
    """A renamed kernel would make its job look cold forever (announced on every run): caught here."""
    from minfer.backends.cpu import kernel_jobs
    from minfer.compiling import _resolve
    from minfer.runtime.sampling import compile_jobs

    jobs = kernel_jobs.all_jobs() + compile_jobs(batched=True)
    assert len({j.name for j in jobs}) == len(jobs)
    for job in jobs:
        module, function = job.target.split(":")
        assert callable(_resolve(job.target)), job.target
        for kernel in job.kernels:
            assert hasattr(_resolve(kernel), "_cache"), f"{job.name}: {kernel} is not a cached numba kernel"


def test_a_model_needs_only_its_own_kernels():
    """The default-shaped fixture (llama, F32) needs the F32 matmul and none of the block types', nor GELU."""
    from minfer.backends.cpu import kernel_jobs
    from minfer.backends.cpu.backend import CPUBackend
    from minfer.graph.fusion import fuse
    from minfer.models.model import TransformerModel

    model = TransformerModel.from_path(fixture_dir("llama") / "model-f32.gguf")
    graph = fuse(model.build_graph(4, 1, 64), CPUBackend(kernels="fast").quantized_input)
    names = {j.name for j in kernel_jobs.jobs_for(graph.nodes)}
    assert "matmul:float" in names and not any(n.startswith("matmul:Q") or "k-quants" in n for n in names)
    assert not any("gelu" in n for n in names)
    assert {n.split(":")[0] for n in names} >= {"norms", "rope", "elementwise"}


def test_compile_workers_setting(monkeypatch):
    from minfer.compiling import compile_workers
    from minfer.errors import BadRequestError

    monkeypatch.setenv("MINFER_COMPILE_WORKERS", "1")
    assert compile_workers() == 1
    monkeypatch.setenv("MINFER_COMPILE_WORKERS", "zero")
    with pytest.raises(BadRequestError, match="MINFER_COMPILE_WORKERS"):
        compile_workers()
