"""The compiled LoRA update, ``out = y + s·B·(A·x)`` row by row (``reference.lora`` is its numpy namesake).

One call per adapted matmul: numpy's version made six calls of its own per node, and a decode pass of
SmolLM2-135M with a rank-16 adapter on all seven matrices of its 30 layers has 210 such nodes. The kernels read
A and B as :func:`operands` lays them out: the rank padded with zeros to a multiple of 8 (``rank8``, one vector),
A^T ``[n_in, rank8]``, and B^T in groups of eight outputs. The arithmetic is float64 on eight-lane vectors
(:mod:`~minfer.backends.cpu.simd`):

* ``t = x·A^T``: four partial sums over the inputs ``c`` (``c mod 4``, the inputs past the last group of four
  into the first), added as ``(p0 + p1) + (p2 + p3)``; each product of two float32 values is exact;
* ``u = t·B^T``: each output's sum over the rank, ascending from 0, fused multiply-adds where the CPU has them;
* ``out = float32(y + s·u)``: PEFT's order (the product, scaled, then added), rounded to float32 once.

So the update is all but correctly rounded, and what is left of the difference from transformers + PEFT is
their own float32 rounding (the llama rsLoRA fixture: 6.3e-5 at worst, the float64 numpy product's figure; the
float32 kernel before this one: 7.9e-5, and a float32 variant with partial sums 1.3e-4, over the 1e-4 bound).
Each sum runs in its fixed order whatever the batch, so a row's bits are its own: alone, in a prompt, or on any
number of threads. Zero-padded ranks add exact zeros.

A^T and B^T are kept as float16 where that is lossless (every value of the matrix is a float16 exactly: an
adapter stored in F16, as llama.cpp's converter writes them, and nearly every BF16 one): the kernel widens them
in registers, exactly, so the results are the float32 copy's bits from half the bytes.

Rows go four at a time (:func:`_rows4`: each vector of A and B loaded and widened once for the four, each row's
operations unchanged), the rest one by one. Rows with scale 0 (sequences without the adapter) are ``y``'s own
values, bit for bit. From ``PARALLEL_ROWS`` rows on (a prompt) blocks of ``BLOCK`` rows are shared among the
threads; fewer run on the calling thread, where a parallel region's start cost more than the work (32 us a node
instead of 9 on SmolLM2).
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
BLOCK = 16  # rows per work item of a prompt (four blocks of four)
LANES = 8  # the rank is padded to a multiple of this (one vector of A^T's row)
F16_BITS = np.uint16  # an operand of float16 bit patterns (load_row_f32x8 widens them)


@njit(nogil=True, cache=True, error_model="numpy")
def _row(y, x, at, bt, s, out, i, t) -> None:  # pragma: no cover - compiled
    """Row ``i``'s update, in the fixed order of the module docstring; ``t``: a float64 scratch ``[rank8]``."""
    n_in, rank = at.shape
    k = 0
    while k + 16 <= rank:  # two vectors of the rank in one pass over A^T's rows (one stream from memory)
        p0, p1, p2, p3 = zeros_f64x8(), zeros_f64x8(), zeros_f64x8(), zeros_f64x8()
        q0, q1, q2, q3 = zeros_f64x8(), zeros_f64x8(), zeros_f64x8(), zeros_f64x8()
        c = 0
        while c + 4 <= n_in:
            p0 = madd_wide_f64x8(p0, x[i, c], load_row_f32x8(at, c, k))
            q0 = madd_wide_f64x8(q0, x[i, c], load_row_f32x8(at, c, k + 8))
            p1 = madd_wide_f64x8(p1, x[i, c + 1], load_row_f32x8(at, c + 1, k))
            q1 = madd_wide_f64x8(q1, x[i, c + 1], load_row_f32x8(at, c + 1, k + 8))
            p2 = madd_wide_f64x8(p2, x[i, c + 2], load_row_f32x8(at, c + 2, k))
            q2 = madd_wide_f64x8(q2, x[i, c + 2], load_row_f32x8(at, c + 2, k + 8))
            p3 = madd_wide_f64x8(p3, x[i, c + 3], load_row_f32x8(at, c + 3, k))
            q3 = madd_wide_f64x8(q3, x[i, c + 3], load_row_f32x8(at, c + 3, k + 8))
            c += 4
        while c < n_in:
            p0 = madd_wide_f64x8(p0, x[i, c], load_row_f32x8(at, c, k))
            q0 = madd_wide_f64x8(q0, x[i, c], load_row_f32x8(at, c, k + 8))
            c += 1
        store_f64x8(t, k, add_f64x8(add_f64x8(p0, p1), add_f64x8(p2, p3)))
        store_f64x8(t, k + 8, add_f64x8(add_f64x8(q0, q1), add_f64x8(q2, q3)))
        k += 16
    if k < rank:
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
    _columns(y, bt, rank, s, out, i, t, 0)


@njit(nogil=True, cache=True, error_model="numpy")
def _one(y, x, at, bt, scales, factor, out, i, t) -> None:  # pragma: no cover - compiled
    s = np.float64(scales[i]) * factor
    if s != 0:
        _row(y, x, at, bt, s, out, i, t)
    elif out.ctypes.data != y.ctypes.data:  # no adapter on this row: y's own bits
        for j in range(y.shape[1]):
            out[i, j] = y[i, j]


@njit(nogil=True, cache=True, error_model="numpy")
def _rows4(y, x, at, bt, scales, factor, out, r, t4) -> None:  # pragma: no cover - compiled
    """Rows ``r..r+3`` at once, each row's operations exactly :func:`_row`'s (so its bits): every vector of A
    and B is loaded and widened once for the four rows (a prompt's cost was those loads and conversions).
    ``t4``: a float64 scratch ``[4, rank8]``."""
    n_in, rank = at.shape
    n_out = y.shape[1]
    for k in range(0, rank, 8):
        p00, p01, p02, p03 = zeros_f64x8(), zeros_f64x8(), zeros_f64x8(), zeros_f64x8()
        p10, p11, p12, p13 = zeros_f64x8(), zeros_f64x8(), zeros_f64x8(), zeros_f64x8()
        p20, p21, p22, p23 = zeros_f64x8(), zeros_f64x8(), zeros_f64x8(), zeros_f64x8()
        p30, p31, p32, p33 = zeros_f64x8(), zeros_f64x8(), zeros_f64x8(), zeros_f64x8()
        c = 0
        while c + 4 <= n_in:
            a0, a1 = load_row_f32x8(at, c, k), load_row_f32x8(at, c + 1, k)
            a2, a3 = load_row_f32x8(at, c + 2, k), load_row_f32x8(at, c + 3, k)
            p00, p01 = madd_wide_f64x8(p00, x[r, c], a0), madd_wide_f64x8(p01, x[r, c + 1], a1)
            p02, p03 = madd_wide_f64x8(p02, x[r, c + 2], a2), madd_wide_f64x8(p03, x[r, c + 3], a3)
            p10, p11 = madd_wide_f64x8(p10, x[r + 1, c], a0), madd_wide_f64x8(p11, x[r + 1, c + 1], a1)
            p12, p13 = madd_wide_f64x8(p12, x[r + 1, c + 2], a2), madd_wide_f64x8(p13, x[r + 1, c + 3], a3)
            p20, p21 = madd_wide_f64x8(p20, x[r + 2, c], a0), madd_wide_f64x8(p21, x[r + 2, c + 1], a1)
            p22, p23 = madd_wide_f64x8(p22, x[r + 2, c + 2], a2), madd_wide_f64x8(p23, x[r + 2, c + 3], a3)
            p30, p31 = madd_wide_f64x8(p30, x[r + 3, c], a0), madd_wide_f64x8(p31, x[r + 3, c + 1], a1)
            p32, p33 = madd_wide_f64x8(p32, x[r + 3, c + 2], a2), madd_wide_f64x8(p33, x[r + 3, c + 3], a3)
            c += 4
        while c < n_in:
            a0 = load_row_f32x8(at, c, k)
            p00, p10 = madd_wide_f64x8(p00, x[r, c], a0), madd_wide_f64x8(p10, x[r + 1, c], a0)
            p20, p30 = madd_wide_f64x8(p20, x[r + 2, c], a0), madd_wide_f64x8(p30, x[r + 3, c], a0)
            c += 1
        store_f64x8(t4[0], k, add_f64x8(add_f64x8(p00, p01), add_f64x8(p02, p03)))
        store_f64x8(t4[1], k, add_f64x8(add_f64x8(p10, p11), add_f64x8(p12, p13)))
        store_f64x8(t4[2], k, add_f64x8(add_f64x8(p20, p21), add_f64x8(p22, p23)))
        store_f64x8(t4[3], k, add_f64x8(add_f64x8(p30, p31), add_f64x8(p32, p33)))
    s0, s1 = np.float64(scales[r]) * factor, np.float64(scales[r + 1]) * factor
    s2, s3 = np.float64(scales[r + 2]) * factor, np.float64(scales[r + 3]) * factor
    j = 0
    while j + 16 <= n_out:
        u00, u01, u10, u11 = zeros_f64x8(), zeros_f64x8(), zeros_f64x8(), zeros_f64x8()
        u20, u21, u30, u31 = zeros_f64x8(), zeros_f64x8(), zeros_f64x8(), zeros_f64x8()
        r0 = j // 8 * rank
        for k in range(rank):
            b0, b1 = load_row_f32x8(bt, r0 + k, 0), load_row_f32x8(bt, r0 + rank + k, 0)
            u00, u01 = madd_wide_f64x8(u00, t4[0, k], b0), madd_wide_f64x8(u01, t4[0, k], b1)
            u10, u11 = madd_wide_f64x8(u10, t4[1, k], b0), madd_wide_f64x8(u11, t4[1, k], b1)
            u20, u21 = madd_wide_f64x8(u20, t4[2, k], b0), madd_wide_f64x8(u21, t4[2, k], b1)
            u30, u31 = madd_wide_f64x8(u30, t4[3, k], b0), madd_wide_f64x8(u31, t4[3, k], b1)
        _store_update(y, out, r, j, s0, u00, u01)
        _store_update(y, out, r + 1, j, s1, u10, u11)
        _store_update(y, out, r + 2, j, s2, u20, u21)
        _store_update(y, out, r + 3, j, s3, u30, u31)
        j += 16
    if j < n_out:  # the last outputs row by row, as _row computes them
        for q in range(4):
            s = np.float64(scales[r + q]) * factor
            if s != 0:
                _columns(y, bt, rank, s, out, r + q, t4[q], j)
            else:
                for jj in range(j, n_out):
                    out[r + q, jj] = y[r + q, jj]


@njit(inline="always")
def _store_update(y, out, i, j, s, u0, u1) -> None:  # pragma: no cover - compiled
    """``out[i, j:j+16] = y + s · u`` (``_row``'s rounding); ``y``'s own values where ``s`` is 0."""
    if s != 0:
        store_row_f32x8(out, i, j, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j), s, u0))
        store_row_f32x8(out, i, j + 8, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j + 8), s, u1))
    else:
        store_row_f32x8(out, i, j, load_row_f32x8(y, i, j))
        store_row_f32x8(out, i, j + 8, load_row_f32x8(y, i, j + 8))


@njit(inline="always")
def _columns(y, bt, rank, s, out, i, t, j0) -> None:  # pragma: no cover - compiled
    """Row ``i``'s outputs from ``j0`` (a multiple of 8) on: ``y + s · (t · B^T)``, each lane's sum over the rank
    ascending from 0, in float64, then rounded once; four groups of eight at a time, then one group, then the
    last outputs one by one (the same operations on each lane)."""
    n_out = y.shape[1]
    j = j0
    while j + 32 <= n_out:
        u0, u1, u2, u3 = zeros_f64x8(), zeros_f64x8(), zeros_f64x8(), zeros_f64x8()
        r0 = j // 8 * rank
        for k in range(rank):
            tk = t[k]
            u0 = madd_wide_f64x8(u0, tk, load_row_f32x8(bt, r0 + k, 0))
            u1 = madd_wide_f64x8(u1, tk, load_row_f32x8(bt, r0 + rank + k, 0))
            u2 = madd_wide_f64x8(u2, tk, load_row_f32x8(bt, r0 + 2 * rank + k, 0))
            u3 = madd_wide_f64x8(u3, tk, load_row_f32x8(bt, r0 + 3 * rank + k, 0))
        store_row_f32x8(out, i, j, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j), s, u0))
        store_row_f32x8(out, i, j + 8, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j + 8), s, u1))
        store_row_f32x8(out, i, j + 16, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j + 16), s, u2))
        store_row_f32x8(out, i, j + 24, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j + 24), s, u3))
        j += 32
    while j + 8 <= n_out:
        u = zeros_f64x8()
        r0 = j // 8 * rank
        for k in range(rank):
            u = madd_wide_f64x8(u, t[k], load_row_f32x8(bt, r0 + k, 0))
        store_row_f32x8(out, i, j, scaled_add_narrow_f32x8(load_row_f32x8(y, i, j), s, u))
        j += 8
    r0 = j // 8 * rank
    while j < n_out:
        u = 0.0
        for k in range(rank):
            u = fma_f64(t[k], np.float64(row_value_f32(bt, r0 + k, j % 8)), u)
        out[i, j] = np.float32(np.float64(y[i, j]) + s * u)
        j += 1


@njit(nogil=True, cache=True, error_model="numpy")
def _block(y, x, at, bt, scales, factor, out, r0, r1, t4) -> None:  # pragma: no cover - compiled
    """Rows ``r0..r1``: four at a time (:func:`_rows4`), the rest one by one."""
    r = r0
    while r + 4 <= r1:
        _rows4(y, x, at, bt, scales, factor, out, r, t4)
        r += 4
    while r < r1:
        _one(y, x, at, bt, scales, factor, out, r, t4[0])
        r += 1


@njit(nogil=True, cache=True, error_model="numpy", parallel=True)
def _lora_parallel(y, x, at, bt, scales, factor, out) -> None:  # pragma: no cover - compiled
    n = x.shape[0]
    for b in prange((n + BLOCK - 1) // BLOCK):
        _block(y, x, at, bt, scales, factor, out, b * BLOCK, min(n, b * BLOCK + BLOCK),
               np.empty((4, at.shape[1]), np.float64))


@njit(nogil=True, cache=True, error_model="numpy")
def _lora_serial(y, x, at, bt, scales, factor, out, t4) -> None:  # pragma: no cover - compiled
    _block(y, x, at, bt, scales, factor, out, 0, x.shape[0], t4)


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
    t = np.empty((4, at.shape[1]), np.float64)

    def run(y: np.ndarray, x: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        if x.shape[0] >= PARALLEL_ROWS:
            _lora_parallel(y, x, at, bt, scales, f, out)
        else:
            _lora_serial(y, x, at, bt, scales, f, out, t)

    return run


def operands(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the kernels read of A ``[rank, n_in]`` and B ``[n_out, rank]``, the rank padded with zeros to a
    multiple of 8 (``rank8``): A^T ``[n_in, rank8]``, and B^T in groups of eight outputs, ``[n8 · rank8, 8]``
    (``n8`` the groups, the last padded with zeros): row ``g · rank8 + k`` holds ``B[8g:8g+8, k]``, so that
    the updates of consecutive outputs read B in one stream. Each as float16 bits where every one of its
    values is a float16 exactly, else float32."""
    rank, n_in = a.shape
    n_out = b.shape[0]
    rank8 = -(-rank // LANES) * LANES
    n8 = -(-n_out // LANES)
    at = np.zeros((n_in, rank8), np.float32)
    at[:, :rank] = a.T
    bt = np.zeros((rank8, n8 * LANES), np.float32)
    bt[:rank, :n_out] = b.T
    bt = np.ascontiguousarray(bt.reshape(rank8, n8, LANES).transpose(1, 0, 2)).reshape(n8 * rank8, LANES)
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
