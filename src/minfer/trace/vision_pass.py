"""The trace explorer's view of a vision tower's pass: the images' tiles through the vision model's graph (a plan
of its own), every node's statistics, and its outputs within a memory budget.

The tower's nodes (patch embedding, each SigLIP layer, the projector) are shown beside the text model's pass
whose image rows took the tower's output (:class:`~minfer.trace.explorer.ForwardTrace`). Outputs that do not
fit the budget are captured again when asked: the same plan runs the same pixels again (bit-identical run to
run), keeping that node.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minfer.errors import BadRequestError
from minfer.graph.ir import Graph, Node, Op
from minfer.graph.plan import Step
from minfer.trace.page_json import MAX_CELLS, node_json, tensor_window
from minfer.trace.tracer import array_stats

SKIPPED = (Op.INPUT, Op.WEIGHT, Op.KV_LOAD, Op.QUANTIZE)


class VisionCapture:
    """An observer of :meth:`Plan.run` keeping the statistics of every node (``stats``) and the outputs of the
    nodes ``keep`` chooses, in build order, until one does not fit ``budget`` bytes (``keep`` None: none)."""

    def __init__(self, budget: int, keep: set[int] | None = None, stats: bool = True) -> None:
        self.budget = budget
        self.keep = keep
        self.record_stats = stats
        self.used = 0
        self.stats: dict[int, dict[str, Any]] = {}
        self.tensors: dict[int, np.ndarray] = {}

    def step(self, s: Step, seconds: float) -> None:
        node = s.node
        if node.op in SKIPPED:
            return
        if self.record_stats:
            self.stats[node.id] = {"us": round(seconds * 1e6, 1), **array_stats(s.out)}
        wanted = self.keep is None or node.id in self.keep
        if wanted and self.used + s.out.nbytes <= self.budget:
            self.tensors[node.id] = np.array(s.out, dtype=np.float32, copy=True)
            self.used += s.out.nbytes


@dataclass
class VisionTrace:
    """One vision pass held for a page: ``n_tiles`` tiles (an image that the processor splits is several) of
    ``tokens_per_tile`` text tokens each, the rows of the tower's output."""

    graph: Graph
    execute: Callable[[VisionCapture], None]  # runs the same plan on the same pixels with a capture watching
    n_tiles: int
    tokens_per_tile: int
    budget: int
    seconds: float = 0.0
    by_id: dict[int, Node] = field(default_factory=dict)
    stats: dict[int, dict[str, Any]] = field(default_factory=dict)
    tensors: dict[int, np.ndarray] = field(default_factory=dict)  # what the first run kept
    again: dict[int, np.ndarray] = field(default_factory=dict)  # the last node captured again (at most one)
    recaptures: int = 0

    @classmethod
    def run(cls, graph: Graph, execute: Callable[[VisionCapture], None], n_tiles: int, tokens_per_tile: int,
            budget: int) -> VisionTrace:
        trace = cls(graph, execute, n_tiles, tokens_per_tile, budget)
        trace.by_id = {n.id: n for n in graph.nodes}
        capture = VisionCapture(budget)
        t0 = time.perf_counter()
        execute(capture)
        trace.seconds = time.perf_counter() - t0
        trace.stats, trace.tensors = capture.stats, capture.tensors
        return trace

    def held_bytes(self) -> int:
        return sum(a.nbytes for a in (*self.tensors.values(), *self.again.values()))

    def node(self, node_id: int) -> Node:
        node = self.by_id.get(node_id)
        if node is None or node.op in SKIPPED:
            raise BadRequestError(f"node {node_id} is not a computed node of this trace's vision pass")
        return node

    def tensor(self, node: Node) -> np.ndarray:
        """A node's output: held since the first run, or captured again (the previous recapture let go)."""
        held = self.tensors.get(node.id, self.again.get(node.id))
        if held is not None:
            return held
        capture = VisionCapture(max(self.budget, int(np.prod(node.shape)) * 4), keep={node.id}, stats=False)
        self.execute(capture)
        self.recaptures += 1
        self.again = {node.id: capture.tensors[node.id]}
        return self.again[node.id]

    def summary(self) -> dict[str, Any]:
        """The tower's computed nodes in build order with their statistics, and what the pass held."""
        nodes = [node_json(n) | {"stats": self.stats.get(n.id), "held": n.id in self.tensors}
                 for n in self.graph.nodes if n.op not in SKIPPED]
        return {"tiles": self.n_tiles, "tokens_per_tile": self.tokens_per_tile, "seconds": round(self.seconds, 4),
                "held_bytes": self.held_bytes(), "budget_bytes": self.budget, "recaptures": self.recaptures,
                "nodes": nodes}

    def tensor_view(self, node_id: int, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
                    max_rows: int = MAX_CELLS, max_cols: int = MAX_CELLS) -> dict[str, Any]:
        """A window of a node's output (rows: the tiles' patches, or their text tokens after the projector),
        strided to at most ``max_rows x max_cols`` cells, with the whole tensor's statistics and histogram."""
        node = self.node(node_id)
        data = self.tensor(node)
        window, shown = tensor_window(data, rows, cols, max_rows, max_cols)
        n_rows = data.shape[0] if data.ndim > 1 else 1
        per_tile = n_rows // self.n_tiles if n_rows % self.n_tiles == 0 else 0
        return {"node": node_json(node), "axes": {"rows": "patch or image token (tile by tile)", "cols": "feature"},
                **window, "labels": [f"tile {r // per_tile} · {r % per_tile}" for r in shown] if per_tile else None}
