"""A host-memory cache of KV blocks that left the pool (llama-server's ``--cache-ram``), found again by the
tokens they hold.

A block of a sequence is named by a hash chain: the hash of the previous block's name and its own
``KV_BLOCK`` tokens, from a root that names what else decides its cells (the adapter scales it was
computed with). Equal names mean equal tokens at equal positions after an equal prefix, so the cells are
the ones a fresh evaluation would write (the engine's prefill and decode rows are bit-identical). When a
slot's cached tokens are about to be overwritten or dropped, its full blocks are copied here; a later
prompt that starts with them gets its cells copied back instead of evaluated. Bounded by bytes; the least
recently used blocks go first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from minfer.runtime.kv_cache import KV_BLOCK

BlockCells = list[tuple[np.ndarray, np.ndarray]]  # per layer: K and V rows of one block, in the stored type


def block_names(tokens: Sequence[int], n_blocks: int, root: bytes) -> list[bytes]:
    """The names of the first ``n_blocks`` full blocks of ``tokens`` (see the module's text)."""
    names = []
    prev = hashlib.blake2b(root, digest_size=16).digest()
    ids = np.asarray(tokens[: n_blocks * KV_BLOCK], dtype=np.int64)
    for b in range(n_blocks):
        prev = hashlib.blake2b(prev + ids[b * KV_BLOCK : (b + 1) * KV_BLOCK].tobytes(), digest_size=16).digest()
        names.append(prev)
    return names


class PromptCache:
    """Blocks' cells by name, at most ``max_bytes`` of them."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[bytes, BlockCells] = OrderedDict()
        self.nbytes = 0
        self.stored = 0  # blocks copied in
        self.restored = 0  # blocks copied back out

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, name: bytes) -> bool:
        return name in self._blocks

    def put(self, name: bytes, cells: BlockCells) -> None:
        """Keep ``cells`` under ``name`` (the least recently used blocks leave to make room)."""
        if name in self._blocks:
            self._blocks.move_to_end(name)
            return
        size = sum(k.nbytes + v.nbytes for k, v in cells)
        if size > self.max_bytes:
            return
        while self.nbytes + size > self.max_bytes:
            _, old = self._blocks.popitem(last=False)
            self.nbytes -= sum(k.nbytes + v.nbytes for k, v in old)
        self._blocks[name] = cells
        self.nbytes += size
        self.stored += 1

    def get(self, name: bytes) -> BlockCells | None:
        cells = self._blocks.get(name)
        if cells is not None:
            self._blocks.move_to_end(name)
        return cells
