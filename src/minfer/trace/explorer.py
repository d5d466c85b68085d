"""The trace explorer's model of one forward pass: what a page asks for, computed from the engine's own tensors.

A :class:`ForwardTrace` is one prompt run once through a plan with a :class:`TraceCapture` watching every
executed node. It keeps, within a memory budget (:data:`DEFAULT_BUDGET`, ``MINFER_TRACE_MEMORY`` bytes):

* the statistics and time of every node (small);
* every layer's residual output (the logit lens reads them: ``n_layer x tokens x n_embd`` floats);
* the top tokens of the logits at each position (never the ``[tokens, vocab]`` logits themselves);
* the full output of every node of as many layers as the budget holds, first layers first, together
  with the K/V rows the attention read from the cache (dequantized for f16 / q8_0 cells).

A layer that is not held is captured again when asked for: the same plan runs the same tokens again
(results are bit-identical run to run), keeping that layer and letting the least recently used one go.
So memory stays bounded whatever the prompt length, and every value shown is one the engine computed.

Attention is the one op whose intermediates the fused kernel never materializes: one head is recomputed
from the engine's Q and the K/V the kernel read (:mod:`minfer.trace.head_attention`), and its output is
compared with the fused kernel's (``check``), so what the page shows is what the engine did.

The nodes outside the layers (the embedding rows, an image's rows merged in, the final norm) are kept from
the first run, ``[tokens, n_embd]`` each. What the trace recomputes outside the plan (the final norm's gain
and the logit lens's matmul) runs on the backend object it is given: this layer imports no kernels. Beside this module:
:mod:`~minfer.trace.capture` (what a run keeps), :mod:`~minfer.trace.logit_lens`,
:mod:`~minfer.trace.page_json` (how answers are written), :mod:`~minfer.trace.compare` (two runs side
by side) and :mod:`~minfer.trace.example` (a hand-made head).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minfer.errors import BadRequestError
from minfer.graph.ir import Backend, Graph, Node, Op
from minfer.trace import logit_lens
from minfer.trace.capture import TraceCapture
from minfer.trace.head_attention import attention_check, attention_reference, image_key_ends
from minfer.trace.page_json import (
    MAX_CELLS,
    b64,
    node_axes,
    node_json,
    span_within,
    tensor_window,
    weight_layer,
)
from minfer.trace.vision_pass import VisionTrace

# bytes of held tensors (MINFER_TRACE_MEMORY overrides): a 512-token SmolLM2 pass, all 30 layers, takes 675 MiB
DEFAULT_BUDGET = 768 << 20


def budget_from_env() -> int:
    raw = os.environ.get("MINFER_TRACE_MEMORY")
    if not raw:
        return DEFAULT_BUDGET
    try:
        value = int(raw)
    except ValueError:
        raise BadRequestError(f"MINFER_TRACE_MEMORY must be a number of bytes, got {raw!r}") from None
    if value < 0:
        raise BadRequestError(f"MINFER_TRACE_MEMORY must be >= 0, got {value}")
    return value


@dataclass
class ForwardTrace:
    """One prompt's forward pass, held for a page (see the module docstring)."""

    graph: Graph
    hparams: Any
    tokens: list[int]
    labels: list[str]
    cache_type: str
    model_name: str
    recapture: Callable[[set[int]], TraceCapture]  # runs the same plan again keeping these layers
    decode: Callable[[int], str]
    backend: Backend  # what the trace recomputes outside the plan (embedding rows, the logit lens) runs on it
    budget: int = DEFAULT_BUDGET
    arena_bytes: int = 0
    seconds: float = 0.0
    description: str = ""
    by_id: dict[int, Node] = field(default_factory=dict)
    by_name: dict[str, Node] = field(default_factory=dict)
    stats: dict[int, dict[str, Any]] = field(default_factory=dict)
    layers: OrderedDict[int, dict[int, np.ndarray]] = field(default_factory=OrderedDict)  # LRU of held layers
    kv_read: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    residuals: dict[int, np.ndarray] = field(default_factory=dict)
    top_tokens: np.ndarray | None = None
    top_logits: np.ndarray | None = None
    recaptures: int = 0
    outside: dict[int, np.ndarray] = field(default_factory=dict)  # the nodes outside the layers (first run)
    # the prompt's images (PassImage: rows first..end - 1 took its tokens; a run traced again takes them), and
    # whether an image's rows see the whole image (Gemma 3) rather than the keys up to their own position (Idefics3)
    images: list[Any] = field(default_factory=list)
    images_bidirectional: bool = False
    vision: VisionTrace | None = None  # the vision tower's pass that made them, when the trace ran it
    image_inputs: list[Any] = field(default_factory=list)  # those images as sent (ImageInput), when given

    @classmethod
    def run(cls, graph: Graph, hparams: Any, tokens: Sequence[int], labels: list[str], cache_type: str,
            model_name: str, execute: Callable[[TraceCapture], None], decode: Callable[[int], str],
            backend: Backend, budget: int | None = None, arena_bytes: int = 0,
            images: Sequence[Any] = (), images_bidirectional: bool = False) -> ForwardTrace:
        """Run the pass once (``execute(capture)`` runs the plan with the capture as its observer), keeping
        the first layers whose tensors fit in ``budget``; ``images``: the prompt's images (``PassImage`` s), whose
        rows ``labels`` already name."""
        budget = budget_from_env() if budget is None else budget

        def recapture(layers: set[int], stats: bool = False) -> TraceCapture:
            capture = TraceCapture(layers, trace.layer_outputs(), stats=stats)
            execute(capture)
            return capture

        trace = cls(graph, hparams, list(tokens), labels, cache_type, model_name, recapture, decode, backend,
                    budget, arena_bytes, images=list(images), images_bidirectional=images_bidirectional)
        trace.by_id = {n.id: n for n in graph.nodes}
        trace.by_name = {n.name: n for n in graph.nodes if n.name}
        keep: set[int] = set()
        used = trace.fixed_bytes()
        for layer in range(hparams.n_layer):
            need = trace.layer_bytes(layer)
            if used + need > budget:
                break
            keep.add(layer)
            used += need
        t0 = time.perf_counter()
        capture = recapture(keep, stats=True)
        trace.seconds = time.perf_counter() - t0
        trace.stats = capture.stats
        trace.residuals = capture.residuals
        trace.top_tokens, trace.top_logits = capture.top_tokens, capture.top_logits
        trace.outside = capture.outside
        trace._take(capture, keep)
        return trace

    # -- memory ------------------------------------------------------------------------------------

    def layer_outputs(self) -> dict[int, int]:
        """Each layer's last compute node (its residual output)."""
        out: dict[int, int] = {}
        for n in self.graph.nodes:
            if n.layer is not None and n.op not in (Op.INPUT, Op.WEIGHT):
                out[n.layer] = n.id
        return out

    def layer_bytes(self, layer: int) -> int:
        """Bytes the full tensors of ``layer`` take (its nodes' outputs and the K/V read back)."""
        total = 0
        for n in self.graph.nodes:
            if n.layer == layer and n.op not in (Op.INPUT, Op.WEIGHT, Op.KV_LOAD, Op.QUANTIZE):
                if n.op is Op.KV_STORE:
                    total += len(self.tokens) * self.hparams.k_width * 4
                else:
                    total += int(np.prod(n.shape)) * 4
        return total + len(self.tokens) * (self.hparams.k_width + self.hparams.v_width) * 4

    def fixed_bytes(self) -> int:
        """Bytes held whatever the budget: the residuals, the nodes outside the layers and the top tokens."""
        n = len(self.tokens)
        outside = sum(int(np.prod(n.shape)) * 4 for n in self.graph.nodes
                      if n.layer is None and n.op not in (Op.INPUT, Op.WEIGHT, Op.KV_LOAD, Op.QUANTIZE)
                      and n.id < self._output_id())
        return self.hparams.n_layer * n * self.hparams.n_embd * 4 + outside + n * 5 * 12

    def _output_id(self) -> int:
        out = self.by_name.get("output")
        return out.id if out is not None else max(n.id for n in self.graph.nodes) + 1

    def held_bytes(self) -> int:
        held = sum(a.nbytes for tensors in self.layers.values() for a in tensors.values())
        held += sum(k.nbytes + v.nbytes for k, v in self.kv_read.values())
        held += sum(a.nbytes for a in self.residuals.values())
        held += sum(a.nbytes for a in self.outside.values())
        if self.vision is not None:
            held += self.vision.held_bytes()
        if self.top_tokens is not None and self.top_logits is not None:
            held += self.top_tokens.nbytes + self.top_logits.nbytes
        return held

    def memory(self) -> dict[str, Any]:
        return {"held_bytes": self.held_bytes(), "budget_bytes": self.budget, "arena_bytes": self.arena_bytes,
                "held_layers": sorted(self.layers),
                "all_layers_bytes": self.fixed_bytes() + sum(self.layer_bytes(i) for i in range(self.hparams.n_layer)),
                "recaptures": self.recaptures}

    def _take(self, capture: TraceCapture, layers: set[int]) -> None:
        for layer in sorted(layers):
            self.layers[layer] = {nid: a for nid, a in capture.tensors.items() if self.by_id[nid].layer == layer}
            if layer in capture.kv_read:
                self.kv_read[layer] = capture.kv_read[layer]

    def drop_oldest_layer(self) -> None:
        """Let the least recently used held layer go (it is captured again when asked for)."""
        old, _ = self.layers.popitem(last=False)
        self.kv_read.pop(old, None)

    def ensure_layer(self, layer: int) -> dict[int, np.ndarray]:
        """The full tensors of ``layer``, captured again (evicting the least recently used layers) if needed."""
        if not 0 <= layer < self.hparams.n_layer:
            raise BadRequestError(f"layer {layer} is outside 0..{self.hparams.n_layer - 1}")
        held = self.layers.get(layer)
        if held is not None:
            self.layers.move_to_end(layer)
            return held
        need = self.layer_bytes(layer)
        while self.layers and self.held_bytes() + need > max(self.budget, need + self.fixed_bytes()):
            self.drop_oldest_layer()
        capture = self.recapture({layer})
        self.recaptures += 1
        self._take(capture, {layer})
        return self.layers[layer]

    def tensor(self, node: Node) -> np.ndarray | None:
        """A node's full output (for the K/V store: the K rows it wrote); None for inputs and weights."""
        if node.op in (Op.WEIGHT, Op.KV_LOAD, Op.QUANTIZE) or (node.op is Op.INPUT and node.layer is None):
            return None
        if node.layer is None:
            # the nodes outside the layers (embedding, an image's rows merged in, the final norm) were kept by
            # the first run; the logits were not ([tokens, vocab]: only their top tokens)
            return self.outside.get(node.id)
        return self.ensure_layer(node.layer)[node.id]

    # -- views -------------------------------------------------------------------------------------

    def node(self, node_id: int) -> Node:
        node = self.by_id.get(node_id)
        if node is None:
            raise BadRequestError(f"node {node_id} is not in this trace's graph")
        return node

    def summary(self) -> dict[str, Any]:
        hp = self.hparams
        top = []
        if self.top_tokens is not None and self.top_logits is not None:
            top = [[[int(t), self.decode(int(t)), float(v)] for t, v in zip(row, vals, strict=True)]
                   for row, vals in zip(self.top_tokens, self.top_logits, strict=True)]
        return {"model": self.model_name, "description": self.description, "tokens": self.tokens,
                "labels": self.labels, "n_layer": hp.n_layer, "n_head": hp.n_head, "n_head_kv": hp.n_head_kv,
                "head_dim": hp.head_dim_k, "head_dim_v": hp.head_dim_v, "n_embd": hp.n_embd,
                "cache_type": self.cache_type, "seconds": round(self.seconds, 4), "memory": self.memory(),
                "images": [[img.first, img.end] for img in self.images], "vision": self.vision is not None,
                "top_tokens": top, "outside_layers": [node_json(n) | {"stats": self.stats.get(n.id)}
                                                      for n in self.graph.nodes
                                                      if n.layer is None and n.op not in (Op.WEIGHT,)
                                                      and weight_layer(n) is None]}

    def layer_graph(self, layer: int) -> dict[str, Any]:
        """The nodes of one layer (weights shown as inputs, nodes from outside the layer as sources), with
        each compute node's statistics."""
        if not 0 <= layer < self.hparams.n_layer:
            raise BadRequestError(f"layer {layer} is outside 0..{self.hparams.n_layer - 1}")
        inside = [n for n in self.graph.nodes if n.layer == layer or (n.op is Op.WEIGHT and weight_layer(n) == layer)]
        ids = {n.id for n in inside}
        outside = {i.id: i for n in inside for i in n.inputs if i.id not in ids}
        nodes = []
        for n in [*outside.values(), *inside]:
            entry = node_json(n)
            entry["outside"] = n.id in outside
            entry["stats"] = self.stats.get(n.id)
            if n.op not in (Op.INPUT, Op.WEIGHT):
                entry["axes"] = node_axes(n, self.hparams)
            nodes.append(entry)
        nodes.sort(key=lambda e: e["id"])
        return {"layer": layer, "nodes": nodes, "window": self.hparams.layer_window(layer)}

    def tensor_view(self, node_id: int, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
                    max_rows: int = MAX_CELLS, max_cols: int = MAX_CELLS) -> dict[str, Any]:
        """A window of a node's output, strided to at most ``max_rows x max_cols`` cells (the step says which
        rows and columns are shown), with the whole tensor's statistics and histogram."""
        node = self.node(node_id)
        data = self.tensor(node)
        if data is None:
            raise BadRequestError(f"node {node_id} ({node.name or node.op}) has no tensor to show"
                                  + (" (the logits: see the top tokens)" if node.name == "output" else ""))
        window, shown = tensor_window(data, rows, cols, max_rows, max_cols)
        return {"node": node_json(node), "axes": node_axes(node, self.hparams), **window,
                "labels": [self.labels[r] for r in shown] if data.ndim > 1 and data.shape[0] == len(self.tokens)
                else None}

    # -- attention -----------------------------------------------------------------------------------

    def attention_nodes(self, layer: int) -> dict[str, Node | None]:
        p = f"blk.{layer}."
        found: dict[str, Node | None] = {}
        for key, names in {"q": ["q.bias", "q"], "k": ["k.bias", "k"], "v": ["v.bias", "v"],
                           "q_norm": ["q_norm.gain", "q_norm"], "k_norm": ["k_norm.gain", "k_norm"],
                           "q_rope": ["q_rope"], "k_rope": ["k_rope"], "attn": ["attn"],
                           "o_proj": ["attn_out"]}.items():
            found[key] = next((self.by_name[p + n] for n in names if p + n in self.by_name), None)
        return found

    def attention(self, layer: int, head: int, rows: tuple[int, int] | None = None) -> dict[str, Any]:
        """Head ``head`` of layer ``layer``: the engine's Q (after QK-norm and RoPE), the K and V its kernel
        read from the cache, the reference's scores, causal window and softmax weights, and the output
        O = AV next to the fused kernel's, with how far apart they are."""
        hp = self.hparams
        if not 0 <= head < hp.n_head:
            raise BadRequestError(f"head {head} is outside 0..{hp.n_head - 1}")
        tensors = self.ensure_layer(layer)
        nodes = self.attention_nodes(layer)
        attn = nodes["attn"]
        if attn is None or nodes["q_rope"] is None:
            raise BadRequestError(f"layer {layer} has no attention node")
        n = len(self.tokens)
        r0, r1 = span_within(rows, n, "rows")
        group = hp.n_head // hp.n_head_kv
        kvh = head // group
        dk, dv = hp.head_dim_k, hp.head_dim_v
        ends = image_key_ends(n, self.images, self.images_bidirectional)[r0:r1]
        n_keys = max(r1, int(ends.max()) + 1)  # an image's rows see keys past the last row shown
        q = tensors[nodes["q_rope"].id].reshape(n, hp.n_head, dk)[r0:r1, head]
        k_all, v_all = self.kv_read[layer]
        k = k_all.reshape(-1, hp.n_head_kv, dk)[:n_keys, kvh]
        v = v_all.reshape(-1, hp.n_head_kv, dv)[:n_keys, kvh]
        o_engine = tensors[attn.id].reshape(n, hp.n_head, dv)[r0:r1, head]
        window = attn.meta.window
        ref = attention_reference(q, k, v, attn.meta.scale, np.arange(r0, r1), window, ends)
        check = attention_check(ref["output"], o_engine)
        visible = ref["visible"]
        first = np.argmax(visible, axis=1)
        o_proj = nodes["o_proj"]
        return {
            "layer": layer, "head": head, "kv_head": kvh, "group": group, "rows": [r0, r1], "keys": n_keys,
            "scale": attn.meta.scale, "window": window, "cache_type": self.cache_type,
            "labels": self.labels[:n_keys],
            "nodes": {key: (None if nd is None else node_json(nd)) for key, nd in nodes.items()},
            "q": b64(q), "k": b64(k), "v": b64(v),
            "scores": b64(ref["scores"]), "weights": b64(ref["weights"]),
            "visible_from": first.tolist(), "visible_to": ends.tolist(),
            "output_reference": b64(ref["output"]), "output": b64(o_engine),
            "o_proj": None if o_proj is None else b64(tensors[o_proj.id][r0:r1]),
            "check": check,
            "qk_norm": nodes["q_norm"] is not None,
        }

    # -- logit lens ----------------------------------------------------------------------------------

    def final_norm(self, x: np.ndarray, node: Node | None = None) -> np.ndarray:
        node = node or self.by_name.get("output_norm.gain") or self.by_name.get("output_norm")
        if node is None:
            raise BadRequestError("this graph has no final norm (output_norm)")
        return logit_lens.final_norm(x, node, self.hparams.rms_eps, self.backend)

    def lens(self, positions: Sequence[int], top: int = 5) -> dict[str, Any]:
        """Logit lens: each layer's residual at ``positions`` through the final norm and the output matrix;
        the top tokens per layer and position. The last layer's row is the model's own prediction."""
        n = len(self.tokens)
        pos = [int(p) for p in positions]
        bad = [p for p in pos if not 0 <= p < n]
        if bad:
            raise BadRequestError(f"position {bad[0]} is outside 0..{n - 1}")
        if not pos:
            raise BadRequestError("no positions for the logit lens")
        out_node = self.by_name.get("output")
        if out_node is None:
            raise BadRequestError("this graph has no output matmul")
        x = np.concatenate([self.residuals[layer][pos] for layer in range(self.hparams.n_layer)])
        best, vals, probs = logit_lens.top_tokens(self.final_norm(x), out_node.inputs[1].source, self.backend, top)
        cells = []
        for layer in range(self.hparams.n_layer):
            row = []
            for j in range(len(pos)):
                i = layer * len(pos) + j
                row.append([[int(t), self.decode(int(t)), float(v), float(p)]
                            for t, v, p in zip(best[i], vals[i], probs[i], strict=True)])
            cells.append(row)
        final = [int(self.top_tokens[p][0]) for p in pos] if self.top_tokens is not None else None
        return {"positions": pos, "labels": [self.labels[p] for p in pos], "layers": cells, "model_top": final}
