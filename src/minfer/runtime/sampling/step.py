"""What a step of the chain is: its declared kind, the state steps share.

A step transforms the candidate set (:class:`~.candidates.Candidates`) in place, or picks the token. Each
step class declares one property, its :class:`Kind`: what it may do to the ranking of the tokens. The
greedy route (``Sampler``) reads the kinds to decide whether an argmax gives the chain's pick, so a new
step must say what it does: a class without a ``name`` and a ``kind`` cannot be defined. A step the
compiled chain (:mod:`minfer.runtime.sampling.compiled`) can run also implements ``compile_into``, which
sets its settings on the chain and answers with its :class:`~.compiled.Stage` (the others answer None).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import ClassVar

import numpy as np

from minfer.errors import BadRequestError
from minfer.runtime.sampling.candidates import Candidates
from minfer.runtime.sampling.compiled import CompiledChain, Stage
from minfer.runtime.sampling.params import SamplingParams

TokenText = Callable[[int], str | bytes]  # a token's text (DRY matches its sequence breakers on it)


class Kind(Enum):
    """What a step may do to the ranking of the tokens (the greedy shortcut's question)."""

    PROCESSOR = "rewrites logits anywhere in the vocabulary: may change which token is best"
    KEEPS_BEST = "drops tokens, never the most likely one, and leaves the others' logits as they are"
    KEEPS_ORDER = "rewrites the candidates' logits without changing their order"
    ONLY_BEST = "keeps the most likely token alone"
    MAY_DROP_BEST = "may drop the most likely token"
    DRAWS = "picks the token from the softmax of the candidates, keeping no state"
    PICKS_ITSELF = "picks the token by its own rule and carries state from one token to the next"

    @property
    def picks(self) -> bool:
        """Whether the step chooses the token (it ends the chain)."""
        return self in (Kind.DRAWS, Kind.PICKS_ITSELF)


class State:
    """What the steps share and what ``Sampler.reset`` restores: history, random streams, mirostat's mu."""

    def __init__(self) -> None:
        self.history: list[int] = []
        self.rng = np.random.default_rng()
        self.xtc_rng = np.random.default_rng()
        self.mu = 0.0

    def window(self, last_n: int) -> list[int]:
        return self.history if last_n < 0 else self.history[len(self.history) - last_n :]


class Step:
    """One step of the chain. Subclasses set ``name`` (as llama.cpp prints it) and ``kind``."""

    name: ClassVar[str]
    kind: ClassVar[Kind]

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        missing = [attr for attr in ("name", "kind") if not hasattr(cls, attr)]
        if missing:
            raise TypeError(f"sampling step {cls.__name__} must declare {' and '.join(missing)}")

    @classmethod
    def from_params(cls, params: SamplingParams, state: State, token_text: TokenText | None) -> Step:
        """The step for ``params`` (a step ``samplers`` names builds itself from the parameters)."""
        raise NotImplementedError(f"{cls.__name__} is not built from SamplingParams")

    def apply(self, cand: Candidates) -> int | None:
        """Transform ``cand`` in place; a picking step returns the chosen token."""
        raise NotImplementedError

    def compile_into(self, chain: CompiledChain) -> Stage | None:
        """Set this step's settings on the compiled chain and say where its kernel runs the step; None
        (this default): the kernel cannot run it, and its chain runs in numpy."""
        return None


def check_in_vocab(tokens: np.ndarray, n_vocab: int, what: str) -> None:
    if len(tokens) and int(tokens.max()) >= n_vocab:
        raise BadRequestError(f"{what}: token {int(tokens.max())} is outside the vocabulary of {n_vocab} tokens")
