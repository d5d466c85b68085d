"""What a pass of k tokens costs against a pass of one: the curve that decides whether speculative decoding
(a verify pass of 1 + draft tokens) and batched decode (k sequences in one step) pay.

Each pass evaluates k tokens after a 64-token prompt, with every row's logits (as a verify pass has), on
a plan prepared beforehand; the time is the median of ``--reps`` passes.

    python bench/pass_cost.py [MODEL] [--threads 2] [--sizes 1,2,3,4,8,9,16]
"""

from __future__ import annotations

import argparse

import numpy as np
from graph_overhead import best_of  # (this folder: a script's own)

import minfer

PROMPT = 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="1,2,3,4,8,9,16")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    sizes = [int(k) for k in a.sizes.split(",")]
    model = minfer.load(a.model, n_ctx=PROMPT + max(sizes) + 8, threads=a.threads)
    runner = model.runner
    rng = np.random.default_rng(0)
    n_vocab = model.hparams.n_vocab
    runner.forward(rng.integers(0, n_vocab, PROMPT), np.arange(PROMPT), [PROMPT - 1])
    base = None
    print(f"{model.path.name}, {a.threads} threads, after a {PROMPT}-token prompt (median of {a.reps}):")
    for k in sizes:
        tokens, positions = rng.integers(0, n_vocab, k), np.arange(PROMPT, PROMPT + k)
        seconds = best_of(lambda: runner.forward(tokens, positions), a.reps)  # noqa: B023 (the median)
        base = base or seconds
        print(f"  k={k:2d}: {seconds * 1e3:8.2f} ms  {seconds / base:5.2f}x the 1-token pass  "
              f"{k / seconds:7.1f} tokens/s")


if __name__ == "__main__":
    main()
