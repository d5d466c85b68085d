"""``minfer trace MODEL PROMPT --html out.html``: one self-contained page showing the forward pass.

The page (no network at view time: data and script are inline) shows the compute graph of one layer,
per-node output statistics for every layer, the top tokens the logits give at each position, and for a
chosen layer and head the attention intermediates the learning page works through: the scaled scores
Q·Kᵀ/√d, the causal window (masked cells are -inf; a sliding-window layer also masks keys older than its
window), the softmax weights (each row sums to 1) and the
weighted-V output, as heatmaps with exact values on hover and token labels on the axes. Query heads that
share a KV head (GQA) are grouped in the head picker.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from minfer.graph.ir import Op
from minfer.graph.plan import Step
from minfer.trace.tracer import array_stats


def attention_intermediates(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, window: int = 0
) -> dict[str, Any]:
    """One head's attention, every intermediate kept: q ``[t, d]``, k ``[s, d]``, v ``[s, dv]`` (rows at
    positions 0..), token t sees keys 0..t (in a sliding-window layer, ``window`` > 0, only keys
    t - window + 1..t). Float64, from the float32 inputs the engine used."""
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = q64 @ k64.T * scale
    t, s = scores.shape
    hidden = np.arange(s)[None, :] > np.arange(t)[:, None]
    if window > 0:
        hidden |= np.arange(t)[:, None] - np.arange(s)[None, :] >= window
    masked = np.where(hidden, -np.inf, scores)
    e = np.exp(masked - masked.max(axis=1, keepdims=True))
    weights = e / e.sum(axis=1, keepdims=True)
    return {"scores": scores.tolist(), "masked": [[None if math.isinf(x) else x for x in row] for row in masked],
            "weights": weights.tolist(), "output": (weights @ v64).tolist(), "v": v64.tolist()}


class Capture:
    """Keeps a copy of every node's output of one forward call (an observer of :meth:`Plan.run`)."""

    def __init__(self) -> None:
        self.outputs: dict[str, np.ndarray] = {}
        self.stats: list[dict[str, Any]] = []

    def step(self, s: Step, seconds: float) -> None:
        node = s.node
        if node.op in (Op.KV_LOAD, Op.QUANTIZE):
            return
        data = s.args[0] if node.op is Op.KV_STORE else s.out
        self.outputs[node.name] = np.array(data, copy=True)
        self.stats.append({"node": node.id, "name": node.name, "op": str(node.op), "layer": node.layer,
                           "shape": list(node.shape), "us": round(seconds * 1e6, 1), **array_stats(data)})

    def logits(self, tokens: np.ndarray, positions: np.ndarray, logits: np.ndarray) -> None:
        pass


def trace_page_data(model: Any, prompt: str, top: int = 5) -> dict[str, Any]:
    """Run ``prompt`` through ``model`` once (a fresh sequence) and collect what the page shows."""
    from minfer.graph import printing
    from minfer.graph.fusion import fuse

    ids = model.tokenize(prompt)
    capture = Capture()
    model.runner.observers.append(capture)
    try:
        logits = model.logits(ids)
    finally:
        model.runner.observers.remove(capture)
    hp = model.hparams
    labels = [model.tokenizer.decode([t]) for t in ids]
    group = hp.n_head // hp.n_head_kv
    layers = []
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        q = capture.outputs[p + "q_rope"].reshape(len(ids), hp.n_head, hp.head_dim_k)
        k = capture.outputs[p + "k_rope"].reshape(len(ids), hp.n_head_kv, hp.head_dim_k)
        v_name = p + "v.bias" if p + "v.bias" in capture.outputs else p + "v"
        v = capture.outputs[v_name].reshape(len(ids), hp.n_head_kv, hp.head_dim_v)
        window = hp.layer_window(il)
        heads = [attention_intermediates(q[:, h], k[:, h // group], v[:, h // group], hp.attn_scale, window)
                 for h in range(hp.n_head)]
        layers.append({"heads": heads, "window": window})
    top_tokens = []
    for row in logits:
        best = np.argsort(-row, kind="stable")[:top]
        top_tokens.append([[int(t), model.tokenizer.decode([int(t)]), float(row[t])] for t in best])
    graph = json.loads(printing.to_json(fuse(model.transformer.build_graph(len(ids), len(ids), model.n_ctx))))
    graph["nodes"] = [n for n in graph["nodes"] if n["layer"] in (0, None) and n["op"] not in ("weight",)]
    return {
        "model": model.path.name, "prompt": prompt, "tokens": labels, "n_head": hp.n_head, "n_head_kv": hp.n_head_kv,
        "head_dim": hp.head_dim_k, "scale": hp.attn_scale, "layers": layers, "stats": capture.stats,
        "top_tokens": top_tokens, "graph": graph,
    }


def example_page_data(q: np.ndarray, k: np.ndarray, v: np.ndarray, labels: list[str]) -> dict[str, Any]:
    """Page data for a hand-made single-head example (the learning page's 2x2 one, say)."""
    scale = 1.0 / math.sqrt(q.shape[1])
    return {"model": "example", "prompt": " ".join(labels), "tokens": labels, "n_head": 1, "n_head_kv": 1,
            "head_dim": q.shape[1], "scale": scale, "layers": [{"heads": [attention_intermediates(q, k, v, scale)]}],
            "stats": [], "top_tokens": [], "graph": {"nodes": []}}


def render(data: dict[str, Any]) -> str:
    """The page with ``data`` inlined (``</`` escaped so no string can close the script element)."""
    page = (Path(__file__).parent / "page.html").read_text(encoding="utf-8")
    payload = json.dumps(data, allow_nan=False).replace("</", "<\\/")
    return page.replace("__TITLE__", html.escape(f"minfer trace: {data['model']}")).replace("__DATA__", payload)
