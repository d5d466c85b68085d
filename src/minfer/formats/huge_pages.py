"""Arrays in one anonymous mapping on transparent huge pages, their pages written up front.

Kernels that walk many small arrays once per forward pass (the KV cache's layers, a LoRA adapter's matrices)
find them faster on 2 MiB pages: a 4 KiB page costs a TLB miss and restarts the hardware prefetcher's stream,
and the model's weights streaming through the caches between two walks evict both.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Sequence

import numpy as np

HUGE_PAGE = 2 << 20


def committed_regions(specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> Iterator[np.ndarray]:
    """Zeroed arrays of these (shape, dtype), in this order, each on a cache line, all in one anonymous
    mapping that asks for transparent huge pages (Linux, ``madvise``) and whose pages are written now. One
    mapping for all of them wastes at most one huge page, not one per array. Without anonymous mappings
    (Windows): ordinary memory."""
    nbytes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs]
    starts = np.cumsum([0] + [(n + 63) // 64 * 64 for n in nbytes])
    if hasattr(mmap, "MAP_ANONYMOUS"):
        mm = mmap.mmap(-1, int(starts[-1]) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
        buf = np.frombuffer(mm, np.uint8)
        buf = buf[(-buf.ctypes.data) % HUGE_PAGE :]
    else:
        buf = np.empty(int(starts[-1]), np.uint8)
    buf[: starts[-1]].fill(0)  # commit: every page taken now
    for (shape, dtype), start, n in zip(specs, starts[:-1], nbytes, strict=True):
        yield buf[start : start + n].view(dtype).reshape(shape)
