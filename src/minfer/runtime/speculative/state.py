"""One sequence's side of speculative decoding: its settings, its token history, its draft length.

Each draft is as long as it is expected to pay (:mod:`.policy`): the sequence counts how many of its draft
tokens the target kept (a draft kept up to its m-th token tried m + 1 of them), for a draft model's drafts
and, for prompt lookup, by the length of the n-gram each draft matched. Prior guesses count as two
tokens for lookup and eight for a draft model, and every step fades the evidence by 2%. A sequence that
stops drafting (from 1-gram matches, say) after a rejection pauses 16 steps, then drafts again once the
faded evidence says it pays; each such stop doubles the pause (up to 128), a kept draft resets it. A
3-gram match in text that repeats the prompt is kept ~95% of the time per token (SmolLM2 copying a
paragraph), a 1-gram one in free text almost never: the first fills the largest pass that pays, the
second drafts nothing.

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
from minfer.runtime.speculative.policy import best_length
from minfer.runtime.speculative.settings import SpeculativeSettings

# the chance that the target keeps a draft token (after the one before) until the sequence measures its
# own: prompt lookup's by the length n of the n-gram the draft matched (SmolLM2, temperature 0: ~0.95 at
# n = 3 on text that repeats the prompt, 0.8-0.9 at n = 2, 0-0.9 at n = 1), a draft model's at 0
PRIOR_KEPT = {0: 0.6, 1: 0.2, 2: 0.5}  # n >= 3: 0.8
# draft tokens the guess counts as: prompt lookup's acceptance swings with the text (a passage copied, then
# free text), so its evidence takes over fast; a draft model's is a steadier property of the pair, so a
# few rejections at a true 70% (a first one-token draft rejected: 0.4 at weight 2) do not stop it
PRIOR_WEIGHT = {"lookup": 2.0, "draft": 8.0}
EVIDENCE_FADE = 0.98  # per step
# a sequence that stops drafting right after a rejection waits this many steps before it may try again,
# twice as long after each try that fails the same way (up to MAX_PAUSE): at the point where it stops its
# estimate sits just below what pays, and the evidence's fading alone would bring it back within a few
# steps, to be rejected again (a draft every ~5 steps that the target never keeps)
PAUSE = 16
MAX_PAUSE = 128


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
        # draft tokens kept and tried (faded each step): [0] a draft model's, [n] prompt lookup's n-gram's
        self.kept_by_n = [0.0] * (settings.ngram_max + 1)
        self.tried_by_n = [0.0] * (settings.ngram_max + 1)
        self.matched = 0  # the n-gram length of the draft being verified (0: a draft model's)
        self.steps = 0
        self.rejected = [False] * (settings.ngram_max + 1)  # the last verified draft lost tokens
        self.paused_until = [0] * (settings.ngram_max + 1)
        self.pause = [PAUSE] * (settings.ngram_max + 1)

    def kept_chance(self, n: int = 0) -> float:
        """The chance that the target keeps a draft token, after the one before: what this sequence measured
        for drafts that matched an ``n``-gram (0: a draft model's), with the prior guess."""
        prior = PRIOR_KEPT.get(n, 0.8)
        weight = PRIOR_WEIGHT[self.settings.mode]
        return (self.kept_by_n[n] + weight * prior) / (self.tried_by_n[n] + weight)

    def draft_length(self, room: int, cost: Callable[[int], float], others: float = 0.0) -> int:
        """Tokens a draft model's next draft may hold: the length that pays (``cost(d)``: what the pass with
        a draft of d tokens costs, in one-token passes of the target; ``others``: the tokens the rest of the
        pass gives), within ``room`` (what the sequence may still generate after the next token, and what
        its context still holds); 0: no draft this step."""
        self._fade()
        k = min(room, self.settings.draft_max)
        if k < max(1, self.settings.draft_min):
            return 0
        return self._length(0, k, cost, others)

    def lookup(self, generated: list[int], room: int, cost: Callable[[int], float],
               others: float = 0.0) -> Draft | None:
        """Prompt lookup's draft after the tokens generated so far (the history catches up on them), as
        long as pays (``cost`` and ``others`` as for :meth:`draft_length`) within ``room``."""
        assert self.history is not None
        have = self.history.n - self.n_prompt
        if len(generated) > have:
            self.history.extend(generated[have:])
        self._fade()
        s = self.settings
        k = min(room, s.draft_max)
        if k < max(1, s.draft_min):
            return None
        tokens, n = lookup_draft(self.history.tokens, k, s.ngram_max, s.ngram_min)
        if not tokens:
            return None
        d = self._length(n, len(tokens), cost, others)
        self.matched = n
        return self.kept(Draft(tokens[:d])) if d else None

    def _length(self, n: int, available: int, cost: Callable[[int], float], others: float) -> int:
        """The draft length that pays for drafts like ``n``'s, or 0 while they are paused."""
        if self.steps < self.paused_until[n]:
            return 0
        d = best_length(self.kept_chance(n), available, cost, others)
        if not d and self.rejected[n]:
            self.paused_until[n] = self.steps + self.pause[n]
            self.pause[n] = min(2 * self.pause[n], MAX_PAUSE)
            self.rejected[n] = False
        return d

    def _fade(self) -> None:
        self.steps += 1
        for n in range(len(self.kept_by_n)):
            self.kept_by_n[n] *= EVIDENCE_FADE
            self.tried_by_n[n] *= EVIDENCE_FADE

    def kept(self, draft: Draft) -> Draft | None:
        """The draft, or None where it is shorter than ``draft_min``."""
        return draft if draft.tokens and len(draft.tokens) >= self.settings.draft_min else None

    def verified(self, drafted: int, accepted: int) -> None:
        """The target kept ``accepted`` of the ``drafted`` tokens of the draft that :meth:`lookup` or the
        draft model made last: evidence for drafts like it."""
        n = self.matched if self.history is not None else 0
        self.kept_by_n[n] += accepted
        self.tried_by_n[n] += accepted + (accepted < drafted)
        self.rejected[n] = accepted < drafted
        if accepted:
            self.pause[n] = PAUSE
