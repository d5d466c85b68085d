"""Embeddings: pooling a sequence's final-normed hidden states into one vector, as llama.cpp does.

The hidden states are the output norm's result for every position (``ForwardRunner.forward_hidden``),
arriving a prompt chunk at a time. ``mean`` averages every position (BOS included), ``cls`` takes the
first, ``last`` the last; ``none`` keeps every position's vector. Pooled vectors are L2-normalised
unless asked not to be (llama.cpp's ``embd_normalize`` 2, its default); per-token vectors (``none``) are
returned as they are, as llama-server does.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import numpy as np

from minfer.errors import BadRequestError

Pooling = Literal["mean", "cls", "last", "none"]
POOLINGS: tuple[str, ...] = get_args(Pooling)
# llama.cpp's enum llama_pooling_type, as GGUF files store it in <arch>.pooling_type
_GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last"}


def check_pooling(value: Any) -> Pooling:
    if value not in POOLINGS:
        raise BadRequestError(f"pooling must be one of {', '.join(POOLINGS)}, got {value!r}")
    return value  # type: ignore[no-any-return]


def model_pooling(raw: int | None, arch: str) -> Pooling:
    """The pooling a checkpoint declares (``raw``: a GGUF file's ``<arch>.pooling_type``), else ``mean``. A
    type this engine does not have (``rank``: a reranker's classification head) is refused by name."""
    if raw is None or int(raw) == -1:  # -1: LLAMA_POOLING_TYPE_UNSPECIFIED
        return "mean"
    try:
        return _GGUF_POOLING[int(raw)]  # type: ignore[return-value]
    except KeyError:
        raise BadRequestError(
            f"{arch}.pooling_type is {raw} (rank or unknown), which this engine cannot pool; "
            "choose a pooling (mean, cls, last, none)"
        ) from None


def l2_normalize(v: np.ndarray) -> np.ndarray:
    """``v`` over its Euclidean norm, in float64 then back to float32 (a zero vector stays zero)."""
    norm = float(np.sqrt(np.dot(v.astype(np.float64), v.astype(np.float64))))
    return (v / norm if norm > 0 else v).astype(np.float32)


# sentence-transformers' poolings of an encoder's last hidden states (every token of the sequence, the special
# ones included, as its attention mask has them)
ENCODER_POOLINGS = ("mean", "cls", "last", "max", "mean_sqrt_len", "weighted_mean", "none")


def pool_rows(rows: np.ndarray, pooling: str) -> np.ndarray:
    """One sequence's hidden states ``[n, n_embd]`` pooled as sentence-transformers' ``Pooling`` module does:
    ``mean``; ``cls`` (the first row); ``last``; ``max`` (per dimension); ``mean_sqrt_len`` (the sum over
    sqrt(n)); ``weighted_mean`` (row i weighted i + 1); ``none`` keeps every row. Sums in float64."""
    n = rows.shape[0]
    if n == 0:
        raise BadRequestError("nothing to pool: the sequence has no tokens")
    if pooling == "none":
        return rows.astype(np.float32, copy=True)
    if pooling == "cls":
        return rows[0].astype(np.float32, copy=True)
    if pooling == "last":
        return rows[-1].astype(np.float32, copy=True)
    if pooling == "max":
        return rows.max(axis=0).astype(np.float32)
    total = rows.sum(axis=0, dtype=np.float64)
    if pooling == "mean":
        return (total / n).astype(np.float32)
    if pooling == "mean_sqrt_len":
        return (total / np.sqrt(n)).astype(np.float32)
    if pooling == "weighted_mean":
        weights = np.arange(1, n + 1, dtype=np.float64)
        return ((weights @ rows.astype(np.float64)) / weights.sum()).astype(np.float32)
    raise BadRequestError(f"pooling must be one of {', '.join(ENCODER_POOLINGS)}, got {pooling!r}")


class Pooler:
    """Accumulates one sequence's hidden states, chunk by chunk in position order."""

    def __init__(self, pooling: Pooling, normalize: bool) -> None:
        self.pooling = check_pooling(pooling)
        self.normalize = normalize
        self.n = 0
        self._sum: np.ndarray | None = None
        self._first: np.ndarray | None = None
        self._last: np.ndarray | None = None
        self._rows: list[np.ndarray] = []

    def add(self, rows: np.ndarray) -> None:
        """The hidden states ``[k, n_embd]`` of the sequence's next ``k`` positions."""
        if rows.shape[0] == 0:
            return
        if self.pooling == "mean":
            part = rows.sum(axis=0, dtype=np.float64)
            self._sum = part if self._sum is None else self._sum + part
        elif self.pooling == "cls":
            if self._first is None:
                self._first = rows[0].copy()
        elif self.pooling == "last":
            self._last = rows[-1].copy()
        else:
            self._rows.append(rows.copy())
        self.n += rows.shape[0]

    def result(self) -> np.ndarray:
        """``[n_embd]`` float32 (``[n_tokens, n_embd]`` for ``none``)."""
        if self.n == 0:
            raise BadRequestError("nothing to pool: the sequence has no tokens")
        if self.pooling == "none":
            return np.concatenate(self._rows).astype(np.float32)
        if self.pooling == "mean":
            assert self._sum is not None
            v = (self._sum / self.n).astype(np.float32)
        else:
            v = self._first if self.pooling == "cls" else self._last
            assert v is not None
        return l2_normalize(v) if self.normalize else v
