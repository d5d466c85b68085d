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

Attention is the one op whose intermediates the fused kernel never materializes: :func:`attention_reference`
recomputes one head from the engine's Q (after QK-norm and RoPE) and the K/V the kernel read, in float64,
returning the scores, the causal window and the softmax weights; its output is compared with the fused
kernel's output for that head (``check``), so what the page shows is what the engine did.
"""

from __future__ import annotations

import base64
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import BadRequestError, FormatError
from minfer.graph.ir import Graph, Node, Op
from minfer.graph.plan import Step
from minfer.trace.tracer import array_stats

# bytes of held tensors (MINFER_TRACE_MEMORY overrides): a 512-token SmolLM2 pass, all 30 layers, takes 675 MiB
DEFAULT_BUDGET = 768 << 20
ATTENTION_CHECK_TOL = 1e-5  # reference vs fused kernel, relative to the largest |O| of the head (at least 1)
MAX_CELLS = 256  # a tensor view is at most this many rows and columns (strided beyond)
HISTOGRAM_BINS = 48


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


def b64(a: np.ndarray) -> dict[str, Any]:
    """A float32 array as ``{"shape", "b64"}``: little-endian bytes, exact and compact (the page decodes it
    into a Float32Array)."""
    a = np.ascontiguousarray(a, dtype="<f4")
    return {"shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


# ---------------------------------------------------------------------------------------------------------
# capture


class TraceCapture:
    """An observer of :meth:`Plan.run`: statistics of every node, full copies of the nodes of ``layers``,
    the residual output of every layer, and the top tokens of the logits."""

    def __init__(self, layers: set[int], layer_outputs: dict[int, int], top: int = 5, stats: bool = True) -> None:
        self.layers = layers
        self.layer_outputs = {node_id: layer for layer, node_id in layer_outputs.items()}
        self.top = top
        self.record_stats = stats
        self.stats: dict[int, dict[str, Any]] = {}
        self.tensors: dict[int, np.ndarray] = {}
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
        if node.layer in self.layers and node.name != "output":
            self.tensors[node.id] = np.array(data, dtype=np.float32, copy=True)
            if node.op is Op.ATTN:
                kv = s.args[1]  # the layer's cache regions: read back as the kernel read them
                n = int(np.asarray(s.args[2]).max()) + 1
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


# ---------------------------------------------------------------------------------------------------------
# attention, every intermediate


def attention_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, positions: np.ndarray, window: int = 0
) -> dict[str, np.ndarray]:
    """One head's attention in float64 from the engine's float32 inputs: q ``[t, d]`` at ``positions``,
    k ``[s, d]`` and v ``[s, dv]`` for key positions 0..s-1. Query t sees keys 0..positions[t] (in a
    sliding-window layer, ``window`` > 0, only the last ``window`` of them). Returns the scaled scores
    ``[t, s]``, the visibility mask, the softmax weights (masked cells exactly 0) and the output ``[t, dv]``."""
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = q64 @ k64.T * scale
    keys = np.arange(k64.shape[0])[None, :]
    pos = np.asarray(positions, np.int64)[:, None]
    visible = keys <= pos
    if window > 0:
        visible &= pos - keys < window
    masked = np.where(visible, scores, -np.inf)
    e = np.exp(masked - masked.max(axis=1, keepdims=True))
    weights = e / e.sum(axis=1, keepdims=True)
    return {"scores": scores, "visible": visible, "weights": weights, "output": weights @ v64}


def attention_check(reference: np.ndarray, engine: np.ndarray) -> dict[str, Any]:
    """How far the fused kernel's output is from the reference: max abs, and whether it is within
    :data:`ATTENTION_CHECK_TOL` of the head's largest value (at least 1)."""
    diff = float(np.abs(np.asarray(reference, np.float64) - engine).max()) if engine.size else 0.0
    scale = max(1.0, float(np.abs(reference).max()) if reference.size else 1.0)
    return {"max_abs": diff, "tol": ATTENTION_CHECK_TOL * scale, "equal": diff <= ATTENTION_CHECK_TOL * scale}


# ---------------------------------------------------------------------------------------------------------
# one forward pass


def _axes(node: Node, hp: Any) -> dict[str, Any]:
    """Names of a node's axes for people: rows are tokens; columns say what they hold."""
    name = node.name
    if node.op is Op.KV_STORE:
        return {"rows": "token", "cols": "kv head x dim", "heads": hp.n_head_kv, "head_dim": hp.head_dim_k}
    if node.op is Op.ATTN or any(name.endswith(s) for s in (".q", ".q_norm.gain", ".q_norm", ".q_rope", ".q.bias")):
        return {"rows": "token", "cols": "query head x dim", "heads": hp.n_head, "head_dim": hp.head_dim_k}
    if any(name.endswith(s) for s in (".k", ".k_norm.gain", ".k_norm", ".k_rope", ".k.bias")):
        return {"rows": "token", "cols": "kv head x dim", "heads": hp.n_head_kv, "head_dim": hp.head_dim_k}
    if name.endswith((".v", ".v.bias")):
        return {"rows": "token", "cols": "kv head x dim", "heads": hp.n_head_kv, "head_dim": hp.head_dim_v}
    if name == "output":
        return {"rows": "token", "cols": "vocabulary"}
    if ".ffn_" in name and not name.endswith(("ffn_norm", "ffn_norm.gain", "ffn_residual", "ffn_down")):
        return {"rows": "token", "cols": "ffn feature"}
    return {"rows": "token", "cols": "embedding feature"}


def node_json(node: Node) -> dict[str, Any]:
    out: dict[str, Any] = {"id": node.id, "op": str(node.op), "name": node.name, "layer": node.layer,
                           "shape": list(node.shape), "inputs": [i.id for i in node.inputs]}
    if node.op is Op.WEIGHT and hasattr(node.source, "ggml_type"):
        out["type"] = node.source.ggml_type.name
    if node.op is Op.INPUT:
        out["role"] = node.source
    return out


def weight_layer(node: Node) -> int | None:
    """The layer a weight belongs to (weights carry no layer; their names say it: ``blk.3.attn_q.weight``)."""
    if node.layer is not None:
        return node.layer
    parts = node.name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1])
    return None


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

    @classmethod
    def run(cls, graph: Graph, hparams: Any, tokens: Sequence[int], labels: list[str], cache_type: str,
            model_name: str, execute: Callable[[TraceCapture], None], decode: Callable[[int], str],
            budget: int | None = None, arena_bytes: int = 0) -> ForwardTrace:
        """Run the pass once (``execute(capture)`` runs the plan with the capture as its observer), keeping
        the first layers whose tensors fit in ``budget``."""
        budget = budget_from_env() if budget is None else budget

        def recapture(layers: set[int], stats: bool = False) -> TraceCapture:
            capture = TraceCapture(layers, trace.layer_outputs(), stats=stats)
            execute(capture)
            return capture

        trace = cls(graph, hparams, list(tokens), labels, cache_type, model_name, recapture, decode, budget,
                    arena_bytes)
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
        """Bytes held whatever the budget: the residuals and the top tokens."""
        n = len(self.tokens)
        return self.hparams.n_layer * n * self.hparams.n_embd * 4 + n * 5 * 12

    def held_bytes(self) -> int:
        held = sum(a.nbytes for tensors in self.layers.values() for a in tensors.values())
        held += sum(k.nbytes + v.nbytes for k, v in self.kv_read.values())
        held += sum(a.nbytes for a in self.residuals.values())
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
            if node.name == "output":
                return None  # [tokens, vocab]: only its top tokens are kept
            for layer, nid in self.layer_outputs().items():
                if nid == node.id:
                    return self.residuals[layer]
            capture = self.recapture(set())  # the final norm: small, recomputed when asked
            self.recaptures += 1
            return self._final_from(capture, node)
        return self.ensure_layer(node.layer)[node.id]

    def _final_from(self, capture: TraceCapture, node: Node) -> np.ndarray | None:
        # the nodes outside layers (embedding, final norm) are cheap: recompute from the residual they read
        src = node.inputs[0] if node.inputs else None
        if node.op is Op.GET_ROWS:
            table = node.inputs[0].source
            from minfer.backends.cpu.reference import get_rows

            out = np.empty(node.shape, np.float32)
            get_rows(table, np.asarray(self.tokens, np.int64), out)
            return out
        if node.op in (Op.RMS_NORM_MUL, Op.RMS_NORM) and src is not None:
            residual = self.tensor(src)
            if residual is None:
                return None
            return self.final_norm(residual, node)
        if node.op is Op.SCALE and src is not None:
            x = self.tensor(src)
            return None if x is None else (x * np.float32(node.meta.factor)).astype(np.float32)
        return None

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
                entry["axes"] = _axes(n, self.hparams)
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
        a = data.reshape(data.shape[0], -1) if data.ndim > 1 else data.reshape(1, -1)
        r0, r1 = _span(rows, a.shape[0], "rows")
        c0, c1 = _span(cols, a.shape[1], "cols")
        rs, cs = max(1, math.ceil((r1 - r0) / max(1, max_rows))), max(1, math.ceil((c1 - c0) / max(1, max_cols)))
        window = a[r0:r1:rs, c0:c1:cs]
        finite = a[np.isfinite(a)]
        counts, edges = np.histogram(finite, bins=HISTOGRAM_BINS) if finite.size else (np.zeros(0), np.zeros(0))
        return {"node": node_json(node), "shape": list(data.shape), "axes": _axes(node, self.hparams),
                "rows": [r0, r1, rs], "cols": [c0, c1, cs], "values": b64(window), "stats": array_stats(a),
                "histogram": {"counts": counts.astype(int).tolist(), "edges": edges.tolist()},
                "labels": self.labels[r0:r1:rs] if a.shape[0] == len(self.tokens) else None}

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
        r0, r1 = _span(rows, n, "rows")
        group = hp.n_head // hp.n_head_kv
        kvh = head // group
        dk, dv = hp.head_dim_k, hp.head_dim_v
        q = tensors[nodes["q_rope"].id].reshape(n, hp.n_head, dk)[r0:r1, head]
        k_all, v_all = self.kv_read[layer]
        k = k_all.reshape(-1, hp.n_head_kv, dk)[:r1, kvh]
        v = v_all.reshape(-1, hp.n_head_kv, dv)[:r1, kvh]
        o_engine = tensors[attn.id].reshape(n, hp.n_head, dv)[r0:r1, head]
        window = attn.meta.window
        ref = attention_reference(q, k, v, attn.meta.scale, np.arange(r0, r1), window)
        check = attention_check(ref["output"], o_engine)
        visible = ref["visible"]
        first = np.argmax(visible, axis=1)
        o_proj = nodes["o_proj"]
        return {
            "layer": layer, "head": head, "kv_head": kvh, "group": group, "rows": [r0, r1], "keys": r1,
            "scale": attn.meta.scale, "window": window, "cache_type": self.cache_type,
            "labels": self.labels[:r1],
            "nodes": {key: (None if nd is None else node_json(nd)) for key, nd in nodes.items()},
            "q": b64(q), "k": b64(k), "v": b64(v),
            "scores": b64(ref["scores"]), "weights": b64(ref["weights"]),
            "visible_from": first.tolist(), "visible_to": list(range(r0, r1)),
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
        x64 = np.asarray(x, np.float64)
        eps = node.meta.eps if node.meta is not None else self.hparams.rms_eps
        y = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)
        if node.op is Op.RMS_NORM_MUL:
            from minfer.backends.cpu.reference import dequantize_tensor

            gain = node.inputs[1].source
            y = y * (dequantize_tensor(gain) if hasattr(gain, "ggml_type") else np.asarray(gain))
        return y.astype(np.float32)

    def lens(self, positions: Sequence[int], top: int = 5) -> dict[str, Any]:
        """Logit lens: each layer's residual at ``positions`` through the final norm and the output matrix;
        the top tokens per layer and position. The last layer's row is the model's own prediction."""
        from minfer.backends.cpu.reference import matmul_chunk, matmul_row_chunks

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
        w = out_node.inputs[1].source
        x = np.concatenate([self.residuals[layer][pos] for layer in range(self.hparams.n_layer)])
        x = self.final_norm(x)
        logits = np.empty((x.shape[0], w.shape[0]), np.float32)
        for r0, r1 in matmul_row_chunks(tuple(w.shape)):
            matmul_chunk(x, w, logits, r0, r1)
        k = min(top, logits.shape[1])
        best = np.argpartition(-logits, k - 1, axis=1)[:, :k]
        vals = np.take_along_axis(logits, best, axis=1)
        order = np.argsort(-vals, axis=1, kind="stable")
        best, vals = np.take_along_axis(best, order, axis=1), np.take_along_axis(vals, order, axis=1)
        z = logits - logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1))
        probs = np.exp(vals - logits.max(axis=1, keepdims=True) - lse[:, None])
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


def _span(span: tuple[int, int] | None, n: int, what: str) -> tuple[int, int]:
    if span is None:
        return 0, n
    a, b = span
    if not (0 <= a < b <= n):
        raise BadRequestError(f"{what} {a}:{b} is outside 0:{n}")
    return a, b


# ---------------------------------------------------------------------------------------------------------
# compare


class DumpRun:
    """A dump folder (``minfer run --dump-dir``) as the other side of a comparison: its first call's nodes
    by name."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        from minfer.trace.dump import load_manifest

        self.dir = Path(directory)
        self.entries = {e["name"]: e for e in load_manifest(directory) if e["call"] == 0}
        self.description = f"dump {self.dir}"

    def tensor_by_name(self, name: str) -> np.ndarray | None:
        e = self.entries.get(name)
        if e is None:
            return None
        try:
            return np.load(self.dir / e["file"])
        except (OSError, ValueError) as err:
            raise FormatError(f"{self.dir / e['file']}: cannot read ({err})") from None


def _trace_tensor_by_name(trace: ForwardTrace, name: str) -> np.ndarray | None:
    node = trace.by_name.get(name)
    return None if node is None else trace.tensor(node)


def compare(a: ForwardTrace, b: ForwardTrace | DumpRun, tol: float = 1e-4, all_nodes: bool = False) -> dict[str, Any]:
    """Node by node in ``a``'s execution order (matched by name): max abs, max relative (to ``a``'s largest
    value) and cosine; the first node past ``tol`` is where the runs part. Stops there unless ``all_nodes``."""
    get_b = b.tensor_by_name if isinstance(b, DumpRun) else (lambda name: _trace_tensor_by_name(b, name))
    rows: list[dict[str, Any]] = []
    first: dict[str, Any] | None = None
    for node in a.graph.nodes:
        if node.op in (Op.INPUT, Op.WEIGHT, Op.KV_LOAD, Op.QUANTIZE) or not node.name or node.name == "output":
            continue
        x = a.tensor(node)
        y = get_b(node.name)
        if x is None or y is None:
            continue
        entry: dict[str, Any] = {"node": node.id, "name": node.name, "op": str(node.op), "layer": node.layer}
        if x.size != y.size:
            entry["shape_mismatch"] = [list(x.shape), list(y.shape)]
        else:
            x64, y64 = x.astype(np.float64).reshape(-1), y.astype(np.float64).reshape(-1)
            diff = np.abs(x64 - y64)
            scale = max(float(np.abs(x64).max()), 1e-30)
            norm = float(np.linalg.norm(x64) * np.linalg.norm(y64))
            entry.update(max_abs=float(diff.max()), max_rel=float(diff.max()) / scale,
                         cosine=float(x64 @ y64) / norm if norm else 1.0)
        entry["parts"] = "shape_mismatch" in entry or entry["max_rel"] > tol
        rows.append(entry)
        if entry["parts"] and first is None:
            first = entry
            if not all_nodes:
                break
    return {"rows": rows, "first": first, "tol": tol,
            "a": a.description or f"{a.model_name} ({a.cache_type} cache)",
            "b": b.description or (f"{b.model_name} ({b.cache_type} cache)" if isinstance(b, ForwardTrace) else "")}


# ---------------------------------------------------------------------------------------------------------
# a hand-made example through the same explorer


@dataclass(frozen=True)
class ExampleHParams:
    """The geometry of a one-layer, one-head example (what :class:`ForwardTrace` reads of a model's)."""

    n_embd: int
    head_dim_k: int
    head_dim_v: int
    n_layer: int = 1
    n_head: int = 1
    n_head_kv: int = 1
    rms_eps: float = 1e-6

    @property
    def k_width(self) -> int:
        return self.n_head_kv * self.head_dim_k

    @property
    def v_width(self) -> int:
        return self.n_head_kv * self.head_dim_v

    def layer_window(self, il: int) -> int:
        return 0


LEARNING_2X2 = {  # the learning page's worked example (one head, d = 2)
    "q": [[1.0, 0.0], [0.0, 1.0]], "k": [[1.0, 0.0], [0.0, 1.0]], "v": [[10.0, 0.0], [0.0, 20.0]],
    "labels": ["t0", "t1"],
}


def example_trace(q: np.ndarray, k: np.ndarray, v: np.ndarray, labels: list[str],
                  attend: Callable[..., None] | None = None) -> ForwardTrace:
    """One head given by hand (the learning page's 2x2 one, say) as a trace: Q, K, V are the inputs, O is
    what the engine's fused attention kernel computes from them (``attend``, the CPU backend's by default),
    and the explorer's attention panel shows the reference's scores and weights beside it."""
    from minfer.graph.ir import AttnMeta

    q, k, v = (np.ascontiguousarray(a, np.float32) for a in (q, k, v))
    t, d = q.shape
    if k.shape != (t, d) or v.shape[0] != t:
        raise BadRequestError(f"q {list(q.shape)}, k {list(k.shape)} and v {list(v.shape)} do not fit one head")
    dv = v.shape[1]
    scale = 1.0 / math.sqrt(d)
    meta = AttnMeta(layer=0, n_head=1, n_head_kv=1, head_dim_k=d, head_dim_v=dv, scale=scale)
    positions = Node(0, Op.INPUT, (), (t,), "i32", name="positions", source="positions")
    nq = Node(1, Op.INPUT, (), (t, d), name="blk.0.q_rope", layer=0, source="q")
    nk = Node(2, Op.INPUT, (), (t, d), name="blk.0.k_rope", layer=0, source="k")
    nv = Node(3, Op.INPUT, (), (t, dv), name="blk.0.v", layer=0, source="v")
    attn = Node(4, Op.ATTN, (nq, nk, nv, positions), (t, dv), meta=meta, name="blk.0.attn", layer=0)
    out = np.zeros((t, dv), np.float32)
    if attend is None:
        from minfer.backends.cpu.attention import attention

        def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, o: np.ndarray) -> None:
            attention(q, k, v, pos, 1, 1, d, dv, scale, o, 0)

    attend(q, k, v, np.arange(t, dtype=np.int32), out)
    graph = Graph([positions, nq, nk, nv, attn], {"positions": positions}, attn)

    def no_recapture(layers: set[int]) -> TraceCapture:
        raise BadRequestError("a hand-made example holds all its tensors")

    trace = ForwardTrace(graph, ExampleHParams(n_embd=dv, head_dim_k=d, head_dim_v=dv), list(range(t)), labels,
                         "f32", "example", no_recapture, lambda i: labels[i] if i < len(labels) else str(i))
    trace.description = "hand-made example: one head, Q K V given, O from the fused attention kernel"
    trace.by_id = {n.id: n for n in graph.nodes}
    trace.by_name = {n.name: n for n in graph.nodes}
    trace.layers[0] = {nq.id: q, nk.id: k, nv.id: v, attn.id: out}
    trace.kv_read[0] = (k, v)
    trace.residuals[0] = out
    trace.stats = {n.id: {"us": None, **array_stats(a)} for n, a in ((nq, q), (nk, k), (nv, v), (attn, out))}
    return trace
