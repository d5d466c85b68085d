"""Encoder passes: many sequences packed into one forward call, their hidden states pooled into embeddings or
scored by a classification head.

An encoder has no KV cache and no decode: each call evaluates whole sequences. The sequences of a batch are
packed back to back into passes of up to ``max_tokens`` rows (longest first, so that similar lengths share a
pass), each sequence a run of rows named by the graph's ``spans`` input, so that attention never crosses from
one into another and no row is padding inside a sequence. A pass is padded to a bucketed size (:func:`bucket`)
with one extra run of padding rows, so that a few plans serve every batch; the padding's rows are
computed and dropped. A sequence's rows are the same bits whatever else shares its pass (every kernel is
row-local, and attention reads its own run only).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from minfer.errors import BadRequestError
from minfer.graph.fusion import fuse
from minfer.graph.ir import Backend
from minfer.graph.plan import BufferArena, Plan, Step
from minfer.models.bert import BertModel, classification_head
from minfer.runtime.pooling import l2_normalize, pool_rows

MAX_PLANS = 16
MIN_BUCKET = 16


def bucket(n_tokens: int) -> int:
    """The pass size ``n_tokens`` rows run in: the next of 16, 24, 32, 48, 64, 96, ... (powers of two and the
    halfway sizes between them: at most a third of a pass is padding, with two plans per doubling)."""
    size = MIN_BUCKET
    while True:
        if size >= n_tokens:
            return size
        if size + size // 2 >= n_tokens:
            return size + size // 2
        size *= 2


class EncoderRunner:
    """Forward passes of an encoder (:class:`~minfer.models.bert.BertModel`) on a backend."""

    def __init__(self, model: BertModel, backend: Backend, max_tokens: int = 2048) -> None:
        self.model = model
        self.backend = backend
        self.max_tokens = max(max_tokens, bucket(model.hparams.n_ctx_train))
        self.arena = BufferArena()
        self._plans: OrderedDict[int, Plan] = OrderedDict()
        self.plans_built = 0
        self.passes = 0

    def plan(self, n_rows: int) -> Plan:
        plan = self._plans.get(n_rows)
        if plan is None:
            graph = fuse(self.model.build_graph(n_rows), self.backend.quantized_input)
            plan = self._plans[n_rows] = Plan(graph, self.backend, (), arena=self.arena)
            self.plans_built += 1
            if len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(n_rows)
        return plan

    def warm_up(self) -> None:
        """Compile the kernels and build the smallest pass's plan now, not inside the first request."""
        self.hidden_states([[0]])

    def check(self, ids: Sequence[int], types: Sequence[int], k: int, what: str = "input") -> None:
        """A :class:`BadRequestError` naming ``what[k]`` unless the sequence fits the model."""
        hp = self.model.hparams
        if len(ids) == 0:
            raise BadRequestError(f"{what}[{k}] has no tokens")
        if len(ids) > hp.n_ctx_train:
            raise BadRequestError(f"{what}[{k}] is {len(ids)} tokens, longer than the model's {hp.n_ctx_train}")
        if len(types) != len(ids):
            raise BadRequestError(f"{what}[{k}]: {len(types)} token types for {len(ids)} tokens")
        a = np.asarray(ids)
        if a.min() < 0 or a.max() >= hp.n_vocab:
            raise BadRequestError(f"{what}[{k}]: token id {int(a.max() if a.max() >= hp.n_vocab else a.min())} is "
                                  f"outside the vocabulary (0..{hp.n_vocab - 1})")
        t = np.asarray(types)
        if t.min() < 0 or t.max() >= hp.n_token_types:
            raise BadRequestError(f"{what}[{k}]: token type outside 0..{hp.n_token_types - 1}")

    def hidden_states(self, sequences: Sequence[Sequence[int]],
                      token_types: Sequence[Sequence[int]] | None = None) -> list[np.ndarray]:
        """Each sequence's last hidden states ``[len, n_embd]`` (fresh arrays), in the order given."""
        types = token_types if token_types is not None else [[0] * len(s) for s in sequences]
        if len(types) != len(sequences):
            raise BadRequestError(f"{len(types)} token-type lists for {len(sequences)} sequences")
        for k, (ids, tt) in enumerate(zip(sequences, types, strict=True)):
            self.check(ids, tt, k)
        order = sorted(range(len(sequences)), key=lambda k: -len(sequences[k]))
        out: list[np.ndarray | None] = [None] * len(sequences)
        group: list[int] = []
        used = 0
        for k in order:
            if group and used + len(sequences[k]) > self.max_tokens:
                self._run(group, sequences, types, out)
                group, used = [], 0
            group.append(k)
            used += len(sequences[k])
        if group:
            self._run(group, sequences, types, out)
        return [o for o in out if o is not None]

    def _run(self, group: list[int], sequences: Sequence[Sequence[int]], types: Sequence[Sequence[int]],
             out: list[np.ndarray | None], on_step: Callable[[Step, float], None] | None = None) -> Plan:
        """One pass of the sequences ``group`` (indices into ``sequences``), their hidden states into ``out``;
        ``on_step``: an observer of every node as it ran (the trace). The plan it ran in."""
        n = sum(len(sequences[k]) for k in group)
        size = bucket(n)
        plan = self.plan(size)
        inp = plan.inputs
        tokens, positions, token_types, spans = (inp[r] for r in ("tokens", "positions", "token_types", "spans"))
        offset = self.model.hparams.position_offset  # RoBERTa's positions start at pad_token_id + 1
        row = 0
        for k in group:
            m = len(sequences[k])
            tokens[row:row + m] = sequences[k]
            token_types[row:row + m] = types[k]
            positions[row:row + m] = np.arange(offset, offset + m)
            spans[row:row + m] = row
            row += m
        # the padding: one more run of rows (token 0 at positions from 0), computed and dropped
        tokens[row:] = 0
        token_types[row:] = 0
        positions[row:] = offset + np.arange(size - row) % self.model.hparams.n_ctx_train
        spans[row:] = row
        with self.backend.running(("encoder", size)):
            hidden = plan.run(on_step)
        self.passes += 1
        row = 0
        for k in group:
            m = len(sequences[k])
            out[k] = hidden[row:row + m].copy()
            row += m
        return plan

    def observe(self, ids: Sequence[int], on_step: Callable[[Step, float], None],
                token_types: Sequence[int] | None = None) -> tuple[Plan, np.ndarray]:
        """One sequence alone in its pass, ``on_step(step, seconds)`` seeing every node as it ran (the trace): the
        plan it ran in (every node's rows past the sequence's are the padding's) and its last hidden states."""
        types = [0] * len(ids) if token_types is None else list(token_types)
        self.check(ids, types, 0)
        out: list[np.ndarray | None] = [None]
        plan = self._run([0], [list(ids)], [types], out, on_step)
        assert out[0] is not None
        return plan, out[0]

    def embed(self, sequences: Sequence[Sequence[int]], pooling: str, normalize: bool) -> list[np.ndarray]:
        """Each sequence's embedding: its hidden states pooled (:func:`~minfer.runtime.pooling.pool_rows`),
        L2-normalised where ``normalize`` (``pooling="none"``: every token's vector, never normalised)."""
        vectors = [pool_rows(h, pooling) for h in self.hidden_states(sequences)]
        if normalize and pooling != "none":
            vectors = [l2_normalize(v) for v in vectors]
        return vectors

    def classify(self, sequences: Sequence[Sequence[int]], token_types: Sequence[Sequence[int]]) -> np.ndarray:
        """The classification head's outputs ``[n, n_labels]`` (a reranker's relevance logits: ``n_labels`` 1)."""
        if not self.model.has_head:
            raise BadRequestError(f"{self.model.path} has no classification head: it cannot rerank (load a "
                                  "cross-encoder, e.g. a *ForSequenceClassification checkpoint)")
        firsts = np.stack([h[0] for h in self.hidden_states(sequences, token_types)])
        return classification_head(self.model, firsts, self.backend.dequantize)
