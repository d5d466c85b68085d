"""KV cache memory per position by cell type: allocated bytes, and RSS growth over a long context.

For each cell type, loads the model with a large context, then evaluates a long random prompt and
reports the regions' bytes per position and how much the process RSS grew while the positions were
written (regions are allocated lazily, so RSS tracks the positions actually used).

    python bench/kv_memory.py [MODEL] [--ctx 4096] [--tokens 4096]
"""

from __future__ import annotations

import argparse

import numpy as np

import minfer


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    f32_per_pos = None
    print(f"{'cells':6s} {'bytes/pos':>10s} {'vs f32':>7s} {'RSS growth':>12s} {'per pos':>9s}")
    for ct in ("f32", "f16", "q8_0"):
        model = minfer.load(a.model, n_ctx=a.ctx, cache_type=ct)
        tokens = np.random.default_rng(0).integers(0, model.hparams.n_vocab, a.tokens)
        for n in (16, 512):  # plans and pooled buffers exist before measuring
            model.runner.forward(tokens[:n], np.arange(n), output_rows=[n - 1])
        model.kv.clear()
        before = rss_bytes()
        for start in range(0, a.tokens, 512):
            chunk = tokens[start : start + 512]
            model.runner.forward(chunk, np.arange(start, start + len(chunk)), output_rows=[len(chunk) - 1])
        grown = rss_bytes() - before
        per_pos = model.kv_bytes_per_position
        f32_per_pos = f32_per_pos or per_pos
        fresh = a.tokens - 512  # the warm-up already touched the first 512 rows
        print(f"{ct:6s} {per_pos:10d} {f32_per_pos / per_pos:6.2f}x {grown / 2**20:9.1f} MiB "
              f"{grown / fresh:9.0f}")
        del model


if __name__ == "__main__":
    main()
