"""``minfer trace ENCODER TEXT --html out.html``: the trace page (:mod:`minfer.trace.html`) of one encoder pass.

An encoder (BERT, :mod:`minfer.models.bert`) has no KV cache, no causal mask and no logits: the page shows the
compute graph of one layer, per-node output statistics of every layer, and for the chosen layers and heads the
attention intermediates recomputed in float64 from the engine's own q/k/v (the ``blk.{i}.q.bias``,
``.k.bias``, ``.v.bias`` nodes' outputs, split by head), every token seeing every token of the text (one
sequence). Each head's recomputed output is checked against the engine's ``enc_attn`` node output
(:func:`~minfer.trace.head_attention.attention_check`). Where a decoder's page shows top tokens, this one says
that an encoder has no vocabulary projection.

The pass runs alone, padded to its bucketed size (:func:`~minfer.runtime.encoder.bucket`); every node's
output is cropped to the text's rows before anything is kept.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from minfer.graph.ir import Op
from minfer.graph.plan import Step
from minfer.models.bert import attention_inputs
from minfer.trace.head_attention import attention_check
from minfer.trace.html import DEFAULT_MAX_CELLS, DEFAULT_MAX_POSITIONS, inlined
from minfer.trace.tracer import array_stats

NO_LOGITS = "an encoder: no vocabulary projection, so no logits and no top tokens (its output is the hidden states)"


class EncoderCapture:
    """Keeps every node's output of one encoder pass, cropped to the first ``n`` rows (the rest of the pass
    is padding): an observer for :meth:`Plan.run`."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.outputs: dict[str, np.ndarray] = {}
        self.stats: list[dict[str, Any]] = []

    def step(self, s: Step, seconds: float) -> None:
        node = s.node
        if node.op is Op.QUANTIZE:
            return
        data = s.out[:self.n] if s.out.ndim and s.out.shape[0] >= self.n else s.out
        self.outputs[node.name] = np.array(data, copy=True)
        self.stats.append({"node": node.id, "name": node.name, "op": str(node.op), "layer": node.layer,
                           "shape": list(data.shape), "us": round(seconds * 1e6, 1), **array_stats(data)})

    __call__ = step


def token_label(tokenizer: Any, token: int) -> str:
    """A token's text for the page's axes: its decoded text, or for a special token (which decodes to nothing:
    ``[CLS]``, ``[SEP]``, ``<s>``) its vocabulary entry."""
    text = tokenizer.decode([token])
    if text:
        return text
    whole = getattr(tokenizer, "_whole", None)  # the tokenizers library's Tokenizer of an EncoderTokenizer
    piece = whole.id_to_token(token) if whole is not None else None
    return piece if piece else f"<{token}>"


def bidirectional_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> dict[str, np.ndarray]:
    """One head's attention in float64 from the engine's float32 inputs, no mask (every query sees every key):
    q ``[t, d]``, k ``[s, d]``, v ``[s, dv]``. The scaled scores, softmax weights and output ``weights · V``."""
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = q64 @ k64.T * scale
    e = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights = e / e.sum(axis=1, keepdims=True)
    return {"scores": scores, "weights": weights, "output": weights @ v64, "v": v64}


def encoder_trace_page_data(
    encoder: Any, text: str, layers: list[int] | None = None, heads: list[int] | None = None,
    max_positions: int | None = DEFAULT_MAX_POSITIONS, max_cells: int = DEFAULT_MAX_CELLS,
) -> dict[str, Any]:
    """Run ``text`` through ``encoder`` (a :class:`~minfer.api_encoder.Encoder`) once and collect what the page
    shows, in the shape :func:`minfer.trace.html.render` takes (``encoder`` true, ``top_tokens`` empty).

    As for a decoder, only some attention matrices are inlined: ``layers``, ``heads`` (default: every head of
    the first layers that fit in ``max_cells`` cells) and the first ``max_positions`` query and key positions
    (None: all). The softmax runs over every key whatever is inlined, so a cropped weights row sums to less
    than 1; ``omitted`` says what was left out. Each head carries ``check``: the recomputed output against the
    engine's ``blk.{i}.attn`` output for that head over all positions."""
    from minfer.graph import printing
    from minfer.graph.fusion import fuse

    ids = encoder.tokenize(text)
    hp = encoder.hparams
    n = len(ids)
    layers, heads, n_pos = inlined(hp.n_layer, hp.n_head, n, layers, heads, max_positions, max_cells)
    capture = EncoderCapture(n)
    encoder.run_observed(ids, capture.step)
    labels = [token_label(encoder.tokenizer, t) for t in ids]
    d = hp.head_dim
    shown = []
    for il in layers:
        p = f"blk.{il}."
        q, k, v = (capture.outputs[name].reshape(n, hp.n_head, d) for name in attention_inputs(hp, il))
        engine = capture.outputs[p + "attn"].reshape(n, hp.n_head, d)
        per_head = []
        for h in heads:
            ref = bidirectional_attention(q[:, h], k[:, h], v[:, h], hp.attn_scale)
            check = attention_check(ref["output"], engine[:, h].astype(np.float64))
            scores = ref["scores"][:n_pos, :n_pos].tolist()
            per_head.append({"head": h, "scores": scores, "masked": scores,
                             "weights": ref["weights"][:n_pos, :n_pos].tolist(),
                             "output": ref["output"][:n_pos].tolist(), "v": ref["v"][:n_pos].tolist(),
                             "check": check})
        shown.append({"layer": il, "heads": per_head, "window": 0})
    omitted = []
    if len(layers) < hp.n_layer:
        omitted.append(f"the attention of {hp.n_layer - len(layers)} of {hp.n_layer} layers (shown: "
                       f"{', '.join(map(str, layers))}; pick others with --layers)")
    if len(heads) < hp.n_head:
        omitted.append(f"{hp.n_head - len(heads)} of {hp.n_head} heads (--heads)")
    if n_pos < n:
        omitted.append(f"positions {n_pos}..{n - 1} of the attention matrices (--positions; the softmax still "
                       "ran over every key, so a shown weights row sums to less than 1)")
    graph = json.loads(printing.to_json(fuse(encoder.model.build_graph(n), encoder.backend.quantized_input)))
    graph["nodes"] = [g for g in graph["nodes"] if g["layer"] in (0, None) and g["op"] not in ("weight",)]
    return {
        "model": encoder.path.name, "prompt": text, "tokens": labels, "n_head": hp.n_head, "n_head_kv": hp.n_head,
        "head_dim": d, "scale": hp.attn_scale, "layers": shown, "stats": capture.stats, "top_tokens": [],
        "graph": graph, "omitted": omitted, "encoder": True, "no_logits": NO_LOGITS,
    }
