"""Log-probabilities of the model's distribution: the log-softmax of the raw logits in float64, before
bias, penalties or temperature (what OpenAI's API reports)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minfer.errors import BadRequestError
from minfer.runtime.sampling.candidates import Candidates, checked_logits
from minfer.runtime.sampling.params import is_int


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the ``n_top`` most likely tokens, best first."""

    token: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


def check_n_top(n_top: object, n_vocab: int) -> None:
    if not (is_int(n_top) and 0 <= n_top <= n_vocab):
        raise BadRequestError(f"n_top must be an integer in [0, {n_vocab}] (the vocabulary size), got {n_top!r}")


def token_logprobs(logits: np.ndarray, token: int, n_top: int = 0) -> TokenLogprob:
    """Log-probabilities of the model's distribution (log-softmax of the raw logits, float64)."""
    raw = checked_logits(logits)
    x = raw.astype(np.float64)
    check_n_top(n_top, len(x))
    if not (is_int(token) and 0 <= token < len(x)):
        raise BadRequestError(f"token must be an id in [0, {len(x)}), got {token!r}")
    m = x.max()
    log_z = float(m + np.log(np.sum(np.exp(x - m))))
    top: tuple[tuple[int, float], ...] = ()
    if n_top:
        c = Candidates(raw)  # ranked on the logits as given: float32 partitions faster, same order
        top = tuple((int(i), float(x[i] - log_z)) for i in c.best(int(n_top)))
    return TokenLogprob(int(token), float(x[token] - log_z), top)
