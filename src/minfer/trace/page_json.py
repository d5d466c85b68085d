"""How the explorer's answers are written for a page: nodes, the names of their axes, float32 arrays, spans."""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np

from minfer.errors import BadRequestError
from minfer.formats.tensors import ExpertTensors, WeightTensor
from minfer.graph.ir import Node, Op
from minfer.trace.tracer import array_stats

MAX_CELLS = 256  # a tensor view is at most this many rows and columns (strided beyond)
HISTOGRAM_BINS = 48


def b64(a: np.ndarray) -> dict[str, Any]:
    """A float32 array as ``{"shape", "b64"}``: little-endian bytes, exact and compact (the page decodes it
    into a Float32Array)."""
    a = np.ascontiguousarray(a, dtype="<f4")
    return {"shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def node_axes(node: Node, hp: Any) -> dict[str, Any]:
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
    if node.op is Op.WEIGHT and isinstance(node.source, WeightTensor | ExpertTensors):
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


def tensor_window(data: np.ndarray, rows: tuple[int, int] | None, cols: tuple[int, int] | None, max_rows: int,
                  max_cols: int) -> tuple[dict[str, Any], range]:
    """A window of a node's output as a page shows it, strided to at most ``max_rows x max_cols`` cells (the step
    says which rows and columns are shown), with the whole tensor's statistics and histogram; and the rows shown."""
    a = data.reshape(data.shape[0], -1) if data.ndim > 1 else data.reshape(1, -1)
    r0, r1 = span_within(rows, a.shape[0], "rows")
    c0, c1 = span_within(cols, a.shape[1], "cols")
    rs, cs = max(1, math.ceil((r1 - r0) / max(1, max_rows))), max(1, math.ceil((c1 - c0) / max(1, max_cols)))
    finite = a[np.isfinite(a)]
    counts, edges = np.histogram(finite, bins=HISTOGRAM_BINS) if finite.size else (np.zeros(0), np.zeros(0))
    return ({"shape": list(data.shape), "rows": [r0, r1, rs], "cols": [c0, c1, cs],
             "values": b64(a[r0:r1:rs, c0:c1:cs]), "stats": array_stats(a),
             "histogram": {"counts": counts.astype(int).tolist(), "edges": edges.tolist()}}, range(r0, r1, rs))


def span_within(span: tuple[int, int] | None, n: int, what: str) -> tuple[int, int]:
    """``span`` checked against ``0:n`` (all of it when None)."""
    if span is None:
        return 0, n
    a, b = span
    if not (0 <= a < b <= n):
        raise BadRequestError(f"{what} {a}:{b} is outside 0:{n}")
    return a, b
