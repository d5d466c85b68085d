"""One sequence's side of speculative decoding: its settings, its token history, its draft length.

Prompt lookup sizes each draft by what it is expected to give (:mod:`.policy`): the sequence keeps, for
each length of the n-gram its drafts matched, how many of their tokens the target kept (a draft kept up
to its m-th token tried m + 1 of them; prior guesses count as two tokens, and every step fades the
evidence by 2%, so a sequence whose 1-gram drafts fail stops drafting from 1-gram matches and tries again
20-60 steps later). A 3-gram match in text that repeats the prompt is kept ~95% of the time per token
(SmolLM2 copying a paragraph), a 1-gram one in free text almost never: the first fills the largest pass
that pays, the second drafts nothing.

A draft model's draft length adapts to what the target accepts: after a pass that accepted the whole draft
the next one may be twice as long (up to ``draft_max``); after a rejection at index m it holds at most
m + 1 tokens. A draft rejected at its first token backs off: the sequence decodes plainly for 1, 2, 4 ...
up to 16 steps before drafting again; a sequence whose drafts keep under 30% of their tokens stops
drafting for 64 steps.

A verifying pass evaluates a bucketed number of tokens (:func:`verify_sizes`: 2, 4, 8 ... and
``1 + draft_max``), so that its plan is one of a few prepared before the first token: a shorter draft is
padded (see the scheduler).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from minfer.runtime.sampling import Sampler, SamplingParams
from minfer.runtime.speculative.draft import Draft
from minfer.runtime.speculative.lookup import TokenHistory, lookup_draft
from minfer.runtime.speculative.policy import PassCosts, best_length
from minfer.runtime.speculative.settings import SpeculativeSettings

MAX_BACKOFF = 16
# a sequence whose drafts keep fewer than this share of their tokens, after OFF_AFTER drafted tokens, stops
# drafting for OFF_STEPS steps: a verifying pass of 2 tokens costs ~1.4 decodes (SmolLM2 and a 1.7B shape,
# 2 threads), so a one-token draft pays only when it is kept more often than that
OFF_ACCEPTANCE = 0.3
OFF_AFTER = 8
OFF_STEPS = 64
# prompt lookup: the chance that the target keeps a draft token (after the one before), guessed by the
# length n of the n-gram the draft matched until the sequence measures its own (SmolLM2, temperature 0:
# ~0.95 at n = 3 on text that repeats the prompt, 0.8-0.9 at n = 2, 0-0.9 at n = 1)
PRIOR_KEPT = {1: 0.2, 2: 0.5}  # n >= 3: 0.8
PRIOR_WEIGHT = 2.0  # draft tokens the guess counts as
EVIDENCE_FADE = 0.98  # per step


def verify_sizes(draft_max: int) -> list[int]:
    """The token counts a verifying pass of a sequence with this ``draft_max`` evaluates: the powers of
    two from 2 below ``1 + draft_max``, and ``1 + draft_max`` itself."""
    sizes = [2]
    while sizes[-1] * 2 < 1 + draft_max:
        sizes.append(sizes[-1] * 2)
    return [s for s in sizes if s < 1 + draft_max] + [1 + draft_max]


def verify_size(n: int, draft_max: int) -> int:
    """The tokens a verifying pass of ``n`` (the next token and its draft) evaluates."""
    return next(s for s in verify_sizes(draft_max) if s >= n)


def draft_sampler(params: SamplingParams, seed: int) -> Sampler:
    """The chain a draft model samples its tokens with: the target's temperature, truncations and bias,
    without the steps that need a history or carry state (penalties, DRY, XTC, mirostat). Any chain keeps
    the output's distribution (the acceptance rule corrects for it); one close to the target's keeps more
    drafts."""
    plain = replace(params, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, dry_multiplier=0.0,
                    xtc_probability=0.0, mirostat=0, seed=seed)
    return Sampler(plain)


class SequenceSpeculation:
    """Drafting for one running sequence: what its settings allow, its history and its next draft length."""

    def __init__(self, settings: SpeculativeSettings, prompt: list[int], sampler: Sampler) -> None:
        self.settings = settings
        # mirostat picks by its own rule with state (mu), not from a distribution the rule can test
        self.enabled = settings.on and not sampler.params.mirostat
        self.history = TokenHistory(prompt) if settings.mode == "lookup" else None
        self.n_prompt = len(prompt)
        self.draft_sampler = (draft_sampler(sampler.params, (sampler.seed + 1) % 2**32)
                              if settings.mode == "draft" else None)
        self.k = settings.draft_max
        self.skip = 0  # steps left to decode without a draft
        self.backoff = 1  # steps to skip after the next draft rejected whole
        self.drafted = self.accepted = 0  # since drafting last resumed
        # prompt lookup: per matched n-gram length, draft tokens kept and tried (faded each step)
        self.kept_by_n = [0.0] * (settings.ngram_max + 1)
        self.tried_by_n = [0.0] * (settings.ngram_max + 1)
        self.matched = 0  # the n-gram length of the draft being verified

    def limit(self, room: int) -> int:
        """Tokens the next draft model's draft may hold: the adaptive length, within ``room`` (what the
        sequence may still generate after the next token, and what its context still holds); 0 while
        backing off."""
        if self.skip:
            self.skip -= 1
            return 0
        k = max(0, min(self.k, room))
        if k:  # the pass is padded to its size anyway: a draft that fills it costs nothing more
            k = min(verify_size(1 + k, self.settings.draft_max) - 1, room)
        return k

    def kept_chance(self, n: int) -> float:
        """The chance that the target keeps a token of a draft that matched an ``n``-gram, each after the
        one before: what this sequence measured, with the prior guess for that length."""
        prior = PRIOR_KEPT.get(n, 0.8)
        return (self.kept_by_n[n] + PRIOR_WEIGHT * prior) / (self.tried_by_n[n] + PRIOR_WEIGHT)

    def lookup(self, generated: list[int], room: int, costs: PassCosts,
               pass_size: Callable[[int], int]) -> Draft | None:
        """Prompt lookup's draft after the tokens generated so far (the history catches up on them), as
        long as pays (:func:`~minfer.runtime.speculative.policy.best_length`) within ``room``; ``costs``
        and ``pass_size`` say what a pass of n tokens costs and evaluates."""
        assert self.history is not None
        have = self.history.n - self.n_prompt
        if len(generated) > have:
            self.history.extend(generated[have:])
        for n in range(len(self.kept_by_n)):
            self.kept_by_n[n] *= EVIDENCE_FADE
            self.tried_by_n[n] *= EVIDENCE_FADE
        s = self.settings
        k = min(room, s.draft_max)
        if k < max(1, s.draft_min):
            return None
        tokens, n = lookup_draft(self.history.tokens, k, s.ngram_max, s.ngram_min)
        if not tokens:
            return None
        d = best_length(self.kept_chance(n), len(tokens), costs.relative, pass_size)
        self.matched = n
        return self.kept(Draft(tokens[:d])) if d else None

    def kept(self, draft: Draft) -> Draft | None:
        """The draft, or None where it is shorter than ``draft_min``."""
        return draft if draft.tokens and len(draft.tokens) >= self.settings.draft_min else None

    def verified(self, drafted: int, accepted: int) -> None:
        """The target kept ``accepted`` of ``drafted`` tokens: the next draft's length follows."""
        if self.history is not None:  # prompt lookup: the evidence for drafts of this match length
            self.kept_by_n[self.matched] += accepted
            self.tried_by_n[self.matched] += accepted + (accepted < drafted)
            return
        if accepted == drafted:
            self.k = min(2 * max(self.k, 1), self.settings.draft_max)
        else:
            self.k = max(1, accepted + 1)
        if accepted == 0:
            self.skip, self.backoff = self.backoff, min(2 * self.backoff, MAX_BACKOFF)
        else:
            self.backoff = 1
        self.drafted += drafted
        self.accepted += accepted
        if self.drafted >= OFF_AFTER and self.accepted < OFF_ACCEPTANCE * self.drafted:
            # speculation does not pay for this sequence: off for a while, then measured afresh
            self.skip = OFF_STEPS
            self.drafted = self.accepted = 0
