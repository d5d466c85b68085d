"""Speculative decoding with a draft model at a real pair of sizes, at an acceptance rate set by hand.

The target is a 1.7B-shaped file of random weights (``bench/synthetic_model.py``, SmolLM2's tokenizer);
the draft is the real SmolLM2-135M, which shares that tokenizer. Random weights make the two disagree on
every token, so the draft's *costs* are real (its catch-up pass and one pass per drafted token run as
they do in use) while its *tokens* are modelled: each drafting row is replaced by the target's own
logits at that position plus Gaussian noise, ``L_j + sigma * e_j``, with ``e_j`` drawn once per position
(seed 0). A greedy draft then proposes ``argmax(L_j + sigma * e_j)``, which the target keeps exactly
where it equals the target's token; ``sigma`` is set by bisection so that this holds at ``--acceptance``
(default 0.7) of the positions. The target's logits ``L_j`` come from one prompt pass over the plain
run's text (prefill rows equal decode rows, bit for bit).

It prints the target's pass-cost curve, the draft's token cost, the speedup these bound at the modelled
acceptance, and the measured plain and speculative rates (alternating, the median of ``--reps``), and
checks that the speculative text is the plain text.

    python bench/draft_pair.py /tmp/synth/1.7b-q4_k_m.gguf [--draft smollm2] [--threads 2] [-n 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from graph_overhead import best_of  # (this folder: a script's own; the median of reps after one warm-up)

import minfer
from minfer.runtime.speculative.draft_model import DraftModel
from minfer.runtime.speculative.policy import expected_tokens
from minfer.runtime.speculative.state import verify_size

PROMPT = "Write a short story about a lighthouse keeper and the ships that pass his light at night."


class ModelledDraft(DraftModel):
    """The draft model's passes as they are, its rows replaced by the target's logits plus noise."""

    logits: np.ndarray  # the target's logits for generated tokens 0..N-1
    noise: np.ndarray
    sigma: float
    n_prompt: int

    def _draw(self, job, row, draft, dists) -> bool:  # type: ignore[override]
        at = len(job.context) - self.n_prompt + len(draft)  # the generated token this row predicts
        if at >= len(self.logits):
            return False
        row[:] = self.logits[at] + self.sigma * self.noise[at]
        return DraftModel._draw(job, row, draft, dists)


def kept_share(logits: np.ndarray, noise: np.ndarray, tokens: np.ndarray, sigma: float) -> float:
    return float(np.mean(np.argmax(logits + sigma * noise, axis=1) == tokens))


def tune_sigma(logits: np.ndarray, noise: np.ndarray, tokens: np.ndarray, target: float) -> float:
    lo, hi = 0.0, 1.0
    while kept_share(logits, noise, tokens, hi) > target:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if kept_share(logits, noise, tokens, mid) > target else (lo, mid)
    return (lo + hi) / 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--draft", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=64, help="tokens to generate")
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()

    model = minfer.load(a.target, threads=a.threads, draft=a.draft,
                        speculative={"draft_max": a.draft_max, "draft_p_min": 0.0})
    ids = model.tokenize(PROMPT)
    plain = model.complete(ids, a.n, temperature=0, speculative="off")
    tokens = np.array(plain.tokens)
    n = len(tokens)
    # the target's logits for each generated token: one pass over the prompt and the text before it
    runner = model.runner
    seq = np.array(ids + plain.tokens[:-1])
    logits = runner.forward(seq, np.arange(len(seq)), output_rows=list(range(len(ids) - 1, len(seq))))
    logits = np.array(logits, np.float32)
    assert (np.argmax(logits, axis=1) == tokens).all(), "prefill rows give the plain run's tokens"
    noise = np.random.default_rng(0).standard_normal(logits.shape).astype(np.float32)
    sigma = tune_sigma(logits, noise, tokens, a.acceptance)
    draft = model.engine.draft
    assert draft is not None
    draft.__class__ = ModelledDraft
    draft.logits, draft.noise, draft.sigma, draft.n_prompt = logits, noise, sigma, len(ids)
    print(f"target {model.path.name}, draft {draft.model.path.name}, {a.threads} threads, {n} tokens; "
          f"sigma {sigma:.4g} keeps {kept_share(logits, noise, tokens, sigma):.0%} of the draft tokens")

    # the pass-cost curve: a pass of k tokens after the prompt against a one-token pass
    rng = np.random.default_rng(1)
    vocab = model.hparams.n_vocab
    base = len(seq)
    sizes = sorted({1, *(verify_size(k, a.draft_max) for k in range(2, a.draft_max + 2))})
    cost = {}
    for k in sizes:
        toks, pos = rng.integers(0, vocab, k), np.arange(base, base + k)
        cost[k] = best_of(lambda: runner.forward(toks, pos), 5)  # noqa: B023
    d_runner = draft.runner
    d_runner.forward(rng.integers(0, vocab, base), np.arange(base), [base - 1])
    d_tok = np.array([1])
    d_cost = best_of(lambda: d_runner.forward(d_tok, [base]), 9)
    r = d_cost / cost[1]
    print("target passes: " + ", ".join(f"{k}: {cost[k] * 1e3:.1f} ms ({cost[k] / cost[1]:.2f}x)" for k in sizes)
          + f"; a draft token {d_cost * 1e3:.2f} ms ({r:.3f} of a target decode)")
    for alpha in (a.acceptance, 1.0):
        rates = {k: expected_tokens(alpha, k) / (cost[verify_size(1 + k, a.draft_max)] / cost[1] + k * r)
                 for k in range(1, a.draft_max + 1)}
        best = max(rates, key=rates.get)  # type: ignore[arg-type]
        print(f"bound at acceptance {alpha:.0%}: {rates[best]:.2f}x plain (drafts of {best})")

    rates: dict[str, list[float]] = {"off": [], "draft": []}
    kept = drafted = passes = generated = 0
    for rep in range(a.reps + 1):
        for mode in ("off", "draft"):
            t0 = time.perf_counter()
            done = model.complete(ids, a.n, temperature=0, speculative=mode)
            dt = time.perf_counter() - t0
            assert done.tokens == plain.tokens, f"{mode}: the text differs from the plain run's"
            if rep:
                rates[mode].append(len(done.tokens) / dt)
                if mode == "draft":
                    s = done.stats
                    kept, drafted = kept + s.accepted_tokens, drafted + s.drafted_tokens
                    passes, generated = passes + s.target_passes, generated + s.generated_tokens
    off, on = statistics.median(rates["off"]), statistics.median(rates["draft"])
    pairs = ", ".join(f"{b / p:.2f}" for p, b in zip(rates["off"], rates["draft"], strict=True))
    print(f"plain {off:.2f} t/s, with the draft {on:.2f} t/s = {on / off:.2f}x (each pair: {pairs}); "
          f"{kept}/{drafted} drafted tokens kept, {generated / passes:.2f} tokens per target pass; the same text")

if __name__ == "__main__":
    main()
