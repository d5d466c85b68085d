"""The chains the compiled kernel runs (:mod:`minfer.runtime.sampling.chain_kernel`): llama.cpp's default
shape ``[logit_bias ->] top_k -> [top_p ->] [min_p ->] temperature -> dist`` (temperature > 0).

Which chains those are is read from the steps: each step the kernel can run sets its settings and
answers with its :class:`Stage` (the kernel's steps, in its order) in ``Step.compile_into``; a chain
compiles when every step has a stage, the stages come in the kernel's order, and top-k, the temperature
and the draw are there. A step without a stage (a new one, a penalty, top-n-sigma, ...) leaves its chain to the steps
in numpy. The kernel computes the same candidates and probabilities as the steps, bit for bit where
numpy's float64 exp is the C library's (on AVX-512 CPUs numpy has its own, which may differ in the last
bit).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Protocol

import numpy as np

from minfer.runtime.sampling import chain_kernel


class Stage(IntEnum):
    """The steps the compiled chain runs, in the order its kernel runs them."""

    LOGIT_BIAS = 0
    TOP_K = 1
    TOP_P = 2
    MIN_P = 3
    TEMPERATURE = 4
    DRAW = 5


REQUIRED_STAGES = frozenset((Stage.TOP_K, Stage.TEMPERATURE, Stage.DRAW))


class Compilable(Protocol):
    """What the compiled chain asks a step (:class:`~.step.Step`): set your settings, say your stage."""

    def compile_into(self, chain: CompiledChain) -> Stage | None: ...  # None: the kernel cannot run the step


class CompiledChain:
    """One sequence's settings of ``chain_kernel.truncate_rows``: the same candidates and probabilities as
    its steps, for many sequences in one call."""

    __slots__ = ("k", "bias_tokens", "bias_values", "top_p", "min_p", "log_min_p", "min_keep", "temperature",
                 "checked_vocab", "alone")

    def __init__(self) -> None:
        # the settings of the stages a chain leaves out: no bias, no top-p, no min-p
        self.k = 0
        self.bias_tokens = np.zeros(0, np.int64)
        self.bias_values = np.zeros(0, np.float64)
        self.top_p = 1.0
        self.min_p = False
        self.log_min_p = 0.0
        self.min_keep = 0  # top_p and min_p take the same one (SamplingParams.min_keep)
        self.temperature = 1.0
        self.checked_vocab = 0  # the vocabulary size the bias tokens were checked against
        self.alone: tuple[np.ndarray, ...] = ()

    @classmethod
    def of(cls, steps: Sequence[Compilable]) -> CompiledChain | None:
        """The compiled form of ``steps``, or None where the kernel cannot run them."""
        chain = cls()
        stages = [step.compile_into(chain) for step in steps]
        # every step compiled, each stage once and in the kernel's order, the required ones there
        if any(stage is None for stage in stages):
            return None
        if stages != sorted(set(stages)) or not REQUIRED_STAGES <= set(stages):  # type: ignore[type-var]
            return None
        chain.alone = chain.arguments([chain])  # a sequence sampled alone: built once, not per token
        return chain

    @staticmethod
    def arguments(chains: Sequence[CompiledChain]) -> tuple[np.ndarray, ...]:
        """``truncate_rows``' arguments after the rows, one entry per chain."""
        return (
            np.array([c.k for c in chains], np.int64),
            np.cumsum([0] + [len(c.bias_tokens) for c in chains]),
            np.concatenate([c.bias_tokens for c in chains]).astype(np.int64, copy=False),
            np.concatenate([c.bias_values for c in chains]).astype(np.float64, copy=False),
            np.array([c.top_p for c in chains], np.float64),
            np.array([c.min_p for c in chains], np.bool_),
            np.array([c.log_min_p for c in chains], np.float64),
            np.array([c.min_keep for c in chains], np.int64),
            np.array([c.temperature for c in chains], np.float64),
        )

    def fits(self, n_vocab: int) -> bool:
        if self.checked_vocab != n_vocab:
            if len(self.bias_tokens) and int(self.bias_tokens.max()) >= n_vocab:
                return False  # the steps say so (a bias outside the vocabulary)
            if not chain_kernel.compiles(n_vocab, self.k, len(self.bias_tokens)):
                return False
            self.checked_vocab = n_vocab
        return True
