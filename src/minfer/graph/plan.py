"""The plan executor: a prepared plan of kernel calls over pre-bound buffers, run in build order.

Preparing a plan resolves, once per graph shape, every node's output view and input operands (pool
slots, input arrays, weights as the backend wants them, the KV regions), so executing it is a plain loop
of kernel calls: no lookups, no allocations per node. Nodes run strictly in build order, which is what
keeps each layer's KV store before the attention that reads it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from minfer.graph.allocator import Allocation, allocate
from minfer.graph.ir import Backend, Graph, Node, Op


class BufferArena:
    """Storage shared by plans that never run at the same time (the plans of one runner).

    A plan's activation slots and backend buffers are prefixes of the arena's arrays (the k-th largest
    slot of every plan shares one array, and so does the k-th backend buffer), so all the plans together take
    the memory of the largest one instead of the sum: a server that has seen every batch shape keeps a
    few dozen plans. ``grown`` counts the arrays replaced by larger ones; plans built before a growth
    still hold the old arrays (correct, not shared) until they are dropped. ``retired_bytes``: the bytes
    of the arrays replaced so far (what such plans keep alive, at most).
    """

    def __init__(self) -> None:
        self._arrays: dict[tuple[Any, ...], np.ndarray] = {}
        self.grown = 0
        self.retired_bytes = 0

    def take(self, key: tuple[Any, ...], n: int, dtype: Any) -> np.ndarray:
        a = self._arrays.get(key)
        if a is None or a.size < n or a.dtype != dtype:
            if a is not None:
                self.grown += 1
                self.retired_bytes += a.nbytes
            keep = a.size if a is not None and a.dtype == dtype else 0
            a = self._arrays[key] = np.empty(max(n, keep), dtype)
        return a[:n]

    def commit(self) -> None:
        """Write every page of the arena now (so the memory is taken once, up front)."""
        for a in self._arrays.values():
            a.fill(0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays.values())


@dataclass
class Step:
    node: Node
    fn: Callable[..., None]
    out: Any
    args: tuple[Any, ...]


class Plan:
    """A graph bound to buffers, weights and the KV cache's layers, ready to run many times."""

    def __init__(
        self,
        graph: Graph,
        backend: Backend,
        kv_layers: Sequence[Any],
        allocation: Allocation | None = None,
        arena: BufferArena | None = None,
    ) -> None:
        self.graph = graph
        self.allocation = allocation or allocate(graph)
        alloc = self.allocation

        def take(key: tuple[Any, ...], n: int, dtype: Any) -> np.ndarray:
            return np.empty(n, dtype) if arena is None else arena.take(key, n, dtype)

        # the arena's k-th array serves every plan's k-th largest slot: a plan whose buffers are all no
        # larger than another's (fewer tokens, fewer outputs) then fits in what that one took
        by_size = sorted(range(len(alloc.slot_sizes)), key=lambda i: -alloc.slot_sizes[i])
        rank = {slot: k for k, slot in enumerate(by_size)}
        self.pool = [take(("slot", rank[i]), n, np.float32) for i, n in enumerate(alloc.slot_sizes)]
        # a backend that compiles its kernels ahead of their first call learns here which ones this plan runs
        backend.prepare_kernels(graph.nodes, kv_layers)
        n_buffers = 0
        self.inputs: dict[str, np.ndarray] = {}
        views: dict[int, Any] = {}
        for node in graph.nodes:
            if node.op is Op.INPUT:
                dtype = np.float32 if node.dtype == "f32" else np.int32
                views[node.id] = self.inputs[node.source] = np.zeros(node.shape, dtype=dtype)
            elif node.op is Op.WEIGHT:
                views[node.id] = backend.prepare_weight(node.source)
            elif node.op in (Op.KV_STORE, Op.KV_LOAD):
                views[node.id] = kv_layers[node.meta.layer]
            elif node.op is Op.QUANTIZE:  # a layout only the backend knows
                views[node.id] = backend.buffer(
                    node, lambda part, n, dtype, k=n_buffers: take(("buffer", k, part), n, dtype)
                )
                n_buffers += 1
            else:
                size = math.prod(node.shape)
                views[node.id] = self.pool[alloc.slot_of[node.id]][:size].reshape(node.shape)
        self.views = views
        self.steps = [
            Step(n, backend.kernel(n), views[n.id], tuple(views[i.id] for i in n.inputs))
            for n in graph.nodes
            if n.op not in (Op.INPUT, Op.WEIGHT)
        ]
        # a backend may run some consecutive steps as one (the matmuls of q/k/v, of gate/up)
        fns = backend.group_kernels([(s.node, s.fn, s.out, s.args) for s in self.steps])
        self.steps = [Step(s.node, fn, s.out, s.args) for s, fn in zip(self.steps, fns, strict=True)]
        self.output = views[graph.output.id]
        self.extras: dict[str, np.ndarray] = {k: views[v.id] for k, v in graph.extras.items()}

    def run_slices(self, on_step: Callable[[Step, float], None] | None = None) -> Generator[None, None, np.ndarray]:
        """:meth:`run` in slices: a generator that yields after each layer's last step (and returns the output),
        so a caller can do other work between two layers (the engine decodes while an image is encoded)."""
        steps = self.steps
        for i, s in enumerate(steps):
            t0 = time.perf_counter()
            s.fn(s.node, s.out, *s.args)
            if on_step is not None:
                on_step(s, time.perf_counter() - t0)
            if i + 1 < len(steps) and steps[i + 1].node.layer != s.node.layer:
                yield
        return self.output

    def run(self, on_step: Callable[[Step, float], None] | None = None) -> np.ndarray:
        """Execute every step in build order; ``on_step(step, seconds)`` (the trace) sees each step after
        it ran, with the time it took."""
        if on_step is None:
            for s in self.steps:
                s.fn(s.node, s.out, *s.args)
        else:
            clock = time.perf_counter
            for s in self.steps:
                t0 = clock()
                s.fn(s.node, s.out, *s.args)
                on_step(s, clock() - t0)
        return self.output
