"""A draft: the tokens a drafter (prompt lookup or a draft model) proposes for one sequence, which the
target's verifying pass keeps or rejects."""

from __future__ import annotations

from typing import Any


class Draft:
    """Tokens a drafter proposes for one sequence, with the distribution each was drawn from (None: a
    point mass, as prompt lookup's)."""

    __slots__ = ("tokens", "q")

    def __init__(self, tokens: list[int], q: list[Any] | None = None) -> None:
        self.tokens = tokens
        self.q = q

    def dist(self, j: int) -> Any:
        return None if self.q is None else self.q[j]
