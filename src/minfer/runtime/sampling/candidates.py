"""The candidate set the steps work on, its ranking and softmax, and the checks of the logits it starts from.

Logits at ``-inf`` (a grammar mask, a ban) stay candidates but are never drawn; if nothing else is left,
``BadRequestError``. NaN or ``+inf`` means the forward pass broke down: ``ModelError``.
"""

from __future__ import annotations

import math

import numpy as np

from minfer.errors import BadRequestError, ModelError
from minfer.runtime.sampling.top_k_kernel import prunes_well, top_k_positions

NOTHING_DRAWABLE = "no token can be sampled: every candidate is at -inf (banned by logit_bias or masked)"


class Candidates:
    """The tokens still in the running and their processed logits.

    While the whole vocabulary is in play ``ids`` is None (position == token id) and ``logits`` may be
    the caller's float32 array, copied only once a step writes to it. The first cut turns the survivors
    into float64 arrays with explicit ids. ``sorted`` means best first, equal logits by lower id.
    """

    __slots__ = ("ids", "logits", "sorted", "owned", "n_vocab")

    def __init__(self, logits: np.ndarray) -> None:
        self.ids: np.ndarray | None = None
        self.logits = logits
        self.sorted = False
        self.owned = False
        self.n_vocab = len(logits)

    def __len__(self) -> int:
        return len(self.logits)

    def writable(self) -> np.ndarray:
        if not self.owned:
            self.logits = self.logits.copy()
            self.owned = True
        return self.logits

    def token(self, pos: int) -> int:
        return int(pos if self.ids is None else self.ids[pos])

    def keep(self, pos: np.ndarray, is_sorted: bool) -> None:
        """Keep the candidates at positions ``pos``, in that order."""
        self.ids = pos if self.ids is None else self.ids[pos]
        self.logits = self.logits[pos].astype(np.float64, copy=False)
        self.owned = True
        self.sorted = is_sorted

    def keep_prefix(self, m: int) -> None:
        """Keep the first ``m`` candidates, in their order: ``keep(np.arange(m), self.sorted)`` without the
        gathers (the cut of a sorted set is a prefix)."""
        if m >= len(self.logits):
            return
        self.ids = np.arange(m) if self.ids is None else self.ids[:m]
        # a view only of an array this set owns: a caller's float64 logits are never written
        self.logits = self.logits[:m].astype(np.float64, copy=not self.owned)
        self.owned = True

    def positions_of(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions, indices into ``tokens``) of those ``tokens`` that are still candidates."""
        if self.ids is None:
            return tokens, np.arange(len(tokens))
        order = np.argsort(self.ids)
        sorted_ids = self.ids[order]
        at = np.minimum(np.searchsorted(sorted_ids, tokens), len(sorted_ids) - 1)
        found = sorted_ids[at] == tokens
        return order[at[found]], np.flatnonzero(found)

    def best(self, k: int) -> np.ndarray:
        """Positions of the ``k`` best candidates, best first (equal logits: lower id first)."""
        x, n = self.logits, len(self.logits)
        k = min(k, n)
        if self.sorted:
            return np.arange(k)
        if self.ids is None and x.dtype == np.float32 and prunes_well(n, k):  # the whole vocabulary
            return top_k_positions(x, k)
        if k < n:
            # a partition finds the k-th value without sorting; only the survivors get sorted
            kth = np.partition(x, n - k)[n - k]
            pos = np.flatnonzero(x >= kth)
            if len(pos) > k:  # ties on the boundary: the lower ids win, whatever order the partition left
                above = pos[x[pos] > kth]
                ties = pos[x[pos] == kth]
                if self.ids is not None:
                    ties = ties[np.argsort(self.ids[ties], kind="stable")]
                pos = np.concatenate((above, ties[: k - len(above)]))
                pos.sort()
        else:
            pos = np.arange(n)
        # with the whole vocabulary, positions ascending are ids ascending
        return pos[rank(x[pos], None if self.ids is None else self.ids[pos])]

    def sort(self) -> None:
        if not self.sorted:
            self.keep(self.best(len(self)), True)

    def probs(self) -> np.ndarray:
        return softmax(self.logits)


def rank(x: np.ndarray, tok: np.ndarray | None) -> np.ndarray:
    """Order of positions by larger ``x`` first, equal ``x`` by lower ``tok`` (None: by position)."""
    n = len(x)
    if n <= 64:
        return np.lexsort((np.arange(n) if tok is None else tok, -x))
    # numpy's default sort is vectorised and several times faster than a stable one; its order among
    # equal values is arbitrary, so it is used only when there are none
    order = np.argsort(-x)
    xs = x[order]
    if not np.any(xs[1:] == xs[:-1]):
        return order
    if tok is None and x.dtype == np.float32:
        # float32 ties (common over a whole vocabulary): sort one uint64 key per position, the float's
        # bits mapped to an order-preserving unsigned integer above the position
        u = (-(x + np.float32(0.0))).view(np.uint32)  # + 0.0 makes -0.0 equal to 0.0
        u = np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000))
        key = (u.astype(np.uint64) << np.uint64(32)) | np.arange(n, dtype=np.uint64)
        key.sort()
        return (key & np.uint64(0xFFFFFFFF)).astype(np.intp)
    return np.lexsort((np.arange(n) if tok is None else tok, -x))


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax in float64 (the row max subtracted first; -inf logits get probability exactly 0)."""
    e = np.exp(x - x.max()).astype(np.float64, copy=False)
    return e / e.sum()


def check_drawable(cand: Candidates) -> None:
    if (cand.logits[0] if cand.sorted else cand.logits.max()) == -np.inf:
        raise BadRequestError(NOTHING_DRAWABLE)


def checked_logits(logits: np.ndarray) -> np.ndarray:
    """``logits`` as a float32 or float64 vector the steps can run on, or the error that says why not."""
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise BadRequestError(f"logits must be a non-empty 1-D array, got shape {x.shape}")
    if x.dtype != np.float32 and x.dtype != np.float64:
        x = x.astype(np.float32)
    m = float(x.max())
    if m != m or m == math.inf:  # NaN
        raise ModelError("the logits contain NaN or +inf: the forward pass broke down")
    if m == -math.inf:  # said here, before a softmax of nothing turns into NaNs
        raise BadRequestError("no token can be sampled: every logit is -inf (everything masked or banned)")
    return x
