"""What a sequence's speculative decoding does: the mode, how many tokens a draft may hold, when to stop."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from minfer.errors import BadRequestError

Mode = Literal["off", "lookup", "draft"]
MODES: tuple[str, ...] = ("off", "lookup", "draft")

DEFAULT_DRAFT_MAX = 8  # tokens a draft holds at most (the verifying pass evaluates one more)


@dataclass(frozen=True)
class SpeculativeSettings:
    """``mode``: ``"off"``, ``"lookup"`` (n-gram drafts from the prompt and the output, no second model) or
    ``"draft"`` (a draft model, loaded with the target). ``draft_max``: tokens a draft holds at most;
    ``draft_min``: a shorter draft is not verified (the step decodes one token); ``draft_p_min``: the
    draft model stops drafting when its most likely token has a probability below this (at temperature
    1); ``ngram_max``..``ngram_min``: the n-gram lengths prompt lookup tries, longest first."""

    mode: Mode = "off"
    draft_max: int = DEFAULT_DRAFT_MAX
    draft_min: int = 0
    draft_p_min: float = 0.5
    ngram_max: int = 3
    ngram_min: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BadRequestError(f"speculative mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        _whole("draft_max", self.draft_max, 1)
        _whole("draft_min", self.draft_min, 0)
        if self.draft_min > self.draft_max:
            raise BadRequestError(f"draft_min ({self.draft_min}) is above draft_max ({self.draft_max})")
        p = self.draft_p_min
        if isinstance(p, bool) or not isinstance(p, int | float) or not math.isfinite(p) or not 0 <= p <= 1:
            raise BadRequestError(f"draft_p_min must be a number in [0, 1], got {p!r}")
        _whole("ngram_min", self.ngram_min, 1)
        _whole("ngram_max", self.ngram_max, 1)
        if self.ngram_min > self.ngram_max:
            raise BadRequestError(f"ngram_min ({self.ngram_min}) is above ngram_max ({self.ngram_max})")

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def check_context(self, capacity: int) -> None:
        """Refuse a draft that can never fit a sequence's context (``capacity`` positions)."""
        if self.on and self.draft_max >= capacity:
            raise BadRequestError(
                f"draft_max {self.draft_max} does not fit in the context of {capacity} tokens per sequence "
                f"(a verifying pass evaluates draft_max + 1 tokens)"
            )

    def updated(self, fields: dict[str, Any], where: str = "speculative") -> SpeculativeSettings:
        """These settings with ``fields`` replaced (a request's own), each name checked."""
        known = set(SpeculativeSettings.__dataclass_fields__)
        for name in fields:
            if name not in known:
                raise BadRequestError(f"{where}: unknown field {name!r} (known: {', '.join(sorted(known))})")
        try:
            return replace(self, **fields)
        except BadRequestError as e:
            raise BadRequestError(f"{where}: {e}") from None


def _whole(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise BadRequestError(f"{name} must be an integer >= {lo}, got {value!r}")


def resolve(value: object, base: SpeculativeSettings, where: str = "speculative") -> SpeculativeSettings:
    """A request's own settings from ``value``: a mode name, a mapping of fields (``{"mode": "lookup",
    "draft_max": 4}``; the fields it leaves out are ``base``'s) or settings; ``base`` itself for None."""
    if value is None:
        return base
    if isinstance(value, SpeculativeSettings):
        return value
    if isinstance(value, str):
        return base.updated({"mode": value}, where)
    if isinstance(value, dict):
        return base.updated(dict(value), where)
    raise BadRequestError(f"{where}: must be a mode ({', '.join(MODES)}) or an object of settings, "
                          f"got {type(value).__name__}")
