"""Build-order scheduler: a prepared plan of kernel calls over pre-bound buffers.

Preparing a plan resolves, once per graph shape, every node's output view and input operands (pool
slots, input arrays, weights as the backend wants them, the KV regions), so executing it is a plain loop
of kernel calls: no lookups, no allocations per node. Nodes run strictly in build order, which is what
keeps each layer's KV store before the attention that reads it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from minfer.graph.allocator import Allocation, allocate
from minfer.graph.ir import Graph, Node, Op


class Backend(Protocol):
    def prepare_weight(self, tensor: Any) -> Any: ...

    def kernel(self, node: Node) -> Callable[..., None]: ...

    def running(self) -> AbstractContextManager[Any]: ...

    def buffer(self, node: Node) -> Any: ...


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
    ) -> None:
        self.graph = graph
        self.allocation = allocation or allocate(graph)
        alloc = self.allocation
        self.pool = [np.empty(n, dtype=np.float32) for n in alloc.slot_sizes]
        self.inputs: dict[str, np.ndarray] = {}
        views: dict[int, Any] = {}
        for node in graph.nodes:
            if node.op is Op.INPUT:
                views[node.id] = self.inputs[node.source] = np.zeros(node.shape, dtype=np.int32)
            elif node.op is Op.WEIGHT:
                views[node.id] = backend.prepare_weight(node.source)
            elif node.op in (Op.KV_STORE, Op.KV_LOAD):
                views[node.id] = kv_layers[node.meta.layer]
            elif node.op is Op.QUANTIZE:
                views[node.id] = backend.buffer(node)  # a layout only the backend knows
            else:
                size = int(np.prod(node.shape))
                views[node.id] = self.pool[alloc.slot_of[node.id]][:size].reshape(node.shape)
        self.views = views
        self.steps = [
            Step(n, backend.kernel(n), views[n.id], tuple(views[i.id] for i in n.inputs))
            for n in graph.nodes
            if n.op not in (Op.INPUT, Op.WEIGHT)
        ]
        self.output = views[graph.output.id]

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
