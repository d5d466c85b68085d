"""Where a generation's resident memory goes, stage by stage, in one process.

    PYTHONPATH=src python bench/rss_stages.py MODEL.gguf [--prompt 450] [--gen 16] [--threads 2]

Prints, after each stage, VmRSS and VmHWM (the peak so far, what ``minfer bench`` reports) from
/proc/self/status and the anonymous / file-backed split of /proc/self/smaps_rollup, with the growth of each
since the stage before. The stages are those ``Model`` runs in one go, taken apart:

* imports: numpy, numba and minfer's modules;
* kernels: the numba kernels of the prefill and decode plans loaded from the on-disk cache (compiled code
  and LLVM); a cold cache compiles them in worker processes first (run once before measuring);
* weights: the decode plan, which binds (prepares) every matrix: quantized kinds repacked into private arrays
  whose mapped bytes are then given back;
* plans: the prefill plan of ``prompt`` tokens (its activation buffers);
* kv: the KV cache of ``prompt + gen`` positions, every page written (prefill would write its part);
* prefill: the prompt evaluated from position 0 with logits of its last row only, as the engine asks;
* again: the same pass once more, as ``minfer bench``'s runs after its warm-up: its transients now sit on top
  of activation buffers the first pass wrote;
* decode: ``gen`` tokens one at a time.

The last line sets the peak against file + KV, as ``minfer bench`` does. Only the Linux /proc files are
read; nothing here is timed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_last: dict[str, int] = {}


def _kib(path: str, field: str) -> int:
    text = Path(path).read_text()
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else 0


def stage(name: str) -> None:
    """One line: this stage's RSS, peak, anonymous and file-backed MiB, and the growth since the last."""
    now = {
        "rss": _kib("/proc/self/status", "VmRSS"),
        "hwm": _kib("/proc/self/status", "VmHWM"),
        "anon": _kib("/proc/self/smaps_rollup", "Anonymous"),
    }
    now["file"] = _kib("/proc/self/smaps_rollup", "Rss") - now["anon"]
    cells = [f"{k} {v / 1024:7.1f} ({(v - _last.get(k, 0)) / 1024:+7.1f})" for k, v in now.items()]
    print(f"{name:<10} " + "  ".join(cells) + "  MiB", flush=True)
    _last.update(now)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--prompt", type=int, default=450, help="prompt tokens (default 450)")
    ap.add_argument("--gen", type=int, default=16, help="decoded tokens (default 16)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    stage("start")

    import numpy as np

    from minfer.backends.cpu.backend import CPUBackend
    from minfer.graph.fusion import fuse
    from minfer.models.model import TransformerModel
    from minfer.runtime.forward import ForwardRunner
    from minfer.runtime.kv_cache import KVCache

    stage("imports")
    model = TransformerModel.from_path(args.model, threads=args.threads)
    backend = CPUBackend(threads=args.threads)
    n_ctx = args.prompt + args.gen
    kv = KVCache(model.hparams, n_ctx)
    kv_layers = kv.layers
    for n in (1, args.prompt):
        graph = fuse(model.build_graph(n, 1, n_ctx), backend.quantized_input)
        backend.prepare_kernels(graph.nodes, kv_layers)
    stage("kernels")
    runner = ForwardRunner(model, backend, kv)
    runner.plan(1, 1)  # binds every matrix: the decode plan prepares (repacks) each one
    stage("weights")
    runner.plan(args.prompt, 1)
    stage("plans")
    # the cells are allocated lazily; write them to count the whole cache here (prefill would fill its part)
    for layer in kv.layers:
        for region in (layer.k, layer.v):
            region.reshape(-1).view(np.uint8)[::4096] = 0
    stage("kv")
    toks = np.random.default_rng(0).integers(0, model.hparams.n_vocab, args.prompt)
    with backend.running():
        runner.forward(toks, np.arange(args.prompt), output_rows=[args.prompt - 1])
    stage("prefill")
    with backend.running():  # again, as bench's runs after its warm-up: now on top of a written arena
        runner.forward(toks, np.arange(args.prompt), output_rows=[args.prompt - 1])
    stage("again")
    with backend.running():
        for i in range(args.gen):
            runner.forward(toks[i : i + 1], [args.prompt + i])
    stage("decode")
    file_bytes = args.model.stat().st_size
    over = _last["hwm"] * 1024 - file_bytes - kv.nbytes
    print(f"peak {_last['hwm'] / 1024:.0f} MiB = file {file_bytes / 2**20:.0f} + KV {kv.nbytes / 2**20:.0f} "
          f"+ {over / 2**20:.0f} MiB")
    backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
