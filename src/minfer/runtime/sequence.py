"""One sequence's output: the token each step picks, the text it releases, and when the sequence stops.

Stops: an end-of-generation token (not part of the text), a stop string (not part of the text either),
a finished grammar, or ``max_tokens``. The text goes through the UTF-8-safe detokenizer (a character split
over tokens comes out whole) and the stop-string matcher (text that may begin a stop string is held back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minfer.errors import BadRequestError
from minfer.runtime.sampling import Sampler, TokenLogprob
from minfer.runtime.sampling.logprobs import check_n_top
from minfer.runtime.speculative import verify
from minfer.runtime.speculative.draft import Draft
from minfer.runtime.stop import StopMatcher


@dataclass
class TokenStep:
    """One generated token and the text it releases (may be empty: a split UTF-8 character, or text held
    back because it may begin a stop string). ``token`` is None for the final flush of held text."""

    token: int | None
    text: str
    logprob: TokenLogprob | None = None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""  # "stop" (end-of-generation token, stop string, grammar done), "length"
    stop: str | None = None  # the stop string that ended generation, if one did
    tokens: list[int] = field(default_factory=list)
    # speculative decoding: tokens drafted, those the target kept, and the target passes that sampled
    # this sequence (each gives one token, or several where a draft was kept)
    speculative: str = "off"
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_passes: int = 0
    preempted: int = 0  # times its blocks were freed for others (a unified cache), its tokens evaluated again

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # the first generated token comes out of prefill; decode steps are the rest
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Share of the drafted tokens the target kept (0 without drafts)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Generated tokens per target pass that sampled the sequence (1 without speculation)."""
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0


class Continuation:
    """One sequence's side of an engine step: logits -> (constraint mask) -> sampler -> token, then the
    token's text through the UTF-8-safe detokenizer and the stop-string matcher, and the stop checks.

    The engine (:mod:`minfer.runtime.engine`) keeps one per running sequence.
    """

    def __init__(
        self,
        tokenizer: Any,
        sampler: Sampler,
        max_tokens: int,
        stats: GenerationStats,
        stop_ids: frozenset[int] | None = None,
        stop: str | Sequence[str] = (),
        logprobs: int | None = None,
        constraint: Any = None,
    ) -> None:
        if max_tokens < 0:
            raise BadRequestError(f"max_tokens must be >= 0, got {max_tokens}")
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise BadRequestError(f"logprobs must be between 0 and 20, got {logprobs}")
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.stats = stats
        self.stop_ids = tokenizer.eog_ids if stop_ids is None else stop_ids
        self.matcher = StopMatcher(stop) if stop else None
        self.logprobs = logprobs
        self.constraint = constraint
        self.detok = tokenizer.detokenizer()
        self.done = max_tokens == 0
        if self.done:
            stats.finish_reason = "length"
        self._stopped_by_string = False

    def start(self, prompt_ids: Sequence[int]) -> None:
        self.stats.prompt_tokens = len(prompt_ids)
        self.sampler.reset(t for t in prompt_ids if t >= 0)  # (an image's rows have its own negative ids)

    def mask(self, logits: np.ndarray) -> None:
        """Before ``logits`` are sampled: the constraint (if any) masks the tokens it does not allow, in place."""
        if self.constraint is not None:
            self.constraint.mask_logits(logits)

    def take(self, logits: np.ndarray, token: int) -> TokenStep | None:
        """The sequence goes on with ``token``, which its sampler drew from ``logits`` (already masked, see
        ``mask``; the batch's one entry into sampling draws it): its step, or None for an end-of-generation
        token. Afterwards ``done`` says whether the sequence has finished (``stats.finish_reason`` says why)."""
        lp = None
        if self.logprobs is not None:
            check_n_top(self.logprobs, logits.shape[-1])
            lp = self.sampler.token_logprobs(logits, token, self.logprobs)
        return self._take(token, lp)

    def step(self, logits: np.ndarray) -> TokenStep | None:
        """``mask``, then the sampler's pick from ``logits``, then ``take``: one sequence sampled alone."""
        self.mask(logits)
        return self.take(logits, self.sampler.sample(logits))

    def draft_step(
        self, logits: np.ndarray, draft: int, q: verify.Distribution | None
    ) -> tuple[TokenStep | None, bool]:
        """Speculative decoding: the token at a position the drafter proposed ``draft`` for (drawn from ``q``,
        None for a point mass on it), and whether it is the draft. ``logits`` are the target's at this
        position; the constraint masks them and the sampler's whole chain gives the distribution the rule
        (:func:`~minfer.runtime.speculative.verify.accept_or_resample`) keeps or replaces the draft with. At
        temperature 0 the token is the sampler's own pick. Then as ``step``."""
        if self.constraint is not None:
            self.constraint.mask_logits(logits)
        if self.sampler.params.greedy:
            token = self.sampler.sample(logits)
            accepted = token == draft
        else:
            token, accepted = verify.accept_or_resample(self.sampler.distribution(logits), draft, q,
                                                        self.sampler.draw_rng)
        lp = None if self.logprobs is None else self.sampler.token_logprobs(logits, token, self.logprobs)
        return self._take(token, lp), accepted

    def verify(self, rows: np.ndarray, draft: Draft) -> tuple[list[TokenStep | None], int]:
        """Speculative decoding: the steps of a verifying pass and how many draft tokens they kept.
        ``rows[j]`` are the target's logits after the next token and ``draft.tokens[:j]`` (``1 + k`` rows
        for ``k`` tokens). Each draft token is kept or replaced (``draft_step``) until one is replaced or
        the sequence ends; after a draft kept whole the last row gives one more token. Tokens past a stop
        or ``max_tokens`` are never taken, and the constraint and the sampler's history advance over the
        tokens taken only."""
        steps: list[TokenStep | None] = []
        accepted = 0
        for j, token in enumerate(draft.tokens):
            step, kept = self.draft_step(rows[j], token, draft.dist(j))
            steps.append(step)
            accepted += kept
            if self.done or not kept:
                return steps, accepted
        steps.append(self.step(rows[len(draft.tokens)]))
        return steps, accepted

    def _take(self, token: int, lp: TokenLogprob | None) -> TokenStep | None:
        """The sequence goes on with ``token``: history, constraint, text, stops."""
        stats = self.stats
        self.sampler.accept(token)
        stats.tokens.append(token)
        stats.generated_tokens += 1
        if token in self.stop_ids:
            stats.finish_reason, self.done = "stop", True
            return None
        if self.constraint is not None:
            self.constraint.accept(token)
        text = self.detok.push(token)
        if self.matcher is not None:
            text, stopped = self.matcher.push(text)
            if stopped:
                stats.finish_reason, stats.stop = "stop", self.matcher.stop
                self.done = self._stopped_by_string = True
                return TokenStep(token, text, lp)
        if self.constraint is not None and self.constraint.is_finished():
            stats.finish_reason, self.done = "stop", True
        elif stats.generated_tokens >= self.max_tokens:
            stats.finish_reason, self.done = "length", True
        return TokenStep(token, text, lp)

    def finish(self, reason: str | None = None) -> TokenStep | None:
        """The text still held back (a split character, a possible stop string's start), once the sequence
        ends; ``reason`` ends it from outside (a full context, a cancelled request)."""
        if reason is not None:
            self.stats.finish_reason, self.done = reason, True
        if self._stopped_by_string:
            return None
        tail = self.detok.flush()
        if self.matcher is not None:
            tail, stopped = self.matcher.push(tail)
            if stopped:
                self.stats.finish_reason, self.stats.stop = "stop", self.matcher.stop
            else:
                tail += self.matcher.flush()
        return TokenStep(None, tail) if tail else None
