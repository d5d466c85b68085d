"""The truncations and the temperature: steps that drop candidates or rescale what is left.

- ``top_k``: the k most likely (0: off). ``top_p``: the smallest most-likely set reaching probability p
  (1.0: off). ``min_p``: tokens with probability at least p times the top one (0.0: off).
- ``top_n_sigma``: tokens whose logit is at least ``max - n * sigma``, sigma the standard deviation of
  the finite logits of the candidates (n <= 0: off). llama.cpp sets the others to ``-inf``; they are
  dropped here, which leaves the same tokens with the same probabilities.
- ``typ_p``: locally typical sampling (1.0: off). ``xtc``: with probability ``xtc_probability`` removes
  every token above ``xtc_threshold`` except the least likely of them (``> 0.5``: never anything to
  remove). These two may drop the most likely token.
- ``temperature``: divides the logits; 0 is greedy: the first maximal logit (the lowest token id among
  equal maxima), no random number drawn.

The truncations keep at least ``min_keep`` tokens where llama.cpp does. ``top_k`` over the whole
vocabulary is one compiled pass (:mod:`minfer.runtime.sampling.top_k_kernel`), a cut of fewer candidates a
partition; ``top_p`` without ``top_k`` probes the mass of the best 256, 2048, ... tokens before sorting
any.
"""

from __future__ import annotations

import math

import numpy as np

from minfer.runtime.sampling.candidates import Candidates
from minfer.runtime.sampling.compiled import CompiledChain, Stage
from minfer.runtime.sampling.params import SamplingParams
from minfer.runtime.sampling.step import Kind, State, Step, TokenText


class TopK(Step):
    name = "top_k"
    kind = Kind.KEEPS_BEST

    def __init__(self, k: int) -> None:
        self.k = k

    @classmethod
    def from_params(cls, params: SamplingParams, state: State, token_text: TokenText | None) -> TopK:
        return cls(params.top_k)

    def apply(self, cand: Candidates) -> None:
        if self.k < len(cand):
            cand.keep(cand.best(self.k), True)

    def compile_into(self, chain: CompiledChain) -> Stage:
        chain.k = self.k
        return Stage.TOP_K


class TopNSigma(Step):
    name = "top_n_sigma"
    kind = Kind.KEEPS_BEST  # the best logit is the maximum: never below max - n * sigma

    def __init__(self, n: float) -> None:
        self.n = n

    @classmethod
    def from_params(cls, params: SamplingParams, state: State, token_text: TokenText | None) -> TopNSigma:
        return cls(params.top_n_sigma)

    def apply(self, cand: Candidates) -> None:
        x = cand.logits
        if len(x) <= 1:
            return
        finite = x[x > -np.inf].astype(np.float64, copy=False)  # masked tokens say nothing of the spread
        bound = finite.max() - self.n * finite.std()  # a float64 scalar: compared in float64, not rounded
        if cand.sorted:  # best first: the kept tokens are a prefix
            cand.keep_prefix(int(np.count_nonzero(x >= bound)))
            return
        keep = np.flatnonzero(x >= bound)
        if len(keep) < len(x):
            cand.keep(keep, False)


class TypicalP(Step):
    name = "typ_p"
    kind = Kind.MAY_DROP_BEST

    def __init__(self, p: float, min_keep: int) -> None:
        self.p, self.min_keep = p, min_keep

    @classmethod
    def from_params(cls, params: SamplingParams, state: State, token_text: TokenText | None) -> TypicalP:
        return cls(params.typical_p, params.min_keep)

    def apply(self, cand: Candidates) -> None:
        probs = cand.probs()
        nz = probs > 0
        logp = np.full_like(probs, -np.inf)
        logp[nz] = np.log(probs[nz])
        entropy = -float(np.sum(probs[nz] * logp[nz]))
        shifted = np.abs(-logp - entropy)  # |surprise - entropy|: how typical each token is
        ids = np.arange(len(cand)) if cand.ids is None else cand.ids
        order = np.argsort(shifted)
        ss = shifted[order]
        if np.any(ss[1:] == ss[:-1]):  # equal scores: order them by logit, then id, whatever the sort did
            order = np.lexsort((ids, -cand.logits, shifted))
        cum = np.cumsum(probs[order])
        over = np.flatnonzero(cum > self.p)
        # the first index where the mass exceeds p and at least min_keep tokens are in
        start = max(self.min_keep - 1, 0)
        over = over[over >= start]
        last = int(over[0]) + 1 if len(over) else len(order)
        cand.keep(order[:last], False)


class TopP(Step):
    name = "top_p"
    kind = Kind.KEEPS_BEST

    def __init__(self, p: float, min_keep: int) -> None:
        self.p, self.min_keep = p, min_keep

    @classmethod
    def from_params(cls, params: SamplingParams, state: State, token_text: TokenText | None) -> TopP:
        return cls(params.top_p, params.min_keep)

    def apply(self, cand: Candidates) -> None:
        n = len(cand)
        probs = cand.probs()
        if cand.sorted:  # the loop below with k = n: the first prefix whose mass reaches p
            # probabilities are >= 0, so the running sum never decreases: its first index at or above p
            # is where the mass is reached, and every later index reaches it too
            last = max(int(np.searchsorted(np.cumsum(probs), self.p)), self.min_keep - 1)
            if last < n:
                cand.keep_prefix(last + 1)
            return
        k = 256
        while True:
            k = min(k, n)
            # the kept set is usually small: the mass of the k best (a partition, no sort) tells whether
            # they reach p before any sorting; only then are those k sorted and summed in order
            if k < n and (k < self.min_keep or np.partition(probs, n - k)[n - k :].sum() < self.p):
                k *= 8
                continue
            pos = cand.best(k)
            cum = np.cumsum(probs[pos])
            reach = np.flatnonzero(cum >= self.p)
            reach = reach[reach + 1 >= self.min_keep]
            if len(reach):
                cand.keep(pos[: int(reach[0]) + 1], True)
                return
            if k >= n:
                cand.keep(pos, True)  # rounding kept the total under p: everything stays
                return
            k *= 8

    def compile_into(self, chain: CompiledChain) -> Stage:
        chain.top_p, chain.min_keep = self.p, self.min_keep
        return Stage.TOP_P


class MinP(Step):
    name = "min_p"
    kind = Kind.KEEPS_BEST

    def __init__(self, p: float, min_keep: int) -> None:
        self.p, self.min_keep = p, min_keep
        self.log_p = math.log(p)

    @classmethod
    def from_params(cls, params: SamplingParams, state: State, token_text: TokenText | None) -> MinP:
        return cls(params.min_p, params.min_keep)

    def apply(self, cand: Candidates) -> None:
        x = cand.logits
        if cand.sorted:  # best first: the kept tokens are a prefix
            kept = int(np.count_nonzero(x >= x[0] + self.log_p))
            cand.keep_prefix(max(kept, min(self.min_keep, len(x))))
            return
        # p_i >= p * p_max  <=>  logit_i >= max_logit + log(p): no softmax needed
        keep = np.flatnonzero(x >= x.max() + self.log_p)
        if len(keep) < self.min_keep:
            keep = np.sort(cand.best(self.min_keep)) if not cand.sorted else np.arange(min(self.min_keep, len(x)))
        if len(keep) < len(x):
            cand.keep(keep, cand.sorted)  # positions ascending: the order (sorted or not) is preserved

    def compile_into(self, chain: CompiledChain) -> Stage:
        chain.min_p, chain.log_min_p, chain.min_keep = True, self.log_p, self.min_keep
        return Stage.MIN_P


class Xtc(Step):
    name = "xtc"
    kind = Kind.MAY_DROP_BEST

    def __init__(self, state: State, probability: float, threshold: float, min_keep: int) -> None:
        self.state, self.probability, self.threshold, self.min_keep = state, probability, threshold, min_keep

    @classmethod
    def from_params(cls, params: SamplingParams, state: State, token_text: TokenText | None) -> Xtc:
        return cls(state, params.xtc_probability, params.xtc_threshold, params.min_keep)

    def apply(self, cand: Candidates) -> None:
        n = len(cand)
        if n < 2:
            return
        if self.state.xtc_rng.random() > self.probability:
            return
        above = np.flatnonzero(cand.probs() >= self.threshold)
        remove = len(above) - 1  # every token above the threshold but the least likely of them
        if remove <= 0 or n - remove < self.min_keep:
            return
        tok = above if cand.ids is None else cand.ids[above]
        order = np.lexsort((tok, -cand.logits[above]))
        mask = np.ones(n, dtype=bool)
        mask[above[order[:remove]]] = False
        cand.keep(np.flatnonzero(mask), cand.sorted)


class Temperature(Step):
    """Divides the logits by ``t > 0``; a temperature of 0 is :class:`Greedy`."""

    name = "temperature"
    kind = Kind.KEEPS_ORDER

    def __init__(self, t: float) -> None:
        self.t = t

    @classmethod
    def from_params(cls, params: SamplingParams, state: State, token_text: TokenText | None) -> Step:
        return cls(params.temperature) if params.temperature > 0 else Greedy()

    def apply(self, cand: Candidates) -> None:
        if cand.owned:
            cand.logits /= self.t
        else:
            cand.logits = cand.logits / self.t
            cand.owned = True

    def compile_into(self, chain: CompiledChain) -> Stage:
        chain.temperature = self.t
        return Stage.TEMPERATURE


class Greedy(Step):
    """Temperature 0: only the first maximal logit survives (the lowest id among equal maxima)."""

    name = "temperature"
    kind = Kind.ONLY_BEST

    def apply(self, cand: Candidates) -> None:
        if cand.sorted:
            first = 0
        elif cand.ids is None:
            first = int(np.argmax(cand.logits))
        else:
            ties = np.flatnonzero(cand.logits == cand.logits.max())
            first = int(ties[np.argmin(cand.ids[ties])])
        cand.keep(np.array([first]), True)
