"""The machine's own memory read bandwidth: a STREAM-like read of a buffer much larger than the L3.

Decode reads every weight once per token from DRAM, so its ceiling is how fast the cores can *read*
memory. This measures that ceiling the way STREAM's kernels do (each thread streams one contiguous
slice, summing it in vector registers so that nothing but the loads matters), on the threads asked for.
``minfer bench`` and ``bench/kquant_bench.py --bandwidth`` set tg and GEMV rates against it.
"""

from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange

from minfer.backends.cpu.simd import fma_f32x8, hsum_folded, load_f32x8, splat_f32x8, zeros_f32x8

DEFAULT_BYTES = 512 * 2**20  # ≫ any L3 of the machines we run on (32 MiB here)


@njit(cache=True)
def _sum_slice(buf, lo, hi):
    """Σ buf[lo:hi] (lo, hi multiples of 32), 128 bytes per iteration in four independent vector sums:
    the loads, not the adds, set the pace (a plain numba loop stays scalar and reads 5x slower)."""
    one = splat_f32x8(np.float32(1.0))
    a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
    for i in range(lo, hi, 32):
        a0 = fma_f32x8(a0, load_f32x8(buf, i), one)
        a1 = fma_f32x8(a1, load_f32x8(buf, i + 8), one)
        a2 = fma_f32x8(a2, load_f32x8(buf, i + 16), one)
        a3 = fma_f32x8(a3, load_f32x8(buf, i + 24), one)
    return hsum_folded(a0) + hsum_folded(a1) + hsum_folded(a2) + hsum_folded(a3)


@njit(parallel=True, cache=True)
def _read_all(buf, n_slices):
    """Each of ``n_slices`` workers reads one contiguous slice of ``buf``; the sums keep the loads live."""
    n = buf.shape[0]
    part = np.zeros(n_slices, np.float32)
    for s in prange(n_slices):
        part[s] = _sum_slice(buf, s * n // n_slices // 32 * 32, (s + 1) * n // n_slices // 32 * 32)
    return part.sum()


def read_once(buf: np.ndarray, threads: int) -> float:
    """One STREAM-like pass over the float32 ``buf`` (its length a multiple of 32 per thread) on
    ``threads`` slices; the caller times it (and sets numba's thread count)."""
    return float(_read_all(buf, threads))


def measure_read_bandwidth(threads: int = 1, nbytes: int = DEFAULT_BYTES, seconds: float = 1.0) -> float:
    """Bytes per second read from memory by ``threads`` threads: the best of repeated whole-buffer reads
    filling about ``seconds`` (the least disturbed pass on a shared machine). Restores numba's thread
    count afterwards."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    buf = np.ones(nbytes // 4, np.float32)  # written once, so every page is really backed
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        _read_all(buf, threads)  # compile / load, and fault the pages in
        best = float("inf")
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or best == float("inf"):
            t = time.perf_counter()
            _read_all(buf, threads)
            best = min(best, time.perf_counter() - t)
    finally:
        numba.set_num_threads(before)
    return buf.nbytes / best


if __name__ == "__main__":
    for n in (1, 2):
        print(f"read bandwidth, {n} thread(s): {measure_read_bandwidth(n) / 1e9:.1f} GB/s")
