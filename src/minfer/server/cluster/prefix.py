"""Prefix-affine routing: which replica a request goes to.

A request's key is a chain of block hashes over its rendered prompt's leading tokens (block ``i``'s hash
covers blocks 0..i), so two prompts that share their first ``k`` blocks share their first ``k`` hashes: the
names a replica's KV cache gives its blocks of ``KV_BLOCK`` tokens without adapters
(:func:`~minfer.runtime.prompt_cache.block_names`). The router remembers, for each hash, the replica that
most recently served a prompt with it, and sends a request to the replica holding its longest known prefix:
that replica's KV cache (the engine reuses the longest common prefix of any slot) most likely still holds
it. When that replica is saturated (more than ``queue_threshold`` requests waiting beyond its slots, or a
whole replica's slots busier than the least-loaded one) the request goes to the least-loaded replica
instead, and so does a request with no known prefix or one shorter than ``MIN_MATCH_BLOCKS`` (a chat
template's header and default system prompt are shared by every request: they must not pull every request to
one replica).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from minfer.runtime.kv_cache import KV_BLOCK
from minfer.runtime.prompt_cache import block_names

BLOCK_TOKENS = KV_BLOCK  # tokens per hashed block: the KV cache's
MAX_BLOCKS = 64  # blocks hashed per prompt: the first 2048 tokens decide the route
MIN_MATCH_BLOCKS = 4  # a shorter shared prefix (128 tokens) is cheaper to evaluate again than to queue for
MAX_ENTRIES = 200_000  # remembered hashes (least recently used ones are forgotten first)
POLICIES = ("prefix", "least-loaded", "random")


def block_hashes(tokens: Sequence[int], limit: int = MAX_BLOCKS) -> list[bytes]:
    """The chained hashes of ``tokens``' full blocks (at most ``limit``); a partial last block is not hashed."""
    return block_names(tokens, min(limit, len(tokens) // BLOCK_TOKENS), b"")


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica: requests sent to it and not yet answered, and its slots."""

    in_flight: int
    slots: int

    @property
    def queued(self) -> int:
        return max(0, self.in_flight - self.slots)

    @property
    def load(self) -> float:
        return self.in_flight / max(self.slots, 1)


@dataclass(frozen=True)
class Decision:
    replica: str
    kind: str  # "prefix": the holder of its prefix; "saturated": the holder was too busy; "least_loaded"; "random"
    matched_blocks: int  # blocks of its prefix known to be on ``replica``'s side before this request


class PrefixRouter:
    """Chooses replicas (not thread-safe: the front calls it from its event loop only)."""

    def __init__(self, policy: str = "prefix", queue_threshold: int = 2, seed: int | None = None,
                 max_entries: int = MAX_ENTRIES) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.queue_threshold = queue_threshold
        self.max_entries = max_entries
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # block hash -> the replica that last served it
        self._rng = random.Random(seed)
        self._turn = 0
        self._last_pick: dict[str, int] = {}  # replica -> the turn it was last picked at (ties go round)

    def choose(self, hashes: Sequence[bytes], loads: Mapping[str, ReplicaLoad]) -> Decision | None:
        """The replica for a request with prefix ``hashes`` among ``loads`` (the ready replicas); None if none."""
        if not loads:
            return None
        self._turn += 1
        if self.policy == "random":
            return self._pick(Decision(self._rng.choice(sorted(loads)), "random", 0), hashes)
        least = self._least_loaded(loads)
        if self.policy == "prefix":
            for depth in range(len(hashes), MIN_MATCH_BLOCKS - 1, -1):
                owner = self._owner.get(hashes[depth - 1])
                if owner is None or owner not in loads:
                    continue
                holder = loads[owner]
                if holder.queued <= self.queue_threshold and holder.load - loads[least].load < 1.0:
                    return self._pick(Decision(owner, "prefix", depth), hashes)
                return self._pick(Decision(least, "saturated", 0), hashes)
        return self._pick(Decision(least, "least_loaded", 0), hashes)

    def forget(self, replica: str) -> None:
        """``replica`` is gone: its prefixes are nobody's."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]

    def _least_loaded(self, loads: Mapping[str, ReplicaLoad]) -> str:
        # equal loads: the one picked longest ago, so idle replicas take turns
        return min(loads, key=lambda r: (loads[r].load, self._last_pick.get(r, 0), r))

    def _pick(self, decision: Decision, hashes: Sequence[bytes]) -> Decision:
        self._last_pick[decision.replica] = self._turn
        for h in hashes:
            self._owner[h] = decision.replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)
        return decision
