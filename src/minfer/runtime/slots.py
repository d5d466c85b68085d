"""Slots: the sequences of a KV cache that running requests hold, where a new one goes, and context shift.

Each running request holds a *slot*, one sequence of the cache (``capacity`` positions of its own). A
finished request leaves its tokens in its slot, so a new request takes the free slot whose cached tokens
share the longest prefix with its prompt, or copies the longest shared prefix from any slot, and
evaluates only the rest of its prompt (positions are data: the reused rows stay where they are). A slot's
tokens are reused only under the LoRA adapter scales they were computed with. With a
:class:`~minfer.runtime.prompt_cache.PromptCache` (``--cache-ram``), the full blocks a slot's new request
is about to overwrite, or that give way to running sequences, are copied there first, and a prompt that
starts with blocks held there gets their cells back instead of evaluating them. A free slot whose blocks give
way to running sequences (a unified cache that runs short) is kept there too, unless ``cache_idle_slots`` is
off (llama-server's ``--no-cache-idle-slots``): its tokens are then dropped.

A free slot's tokens and cells can be read out and put back whole (:meth:`Slots.state`,
:meth:`Slots.restore`: llama-server's slot save and restore) or forgotten (:meth:`Slots.erase`).

An engine that pads its batches to a few shapes keeps one more sequence than it has slots: the scratch
sequence its padding tokens write to, which nothing reads (see :func:`~minfer.runtime.kv_cache.slots_kv_cache`).
Only :mod:`minfer.runtime.scheduler` holds the slots (an import-linter contract).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minfer.errors import BadRequestError, ContextOverflowError
from minfer.runtime.forward import ForwardRunner
from minfer.runtime.kv_cache import KV_BLOCK, KVCache, common_prefix
from minfer.runtime.prompt_cache import PromptCache, block_names
from minfer.runtime.slot_file import SlotBusyError, SlotState


class Slots:
    """Which of the first ``n_slots`` sequences of ``runner.kv`` are taken, and by what they were left."""

    def __init__(self, runner: ForwardRunner, n_slots: int, prompt_cache: PromptCache | None = None,
                 cache_idle_slots: bool = True) -> None:
        if not 1 <= n_slots <= runner.kv.n_seq:
            raise BadRequestError(f"{n_slots} slots do not fit in a cache of {runner.kv.n_seq} sequences")
        self.runner = runner
        self.kv: KVCache = runner.kv
        self.n_slots = n_slots
        self._busy: set[int] = set()
        self._free_since = dict.fromkeys(range(n_slots), 0)  # slot -> engine step it was freed at
        # slot -> the adapter scales its cached K/V were computed with
        self._lora: dict[int, np.ndarray] = {s: runner.lora_scales for s in range(n_slots)}
        self.prompt_cache = prompt_cache
        self.cache_idle_slots = cache_idle_slots  # free slots' blocks that give way go to the prompt cache

    @property
    def capacity(self) -> int:
        """Positions each slot holds (prompt + generated)."""
        return self.kv.capacity

    @property
    def n_free(self) -> int:
        return self.n_slots - len(self._busy)

    def take(self, prompt: Sequence[int], reuse: bool = True,
             lora: Sequence[float] | None = None) -> tuple[int, int]:
        """A free slot for ``prompt`` and how many of its first tokens that slot now holds (reused from this
        slot or copied from another). The last prompt token is always left to evaluate: its logits are
        needed. The prompt fits in a slot (the engine checked it). ``reuse=False`` (an embedding, which
        needs every position evaluated): the free slot holding the fewest tokens, emptied. ``lora``: the
        sequence's adapter scales (None: the runner's defaults); only tokens computed under the same ones
        are reused."""
        free = [s for s in range(self.n_slots) if s not in self._busy]
        if not free:
            raise BadRequestError(f"all {self.n_slots} slots are taken")
        scales = self.runner.lora_scales if lora is None else np.asarray(lora, np.float32)
        best_src, best_n = self._best_prefix(prompt, scales, free) if reuse else (-1, 0)

        def lost(s: int) -> tuple[int, int, int]:
            """Cached tokens that taking slot ``s`` throws away (then: prefer no copy, the longest unused)."""
            held = len(self.kv.tokens(s))
            return (held - best_n if s == best_src else held, s != best_src, self._free_since[s])

        slot = min(free, key=lost)
        self._save(slot, best_n if slot == best_src else 0)
        if best_n and slot != best_src:
            self.kv.copy_prefix(best_src, slot, best_n)
        self.kv.truncate(slot, best_n)
        if reuse:
            best_n = self._restore(slot, prompt, best_n, scales)
        self._busy.add(slot)
        self._lora[slot] = scales
        if scales.size:  # the sequence keeps these scales while it runs, whatever the defaults become
            self.runner.set_lora(scales, seq=slot)
        return slot, best_n

    def _best_prefix(self, prompt: Sequence[int], scales: np.ndarray, free: Sequence[int]) -> tuple[int, int]:
        """(slot, n): the slot holding the longest prefix of ``prompt`` computed under ``scales`` (never the
        last prompt token; of equal ones a free slot), and its length ((-1, 0): none)."""
        limit = len(prompt) - 1
        best_src, best_n = -1, 0
        for s in range(self.n_slots):
            if not np.array_equal(self._lora[s], scales):
                continue
            n = common_prefix(self.kv.tokens(s), prompt, limit)
            if n > best_n or (n == best_n and n > 0 and s in free and best_src not in free):
                best_src, best_n = s, n
        return best_src, best_n

    def resume(self, slot: int, tokens: Sequence[int], max_blocks: int) -> int:
        """``slot``'s sequence was preempted (it holds nothing) and is about to evaluate ``tokens`` again: it
        references the longest prefix of them another slot holds, then gets the blocks after it that the
        prompt cache holds (taking at most ``max_blocks`` from the pool); how many it holds now (never the
        last one)."""
        scales = self._lora[slot]
        src, n = self._best_prefix(tokens, scales, ())
        if n:
            self.kv.copy_prefix(src, slot, n)
        return self._restore(slot, tokens, n, scales, max_blocks)

    def release(self, slot: int, step: int) -> None:
        """The slot is free again (since engine step ``step``); its tokens stay for a later prompt that
        shares them."""
        self._busy.discard(slot)
        self._free_since[slot] = step

    def reclaim(self, n_blocks: int) -> None:
        """Drop the cached tokens of free slots, least recently used first, until the cache has ``n_blocks``
        free blocks or no free slot holds any (a unified cache draws every sequence's blocks from one
        pool: a finished request's cached prefix gives way to running ones; with a prompt cache, its
        blocks are kept there)."""
        for slot in sorted((s for s in range(self.n_slots) if s not in self._busy), key=self._free_since.__getitem__):
            if self.kv.blocks_free >= n_blocks:
                return
            if self.cache_idle_slots:
                self._save(slot, 0)
            self.kv.truncate(slot, 0)

    def save(self, slot: int) -> None:
        """Copy ``slot``'s full blocks into the prompt cache (if there is one): it is about to lose them."""
        self._save(slot, 0)

    # -- a free slot's contents, whole (llama-server's /slots actions) ---------------------------------

    def _free_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise BadRequestError(f"slot {slot} does not exist (this server has slots 0..{self.n_slots - 1})")
        if slot in self._busy:
            raise SlotBusyError(f"slot {slot} is processing a request")

    def state(self, slot: int) -> SlotState:
        """What free slot ``slot`` holds: its tokens, their cells (copies) and the adapter scales of both."""
        self._free_slot(slot)
        tokens = self.kv.tokens(slot)
        return SlotState(tokens, self.kv.read(slot, len(tokens)), self._lora[slot].copy())

    def erase(self, slot: int) -> int:
        """Free slot ``slot`` forgets its tokens (its blocks go back to the pool); how many it held."""
        self._free_slot(slot)
        n = len(self.kv.tokens(slot))
        self.kv.truncate(slot, 0)
        return n

    def restore(self, slot: int, state: SlotState) -> None:
        """Free slot ``slot`` holds ``state`` (checked to fit a slot) in place of what it held, which goes to the
        prompt cache as when a new prompt takes the slot. On a unified cache, free slots' blocks give way
        when the pool is short; a refusal when that is not enough leaves the slot empty."""
        self._free_slot(slot)
        n = len(state.tokens)
        self._save(slot, 0)
        self.kv.truncate(slot, 0)
        need = -(-n // KV_BLOCK)
        if self.kv.blocks_free < need:
            self.reclaim(need)
        if self.kv.blocks_free < need:
            raise ContextOverflowError(f"no room in the KV cache for {n} tokens: running requests hold "
                                       f"{self.kv.blocks_in_use} of its {self.kv.n_blocks - 1} blocks")
        self.kv.write(slot, state.cells)
        if n:
            self.kv.record(slot, np.arange(n), np.asarray(state.tokens))
        self._lora[slot] = np.asarray(state.lora, np.float32)

    # -- the prompt cache ----------------------------------------------------------------------------

    def _root(self, scales: np.ndarray) -> bytes:
        return np.asarray(scales, np.float32).tobytes()

    def _save(self, slot: int, keep: int) -> None:
        """Copy the full blocks of ``slot`` from the one holding position ``keep`` on (what it is about to
        lose) into the prompt cache."""
        cache = self.prompt_cache
        tokens = self.kv.tokens(slot)
        n_full = len(tokens) // KV_BLOCK
        first = keep // KV_BLOCK
        if cache is None or first >= n_full or -1 in tokens:  # (-1: positions never written)
            return
        names = block_names(tokens, n_full, self._root(self._lora[slot]))
        for b in range(first, n_full):
            if names[b] not in cache:
                cache.put(names[b], self.kv.read(slot, (b + 1) * KV_BLOCK, b * KV_BLOCK))

    def _restore(self, slot: int, prompt: Sequence[int], held: int, scales: np.ndarray,
                 max_blocks: int | None = None) -> int:
        """Give ``slot`` (holding the first ``held`` tokens of ``prompt``) the cells of the blocks that follow
        from the prompt cache, as far as they go (never the prompt's last token: its logits are needed,
        and never more blocks than the pool has free, nor than ``max_blocks``); how many tokens it holds
        then."""
        cache = self.prompt_cache
        n_full = (len(prompt) - 1) // KV_BLOCK
        first = held // KV_BLOCK
        if cache is None or first >= n_full:
            return held
        names = block_names(prompt, n_full, self._root(scales))
        found = []
        room = self.kv.blocks_free if max_blocks is None else min(max_blocks, self.kv.blocks_free)
        for b in range(first, n_full):
            cells = cache.get(names[b])
            if cells is None or len(found) + 1 > room:
                break
            found.append(cells)
        if not found or (first + len(found)) * KV_BLOCK <= held:
            return held
        start, stop = first * KV_BLOCK, (first + len(found)) * KV_BLOCK
        self.kv.write(slot, [(np.concatenate([c[il][0] for c in found]), np.concatenate([c[il][1] for c in found]))
                             for il in range(len(found[0]))], start)
        self.kv.record(slot, np.arange(start, stop), np.asarray(prompt[start:stop]))
        cache.restored += len(found)
        return stop

    def shift(self, slot: int, n_keep: int, pos: int) -> int:
        """Context shift of a full slot: drop the oldest half after the first ``n_keep`` positions (a system
        prompt); the position the next token goes to."""
        n_discard = (pos - n_keep) // 2
        if n_discard < 1:
            raise ContextOverflowError(f"context shift: n_keep {n_keep} leaves nothing to drop in {self.capacity}")
        self.runner.shift_context(slot, n_keep, n_discard)
        return pos - n_discard
