"""What a traced forward pass keeps while it runs: :class:`TraceCapture`, an observer of :meth:`Plan.run`."""

from __future__ import annotations

from typing import Any

import numpy as np

from minfer.graph.ir import Op
from minfer.graph.plan import Step
from minfer.trace.tracer import array_stats


class TraceCapture:
    """An observer of :meth:`Plan.run`: statistics of every node, full copies of the nodes of ``layers``,
    the residual output of every layer, and the top tokens of the logits; with ``stats``, also full copies of
    the nodes outside the layers but the logits (the embedding rows, an image's rows merged in, the final norm:
    ``[tokens, n_embd]`` each)."""

    def __init__(self, layers: set[int], layer_outputs: dict[int, int], top: int = 5, stats: bool = True) -> None:
        self.layers = layers
        self.layer_outputs = {node_id: layer for layer, node_id in layer_outputs.items()}
        self.top = top
        self.record_stats = stats
        self.stats: dict[int, dict[str, Any]] = {}
        self.tensors: dict[int, np.ndarray] = {}
        self.outside: dict[int, np.ndarray] = {}  # node id -> output, for nodes outside the layers
        self.past_output = False
        self.kv_read: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> (K, V) as attention read them
        self.residuals: dict[int, np.ndarray] = {}
        self.top_tokens: np.ndarray | None = None  # [tokens, top] ids
        self.top_logits: np.ndarray | None = None
        self.logits_rows: np.ndarray | None = None  # the last position's full logits (small: one row)

    def step(self, s: Step, seconds: float) -> None:
        node = s.node
        if node.op in (Op.KV_LOAD, Op.QUANTIZE):
            return
        data = s.args[0] if node.op is Op.KV_STORE else s.out
        if self.record_stats:
            self.stats[node.id] = {"us": round(seconds * 1e6, 1), **array_stats(data)}
            if node.name == "output":
                self.past_output = True  # what follows works on the [tokens, vocab] logits: not kept
            elif node.layer is None and node.op is not Op.INPUT and not self.past_output:
                self.outside[node.id] = np.array(data, dtype=np.float32, copy=True)
        if node.layer in self.layers and node.name != "output":
            self.tensors[node.id] = np.array(data, dtype=np.float32, copy=True)
            if node.op is Op.ATTN:
                kv = s.args[1]  # the layer's cache regions: read back as the kernel read them
                n = int(np.asarray(s.args[-1 if len(s.args) > 4 else 2]).max()) + 1  # (to the key ends, if any)
                k, v = kv.window(0, n)
                self.kv_read[node.layer] = (np.array(k, dtype=np.float32), np.array(v, dtype=np.float32))
        layer = self.layer_outputs.get(node.id)
        if layer is not None:
            self.residuals[layer] = np.array(data, dtype=np.float32, copy=True)

    def logits(self, tokens: np.ndarray, positions: np.ndarray, logits: np.ndarray) -> None:
        k = min(self.top, logits.shape[1])
        best = np.argpartition(-logits, k - 1, axis=1)[:, :k]
        vals = np.take_along_axis(logits, best, axis=1)
        order = np.lexsort((best, -vals), axis=1)
        self.top_tokens = np.take_along_axis(best, order, axis=1)
        self.top_logits = np.take_along_axis(vals, order, axis=1)
        self.logits_rows = np.array(logits[-1], copy=True)
