"""What the machine itself can do, measured: read bandwidth from memory and float32 FMA throughput, per thread count.

``minfer bench`` sets its results against these (tg: the read bandwidth its tokens/s imply; pp: GFLOP/s), so
they are measured in the same run, at the bench's thread counts, and kept in a :class:`MachineProbe` the run
owns (no global cache: another run, another load on a shared machine, measures again).

* **Read bandwidth**: :mod:`minfer.tools.read_bandwidth`'s STREAM-like read of a float32 buffer of
  ``max(512 MiB, 8 x L3)``, each thread summing one contiguous slice in vector registers; the best pass over
  about a second (bandwidth is an upper bound the machine can reach; other processes only ever lower it).
* **FMA peak**: each thread runs ``acc = acc * a + b`` over 256 independent float32 accumulators (vectorized
  by LLVM for the host's widest FMA, as the kernels are), 2 FLOPs per element; best of 5.
* **Instruction set**: from the CPU's flags (``/proc/cpuinfo``): AVX-512 (16 float32 lanes), AVX2 + FMA (8),
  and whether the integer dot products (AVX-512 VNNI / AVX-VNNI) are there. With VNNI an int8 ``vpdpbusd``
  does 4 multiply-adds per 32-bit lane where an FMA does 1, so the int8 peak is taken as 4x the measured
  float32 one (derived, not measured: numba cannot emit it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numba
import numpy as np
from numba import njit, prange

_MIN_BUFFER = 512 << 20
_FMA_WIDTH = 256  # accumulators per thread: enough independent chains to hide the FMA latency
_FMA_ITERS = 200_000


@njit(parallel=True, cache=True, fastmath=True)
def _fma_loop(n_threads, iters, a, b):
    out = np.zeros(n_threads, np.float32)
    for t in prange(n_threads):
        acc = np.empty(_FMA_WIDTH, np.float32)
        for j in range(_FMA_WIDTH):
            acc[j] = np.float32(j) * np.float32(1e-3)
        for _ in range(iters):
            for j in range(_FMA_WIDTH):
                acc[j] = acc[j] * a + b
        out[t] = acc.sum()
    return out.sum()


def l3_bytes() -> int:
    """The last-level cache's size (0 where the system does not say)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in os.listdir(base):
            try:
                with open(os.path.join(base, index, "size")) as f:
                    text = f.read().strip()
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return best


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def instruction_set(flags: frozenset[str]) -> tuple[str, int, bool]:
    """(name, float32 lanes of the widest FMA, integer dot products present)."""
    vnni = "avx512_vnni" in flags or "avx_vnni" in flags
    if "avx512f" in flags:
        return ("AVX-512" + (" VNNI" if "avx512_vnni" in flags else ""), 16, vnni)
    if "avx2" in flags and "fma" in flags:
        return ("AVX2+FMA" + (" AVX-VNNI" if "avx_vnni" in flags else ""), 8, vnni)
    if "avx" in flags:
        return "AVX", 8, False
    return "SSE/other", 4, False


@dataclass
class MachineProbe:
    """Measurements of this machine, made on first use for each thread count and kept for the run."""

    bandwidth: dict[int, float] = field(default_factory=dict)  # threads -> bytes/s
    fma_flops: dict[int, float] = field(default_factory=dict)  # threads -> float32 FLOP/s

    def read_bandwidth(self, threads: int) -> float:
        if threads not in self.bandwidth:
            self.bandwidth[threads] = measure_read_bandwidth(threads)
        return self.bandwidth[threads]

    def fma_peak(self, threads: int) -> float:
        if threads not in self.fma_flops:
            self.fma_flops[threads] = measure_fma_peak(threads)
        return self.fma_flops[threads]

    def describe(self) -> dict[str, object]:
        name, lanes, vnni = instruction_set(cpu_flags())
        from minfer.backends.cpu import amx  # (its probe runs in a child process, once per CPU)

        return {"instruction_set": name, "f32_lanes": lanes, "int8_dot": vnni, "l3_bytes": l3_bytes(),
                "amx": amx.reason(), "read_bandwidth_bytes_s": dict(self.bandwidth),
                "f32_fma_flop_s": dict(self.fma_flops),
                "int8_peak_op_s": {t: 4 * f for t, f in self.fma_flops.items()} if vnni else {}}


def _with_threads(threads: int):
    previous = numba.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    return previous


def measure_read_bandwidth(threads: int, nbytes: int | None = None, seconds: float = 1.0) -> float:
    """Bytes per second ``threads`` threads read from memory (read_bandwidth's best pass)."""
    from minfer.tools.read_bandwidth import measure_read_bandwidth as stream_read

    return stream_read(threads, nbytes=nbytes or max(_MIN_BUFFER, 8 * l3_bytes()), seconds=seconds)


def measure_fma_peak(threads: int, tries: int = 5) -> float:
    """float32 FLOP/s of ``threads`` threads doing independent FMAs (best of ``tries``)."""
    previous = _with_threads(threads)
    try:
        _fma_loop(threads, 10, np.float32(0.999), np.float32(1e-3))
        best = 0.0
        for _ in range(tries):
            t0 = time.perf_counter()
            _fma_loop(threads, _FMA_ITERS, np.float32(0.999), np.float32(1e-3))
            best = max(best, 2.0 * _FMA_WIDTH * _FMA_ITERS * threads / (time.perf_counter() - t0))
    finally:
        numba.set_num_threads(previous)
    return best
