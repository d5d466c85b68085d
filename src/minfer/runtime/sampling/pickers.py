"""The steps that pick the token: the draw, and mirostat's two versions.

- ``dist``: a draw from the softmax of what is left, from a numpy ``Generator`` seeded with the sampler's
  seed: the same seed gives the same tokens (the draw is single-threaded, whatever the thread count).
- ``mirostat`` v1 (tau, eta, m = 100) and v2 (tau, eta) pick the token themselves and steer the surprise
  ``-log2 p`` of the picks towards ``tau``; their state ``mu`` (initially ``2 * tau``) is ``Sampler.mu``.
"""

from __future__ import annotations

import math

import numpy as np

from minfer.runtime.sampling.candidates import Candidates, check_drawable
from minfer.runtime.sampling.compiled import CompiledChain, Stage
from minfer.runtime.sampling.step import Kind, State, Step

MIROSTAT_M = 100  # tokens used to estimate the Zipf exponent in mirostat v1 (llama.cpp's m)


def draw(cand: Candidates, rng: np.random.Generator) -> tuple[int, float]:
    """(position, probability) of a token drawn from the softmax of the candidates (llama.cpp's dist)."""
    n = len(cand)
    if n == 1:
        return 0, 1.0  # llama.cpp draws no number for a single candidate
    probs = cand.probs()
    i = search(np.cumsum(probs), rng)
    return i, float(probs[i])


def search(cum: np.ndarray, rng: np.random.Generator) -> int:
    """The position a draw picks from the cumulative masses ``cum`` of two or more candidates: side="right",
    the first position whose cumulative mass exceeds the target, so a zero-probability (banned) token can
    never be picked, even for a draw of exactly 0."""
    return min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), len(cum) - 1)


class Dist(Step):
    name = "dist"
    kind = Kind.DRAWS

    def __init__(self, state: State) -> None:
        self.state = state

    def apply(self, cand: Candidates) -> int:
        check_drawable(cand)
        return cand.token(draw(cand, self.state.rng)[0])

    def compile_into(self, chain: CompiledChain) -> Stage:
        """Nothing to set: the compiled chain leaves the draw to its caller (``sample_batch``)."""
        return Stage.DRAW


class Mirostat(Step):
    """Mirostat v1: estimate the Zipf exponent from the top m tokens, pick k from it and mu, draw."""

    name = "mirostat"
    kind = Kind.PICKS_ITSELF

    def __init__(self, state: State, tau: float, eta: float, m: int = MIROSTAT_M) -> None:
        self.state, self.tau, self.eta, self.m = state, tau, eta, m

    def apply(self, cand: Candidates) -> int:
        check_drawable(cand)
        st, n_vocab = self.state, cand.n_vocab
        n = len(cand)
        if n > 1:
            probs = cand.probs()
            top = probs[cand.best(self.m)]
            top = top[top > 0]
            i = np.arange(len(top) - 1)
            t = np.log((i + 2) / (i + 1))
            b = np.log(top[:-1] / top[1:])
            s_hat = float(np.sum(t * b) / np.sum(t * t)) if len(top) > 1 else 1.0
            eps = s_hat - 1
            # k = (eps * 2^mu / (1 - N^-eps)) ^ (1 / s_hat); the eps -> 0 limit of the ratio is 1 / ln N
            ratio = eps / (1 - n_vocab ** (-eps)) if eps != 0 else 1 / math.log(n_vocab)
            with np.errstate(all="ignore"):
                k = float(np.power(ratio * np.exp2(st.mu), 1 / s_hat)) if s_hat > 0 else math.inf
            if k < n:  # NaN or inf: no truncation
                cand.keep(cand.best(max(int(k), 1)), True)
        pos, p = draw(cand, st.rng)
        st.mu -= self.eta * (-math.log2(p) - self.tau)
        return cand.token(pos)


class MirostatV2(Step):
    """Mirostat 2.0: keep tokens whose surprise -log2 p is at most mu, draw, move mu towards tau."""

    name = "mirostat_v2"
    kind = Kind.PICKS_ITSELF

    def __init__(self, state: State, tau: float, eta: float) -> None:
        self.state, self.tau, self.eta = state, tau, eta

    def apply(self, cand: Candidates) -> int:
        check_drawable(cand)
        st = self.state
        probs = cand.probs()
        keep = np.flatnonzero(probs >= np.exp2(-st.mu))  # -log2 p <= mu
        if not len(keep):
            keep = cand.best(1)
        if len(keep) < len(cand):
            cand.keep(keep, cand.sorted or len(keep) == 1)
        pos, p = draw(cand, st.rng)
        st.mu -= self.eta * (-math.log2(p) - self.tau)
        return cand.token(pos)
