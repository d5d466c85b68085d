"""Forward passes: build (or reuse) the graph for a batch shape, bind it, run it.

One graph per (tokens, outputs, hidden) shape: build -> fusion -> allocation -> plan (``hidden``: the pass
also keeps every token's final-normed hidden state, for embeddings). Plans are kept for the
shapes seen recently (decode reuses the one-token plan every step); their activation buffers come from
one :class:`~minfer.graph.plan.BufferArena` (the plans run one at a time).

A plan costs a graph build (SmolLM2, 2 threads: 13-18 ms, the first one of a run also its weights' setup), so
the engine prepares the shapes it will run after a prompt (decode, the verifying passes' buckets) before
it, and a larger prompt that grows the arena keeps them: the arrays it replaces stay with the plans that
hold them, up to :data:`RETIRED_SHARE` of the arena. ``plans_built`` counts the builds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from minfer.errors import BadRequestError, ModelError
from minfer.graph.fusion import fuse
from minfer.graph.ir import Backend
from minfer.graph.plan import BufferArena, Plan
from minfer.models.model import TransformerModel
from minfer.models.rope_scaling import layer_rope_meta
from minfer.runtime.kv_cache import KVCache
from minfer.runtime.vision import PassImage, image_inputs

MAX_PLANS = 8
# the replaced arena arrays the plans built before a growth may keep alive, as a share of the arena: the
# small shapes (decode, verification) keep their plans when a prompt grows the arena; a growth past it
# drops every older plan and frees what they held
RETIRED_SHARE = 0.25


class ForwardRunner:
    def __init__(
        self,
        model: TransformerModel,
        backend: Backend,
        kv: KVCache,
        observers: Sequence[Any] = (),
        max_plans: int = MAX_PLANS,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv = kv
        # minfer.trace observers (Tracer, Dumper): see every executed node, then each call's logits
        self.observers = list(observers)
        # keyed (tokens, outputs), and (tokens, outputs, "hidden") for the passes that keep hidden states
        self._plans: OrderedDict[tuple[int, int] | tuple[int, int, str], Plan] = OrderedDict()
        # a batching server sees many batch shapes; the plans share their activation buffers (they run
        # one at a time), so memory is that of the largest plan whatever the number of plans
        self.max_plans = max_plans
        self.arena = BufferArena()
        self.plans_built = 0  # graph builds so far (reserve's included): what a warm-up should leave flat
        self._retired_since_drop = 0
        # the scale of each of the model's LoRA adapters (model.loras), for the sequences that were given none
        # of their own; 0 leaves an adapter out
        self.lora_scales = np.zeros(len(model.loras), np.float32)
        self._sequence_lora: dict[int, np.ndarray] = {}

    def set_lora(self, scales: Sequence[float] | np.ndarray, seq: int | None = None) -> None:
        """Each adapter's scale (in the order of ``model.loras``), for sequence ``seq`` or (None) for every
        sequence that has none of its own. Scales are data: no plan changes."""
        values = np.asarray(scales, np.float32).reshape(-1)
        if values.shape[0] != len(self.model.loras) or not np.isfinite(values).all():
            raise BadRequestError(f"expected {len(self.model.loras)} finite adapter scales, got {list(scales)}")
        if seq is None:
            self.lora_scales = values
        else:
            self._sequence_lora[seq] = values

    def adapter_added(self) -> None:
        """The model has one more LoRA adapter (appended to ``model.loras``): it starts at scale 0 for the
        defaults and for every sequence with scales of its own, and the plans built for the old adapter set
        (a node per adapter beside each adapted matmul) are dropped, to be built again by the next passes."""
        self.lora_scales = np.append(self.lora_scales, np.float32(0.0))
        for seq, scales in self._sequence_lora.items():
            self._sequence_lora[seq] = np.append(scales, np.float32(0.0))
        self._plans.clear()

    def lora_of(self, seq: int) -> np.ndarray:
        """The adapter scales sequence ``seq`` runs with."""
        return self._sequence_lora.get(seq, self.lora_scales)

    def plan(self, n_tokens: int, n_outputs: int, hidden: bool = False) -> Plan:
        key: tuple[int, int] | tuple[int, int, str] = (
            (n_tokens, n_outputs, "hidden") if hidden else (n_tokens, n_outputs)
        )
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build(n_tokens, n_outputs, hidden)
            self._plans[key] = plan
            if len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def _build(self, n_tokens: int, n_outputs: int, hidden: bool) -> Plan:
        quantized_input = self.backend.quantized_input
        graph = self.model.build_graph(n_tokens, n_outputs, self.kv.n_ctx, hidden=True) if hidden else \
            self.model.build_graph(n_tokens, n_outputs, self.kv.n_ctx)
        graph = fuse(graph, quantized_input)
        retired = self.arena.retired_bytes
        plan = Plan(graph, self.backend, self.kv.layers, arena=self.arena)
        self.plans_built += 1
        if self.arena.retired_bytes != retired:
            # the older plans hold arrays the arena has replaced: they stay correct (their own buffers),
            # and are kept while what they hold is small beside the arena
            self._retired_since_drop += self.arena.retired_bytes - retired
            if self._retired_since_drop > RETIRED_SHARE * self.arena.nbytes:
                self._plans.clear()
                self._retired_since_drop = 0
        return plan

    def reserve(self, n_tokens: int, n_outputs: int, hidden: bool = False) -> None:
        """Size the buffer arena for a pass of this shape without keeping its plan (a warm-up, so that a
        later pass of that shape does not grow the memory)."""
        self._build(n_tokens, n_outputs, hidden)

    def forward(
        self,
        tokens: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        output_rows: Sequence[int] | np.ndarray | None = None,
        seq_ids: Sequence[int] | np.ndarray | int = 0,
        images: Sequence[PassImage] = (),
    ) -> np.ndarray:
        """Logits ``[len(output_rows), n_vocab]`` (every row when ``output_rows`` is None); a fresh array.

        Token i of sequence ``seq_ids[i]`` is evaluated at ``positions[i]``; its K/V land in that
        sequence's cache row for the position, and it attends to the sequence's positions 0..its own.
        Several sequences may share one call (they must not interleave within a sequence's positions).
        ``images`` (a vision-language model): the rows that take an image's tokens instead of their token's
        embedding; an image's rows see each other both ways.
        """
        logits, _ = self._run(tokens, positions, output_rows, seq_ids, hidden=False, images=images)
        assert logits is not None
        return logits

    def forward_hidden(
        self,
        tokens: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        output_rows: Sequence[int] | np.ndarray,
        seq_ids: Sequence[int] | np.ndarray | int = 0,
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """As :meth:`forward`, and also every token's final-normed hidden state ``[n_tokens, n_embd]``
        (the output norm's result, before the output matmul): (logits of ``output_rows`` or None when
        it is empty, hidden states), fresh arrays."""
        logits, hidden = self._run(tokens, positions, output_rows, seq_ids, hidden=True)
        assert hidden is not None
        return logits, hidden

    def _run(
        self,
        tokens: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        output_rows: Sequence[int] | np.ndarray | None,
        seq_ids: Sequence[int] | np.ndarray | int,
        hidden: bool,
        images: Sequence[PassImage] = (),
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        n = tokens.shape[0]
        if n == 0:
            raise BadRequestError("no tokens to evaluate")
        if positions.shape != tokens.shape:
            raise BadRequestError(f"{n} tokens but {positions.shape[0]} positions")
        n_vocab = self.model.hparams.n_vocab
        recorded = tokens  # what the cache remembers these rows by (an image's rows: the image's ids)
        if images:  # an image's rows look up no token (their ids may be an image's own negative ids)
            tokens = tokens.copy()
            for img in images:
                tokens[img.first:img.end] = 0
        bad = np.flatnonzero((tokens < 0) | (tokens >= n_vocab))
        if bad.size:
            i = int(bad[0])
            raise BadRequestError(
                f"token id {int(tokens[i])} at index {i} is outside the vocabulary (0..{n_vocab - 1})"
            )
        rows = self.kv.rows(positions, seq_ids)  # refuses positions beyond the context before any write
        out_rows = np.arange(n) if output_rows is None else np.asarray(output_rows, dtype=np.int64)
        # a plan with as many outputs as tokens outputs every row in order (it has no output_rows input):
        # any other selection of n rows is taken from that full result afterwards
        reorder = output_rows is not None and out_rows.shape[0] == n and not np.array_equal(out_rows, np.arange(n))
        n_out = out_rows.shape[0]
        plan = self.plan(n, n_out, hidden)
        plan.inputs["tokens"][:] = tokens
        plan.inputs["positions"][:] = positions
        plan.inputs["rows"][:] = rows
        if "output_rows" in plan.inputs:
            plan.inputs["output_rows"][:] = out_rows
        if self.model.loras:
            self._fill_lora_scales(plan, seq_ids, n, out_rows)
        if self.model.takes_images:
            inp = plan.inputs
            image_inputs(positions, images, self.model.hparams.n_embd, inp["embd_keep"], inp["embd_image"],
                         inp["key_ends"], getattr(getattr(self.model, "vision", None), "bidirectional", True))
        elif images:
            raise BadRequestError(f"{self.model.path} has no vision model: it cannot take images")
        with self.backend.running((n, n_out, hidden)):
            if not self.observers:
                out = plan.run()
                # corrupt weights (a tensor type flipped in the header, NaN block scales) give NaN logits;
                # an error names them, where sampling would pick garbage. Traced runs go on: the trace is
                # how one finds the node that made the NaN.
                if n_out and not np.isfinite(out).all():
                    raise ModelError(f"{self.model.path}: the forward pass gave non-finite logits (NaN or "
                                     "infinity): the model's weights or hyperparameters are corrupt")
            else:
                observers = self.observers
                out = plan.run(lambda s, t: [o.step(s, t) for o in observers])
            logits = out.copy() if n_out else None
            states = plan.extras["hidden"].copy() if hidden else None
            if self.observers and logits is not None:
                for o in self.observers:
                    o.logits(tokens, positions, logits)
        if reorder and logits is not None:
            logits = logits[out_rows]
        self._record(recorded, positions, seq_ids)
        return logits, states

    def _fill_lora_scales(self, plan: Plan, seq_ids: Sequence[int] | np.ndarray | int, n: int,
                          out_rows: np.ndarray) -> None:
        if np.ndim(seq_ids) == 0:
            scales = np.broadcast_to(self.lora_of(int(seq_ids)), (n, len(self.model.loras)))
        elif not self._sequence_lora:
            scales = np.broadcast_to(self.lora_scales, (n, len(self.model.loras)))
        else:  # each row its sequence's scales: one lookup per sequence, not per row
            seqs, row_seq = np.unique(np.asarray(seq_ids).reshape(-1), return_inverse=True)
            scales = np.stack([self.lora_of(int(s)) for s in seqs])[row_seq]
        for k in range(scales.shape[1]):
            plan.inputs[f"lora_scale.{k}"][:] = scales[:, k]
            rows = plan.inputs.get(f"lora_scale.{k}.output_rows")
            if rows is not None:  # the graph's last matmuls run on the output rows alone
                rows[:] = scales[out_rows, k]

    def shift_context(self, seq: int, n_keep: int, n_discard: int) -> None:
        """Drop ``n_discard`` positions of ``seq`` after the first ``n_keep``; later K rows are re-rotated."""
        hp = self.model.hparams
        # a pure rotation by the position delta: the YaRN magnitude (mscale) is already in the stored rows;
        # each layer with its own frequencies (Gemma's sliding-window layers have another base)
        metas = [
            replace(layer_rope_meta(hp, self.model.rope_style, hp.n_head_kv, il, self.kv.n_ctx), mscale=1.0)
            for il in range(hp.n_layer)
        ]

        def rotate(k: np.ndarray, delta: int, layer: int) -> None:
            # RoPE is a rotation by position x frequency, so rotating a row stored at p by -d puts it at p - d
            self.backend.rope(k, np.full(k.shape[0], delta), metas[layer], k)

        self.kv.shift(seq, n_keep, n_discard, rotate)

    def _record(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: Sequence[int] | np.ndarray | int) -> None:
        if np.ndim(seq_ids) == 0:
            self.kv.record(int(seq_ids), positions, tokens)
            return
        seq = np.asarray(seq_ids)
        for s in dict.fromkeys(seq.tolist()):
            idx = np.flatnonzero(seq == s)
            self.kv.record(int(s), positions[idx], tokens[idx])
