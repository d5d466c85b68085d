"""``out = x @ W^T`` for float weights (F32, F16, BF16) in passes of many rows: an encoder's matmuls, which never
run a decode step (the decode GEMV of :mod:`~minfer.backends.cpu.float_matmul` is not involved, so its bits
need not be these).

The weight is repacked once into panels of :data:`PANEL` output columns, ``[n_panels, n_in, PANEL]`` float32
(zero columns past ``n_out``), so that the innermost step loads two sixteen-lane vectors of one panel row and
multiplies them by a broadcast activation: the outer-product form of a GEMM, with no horizontal sums. A tile
holds :data:`ROWS` activation rows by one panel in ``2 * ROWS`` vector accumulators (sixteen on AVX-512: all
its registers but sixteen; four rows on AVX2, whose sixteen 256-bit registers hold half as much).

Each output element is ``fma(x[r, k], w[k, j], acc)`` for k = 0, 1, ... n_in - 1 from 0, one fused multiply-add
after another (a multiply and an add where the CPU has no FMA): the same operations whatever tile, pass or
thread computes it, so a sequence alone in a pass gives the bits it gives among others, at any thread count.
Against numpy's float32 BLAS it differs by rounding only. Whole tiles are stored in place; rows past the last whole
tile are copied into a zero-padded scratch tile, and a partial last panel is stored through it. The threads take
runs of consecutive work items (tiles, panel by panel), one scratch tile each.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from minfer.backends.cpu.simd512 import WIDE, fma_f32x16, load_f32x16, splat_at_x16, store_f32x16, zeros_f32x16

PANEL = 32  # output columns per panel: two sixteen-lane vectors
ROWS = 8 if WIDE else 4  # activation rows per tile
F32 = np.float32


def repack(w: np.ndarray) -> np.ndarray:
    """``w`` ``[n_out, n_in]`` (any float dtype) as panels ``[n_panels, n_in, PANEL]`` float32, zero-padded."""
    n_out, n_in = w.shape
    n_panels = -(-n_out // PANEL)
    padded = np.zeros((n_panels * PANEL, n_in), F32)
    padded[:n_out] = w
    return np.ascontiguousarray(padded.reshape(n_panels, PANEL, n_in).transpose(0, 2, 1))


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _tile8(x, xo, k_in, wp, wo, out, oo, os) -> None:  # pragma: no cover - compiled
    """Eight rows (``x[xo + r * k_in + k]``) by one panel (``wp[wo + k * PANEL + j]``) into ``out[oo + r * os + j]``
    (all flat float32 arrays: ``out`` the output itself, rows ``os`` apart, or a scratch tile)."""
    a00 = zeros_f32x16()
    a01 = zeros_f32x16()
    a10 = zeros_f32x16()
    a11 = zeros_f32x16()
    a20 = zeros_f32x16()
    a21 = zeros_f32x16()
    a30 = zeros_f32x16()
    a31 = zeros_f32x16()
    a40 = zeros_f32x16()
    a41 = zeros_f32x16()
    a50 = zeros_f32x16()
    a51 = zeros_f32x16()
    a60 = zeros_f32x16()
    a61 = zeros_f32x16()
    a70 = zeros_f32x16()
    a71 = zeros_f32x16()
    for k in range(k_in):
        w0 = load_f32x16(wp, wo + k * PANEL)
        w1 = load_f32x16(wp, wo + k * PANEL + 16)
        b = splat_at_x16(x, xo + k)
        a00 = fma_f32x16(a00, b, w0)
        a01 = fma_f32x16(a01, b, w1)
        b = splat_at_x16(x, xo + k_in + k)
        a10 = fma_f32x16(a10, b, w0)
        a11 = fma_f32x16(a11, b, w1)
        b = splat_at_x16(x, xo + 2 * k_in + k)
        a20 = fma_f32x16(a20, b, w0)
        a21 = fma_f32x16(a21, b, w1)
        b = splat_at_x16(x, xo + 3 * k_in + k)
        a30 = fma_f32x16(a30, b, w0)
        a31 = fma_f32x16(a31, b, w1)
        b = splat_at_x16(x, xo + 4 * k_in + k)
        a40 = fma_f32x16(a40, b, w0)
        a41 = fma_f32x16(a41, b, w1)
        b = splat_at_x16(x, xo + 5 * k_in + k)
        a50 = fma_f32x16(a50, b, w0)
        a51 = fma_f32x16(a51, b, w1)
        b = splat_at_x16(x, xo + 6 * k_in + k)
        a60 = fma_f32x16(a60, b, w0)
        a61 = fma_f32x16(a61, b, w1)
        b = splat_at_x16(x, xo + 7 * k_in + k)
        a70 = fma_f32x16(a70, b, w0)
        a71 = fma_f32x16(a71, b, w1)
    store_f32x16(out, oo, a00)
    store_f32x16(out, oo + 16, a01)
    store_f32x16(out, oo + os, a10)
    store_f32x16(out, oo + os + 16, a11)
    store_f32x16(out, oo + 2 * os, a20)
    store_f32x16(out, oo + 2 * os + 16, a21)
    store_f32x16(out, oo + 3 * os, a30)
    store_f32x16(out, oo + 3 * os + 16, a31)
    store_f32x16(out, oo + 4 * os, a40)
    store_f32x16(out, oo + 4 * os + 16, a41)
    store_f32x16(out, oo + 5 * os, a50)
    store_f32x16(out, oo + 5 * os + 16, a51)
    store_f32x16(out, oo + 6 * os, a60)
    store_f32x16(out, oo + 6 * os + 16, a61)
    store_f32x16(out, oo + 7 * os, a70)
    store_f32x16(out, oo + 7 * os + 16, a71)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _tile4(x, xo, k_in, wp, wo, out, oo, os) -> None:  # pragma: no cover - compiled
    """As :func:`_tile8` on four rows (AVX2: eight 256-bit accumulator pairs fit its sixteen registers)."""
    a00 = zeros_f32x16()
    a01 = zeros_f32x16()
    a10 = zeros_f32x16()
    a11 = zeros_f32x16()
    a20 = zeros_f32x16()
    a21 = zeros_f32x16()
    a30 = zeros_f32x16()
    a31 = zeros_f32x16()
    for k in range(k_in):
        w0 = load_f32x16(wp, wo + k * PANEL)
        w1 = load_f32x16(wp, wo + k * PANEL + 16)
        b = splat_at_x16(x, xo + k)
        a00 = fma_f32x16(a00, b, w0)
        a01 = fma_f32x16(a01, b, w1)
        b = splat_at_x16(x, xo + k_in + k)
        a10 = fma_f32x16(a10, b, w0)
        a11 = fma_f32x16(a11, b, w1)
        b = splat_at_x16(x, xo + 2 * k_in + k)
        a20 = fma_f32x16(a20, b, w0)
        a21 = fma_f32x16(a21, b, w1)
        b = splat_at_x16(x, xo + 3 * k_in + k)
        a30 = fma_f32x16(a30, b, w0)
        a31 = fma_f32x16(a31, b, w1)
    store_f32x16(out, oo, a00)
    store_f32x16(out, oo + 16, a01)
    store_f32x16(out, oo + os, a10)
    store_f32x16(out, oo + os + 16, a11)
    store_f32x16(out, oo + 2 * os, a20)
    store_f32x16(out, oo + 2 * os + 16, a21)
    store_f32x16(out, oo + 3 * os, a30)
    store_f32x16(out, oo + 3 * os + 16, a31)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _item(x, wp, out, n_rows, k_in, n_out, rows, item, scratch) -> None:  # pragma: no cover - compiled
    """Work item ``item`` (panel-major: the threads' consecutive items share a panel while it is in cache): one
    tile of ``rows`` rows by one panel, stored in place, or through ``scratch`` (``[rows * k_in + rows * PANEL]``)
    where the rows or the panel's columns are not whole."""
    n_tiles = -(-n_rows // rows)
    p = item // n_tiles
    t = item - p * n_tiles
    r0 = t * rows
    nr = min(rows, n_rows - r0)
    c0 = p * PANEL
    nc = min(PANEL, n_out - c0)
    xf = x.reshape(-1)
    of = out.reshape(-1)
    whole = nr == rows and nc == PANEL
    if nr == rows:
        src, so = xf, r0 * k_in
    else:
        src, so = scratch, 0
        for i in range(rows * k_in):
            scratch[i] = xf[r0 * k_in + i] if i < nr * k_in else F32(0.0)
    dst, do, ds = (of, r0 * n_out + c0, n_out) if whole else (scratch, rows * k_in, PANEL)
    if rows == 8:
        _tile8(src, so, k_in, wp, p * k_in * PANEL, dst, do, ds)
    else:
        _tile4(src, so, k_in, wp, p * k_in * PANEL, dst, do, ds)
    if not whole:
        for r in range(nr):
            for j in range(nc):
                out[r0 + r, c0 + j] = scratch[do + r * PANEL + j]


@njit(nogil=True, cache=True, error_model="numpy")
def _gemm_serial(x, wp, out, rows) -> None:  # pragma: no cover - compiled
    n_rows, k_in = x.shape
    wf = wp.reshape(-1)
    scratch = np.empty(rows * k_in + rows * PANEL, F32)
    for item in range(wp.shape[0] * (-(-n_rows // rows))):
        _item(x, wf, out, n_rows, k_in, out.shape[1], rows, item, scratch)


@njit(nogil=True, cache=True, error_model="numpy", parallel=True)
def _gemm_parallel(x, wp, out, rows, n_chunks) -> None:  # pragma: no cover - compiled
    """The items in ``n_chunks`` runs of consecutive ones (one per thread, each with its scratch tile)."""
    n_rows, k_in = x.shape
    wf = wp.reshape(-1)
    n_items = wp.shape[0] * (-(-n_rows // rows))
    for c in prange(n_chunks):
        scratch = np.empty(rows * k_in + rows * PANEL, F32)
        for item in range(c * n_items // n_chunks, (c + 1) * n_items // n_chunks):
            _item(x, wf, out, n_rows, k_in, out.shape[1], rows, item, scratch)


PARALLEL_ITEMS = 4  # tiles from which the work is shared among the threads


def gemm(x: np.ndarray, panels: np.ndarray, out: np.ndarray) -> None:
    """``out[:, :n_out] = x @ W^T`` with ``panels`` = :func:`repack` (W) (see the module docstring)."""
    n_rows, k_in = x.shape
    n_panels, pk, width = panels.shape
    if (pk != k_in or width != PANEL or out.shape[0] != n_rows or not 0 < out.shape[1] <= n_panels * PANEL
            or x.dtype != F32 or out.dtype != F32 or panels.dtype != F32):
        raise ValueError(f"gemm: x {x.shape}, panels {panels.shape}, out {out.shape} (float32) do not fit")
    x = x if x.flags.c_contiguous else np.ascontiguousarray(x)
    o = out if out.flags.c_contiguous else np.empty(out.shape, F32)
    items = n_panels * -(-n_rows // ROWS)
    threads = numba.get_num_threads()
    if items >= PARALLEL_ITEMS and threads > 1:
        _gemm_parallel(x, panels, o, ROWS, min(threads, items))
    else:
        _gemm_serial(x, panels, o, ROWS)
    if o is not out:
        out[:] = o


def warmup() -> None:
    """Compile (or load from the on-disk cache) both variants."""
    w = repack(np.ones((PANEL + 1, 3), F32))
    for n in (1, ROWS * PARALLEL_ITEMS + 1):
        _gemm_serial(np.ones((n, 3), F32), w, np.empty((n, PANEL + 1), F32), ROWS)
        _gemm_parallel(np.ones((n, 3), F32), w, np.empty((n, PANEL + 1), F32), ROWS, 2)
