"""From logits to a token: greedy, or seeded temperature / top-k / top-p sampling.

Order of steps (as llama.cpp's default chain): top-k, then top-p on the softmax of the survivors, then
temperature, then a seeded draw. ``temperature == 0`` is greedy (the first maximal logit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minfer.errors import BadRequestError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise BadRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise BadRequestError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, int | float) or not (0.0 < self.top_p <= 1.0):
            raise BadRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise BadRequestError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        logits = logits.astype(np.float64)
        if 0 < p.top_k < logits.shape[0]:
            candidates = np.argpartition(-logits, p.top_k - 1)[: p.top_k]
        else:
            candidates = np.arange(logits.shape[0])
        # best first; equal logits ordered by token id, so the draw is reproducible
        candidates = candidates[np.lexsort((candidates, -logits[candidates]))]
        cand_logits = logits[candidates]
        if p.top_p < 1.0:
            probs = _softmax(cand_logits)
            cum = np.cumsum(probs)
            keep = int(np.searchsorted(cum, p.top_p) + 1)  # smallest prefix reaching top_p
            candidates, cand_logits = candidates[:keep], cand_logits[:keep]
        probs = _softmax(cand_logits / p.temperature)
        r = self.rng.random()
        i = int(np.searchsorted(np.cumsum(probs), r * probs.sum(), side="right"))
        return int(candidates[min(i, len(candidates) - 1)])


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
