"""The compiled LoRA update, ``out = y + s·B·(A·x)`` row by row (``reference.lora`` is its numpy namesake).

One call per adapted matmul: numpy's version made six calls of its own per node, and a decode pass of
SmolLM2-135M with a rank-16 adapter on all seven matrices of its 30 layers has 210 such nodes (0.55x the base's
decode speed). Here A and B are read transposed, A^T ``[n_in, rank]`` and B^T ``[rank, n_out]``, so that both
products are loops of ``rank``- and ``n_out``-wide multiply-adds, which LLVM vectorizes without reassociating
anything (no ``fastmath``, as every vector kernel here): ``t = Σ_i x_i · A^T[i]``, ``u = Σ_k t_k · B^T[k]``,
each in a fixed order, then ``out = y + s · u``. A row's result therefore depends on that row
alone, not on the batch it is in nor on the threads; it differs from the reference's BLAS products by float32
rounding only (``tests/test_lora.py`` holds both to transformers).

Rows with scale 0 (sequences without the adapter) are ``y``'s own values, bit for bit. From
``PARALLEL_ROWS`` rows on (a prompt) the rows are shared among the threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

PARALLEL_ROWS = 8
BLOCK = 4  # rows that share each row of A^T and B^T


@njit(nogil=True, cache=True, error_model="numpy")
def _block(y, x, at, bt, scales, factor, out, r0, r1) -> None:  # pragma: no cover - compiled
    """Rows ``r0..r1`` (at most ``BLOCK``): each element's sums run in the same order whatever the block, so a
    row's bits are its own; the block shares each row of A^T and B^T among its rows while it is in L1."""
    n_in, rank = at.shape
    n_out = bt.shape[1]
    nb = r1 - r0
    t = np.zeros((BLOCK, rank), np.float32)
    for c in range(n_in):
        for q in range(nb):
            xc = x[r0 + q, c]
            for k in range(rank):
                t[q, k] += xc * at[c, k]
    u = np.zeros((BLOCK, n_out), np.float32)
    for k in range(rank):
        for q in range(nb):
            tk = t[q, k]
            for j in range(n_out):
                u[q, j] += tk * bt[k, j]
    same = out.ctypes.data == y.ctypes.data
    for q in range(nb):
        i = r0 + q
        s = scales[i] * factor
        if s == 0:  # no adapter on this row: y's own bits
            if not same:
                for j in range(n_out):
                    out[i, j] = y[i, j]
        else:
            for j in range(n_out):  # PEFT's order: the product, scaled, then added
                out[i, j] = y[i, j] + s * u[q, j]


@njit(nogil=True, cache=True, error_model="numpy", parallel=True)
def _lora_parallel(y, x, at, bt, scales, factor, out) -> None:  # pragma: no cover - compiled
    n = x.shape[0]
    for b in prange((n + BLOCK - 1) // BLOCK):
        _block(y, x, at, bt, scales, factor, out, b * BLOCK, min(b * BLOCK + BLOCK, n))


@njit(nogil=True, cache=True, error_model="numpy")
def _lora_serial(y, x, at, bt, scales, factor, out) -> None:  # pragma: no cover - compiled
    # decode-sized passes on the calling thread: a parallel region's start cost more than the work (B's columns
    # shared between two threads took 32 us a node instead of 9 on SmolLM2)
    n = x.shape[0]
    for r0 in range(0, n, BLOCK):
        _block(y, x, at, bt, scales, factor, out, r0, min(r0 + BLOCK, n))


def lora(y: np.ndarray, x: np.ndarray, at: np.ndarray, bt: np.ndarray, scales: np.ndarray, factor: float,
         out: np.ndarray) -> None:
    """``out = y + factor·scales[row]·(x @ A^T) @ B^T`` with ``at`` = A^T, ``bt`` = B^T (float32, C-contiguous);
    ``out`` may be ``y``."""
    kernel = _lora_parallel if x.shape[0] >= PARALLEL_ROWS else _lora_serial
    kernel(y, x, at, bt, scales, np.float32(factor), out)


def transposed(a: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 copy of ``a``'s transpose (what :func:`lora` reads)."""
    return np.ascontiguousarray(a.T, dtype=np.float32)


def warmup() -> None:
    """Compile (or load from the on-disk cache) both kernels for float32 2-D activations."""
    x = np.ones((PARALLEL_ROWS, 4), np.float32)
    at, bt, scales = np.ones((4, 2), np.float32), np.ones((2, 3), np.float32), np.ones(PARALLEL_ROWS, np.float32)
    y = np.zeros((PARALLEL_ROWS, 3), np.float32)
    lora(y, x, at, bt, scales, 1.0, np.empty_like(y))
    lora(y[:1], x[:1], at, bt, scales[:1], 1.0, np.empty_like(y[:1]))
