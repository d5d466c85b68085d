"""The compiled LoRA update, ``out = y + s·B·(A·x)`` row by row (``reference.lora`` is its numpy namesake).

One call per adapted matmul: numpy's version made six calls of its own per node, and a decode pass of
SmolLM2-135M with a rank-16 adapter on all seven matrices of its 30 layers has 210 such nodes. The kernel reads
A and B transposed (:func:`operands`): A^T ``[n_in, rank8]`` and B^T ``[rank8, n_out]``, the rank rounded up to
a multiple of 8 with zero columns of A (so zero rows of B), so that both products are loops over eight-lane
vectors (:mod:`~minfer.backends.cpu.simd`):

* ``t = x·A^T``: four partial sums over the inputs ``c`` (``c mod 4``, the inputs past the last group of four
  into the first), added as ``(p0 + p1) + (p2 + p3)``: four independent chains instead of one, whose latency
  bounded the kernel;
* ``u = t·B^T``: for eight outputs at a time, ``Σ_k t_k·B^T[k]`` with ``k`` ascending, four such groups at once;
* ``out = y + s·u`` (PEFT's order: the product, scaled, then added), one fused multiply-add where the CPU has it.

Each sum runs in this fixed order whatever the batch, so a row's bits are its own: alone, in a prompt, or on
any number of threads. Zero-padded ranks add exact zeros. The results differ from the reference's BLAS products
by float32 rounding only (``tests/test_lora.py`` holds both to transformers).

A^T and B^T are kept as float16 where that is lossless (every value of the matrix is a float16 exactly: an
adapter stored in F16, as llama.cpp's converter writes them, and nearly every BF16 one): the kernel widens them
in registers, exactly, so the results are the float32 copy's bits from half the bytes. A decode pass reads every
adapter matrix once from memory, so the bytes are its cost.

Rows with scale 0 (sequences without the adapter) are ``y``'s own values, bit for bit. From
``PARALLEL_ROWS`` rows on (a prompt) the rows are shared among the threads; fewer run on the calling thread,
where a parallel region's start cost more than the work (32 us a node instead of 9 on SmolLM2).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from minfer.backends.cpu.simd import (
    add_f64x8,
    fma_f64,
    load_row_f32x8,
    madd_wide_f64x8,
    row_value_f32,
    scaled_add_narrow_f32x8,
    store_f64x8,
    store_row_f32x8,
    zeros_f64x8,
)

PARALLEL_ROWS = 8
LANES = 8  # the rank is padded to a multiple of this (one vector of A^T's row)
F16_BITS = np.uint16  # an operand of float16 bit patterns (load_row_f32x8 widens them)


@njit(nogil=True, cache=True, error_model="numpy")
def _row(y, x, at, bt, s, out, i, t) -> None:  # pragma: no cover - compiled
    """Row ``i``'s update, in the fixed order of the module docstring; ``t``: a float64 scratch ``[rank8]``."""
    n_in, rank = at.shape
    n_out = bt.shape[1]
    for k in range(0, rank, 8):
        p0, p1, p2, p3 = zeros_f64x8(), zeros_f64x8(), zeros_f64x8(), zeros_f64x8()
        c = 0
        while c + 4 <= n_in:
            p0 = madd_wide_f64x8(p0, x[i, c], load_row_f32x8(at, c, k))
            p1 = madd_wide_f64x8(p1, x[i, c + 1], load_row_f32x8(at, c + 1, k))
            p2 = madd_wide_f64x8(p2, x[i, c + 2], load_row_f32x8(at, c + 2, k))
            p3 = madd_wide_f64x8(p3, x[i, c + 3], load_row_f32x8(at, c + 3, k))
            c += 4
        while c < n_in:
            p0 = madd_wide_f64x8(p0, x[i, c], load_row_f32x8(at, c, k))
            c += 1
        store_f64x8(t, k, add_f64x8(add_f64x8(p0, p1), add_f64x8(p2, p3)))
    j = 0
    while j + 32 <= n_out:
        u0, u1, u2, u3 = zeros_f64x8(), zeros_f64x8(), zeros_f64x8(), zeros_f64x8()
        for k in range(rank):
            tk = t[k]
            u0 = madd_wide_f64x8(u0, tk, load_row_f32x8(bt, k, j))
            u1 = madd_wide_f64x8(u1, tk, load_row_f32x8(bt, k, j + 8))
            u2 = madd_wide_f64x8(u2, tk, load_row_f32x8(bt, k, j + 16))
            u3 = madd_wide_f64x8(u3, tk, load_row_f32x8(bt, k, j + 24))
        store_row_f32x8(out, i, j, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j), s, u0))
        store_row_f32x8(out, i, j + 8, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j + 8), s, u1))
        store_row_f32x8(out, i, j + 16, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j + 16), s, u2))
        store_row_f32x8(out, i, j + 24, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j + 24), s, u3))
        j += 32
    while j + 8 <= n_out:
        u0 = zeros_f64x8()
        for k in range(rank):
            u0 = madd_wide_f64x8(u0, t[k], load_row_f32x8(bt, k, j))
        store_row_f32x8(out, i, j, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j), s, u0))
        j += 8
    while j < n_out:  # the same float64 operations one lane at a time
        u = 0.0
        for k in range(rank):
            u = fma_f64(t[k], np.float64(row_value_f32(bt, k, j)), u)
        out[i, j] = np.float32(np.float64(y[i, j]) + s * u)
        j += 1


@njit(nogil=True, cache=True, error_model="numpy")
def _one(y, x, at, bt, scales, factor, out, i, t) -> None:  # pragma: no cover - compiled
    s = np.float64(scales[i]) * factor
    if s != 0:
        _row(y, x, at, bt, s, out, i, t)
    elif out.ctypes.data != y.ctypes.data:  # no adapter on this row: y's own bits
        for j in range(y.shape[1]):
            out[i, j] = y[i, j]


@njit(nogil=True, cache=True, error_model="numpy", parallel=True)
def _lora_parallel(y, x, at, bt, scales, factor, out) -> None:  # pragma: no cover - compiled
    n = x.shape[0]
    for i in prange(n):
        t = np.empty(at.shape[1], np.float64)
        _one(y, x, at, bt, scales, factor, out, i, t)


@njit(nogil=True, cache=True, error_model="numpy")
def _lora_serial(y, x, at, bt, scales, factor, out, t) -> None:  # pragma: no cover - compiled
    for i in range(x.shape[0]):
        _one(y, x, at, bt, scales, factor, out, i, t)


def lora(y: np.ndarray, x: np.ndarray, at: np.ndarray, bt: np.ndarray, scales: np.ndarray, factor: float,
         out: np.ndarray) -> None:
    """``out = y + factor·scales[row]·(x @ A^T) @ B^T`` with ``at``, ``bt`` from :func:`operands`; ``out`` may
    be ``y``."""
    bound(at, bt, factor)(y, x, scales, out)


def bound(at: np.ndarray, bt: np.ndarray, factor: float) -> Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                                                                     None]:
    """:func:`lora` of one adapter matrix pair as a function of ``(y, x, scales, out)``, its scratch made once:
    what a plan calls per pass (at decode the kernel is a few microseconds, so the call's own cost counts)."""
    f = np.float64(factor)
    t = np.empty(at.shape[1], np.float64)

    def run(y: np.ndarray, x: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        if x.shape[0] >= PARALLEL_ROWS:
            _lora_parallel(y, x, at, bt, scales, f, out)
        else:
            _lora_serial(y, x, at, bt, scales, f, out, t)

    return run


def operands(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What :func:`lora` reads of A ``[rank, n_in]`` and B ``[n_out, rank]``: A^T ``[n_in, rank8]`` and B^T
    ``[rank8, n_out]``, C-contiguous, the rank padded with zeros to a multiple of 8, each as float16 bits where
    every one of its values is a float16 exactly, else float32."""
    rank = a.shape[0]
    rank8 = -(-rank // LANES) * LANES
    at = np.zeros((a.shape[1], rank8), np.float32)
    at[:, :rank] = a.T
    bt = np.zeros((rank8, b.shape[0]), np.float32)
    bt[:rank] = b.T
    return _narrowed(at), _narrowed(bt)


def _narrowed(m: np.ndarray) -> np.ndarray:
    """``m`` as float16 bit patterns if that keeps every value exactly, else ``m``."""
    with np.errstate(over="ignore"):
        half = m.astype(np.float16)
    return half.view(F16_BITS) if np.array_equal(half.astype(np.float32), m) else m


def warmup() -> None:
    """Compile (or load from the on-disk cache) both kernels for float32 2-D activations, over float32 and
    float16 operands."""
    x = np.ones((PARALLEL_ROWS, 4), np.float32)
    scales = np.ones(PARALLEL_ROWS, np.float32)
    y = np.zeros((PARALLEL_ROWS, 3), np.float32)
    for at, bt in (operands(np.ones((2, 4)), np.ones((3, 2))), operands(np.full((2, 4), 0.1), np.full((3, 2), 0.1))):
        lora(y, x, at, bt, scales, 1.0, np.empty_like(y))
        lora(y[:1], x[:1], at, bt, scales[:1], 1.0, np.empty_like(y[:1]))
