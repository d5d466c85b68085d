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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import BadRequestError
from minfer.graph.ir import Op
from minfer.graph.plan import Step
from minfer.trace.head_attention import attention_reference, image_key_ends, label_image_rows
from minfer.trace.tracer import array_stats
from minfer.trace.vision_pass import VisionCapture


def attention_intermediates(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, window: int = 0, key_ends: np.ndarray | None = None,
) -> dict[str, Any]:
    """One head's attention, every intermediate kept: q ``[t, d]``, k ``[s, d]``, v ``[s, dv]`` (rows at
    positions 0..), token t sees keys 0..t, or 0..key_ends[t] where given (Gemma 3's image rows see their
    whole image); in a sliding-window layer, ``window`` > 0, only keys t - window + 1... Float64, from the
    float32 inputs the engine used (:func:`~minfer.trace.head_attention.attention_reference`)."""
    ref = attention_reference(q, k, v, scale, np.arange(q.shape[0]), window, key_ends)
    masked = np.where(ref["visible"], ref["scores"], -np.inf)
    return {"scores": ref["scores"].tolist(), "masked": [[None if math.isinf(x) else x for x in row] for row in masked],
            "weights": ref["weights"].tolist(), "output": ref["output"].tolist(),
            "v": np.asarray(v, np.float64).tolist()}


def inlined(n_layer: int, n_head: int, n_tokens: int, layers: list[int] | None, heads: list[int] | None,
            max_positions: int | None, max_cells: int) -> tuple[list[int], list[int], int]:
    """The layers, heads and positions whose attention matrices a page inlines (checked: a layer or head out of
    range is a :class:`BadRequestError`); by default every head of the first layers that fit in ``max_cells``."""
    for what, chosen, n in (("layer", layers, n_layer), ("head", heads, n_head)):
        bad = [i for i in chosen or [] if not 0 <= i < n]
        if bad:
            raise BadRequestError(f"{what} {bad[0]} is outside 0..{n - 1}")
    if max_positions is not None and max_positions < 1:
        raise BadRequestError(f"max_positions must be >= 1, got {max_positions}")
    n_pos = n_tokens if max_positions is None else min(n_tokens, max_positions)
    heads = list(range(n_head)) if heads is None else sorted(set(heads))
    if layers is None:
        per_layer = len(heads) * n_pos * n_pos * 4
        layers = list(range(max(1, min(n_layer, max_cells // max(per_layer, 1)))))
    return sorted(set(layers)), heads, n_pos


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


DEFAULT_MAX_CELLS = 500_000  # attention cells inlined by default (4 matrices per head): about 10 MB of page
DEFAULT_MAX_POSITIONS = 64


def trace_page_data(
    model: Any, prompt: str | Sequence[int], top: int = 5, layers: list[int] | None = None,
    heads: list[int] | None = None, max_positions: int | None = DEFAULT_MAX_POSITIONS,
    max_cells: int = DEFAULT_MAX_CELLS, images: Sequence[Any] = (), image_inputs: Sequence[Any] = (),
) -> dict[str, Any]:
    """Run ``prompt`` (a string, or its token ids) through ``model`` once (a fresh sequence) and collect what the
    page shows; ``images``: where images' tokens go in the ids (``Model.image_prompt`` makes both), their rows
    labelled ``<image k>`` and listed in ``images``; ``image_inputs``: those images as sent, whose pass through the
    vision tower the page shows too (``vision_stats``: every node's statistics).

    The attention matrices grow with the square of the prompt, so the page inlines only some of them:
    ``layers`` and ``heads`` (default: every head of the first layers that fit in ``max_cells`` cells) and
    the first ``max_positions`` query and key positions (None: all). ``omitted`` says what was left out."""
    from minfer.graph import printing
    from minfer.graph.fusion import fuse

    ids = model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    hp = model.hparams
    layers, heads, n_pos = inlined(hp.n_layer, hp.n_head, len(ids), layers, heads, max_positions, max_cells)
    capture = Capture()
    model.runner.observers.append(capture)
    try:
        logits = model.runner.forward(ids, range(len(ids)), images=images) if images else model.logits(ids)
    finally:
        model.runner.observers.remove(capture)
    labels = label_image_rows([model.tokenizer.decode([t]) if t >= 0 else "" for t in ids], images)
    key_ends = image_key_ends(len(ids), images, bool(getattr(model.transformer.vision, "bidirectional", False)))
    group = hp.n_head // hp.n_head_kv
    shown = []
    for il in layers:
        p = f"blk.{il}."
        q = capture.outputs[p + "q_rope"].reshape(len(ids), hp.n_head, hp.head_dim_k)[:n_pos]
        # an image's rows inside the first n_pos may see keys past them (Gemma 3): the window is widened to those
        n_keys = max(n_pos, int(key_ends[:n_pos].max()) + 1)
        k = capture.outputs[p + "k_rope"].reshape(len(ids), hp.n_head_kv, hp.head_dim_k)[:n_keys]
        v_name = p + "v.bias" if p + "v.bias" in capture.outputs else p + "v"
        v = capture.outputs[v_name].reshape(len(ids), hp.n_head_kv, hp.head_dim_v)[:n_keys]
        window = hp.layer_window(il)
        per_head = [attention_intermediates(q[:, h], k[:, h // group], v[:, h // group], hp.attn_scale, window,
                                            key_ends[:n_pos]) | {"head": h} for h in heads]
        shown.append({"layer": il, "heads": per_head, "window": window})
    omitted = []
    if len(layers) < hp.n_layer:
        omitted.append(f"the attention of {hp.n_layer - len(layers)} of {hp.n_layer} layers (shown: "
                       f"{', '.join(map(str, layers))}; pick others with --layers)")
    if len(heads) < hp.n_head:
        omitted.append(f"{hp.n_head - len(heads)} of {hp.n_head} heads (--heads)")
    if n_pos < len(ids):
        omitted.append(f"positions {n_pos}..{len(ids) - 1} of the attention matrices (--positions)")
    top_tokens = []
    for row in logits:
        best = np.argsort(-row, kind="stable")[:top]
        top_tokens.append([[int(t), model.tokenizer.decode([int(t)]), float(row[t])] for t in best])
    graph = json.loads(printing.to_json(fuse(model.transformer.build_graph(len(ids), len(ids), model.n_ctx))))
    graph["nodes"] = [n for n in graph["nodes"] if n["layer"] in (0, None) and n["op"] not in ("weight",)]
    text = prompt if isinstance(prompt, str) else model.tokenizer.decode([t for t in ids if t >= 0])
    vision_stats: list[dict[str, Any]] = []
    if image_inputs:  # the tower's statistics only (its outputs at real sizes are gigabytes)
        runner, pixels = model.images.runner, model.images.pixels(image_inputs)
        tower = VisionCapture(budget=0)
        runner.encode(pixels, tower.step)
        vision_stats = [{"node": n.id, "name": n.name, "op": str(n.op), "layer": n.layer, "shape": list(n.shape),
                         **tower.stats[n.id]} for n in runner.plan(len(pixels)).graph.nodes if n.id in tower.stats]
    return {
        "model": model.path.name, "prompt": text, "tokens": labels, "images": [[img.first, img.end] for img in images],
        "n_head": hp.n_head, "n_head_kv": hp.n_head_kv,
        "head_dim": hp.head_dim_k, "scale": hp.attn_scale, "layers": shown, "stats": capture.stats,
        "top_tokens": top_tokens, "graph": graph, "omitted": omitted, "vision_stats": vision_stats,
    }


def example_page_data(q: np.ndarray, k: np.ndarray, v: np.ndarray, labels: list[str]) -> dict[str, Any]:
    """Page data for a hand-made single-head example (the learning page's 2x2 one, say)."""
    scale = 1.0 / math.sqrt(q.shape[1])
    head = attention_intermediates(q, k, v, scale) | {"head": 0}
    return {"model": "example", "prompt": " ".join(labels), "tokens": labels, "n_head": 1, "n_head_kv": 1,
            "head_dim": q.shape[1], "scale": scale, "layers": [{"layer": 0, "heads": [head]}],
            "stats": [], "top_tokens": [], "graph": {"nodes": []}, "omitted": []}


def render(data: dict[str, Any]) -> str:
    """The page with ``data`` inlined (``</`` escaped so no string can close the script element)."""
    page = (Path(__file__).parent / "page.html").read_text(encoding="utf-8")
    payload = json.dumps(data, allow_nan=False).replace("</", "<\\/")
    return page.replace("__TITLE__", html.escape(f"minfer trace: {data['model']}")).replace("__DATA__", payload)
