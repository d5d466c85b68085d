"""How long a draft pays: the expected tokens a verifying pass gives against what the pass costs.

A draft of d tokens whose tokens the target keeps one after the other with probability ``alpha`` each
gives ``1 + alpha + ... + alpha^d`` tokens (the pass always gives one of its own), for the cost of a
pass of 1 + d tokens (padded to a prepared size) instead of a one-token pass. The draft pays where that
ratio beats 1, and the best length maximizes it. On a CPU the cost grows with the tokens (SmolLM2 at 2
threads: 2, 4, 8, 9 tokens cost 1.21, 1.51, 2.14, 2.43 one-token passes; a 1.7B Q4_K_M shape 1.29,
1.33, 1.80 at 2, 4, 8), so a weak match drafts one token or none, and a strong one fills the largest
pass that pays. A draft model's tokens cost its own passes too (SmolLM2-135M drafting for a 1.7B shape:
0.1 of a target decode each), which shortens its drafts. Beside other sequences a draft competes with
the whole pass's rate: four decodes of SmolLM2 give 4 tokens for 1.51 one-token passes' time, and a
one-token draft kept 30% of the time, which pays alone (1.3 tokens for 1.21), does not pay there (4.3
tokens for about 1.67).

:class:`PassCosts` measures the curve on the passes that run (decode and verifying passes, no prompt in
them); until a size has been measured a prior slope stands in for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# a pass of n tokens over a one-token pass until measured: 1 + PRIOR_SLOPE * (n - 1) (SmolLM2 at 2
# threads measures 0.15-0.2 per token; larger models less, so this errs on the side of shorter drafts)
PRIOR_SLOPE = 0.15
# a size's estimate moves this far towards a faster pass, and this far towards a slower one: a pass is
# slowed by what else runs (a collection, another process), never sped up, so the estimate follows the
# fast passes and lets a few slow ones pass
TOWARDS_FASTER = 0.5
TOWARDS_SLOWER = 0.1
# passes of a size measured before its estimate replaces the prior (the fastest of them, then followed as
# above): one slow first pass (a host's hiccup) would otherwise stand as the size's cost, and a size that
# looks too dear to draft for is never run, so never measured again
TRUSTED_AFTER = 3
# a size not run for this many seconds is measured afresh: an estimate from passes slower than it now runs
# (the first few of a plan can be) prices it out of drafting, so it would never be run to correct it
STALE_AFTER = 10.0
# a draft model's token over a target's one-token pass until both are measured (SmolLM2-135M drafting for a
# 1.7B shape: 0.11)
DRAFT_TOKEN_PRIOR = 0.1


class PassCosts:
    """Seconds of decode and verifying passes by their token count, as measured on the passes that ran;
    :meth:`relative` is a pass of n tokens over a one-token pass. The first pass of a size is not counted:
    it binds its plan's kernels to their buffers (a few ms)."""

    def __init__(self, prior_slope: float = PRIOR_SLOPE, measure: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.prior_slope = prior_slope
        self.measure = measure  # False: the prior alone, whatever the passes take (reproducible drafts)
        self.clock = clock
        self._seconds: dict[int, float] = {}
        self._count: dict[int, int] = {}  # passes counted per size (after the first, not counted)
        self._last: dict[int, float] = {}  # when each size last ran

    def record(self, n_tokens: int, seconds: float) -> None:
        if not self.measure:
            return
        self._last[n_tokens] = self.clock()
        count = self._count.get(n_tokens, -1) + 1
        self._count[n_tokens] = count
        if count == 0:
            return
        mean = self._seconds.get(n_tokens)
        if mean is None:
            self._seconds[n_tokens] = seconds
        elif count <= TRUSTED_AFTER:
            self._seconds[n_tokens] = min(mean, seconds)
        else:
            self._seconds[n_tokens] = mean + (TOWARDS_FASTER if seconds < mean else TOWARDS_SLOWER) * (seconds - mean)

    def seconds(self, n_tokens: int) -> float | None:
        """The estimate for a pass of ``n_tokens`` (None until ``TRUSTED_AFTER`` have been measured, and
        again once none has run for ``STALE_AFTER`` seconds: the next ones measure it afresh)."""
        if self._count.get(n_tokens, 0) < TRUSTED_AFTER:
            return None
        if self.clock() - self._last[n_tokens] > STALE_AFTER:
            self._count[n_tokens] = 0  # bound already: the next pass counts
            del self._seconds[n_tokens]
            return None
        return self._seconds[n_tokens]

    def relative(self, n_tokens: int) -> float:
        if n_tokens <= 1:
            return 1.0
        one, it = self.seconds(1), self.seconds(n_tokens)
        if one and it:
            return max(1.0, it / one)  # a noisy measurement never makes more tokens cheaper than one
        return 1.0 + self.prior_slope * (n_tokens - 1)


def expected_tokens(alpha: float, d: int) -> float:
    """Tokens a verifying pass gives for a draft of ``d`` tokens, each kept (after the one before) with
    probability ``alpha``: ``1 + alpha + ... + alpha^d``."""
    return float(sum(alpha**j for j in range(d + 1)))


def best_length(alpha: float, available: int, cost: Callable[[int], float], others: float = 0.0) -> int:
    """The draft length in ``0..available`` that gives the most tokens per unit of cost, where the pass
    with a draft of d tokens costs ``cost(d)`` one-token passes (its verifying pass, and the drafting where
    that costs) and the rest of the pass gives ``others`` tokens (0 for a sequence alone); 0 (no draft)
    unless some length beats the pass without it."""
    best, best_rate = 0, (others + 1.0) / cost(0)
    for d in range(1, available + 1):
        rate = (others + expected_tokens(alpha, d)) / cost(d)
        if rate > best_rate:
            best, best_rate = d, rate
    return best
