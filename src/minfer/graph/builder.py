"""Graph builder: emits nodes in build order, checking shapes as it goes.

Architecture recipes (``minfer.models``) call these primitives; a shape mismatch here is a bug in a
recipe or a model file whose tensors disagree with its metadata, and raises ModelError naming both.
"""

from __future__ import annotations

from typing import Any

from minfer.errors import ModelError
from minfer.graph.ir import AttnMeta, Graph, KVMeta, MatmulMeta, MoeMeta, Node, NormMeta, Op, RopeMeta, ScaleMeta


class GraphBuilder:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.inputs: dict[str, Node] = {}
        self._weights: dict[str, Node] = {}

    def _emit(
        self,
        op: Op,
        inputs: tuple[Node, ...],
        shape: tuple[int, ...],
        *,
        meta: Any = None,
        name: str = "",
        layer: int | None = None,
        dtype: str = "f32",
        source: Any = None,
    ) -> Node:
        node = Node(len(self.nodes), op, inputs, shape, dtype, meta, name, layer, source)
        self.nodes.append(node)
        return node

    # -- leaves --------------------------------------------------------------------------------

    def input(self, role: str, length: int, dtype: str = "i32", width: int | None = None) -> Node:
        """A per-call input of ``length`` values: ``i32`` (token ids, positions, rows) or ``f32`` (scales); with
        ``width``, ``length`` rows of ``width`` values (f32: an image's pixel patches, its embedding rows)."""
        shape = (length,) if width is None else (length, width)
        node = self._emit(Op.INPUT, (), shape, name=role, dtype=dtype, source=role)
        self.inputs[role] = node
        return node

    def weight(self, tensor: Any) -> Node:
        """A leaf for a model tensor (anything with ``name`` and ``shape``); one node per tensor."""
        if tensor.name not in self._weights:
            self._weights[tensor.name] = self._emit(
                Op.WEIGHT, (), tuple(tensor.shape), name=tensor.name, source=tensor
            )
        return self._weights[tensor.name]

    # -- ops -----------------------------------------------------------------------------------

    def get_rows(self, table: Node, ids: Node, name: str = "") -> Node:
        return self._emit(Op.GET_ROWS, (table, ids), (ids.shape[0], table.shape[-1]), name=name)

    def rms_norm(self, x: Node, eps: float, width: int | None = None, name: str = "", layer=None) -> Node:
        width = width or x.shape[-1]
        if x.shape[-1] % width:
            raise ModelError(f"{name}: cannot normalize width {x.shape[-1]} in groups of {width}")
        return self._emit(Op.RMS_NORM, (x,), x.shape, meta=NormMeta(eps, width), name=name, layer=layer)

    def layer_norm(self, x: Node, gain: Node, bias: Node, eps: float, name: str = "", layer=None) -> Node:
        """``(x - mean) / sqrt(var + eps) * gain + bias`` over each row (the statistics over the whole width)."""
        for w in (gain, bias):
            if tuple(w.shape) != (x.shape[-1],):
                raise ModelError(f"{name}: LayerNorm weight {w.label()} has shape {w.shape}, expected "
                                 f"({x.shape[-1]},)")
        return self._emit(Op.LAYER_NORM, (x, gain, bias), x.shape, meta=NormMeta(eps, x.shape[-1]), name=name,
                          layer=layer)

    def mul(self, x: Node, w: Node, name: str = "", layer=None) -> Node:
        self._check_broadcast(x, w, name)
        return self._emit(Op.MUL, (x, w), x.shape, name=name, layer=layer)

    def add(self, x: Node, y: Node, name: str = "", layer=None) -> Node:
        self._check_broadcast(x, y, name)
        return self._emit(Op.ADD, (x, y), x.shape, name=name, layer=layer)

    def matmul(self, x: Node, w: Node, name: str = "", layer=None, whole_sequences: bool = False) -> Node:
        """``x @ W^T``; ``whole_sequences``: the graph never runs a decode step (an encoder's), see MatmulMeta."""
        if len(w.shape) != 2 or w.shape[1] != x.shape[-1]:
            raise ModelError(
                f"{name}: weight {w.name!r} has shape {w.shape}, expected (*, {x.shape[-1]}) "
                f"to multiply activations of width {x.shape[-1]}"
            )
        meta = MatmulMeta(whole_sequences=True) if whole_sequences else None
        return self._emit(Op.MATMUL, (x, w), (x.shape[0], w.shape[0]), meta=meta, name=name, layer=layer)

    def lora(self, y: Node, x: Node, a: Node, b: Node, scales: Node, factor: float, name: str = "",
             layer=None) -> Node:
        """``y + factor * scales[row] * B·(A·x)``: a LoRA adapter's update of the matmul ``y = W·x`` (``a`` is
        ``[rank, n_in]``, ``b`` ``[n_out, rank]``, ``scales`` one float per row: the user's scale, 0 for rows
        without the adapter; ``factor`` the adapter format's own scale, alpha / rank)."""
        rank = a.shape[0]
        if len(a.shape) != 2 or a.shape[1] != x.shape[-1] or tuple(b.shape) != (y.shape[-1], rank):
            raise ModelError(f"{name}: adapter A {a.shape} and B {b.shape} do not map width {x.shape[-1]} to "
                             f"{y.shape[-1]} through one rank")
        if scales.shape != (x.shape[0],) or scales.dtype != "f32":
            raise ModelError(f"{name}: the adapter scales {scales.label()} are not one float per row")
        return self._emit(Op.LORA, (y, x, a, b, scales), y.shape, meta=ScaleMeta(float(factor)), name=name,
                          layer=layer)

    def rope(self, x: Node, positions: Node, meta: RopeMeta, name: str = "", layer=None) -> Node:
        if x.shape[-1] != meta.n_head * meta.head_dim:
            raise ModelError(f"{name}: width {x.shape[-1]} != {meta.n_head} heads x {meta.head_dim}")
        return self._emit(Op.ROPE, (x, positions), x.shape, meta=meta, name=name, layer=layer)

    def kv_store(self, k: Node, v: Node, rows: Node, meta: KVMeta, n_ctx: int, name: str = "") -> Node:
        """Write this call's K/V rows into the layer's regions at cache ``rows`` (an input: data)."""
        if k.shape[-1] != meta.k_width or v.shape[-1] != meta.v_width:
            raise ModelError(f"{name}: K/V widths {k.shape[-1]}/{v.shape[-1]} != {meta.k_width}/{meta.v_width}")
        # the output stands for the layer's K region, [n_ctx, k_width], as in the seed's contract
        return self._emit(
            Op.KV_STORE, (k, v, rows), (n_ctx, meta.k_width), meta=meta, name=name, layer=meta.layer
        )

    def kv_load(self, store: Node, name: str = "") -> Node:
        return self._emit(Op.KV_LOAD, (store,), store.shape, meta=store.meta, name=name, layer=store.layer)

    def attn(
        self, q: Node, kv: Node, positions: Node, rows: Node, meta: AttnMeta, name: str = "",
        key_ends: Node | None = None,
    ) -> Node:
        """Token t attends to its sequence's cached rows for positions 0..positions[t] (``rows[t] -
        positions[t]`` is where that sequence starts; in a sliding-window layer of width W only from
        positions[t] - W + 1).

        ``key_ends`` (an i32 input like ``positions``): token t attends up to position ``key_ends[t] >=
        positions[t]`` instead, from the same first position: Gemma 3's image tokens see every token of
        their image (``key_ends`` = the image's last position; a text token's is its own position). The
        pass must store those keys (the layer's KV store runs on every token of the pass first). The node's
        inputs are then ``(q, kv, positions, rows, key_ends)``; without it, ``(q, kv, positions, rows)``."""
        if meta.head_dim_k < 1 or meta.n_head % meta.n_head_kv:
            raise ModelError(f"{name}: {meta.n_head} query heads cannot share {meta.n_head_kv} kv heads")
        if q.shape[-1] != meta.n_head * meta.head_dim_k:
            raise ModelError(f"{name}: q width {q.shape[-1]} != {meta.n_head} x {meta.head_dim_k}")
        out = (q.shape[0], meta.n_head * meta.head_dim_v)
        inputs: tuple[Node, ...] = (q, kv, positions, rows)
        if key_ends is not None:
            if key_ends.shape != positions.shape or key_ends.dtype != positions.dtype:
                raise ModelError(f"{name}: key ends {key_ends.label()} {key_ends.shape} {key_ends.dtype} do not match "
                                 f"positions {positions.label()} {positions.shape} {positions.dtype}")
            inputs += (key_ends,)
        return self._emit(Op.ATTN, inputs, out, meta=meta, name=name, layer=meta.layer)

    def encoder_attn(self, q: Node, k: Node, v: Node, spans: Node, meta: AttnMeta, name: str = "") -> Node:
        """Bidirectional attention: token t attends to every token of its own sequence in this pass, the rows
        ``r`` with ``spans[r] == spans[t]`` (``spans``: each token's sequence's first row; a sequence's rows
        are consecutive)."""
        if meta.head_dim_k < 1 or meta.n_head % meta.n_head_kv:
            raise ModelError(f"{name}: {meta.n_head} query heads cannot share {meta.n_head_kv} kv heads")
        if q.shape[-1] != meta.n_head * meta.head_dim_k or k.shape[-1] != meta.n_head_kv * meta.head_dim_k \
                or v.shape[-1] != meta.n_head_kv * meta.head_dim_v:
            raise ModelError(f"{name}: q/k/v widths {q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]} do not fit "
                             f"{meta.n_head} heads ({meta.n_head_kv} kv heads) of {meta.head_dim_k}")
        if not q.shape[0] == k.shape[0] == v.shape[0] == spans.shape[0]:
            raise ModelError(f"{name}: q, k, v and spans disagree on the number of tokens")
        out = (q.shape[0], meta.n_head * meta.head_dim_v)
        return self._emit(Op.ENC_ATTN, (q, k, v, spans), out, meta=meta, name=name, layer=meta.layer)

    def gelu_erf(self, x: Node, name: str = "", layer=None) -> Node:
        """The exact GELU, ``x/2 * (1 + erf(x / sqrt(2)))`` (BERT's ``gelu``)."""
        return self._emit(Op.GELU_ERF, (x,), x.shape, name=name, layer=layer)

    def silu(self, x: Node, name: str = "", layer=None) -> Node:
        return self._emit(Op.SILU, (x,), x.shape, name=name, layer=layer)

    def gelu(self, x: Node, name: str = "", layer=None) -> Node:
        return self._emit(Op.GELU, (x,), x.shape, name=name, layer=layer)

    def scale(self, x: Node, factor: float, name: str = "", layer=None) -> Node:
        return self._emit(Op.SCALE, (x,), x.shape, meta=ScaleMeta(float(factor)), name=name, layer=layer)

    def softcap(self, x: Node, cap: float, name: str = "", layer=None) -> Node:
        return self._emit(Op.SOFTCAP, (x,), x.shape, meta=ScaleMeta(float(cap)), name=name, layer=layer)

    def moe_route(self, logits: Node, meta: MoeMeta, name: str = "") -> Node:
        """Router logits ``[tokens, n_expert]`` -> ``[tokens, 2 k]``: each token's k experts (ids, best first)
        and their weights."""
        if logits.shape[-1] != meta.n_expert or not 0 < meta.n_used <= meta.n_expert:
            raise ModelError(f"{name}: router width {logits.shape[-1]} cannot choose {meta.n_used} of "
                             f"{meta.n_expert} experts")
        return self._emit(Op.MOE_ROUTE, (logits,), (logits.shape[0], 2 * meta.n_used), meta=meta, name=name,
                          layer=meta.layer)

    def moe_experts(self, x: Node, route: Node, gate: Node, up: Node, down: Node, meta: MoeMeta,
                    name: str = "", shared: tuple[Node, Node, Node, Node] | None = None) -> Node:
        """Each token's chosen experts' SwiGLU FFNs ``down_e(silu(gate_e x) * up_e x)``, summed by weight;
        ``gate``/``up`` are stacks ``[n_expert, n_ff, n_embd]`` and ``down`` ``[n_expert, n_embd, n_ff]``.
        ``shared``: a shared expert's gate, up and down matrices and its gate vector ``[1, n_embd]``, added as
        ``sigmoid(g · x) * down_s(silu(gate_s x) * up_s x)`` (Qwen2-MoE)."""
        n_embd = x.shape[-1]
        e, n_ff = meta.n_expert, gate.shape[1] if len(gate.shape) == 3 else -1
        for w, want in ((gate, (e, n_ff, n_embd)), (up, (e, n_ff, n_embd)), (down, (e, n_embd, n_ff))):
            if tuple(w.shape) != want:
                raise ModelError(f"{name}: expert weights {w.name!r} have shape {w.shape}, expected {want}")
        inputs = (x, route, gate, up, down)
        if shared is not None:
            sg, su, sd, sgate = shared
            n_sh = sg.shape[0]
            for w, want in ((sg, (n_sh, n_embd)), (su, (n_sh, n_embd)), (sd, (n_embd, n_sh)), (sgate, (1, n_embd))):
                if tuple(w.shape) != want:
                    raise ModelError(f"{name}: shared expert weight {w.name!r} has shape {w.shape}, expected {want}")
            inputs += shared
        return self._emit(Op.MOE_EXPERTS, inputs, x.shape, meta=meta, name=name, layer=meta.layer)

    def build(self, output: Node, extras: dict[str, Node] | None = None) -> Graph:
        return Graph(self.nodes, self.inputs, output, dict(extras or {}))

    @staticmethod
    def _check_broadcast(x: Node, y: Node, name: str) -> None:
        if y.shape == x.shape:
            return
        if len(y.shape) == 1 and x.shape[-1] % y.shape[0] == 0:
            return
        raise ModelError(f"{name}: cannot combine shapes {x.shape} and {y.shape} ({y.label()})")
