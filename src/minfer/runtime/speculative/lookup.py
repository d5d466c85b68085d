"""Prompt lookup: drafts copied from earlier in the sequence (vLLM's ``ngram`` method, no second model).

The last n tokens of the sequence (prompt and output) are searched for earlier in it, longest n first;
the tokens that followed the most recent earlier occurrence are the draft. Text that repeats or edits
what the prompt holds (code, a quoted paragraph, a summary reusing phrases) is drafted well; free text
rarely matches beyond a token or two, and the engine's draft length (:mod:`.state`) shrinks there.
"""

from __future__ import annotations

import numpy as np


class TokenHistory:
    """A sequence's tokens (prompt, then output) in a growing int64 buffer the search runs on."""

    def __init__(self, tokens: list[int] | tuple[int, ...] = ()) -> None:
        self._buf = np.zeros(max(64, 2 * len(tokens)), np.int64)
        self.n = 0
        self.extend(tokens)

    def extend(self, tokens: list[int] | tuple[int, ...]) -> None:
        m = len(tokens)
        if self.n + m > len(self._buf):
            grown = np.zeros(2 * (self.n + m), np.int64)
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : self.n + m] = tokens
        self.n += m

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self.n]


def lookup_draft(history: np.ndarray, k: int, ngram_max: int, ngram_min: int) -> tuple[list[int], int]:
    """(draft, n): up to ``k`` tokens following the most recent earlier occurrence of the last ``n`` tokens
    of ``history``, for the longest ``n`` in ``ngram_max..ngram_min`` that occurs earlier; ([], 0) if none.

    An occurrence must end before the last token, so that at least one token follows it."""
    size = len(history)
    if k < 1:
        return [], 0
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        # starts i of earlier occurrences: i + n <= size - 1 (a token follows), i.e. i in [0, size - n - 1]
        m = size - n
        hit = history[:m] == history[m]
        for t in range(1, n):
            hit &= history[t : m + t] == history[m + t]
        found = np.flatnonzero(hit)
        if found.size:
            start = int(found[-1]) + n
            return history[start : start + k].tolist(), n
    return [], 0
