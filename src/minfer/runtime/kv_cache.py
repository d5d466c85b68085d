"""The KV cache: a pool of blocks of cells per layer, and a row map that says where each position lives.

Blocks: each layer's K and V regions are cut into blocks of :data:`KV_BLOCK` rows (positions), all
sequences drawing from one pool. A sequence holds a list of blocks; block ``b`` of it holds its positions
``b * KV_BLOCK ..``. Where a position lives is data: ``row_map`` gives, for the *virtual row*
``seq * capacity + pos`` of every sequence and position, the region row that holds it (the block table,
expanded to rows). The forward pass gets the virtual rows as an input; the KV store writes at
``row_map[rows]`` and attention reads a sequence's positions ``0..pos`` through its slice of the map, so
no plan changes when blocks move. Block 0 is the null block: positions that hold nothing map to it, so
the map never points outside the regions.

Sharing: a block may belong to several sequences (a reference count per block). A sequence that takes
another's prefix (:meth:`KVCache.copy_prefix`) references its blocks instead of copying rows; the first
write into a shared block copies that block first (copy on write), so the sequences diverge there and
nowhere else. Blocks whose count drops to 0 go back to the pool.

Sequences: the cache holds ``n_seq`` sequences. Split (the default), each may hold up to ``capacity =
n_ctx // n_seq`` positions and the pool has a block for every position of every sequence, so a write never
waits for a block. Unified (``unified=True``, llama-server's ``--kv-unified``), every sequence may hold up
to ``n_ctx`` positions and the pool has blocks for ``n_ctx`` positions in all (plus ``spare_blocks``):
whoever writes more than the free blocks hold is refused, so its user (the scheduler) counts the blocks a
pass needs first (:meth:`KVCache.blocks_needed`) and frees some when they run short.

Cell types (``cache_type``): ``f32`` (default), ``f16`` (half the bytes; the fast kernels store and read
the halves themselves, the reference ones read a float32 copy of the window), ``q8_0`` (packed Q8_0
blocks, 34 bytes per 32 values, ~3.76x smaller than f32): quantized on store, dequantized for the window
a layer's attention is about to read. Regions are allocated zeroed (``np.zeros`` maps untouched pages
lazily), so a large context costs memory only as positions are written; ``commit=True`` writes every page
at creation instead (a server: its memory is all taken at start and stays flat under load, and no
request pays the page faults of cells touched for the first time), all regions in one mapping that asks
for transparent huge pages.

The cache also records which token each sequence holds at each position (``tokens(seq)``), so callers
can reuse a cached prefix instead of recomputing it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from minfer.errors import BadRequestError, ContextOverflowError
from minfer.formats.huge_pages import committed_regions
from minfer.formats.quants import Q8_0_BLOCK_BYTES, QK8_0, dequantize_q8_0_rows_into, quantize_q8_0_into
from minfer.models.hparams import HParams

CACHE_TYPES = ("f32", "f16", "q8_0")
KV_BLOCK = 32  # positions per block: one Q8_0 block's worth; small enough that sharing wastes little
NULL_BLOCK = 0  # the block unwritten positions map to; never written, never freed


def check_cache_type(cache_type: str | None) -> str:
    """``cache_type``, or ``$MINFER_CACHE_TYPE``, or f32; an unknown one is refused naming the valid ones."""
    value = cache_type or os.environ.get("MINFER_CACHE_TYPE") or "f32"
    if value not in CACHE_TYPES:
        raise BadRequestError(f"unknown KV cache type {value!r} (valid: {', '.join(CACHE_TYPES)})")
    return value


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit`` (how much of a prompt a
    sequence's cached tokens already hold)."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def cell_bytes(cache_type: str, width: int) -> int:
    """Bytes one row of ``width`` values takes in a region of ``cache_type``."""
    if cache_type == "f32":
        return 4 * width
    if cache_type == "f16":
        return 2 * width
    return -(-width // QK8_0) * Q8_0_BLOCK_BYTES


def _contiguous(rows: np.ndarray) -> bool:
    """Whether region rows ``rows`` are consecutive (a window the regions can give as a view)."""
    n = rows.shape[0]
    return n == 0 or (int(rows[-1]) - int(rows[0]) == n - 1 and bool((np.diff(rows) == 1).all()))


@dataclass
class KVLayer:
    """One layer's K and V regions in their stored type, the cache's row map (virtual row -> region row),
    and float32 scratch for the window read."""

    cache_type: str
    k: np.ndarray
    v: np.ndarray
    row_map: np.ndarray  # shared by every layer of the cache; updated in place as blocks move
    k_scratch: np.ndarray | None = None  # f16 / q8_0 only: the dequantized window (shared by all layers)
    v_scratch: np.ndarray | None = None
    identity: np.ndarray | None = None  # q8_0: the row map of a dequantized window (0, 1, 2, ...)

    def physical(self, rows: np.ndarray) -> np.ndarray:
        """The region rows of virtual rows ``rows``."""
        return self.row_map[rows]

    def store(self, k: np.ndarray, v: np.ndarray, rows: np.ndarray) -> None:
        """Write K/V rows ``k[i]``, ``v[i]`` at virtual rows ``rows[i]`` (already bounds-checked, their blocks
        writable)."""
        phys = self.physical(rows)
        if self.cache_type == "q8_0":
            quantize_q8_0_into(k, self.k, phys)
            quantize_q8_0_into(v, self.v, phys)
        else:
            self.k[phys] = k
            self.v[phys] = v

    def move(self, src: np.ndarray, dst: np.ndarray, rotate_k: Callable[[np.ndarray], None]) -> None:
        """Copy region rows ``src`` to region rows ``dst``, K rows re-rotated by ``rotate_k`` (in place,
        float32 rows): RoPE by a position delta, for a context shift."""
        k = self._read(self.k, src)  # a copy: the rows read may be among those about to be overwritten
        rotate_k(k)
        self.v[dst] = self.v[src]  # fancy indexing reads every source row before it writes
        if self.cache_type == "q8_0":
            quantize_q8_0_into(k, self.k, dst)
        else:
            self.k[dst] = k

    def _read(self, region: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Region rows ``rows`` as a fresh float32 array."""
        if self.cache_type == "q8_0":
            out = np.empty((rows.shape[0], region.shape[1] // Q8_0_BLOCK_BYTES * QK8_0), np.float32)
            dequantize_q8_0_rows_into(region, rows, out)
            return out
        return region[rows].astype(np.float32)

    def cells(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Virtual rows ``start..stop-1`` of K and V as the fast attention reads them: (K, V, row map of the
        window). f32 and f16 cells are the regions themselves (its kernels widen float16 as they load),
        read through the map; q8_0 ones are dequantized into consecutive scratch rows."""
        if self.cache_type == "q8_0":
            k, v = self.window(start, stop)
            return k, v, self.identity[: stop - start]
        return self.k, self.v, self.row_map[start:stop]

    def window(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Virtual rows ``start..stop-1`` of K and V as float32 arrays: views where the rows are consecutive
        f32 cells, else gathered (and dequantized) into the scratch."""
        rows = self.row_map[start:stop]
        n = stop - start
        if self.cache_type == "f32":
            if _contiguous(rows):
                r0 = int(rows[0]) if n else 0
                return self.k[r0 : r0 + n], self.v[r0 : r0 + n]
            return self.k[rows], self.v[rows]
        ks, vs = self.k_scratch[:n], self.v_scratch[:n]
        if self.cache_type == "f16":
            np.copyto(ks, self.k[rows])
            np.copyto(vs, self.v[rows])
        else:
            dequantize_q8_0_rows_into(self.k, rows, ks)
            dequantize_q8_0_rows_into(self.v, rows, vs)
        return ks, vs


class KVCache:
    def __init__(
        self, hparams: HParams, n_ctx: int, cache_type: str | None = None, n_seq: int = 1, commit: bool = False,
        unified: bool = False, spare_blocks: int = 0,
    ) -> None:
        self.cache_type = check_cache_type(cache_type)
        if n_seq < 1 or n_ctx < n_seq:
            raise BadRequestError(f"a context of {n_ctx} cannot hold {n_seq} sequences")
        if self.cache_type == "q8_0" and (hparams.k_width % QK8_0 or hparams.v_width % QK8_0):
            raise BadRequestError(
                f"q8_0 cells need K/V widths that are multiples of {QK8_0} (this model: {hparams.k_width}, "
                f"{hparams.v_width})"
            )
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self.unified = unified
        self.capacity = n_ctx if unified else n_ctx // n_seq  # positions per sequence
        self.n_layer = hparams.n_layer
        # split: every position of every sequence has a block, so a write never waits for one; unified:
        # n_ctx positions in all. And the null block.
        per_seq = -(-self.capacity // KV_BLOCK)
        self.n_blocks = (per_seq if unified else n_seq * per_seq) + spare_blocks + 1
        rows = self.n_blocks * KV_BLOCK
        # virtual row seq * capacity + pos -> region row; int32, as the plans' rows
        self.row_map = np.zeros(n_seq * self.capacity, np.int32)
        self._blocks: list[list[int]] = [[] for _ in range(n_seq)]
        self._refs = np.zeros(self.n_blocks, np.int32)
        self._refs[NULL_BLOCK] = 1
        self._free = list(range(self.n_blocks - 1, NULL_BLOCK, -1))  # popped from the end: 1, 2, 3, ...
        scratch: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
        if self.cache_type != "f32":
            scratch = (np.zeros((self.capacity, hparams.k_width), np.float32),
                       np.zeros((self.capacity, hparams.v_width), np.float32))
        identity = np.arange(self.capacity, dtype=np.int32) if self.cache_type == "q8_0" else None
        specs = [self._region_spec(rows, w) for _ in range(hparams.n_layer) for w in (hparams.k_width, hparams.v_width)]
        # committed: one mapping on huge pages (attention reads each sequence's rows of every layer once per
        # step, and that walk measured faster on huge pages: 8 sequences x 100 positions of SmolLM2's 30
        # layers, 4.78 ms on 4 KiB pages, 4.22 ms on huge ones, paired)
        regions = committed_regions(specs) if commit else (np.zeros(shape, dtype) for shape, dtype in specs)
        self.layers = [KVLayer(self.cache_type, next(regions), next(regions), self.row_map, *scratch, identity)
                       for _ in range(hparams.n_layer)]
        self._tokens: list[list[int]] = [[] for _ in range(n_seq)]

    def _region_spec(self, rows: int, width: int) -> tuple[tuple[int, int], np.dtype]:
        """(shape, dtype) of a region of ``rows`` cells of ``width`` values."""
        if self.cache_type == "f32":
            return (rows, width), np.dtype(np.float32)
        if self.cache_type == "f16":
            return (rows, width), np.dtype(np.float16)
        return (rows, cell_bytes("q8_0", width)), np.dtype(np.uint8)

    # -- sizes -------------------------------------------------------------------------------------

    @property
    def bytes_per_position(self) -> int:
        """Bytes of K and V one position takes over all layers, measured from the allocated arrays."""
        return sum(layer.k[0].nbytes + layer.v[0].nbytes for layer in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)

    @property
    def blocks_in_use(self) -> int:
        """Blocks that hold some sequence's positions (each counted once, however many sequences share it)."""
        return self.n_blocks - 1 - len(self._free)

    @property
    def blocks_free(self) -> int:
        """Blocks in the pool that no sequence holds."""
        return len(self._free)

    @property
    def blocks_shared(self) -> int:
        """Blocks held by more than one sequence."""
        return int((self._refs[1:] > 1).sum())

    def blocks(self, seq: int) -> list[int]:
        """The blocks sequence ``seq`` holds, in position order (a copy)."""
        return list(self._blocks[seq])

    def n_blocks_held(self, seq: int) -> int:
        return len(self._blocks[seq])

    def blocks_needed(self, seq: int, first: int, last: int) -> int:
        """Blocks from the pool that writing positions ``first..last`` of ``seq`` takes: one for each block
        it does not hold yet (gaps included), one for each shared block it would copy."""
        held = self._blocks[seq]
        gap = max(0, first // KV_BLOCK - len(held))
        return gap + sum(self._write_cost(held, b) for b in range(first // KV_BLOCK, last // KV_BLOCK + 1))

    def _write_cost(self, held: list[int], b: int) -> int:
        """Blocks from the pool a write into block ``b`` of a sequence holding ``held`` takes: one for a block
        it does not hold yet or shares (then copied), none for its own."""
        return 1 if b >= len(held) or self._refs[held[b]] > 1 else 0

    def writable_end(self, seq: int, start: int, n_blocks: int) -> int:
        """How far from ``start`` sequence ``seq`` can write with ``n_blocks`` blocks from the pool: the end
        (exclusive) of the positions, at most ``capacity``."""
        held = self._blocks[seq]
        if start > len(held) * KV_BLOCK:  # a gap: its blocks come first
            n_blocks -= start // KV_BLOCK - len(held)
            if n_blocks <= 0:
                return start
        b = start // KV_BLOCK
        while b * KV_BLOCK < self.capacity:
            cost = self._write_cost(held, b)
            if cost > n_blocks:
                break
            n_blocks -= cost
            b += 1
        return max(start, min(self.capacity, b * KV_BLOCK))

    # -- addressing --------------------------------------------------------------------------------

    def rows(self, positions: np.ndarray, seq_ids: np.ndarray | int = 0) -> np.ndarray:
        """Virtual rows of tokens at ``positions`` of sequences ``seq_ids``, about to be written: refuses a
        position that does not fit, then gives every block they fall in to its sequence alone (a new block,
        or a private copy of a shared one)."""
        positions = np.asarray(positions, dtype=np.int64)
        seq = np.broadcast_to(np.asarray(seq_ids, dtype=np.int64), positions.shape)
        bad = np.flatnonzero((seq < 0) | (seq >= self.n_seq))
        if bad.size:
            raise BadRequestError(f"sequence id {int(seq[bad[0]])} is outside 0..{self.n_seq - 1}")
        over = np.flatnonzero((positions < 0) | (positions >= self.capacity))
        if over.size:
            i = int(over[0])
            raise ContextOverflowError(
                f"position {int(positions[i])} (token {i}) does not fit in the context of {self.capacity} tokens"
                + (f" per sequence ({self.n_ctx} shared by {self.n_seq})" if self.n_seq > 1 else "")
            )
        virtual = seq * self.capacity + positions
        blocks = self.row_map[virtual] // KV_BLOCK
        need = np.flatnonzero((blocks == NULL_BLOCK) | (self._refs[blocks] > 1))
        if need.size:  # a block to take or to copy: once per (sequence, block)
            per_seq = -(-self.capacity // KV_BLOCK)
            for key in np.unique(seq[need] * per_seq + positions[need] // KV_BLOCK).tolist():
                self._own(key // per_seq, key % per_seq)
        return virtual

    def _own(self, seq: int, b: int) -> None:
        """Give sequence ``seq`` a block of its own for its block ``b`` (and blocks for those before it)."""
        held = self._blocks[seq]
        while len(held) <= b:  # a gap's positions map to blocks of their own too
            self._place(seq, len(held), self._take_block())
        block = held[b]
        if self._refs[block] > 1:  # shared: this sequence writes into a copy of its own
            copy = self._take_block()
            src, dst = slice(block * KV_BLOCK, (block + 1) * KV_BLOCK), slice(copy * KV_BLOCK, (copy + 1) * KV_BLOCK)
            for layer in self.layers:
                layer.k[dst] = layer.k[src]
                layer.v[dst] = layer.v[src]
            self._refs[block] -= 1
            self._place(seq, b, copy)

    def _take_block(self) -> int:
        if not self._free:  # split: cannot happen; unified: the scheduler counts blocks before each pass
            raise ContextOverflowError(f"the KV cache is full: all {self.n_blocks - 1} blocks of {KV_BLOCK} "
                                       "positions are in use")
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _place(self, seq: int, b: int, block: int) -> None:
        """Block ``b`` of sequence ``seq`` is ``block`` (its count already taken)."""
        held = self._blocks[seq]
        if b == len(held):
            held.append(block)
        else:
            held[b] = block
        lo = seq * self.capacity + b * KV_BLOCK
        n = min(KV_BLOCK, self.capacity - b * KV_BLOCK)
        self.row_map[lo : lo + n] = np.arange(block * KV_BLOCK, block * KV_BLOCK + n, dtype=np.int32)

    def _drop_blocks(self, seq: int, n_positions: int) -> None:
        """Sequence ``seq`` keeps the blocks of its first ``n_positions`` positions; the rest go back to the
        pool once no sequence holds them."""
        held = self._blocks[seq]
        keep = -(-n_positions // KV_BLOCK)
        for block in held[keep:]:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        del held[keep:]
        lo = seq * self.capacity
        self.row_map[lo + keep * KV_BLOCK : lo + self.capacity] = NULL_BLOCK * KV_BLOCK

    # -- sequences ---------------------------------------------------------------------------------

    def tokens(self, seq: int = 0) -> list[int]:
        """The tokens sequence ``seq`` holds at positions 0..len-1 (a copy)."""
        return list(self._tokens[seq])

    def record(self, seq: int, positions: np.ndarray, tokens: np.ndarray) -> None:
        """Note that ``tokens`` were written at ``positions`` (contiguous, ascending) of ``seq``."""
        held = self._tokens[seq]
        start = int(positions[0])
        del held[start:]
        if start > len(held):  # a gap: rows before ``start`` are not known to hold anything
            held.extend([-1] * (start - len(held)))
        held.extend(int(t) for t in tokens)

    def truncate(self, seq: int, n: int) -> None:
        """Forget sequence ``seq``'s positions from ``n`` on; the blocks past them go back to the pool."""
        del self._tokens[seq][n:]
        self._drop_blocks(seq, n)

    def remove(self, seq: int) -> None:
        self.truncate(seq, 0)

    def clear(self) -> None:
        for seq in range(self.n_seq):
            self.remove(seq)

    def read(self, seq: int, stop: int, start: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's cells (K, V in their stored type) of sequence ``seq``'s positions ``start..stop-1``,
        copies."""
        base = seq * self.capacity
        rows = self.row_map[base + start : base + stop]
        return [(layer.k[rows], layer.v[rows]) for layer in self.layers]

    def write(self, seq: int, cells: Sequence[tuple[np.ndarray, np.ndarray]], start: int = 0) -> None:
        """Sequence ``seq`` holds ``cells`` (as :meth:`read` gives them) at positions ``start..``, and nothing
        after them; its tokens are recorded by the caller. On a unified cache the blocks must be free."""
        n = cells[0][0].shape[0] if cells else 0
        self.truncate(seq, start)
        if n:
            rows = self.row_map[self.rows(np.arange(start, start + n), seq)]
            for layer, (k, v) in zip(self.layers, cells, strict=True):
                layer.k[rows] = k
                layer.v[rows] = v

    def shift(
        self, seq: int, n_keep: int, n_discard: int, rotate_k: Callable[[np.ndarray, int, int], None]
    ) -> None:
        """Context shift: drop positions ``n_keep .. n_keep+n_discard-1`` of ``seq`` and move the rest down by
        ``n_discard``, K rows re-rotated to their new positions (``rotate_k(rows, -n_discard, layer)`` in
        place)."""
        n = len(self._tokens[seq])
        if not (0 <= n_keep and 0 < n_discard and n_keep + n_discard <= n):
            raise BadRequestError(f"cannot drop {n_discard} positions after {n_keep} of a sequence of {n}")
        moved = n - n_keep - n_discard
        if moved:
            dst_virtual = self.rows(np.arange(n_keep, n_keep + moved), seq)  # blocks of its own to write
            base = seq * self.capacity
            src = self.row_map[base + n_keep + n_discard : base + n]
            dst = self.row_map[dst_virtual]
            for il, layer in enumerate(self.layers):
                layer.move(src, dst, lambda k, il=il: rotate_k(k, -n_discard, il))
        held = self._tokens[seq]
        del held[n_keep : n_keep + n_discard]
        self._drop_blocks(seq, len(held))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give sequence ``dst`` the first ``n`` positions of ``src`` (prefix reuse): ``dst`` references the
        blocks that hold them (no rows are copied; a shared block is copied when either writes into it)."""
        if n > len(self._tokens[src]):
            raise BadRequestError(f"sequence {src} holds {len(self._tokens[src])} positions, not {n}")
        if src == dst:
            self.truncate(dst, n)
            return
        self.truncate(dst, 0)
        for b, block in enumerate(self._blocks[src][: -(-n // KV_BLOCK)]):
            self._refs[block] += 1
            self._place(dst, b, block)
        self._tokens[dst] = self._tokens[src][:n]


def slots_kv_cache(
    hparams: HParams, n_ctx: int, n_slots: int, cache_type: str | None = None, scratch: bool = False,
    unified: bool = False,
) -> KVCache:
    """A cache for ``n_slots`` sequences, plus the scratch sequence of a padded engine (its padding tokens
    all sit at position 0: one block). Split: ``n_ctx // n_slots`` positions each; ``unified``: each up to
    ``n_ctx``, ``n_ctx`` positions in all. A padded (server) cache commits its memory at creation: resident
    memory does not grow as slots fill, and no pass waits on page faults (measured with 8 slots: copying a
    40-token prefix into fresh pages took 183-221 ms on this sandbox, into committed ones 0.2-0.3 ms)."""
    if n_slots < 1 or n_ctx < n_slots:
        raise BadRequestError(f"a context of {n_ctx} cannot hold {n_slots} sequences")
    if unified:
        return KVCache(hparams, n_ctx, cache_type, n_seq=n_slots + scratch, commit=scratch, unified=True,
                       spare_blocks=int(scratch))
    if not scratch:
        return KVCache(hparams, n_ctx, cache_type, n_seq=n_slots)
    capacity = n_ctx // n_slots
    return KVCache(hparams, capacity * (n_slots + 1), cache_type, n_seq=n_slots + 1, commit=True)
