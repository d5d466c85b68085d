"""What reading the KV cache through its blocks costs a decode step: the median time of one decode pass of
``--streams`` sequences (one token each), after each was filled with ``--depth`` positions in chunks of
``--chunk`` tokens taken in turn (so that, in a block cache, every sequence's blocks lie apart from one
another, as a server's do).

The script uses only what both the block cache and the slot cache before it have (``slots_kv_cache``,
``ForwardRunner``), so the same file measures either tree: pair them by alternating runs, e.g.

    for i in 1 2 3; do
        PYTHONPATH=/tmp/base/src python bench/kv_blocks_cost.py smollm2 --streams 8   # the commit before
        python bench/kv_blocks_cost.py smollm2 --streams 8                            # this tree
    done
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import numpy as np

import minfer
from minfer.runtime.forward import ForwardRunner
from minfer.runtime.kv_cache import slots_kv_cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-type", default="f32")
    a = ap.parse_args()
    per_seq = a.depth + a.steps + 8
    model = minfer.load(a.model, n_ctx=per_seq, threads=a.threads)
    # several streams: the engine's layout (a unified cache) where the tree has one; the commit before had none
    unified = {"unified": True} if a.streams > 1 and "unified" in inspect.signature(slots_kv_cache).parameters else {}
    kv = slots_kv_cache(model.hparams, per_seq * a.streams, a.streams, a.cache_type, **unified)
    runner = ForwardRunner(model.transformer, model.backend, kv)
    rng = np.random.default_rng(0)
    n_vocab = model.hparams.n_vocab
    for start in range(0, a.depth, a.chunk):  # the sequences' prompts, a chunk of each in turn
        for s in range(a.streams):
            n = min(a.chunk, a.depth - start)
            runner.forward(rng.integers(0, n_vocab, n), np.arange(start, start + n), [n - 1], seq_ids=s)
    seqs = np.arange(a.streams)
    times = []
    for step in range(a.steps):
        tokens = rng.integers(0, n_vocab, a.streams)
        positions = np.full(a.streams, a.depth + step)
        t0 = time.perf_counter()
        runner.forward(tokens, positions, seq_ids=seqs if a.streams > 1 else 0)
        times.append(time.perf_counter() - t0)
    ms = float(np.median(times[4:])) * 1e3
    print(json.dumps({"model": model.path.name, "streams": a.streams, "depth": a.depth, "cache_type": a.cache_type,
                      "decode_step_ms": round(ms, 3), "tokens_per_s": round(a.streams / ms * 1e3, 1),
                      "blocks": getattr(kv, "blocks_in_use", None)}))


if __name__ == "__main__":
    main()
