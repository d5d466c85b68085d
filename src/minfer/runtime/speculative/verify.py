"""The acceptance rule of speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling").

At one position the target's sampler chain gives the distribution ``p`` (temperature, truncations,
penalties, bias and the grammar mask all applied: :meth:`~minfer.runtime.sampling.Sampler.distribution`)
and the drafter drew token ``x`` from its distribution ``q``. ``x`` is kept with probability
``min(1, p(x) / q(x))``; otherwise the token is drawn from ``max(0, p - q)``, renormalised. The token that
comes out is distributed exactly as ``p``, whatever ``q`` is: for every y,
``q(y) min(1, p(y)/q(y)) + (1 - sum_z min(p(z), q(z))) (p(y) - min(p(y), q(y))) / (1 - sum_z min(p(z), q(z)))
= p(y)``. Prompt lookup's ``q`` is a point mass on ``x``: the draft is kept with probability ``p(x)``, and
a rejection draws from ``p`` without ``x``.

A greedy chain (temperature 0) needs no random number: the target's pick is its argmax, the draft is kept
when it is that token, and the pick replaces it otherwise, so the text is the text of plain decoding.
"""

from __future__ import annotations

import numpy as np

from minfer.runtime.sampling.pickers import search

Distribution = tuple[np.ndarray, np.ndarray]  # (token ids, probabilities), as Sampler.distribution gives


def probability_of(dist: Distribution | None, token: int, point: int | None = None) -> float:
    """``dist``'s probability of ``token``; None is the point mass on ``point``."""
    if dist is None:
        return 1.0 if token == point else 0.0
    ids, probs = dist
    where = np.flatnonzero(ids == token)
    return float(probs[where[0]]) if where.size else 0.0


def accept_or_resample(
    p: Distribution, draft: int, q: Distribution | None, rng: np.random.Generator
) -> tuple[int, bool]:
    """(token, accepted): ``draft`` (drawn from ``q``, None for a point mass on it) kept or replaced by a
    draw from ``norm(max(0, p - q))``. A random number is drawn only where the outcome is not certain."""
    p_ids, p_probs = p
    px = probability_of(p, draft)
    qx = probability_of(q, draft, draft)
    if qx <= 0.0:
        raise ValueError(f"draft token {draft} has probability 0 under the distribution it was drawn from")
    if px >= qx or (px > 0.0 and rng.random() * qx < px):
        return draft, True
    # the residual max(0, p - q) over the tokens p can give (outside them p is 0, so it is 0 too)
    if q is None:
        residual = np.where(p_ids == draft, 0.0, p_probs)
    else:
        q_ids, q_probs = q
        order = np.argsort(q_ids)
        at = np.minimum(np.searchsorted(q_ids[order], p_ids), len(q_ids) - 1)
        q_on_p = np.where(q_ids[order][at] == p_ids, q_probs[order][at], 0.0)
        residual = np.maximum(p_probs - q_on_p, 0.0)
    total = residual.sum()
    if not total > 0.0:  # p == q up to rounding, where a rejection has probability ~0: p itself
        residual, total = p_probs, p_probs.sum()
    nonzero = np.flatnonzero(residual)
    if nonzero.size == 1:
        return int(p_ids[nonzero[0]]), False
    return int(p_ids[search(np.cumsum(residual), rng)]), False
