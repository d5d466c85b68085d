"""A draft model: a second, cheaper model that proposes the target's next tokens.

It keeps a KV cache of its own with the target's layout (one sequence per slot, the same positions), so
a sequence's draft rows sit at the positions of the target's. Before drafting, the draft cache catches up
on what the target's sequence holds now: the tokens it shares with what the draft cache holds stay (the
prefix of the prompt, the accepted draft tokens), the rest is evaluated in one pass, so rejected rows
are simply overwritten (positions are data). The sequences drafting in one engine step draft together:
one pass per draft token for all of them.

Its vocabulary must be the target's, token for token (checked at load): draft ids are target ids.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minfer.errors import ModelError
from minfer.models.model import TransformerModel
from minfer.runtime.forward import ForwardRunner
from minfer.runtime.kv_cache import KVCache, common_prefix
from minfer.runtime.sampling import Sampler
from minfer.runtime.sampling.pickers import search
from minfer.runtime.speculative.draft import Draft
from minfer.runtime.speculative.policy import PassCosts

DRAFT_PLANS = 16  # batch shapes the draft runner keeps plans for (catch-up passes vary in length)


def check_vocabulary(target: Any, draft: Any, where: str) -> None:
    """Refuse a draft tokenizer whose tokens are not the target's, naming the first that differs."""
    n_t, n_d = int(target.vocab_size), int(draft.vocab_size)
    for i in range(min(n_t, n_d)):
        a, b = target.token_text(i), draft.token_text(i)
        if a != b:
            raise ModelError(
                f"{where}: its vocabulary differs from the target's at token {i}: {b!r} in the draft, {a!r} in the "
                "target (a draft model must share the target's tokenizer)"
            )
    if n_t != n_d:
        i = min(n_t, n_d)
        has = "the target" if n_t > n_d else "the draft"
        piece = (target if n_t > n_d else draft).token_text(i)
        raise ModelError(
            f"{where}: its vocabulary differs from the target's at token {i}: only {has} has it ({piece!r}); the "
            f"draft has {n_d} tokens, the target {n_t}"
        )


@dataclass
class DraftJob:
    """One sequence to draft for: its slot, the tokens at its positions 0..pos (the last one is the token
    the target evaluates next), at most ``k`` draft tokens, the chain the draft samples with."""

    slot: int
    context: Sequence[int]
    k: int
    sampler: Sampler
    p_min: float
    stop_ids: frozenset[int]
    constraint: Any = None


class DraftModel:
    """``model`` drafting into its own cache of ``n_seq`` sequences of ``capacity`` positions."""

    def __init__(self, model: TransformerModel, backend: Any, capacity: int, n_seq: int,
                 cache_type: str | None = None, measure_costs: bool = True) -> None:
        self.model = model
        self.kv = KVCache(model.hparams, capacity * n_seq, cache_type, n_seq=n_seq)
        self.runner = ForwardRunner(model, backend, self.kv, max_plans=DRAFT_PLANS)
        # its drafting passes (one token per drafting sequence): what a draft costs
        self.costs = PassCosts(measure=measure_costs)

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft | None]:
        """Each job's draft (None where the draft model had no token it was sure enough of)."""
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[int] = []
        outputs: list[int] = []
        for job in jobs:
            ctx = job.context
            n = common_prefix(self.kv.tokens(job.slot), ctx, len(ctx) - 1)  # the last one is always evaluated
            tokens.extend(ctx[n:])
            positions.extend(range(n, len(ctx)))
            seqs.extend([job.slot] * (len(ctx) - n))
            outputs.append(len(tokens) - 1)
        drafts: list[list[int]] = [[] for _ in jobs]
        dists: list[list[Any]] = [[] for _ in jobs]
        consumed = [0] * len(jobs)  # tokens each constraint advanced over while drafting
        alive = list(range(len(jobs)))
        logits = self.runner.forward(tokens, positions, outputs, seqs)
        try:
            while alive:
                more = []
                for i, row in zip(alive, logits, strict=True):
                    if self._draw(jobs[i], row, drafts[i], dists[i]):
                        job = jobs[i]
                        if job.constraint is not None:
                            job.constraint.accept(drafts[i][-1])
                            consumed[i] += 1
                        more.append(i)
                alive = more
                if alive:
                    t0 = time.perf_counter()
                    logits = self.runner.forward(
                        [drafts[i][-1] for i in alive],
                        [len(jobs[i].context) + len(drafts[i]) - 1 for i in alive],
                        None, [jobs[i].slot for i in alive],
                    )
                    self.costs.record(len(alive), time.perf_counter() - t0)
        finally:
            for job, n in zip(jobs, consumed, strict=True):
                if n:
                    job.constraint.rollback(n)
        return [Draft(d, q) if d else None for d, q in zip(drafts, dists, strict=True)]

    @staticmethod
    def _draw(job: DraftJob, row: np.ndarray, draft: list[int], dists: list[Any]) -> bool:
        """Draw the next draft token from ``row``; whether drafting goes on after it."""
        if job.constraint is not None:
            if job.constraint.is_finished():
                return False
            job.constraint.mask_logits(row)
        if job.p_min > 0:
            top = 1.0 / float(np.exp(row.astype(np.float64) - row.max()).sum())  # at temperature 1
            if top < job.p_min:
                return False
        ids, probs = job.sampler.distribution(row)
        token = int(ids[0] if len(ids) == 1 else ids[search(np.cumsum(probs), job.sampler.draw_rng)])
        draft.append(token)
        dists.append((ids, probs))
        return len(draft) < job.k and token not in job.stop_ids
