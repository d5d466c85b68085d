"""A hand-made example through the same explorer: one head whose Q, K and V are given (the learning
page's 2x2 one, say), with O from the backend's attention kernel."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minfer.errors import BadRequestError
from minfer.graph.ir import AttnMeta, Backend, Graph, Node, Op
from minfer.trace.capture import TraceCapture
from minfer.trace.explorer import ForwardTrace
from minfer.trace.tracer import array_stats


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


def example_trace(q: np.ndarray, k: np.ndarray, v: np.ndarray, labels: list[str], backend: Backend) -> ForwardTrace:
    """One head given by hand as a trace: Q, K, V are the inputs, O is what ``backend``'s attention kernel
    computes from them, and the explorer's attention panel shows the reference's scores and weights beside it."""
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
    backend.attention(q, k, v, np.arange(t, dtype=np.int32), meta, out)
    graph = Graph([positions, nq, nk, nv, attn], {"positions": positions}, attn)

    def no_recapture(layers: set[int]) -> TraceCapture:
        raise BadRequestError("a hand-made example holds all its tensors")

    trace = ForwardTrace(graph, ExampleHParams(n_embd=dv, head_dim_k=d, head_dim_v=dv), list(range(t)), labels,
                         "f32", "example", no_recapture, lambda i: labels[i] if i < len(labels) else str(i), backend)
    trace.description = "hand-made example: one head, Q K V given, O from the fused attention kernel"
    trace.by_id = {n.id: n for n in graph.nodes}
    trace.by_name = {n.name: n for n in graph.nodes}
    trace.layers[0] = {nq.id: q, nk.id: k, nv.id: v, attn.id: out}
    trace.kv_read[0] = (k, v)
    trace.residuals[0] = out
    trace.stats = {n.id: {"us": None, **array_stats(a)} for n, a in ((nq, q), (nk, k), (nv, v), (attn, out))}
    return trace
