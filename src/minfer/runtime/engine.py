"""The engine: one step that every path drives (the Python API, the CLI, conversations and the server).

A step is four calls: the scheduler decides the batch (:meth:`Scheduler.schedule
<minfer.runtime.scheduler.Scheduler.schedule>`: every running sequence's next token, or a chunk of its
prompt, and the drafts of those that speculate), the runner evaluates it in one forward pass, the sampler
draws every row whose sequence's sampler alone picks the token (one compiled call), and the scheduler
advances each sequence with its rows (:meth:`~minfer.runtime.scheduler.Scheduler.update`). Positions and
cache rows are data: token i of the batch belongs to sequence ``seq_ids[i]`` at position
``positions[i]``, so prefill, decode and many sequences share one graph, and one attention call per layer
serves them all (each token reads its own sequence's rows).

Requests (:mod:`minfer.runtime.requests`) join with :meth:`Engine.add` (a free slot, see
:mod:`minfer.runtime.slots`) and leave between steps (finished, cancelled). An ``EmbeddingRequest`` runs in
the same passes: its prompt is evaluated chunk by chunk beside the other sequences' work, with no
sampling; the pass also keeps every token's final-normed hidden state, which :mod:`minfer.runtime.pooling`
pools into its vector. :meth:`Engine.run` drives the steps on the caller's thread until one request ends
(the API); :class:`minfer.runtime.engine_loop.EngineLoop` drives them from a queue on a thread of its own
(the server).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minfer.errors import BadRequestError
from minfer.graph.ir import Backend
from minfer.models.model import TransformerModel
from minfer.runtime.batching import Batch, PassOutput
from minfer.runtime.forward import MAX_PLANS, ForwardRunner
from minfer.runtime.kv_cache import slots_kv_cache
from minfer.runtime.prompt_cache import DiskBlocks, PromptCache, cells_fingerprint
from minfer.runtime.requests import (
    Embedded,
    EmbeddingRequest,
    EngineHooks,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    Request,
    Token,
)
from minfer.runtime.sampling import compile_jobs as sampling_compile_jobs
from minfer.runtime.sampling import sample_batch
from minfer.runtime.scheduler import EndOfContext, Running, Scheduler
from minfer.runtime.sequence import TokenStep
from minfer.runtime.slot_file import load_slot, save_slot
from minfer.runtime.speculative import SpeculativeSettings
from minfer.runtime.speculative.draft_model import DraftModel


class Engine:
    """Sequences in the slots of ``runner.kv``, advanced together one :meth:`step` at a time.

    ``batch_size``: None for an unpadded engine (every sequence of the cache is a slot, a prompt goes in
    one pass); a number for a padded one (at most that many tokens a pass, decodes first, then prompt
    chunks; the cache's last sequence is the padding scratch, see :func:`~minfer.runtime.kv_cache.slots_kv_cache`).
    ``end_of_context``: what a sequence that fills its slot gets: ``"error"`` (a ContextOverflowError
    naming the position, the API's rule) or ``"length"`` (its ``max_tokens`` is capped by the room left
    and it finishes with reason "length", the server's rule). A request with ``context_shift`` shifts
    instead. ``speculative``: what a request without its own settings gets; ``draft``: the draft model.
    """

    def __init__(
        self,
        runner: ForwardRunner,
        tokenizer: Any,
        batch_size: int | None = None,
        end_of_context: EndOfContext = "error",
        hooks: EngineHooks | None = None,
        speculative: SpeculativeSettings | None = None,
        draft: DraftModel | None = None,
        prompt_cache: PromptCache | None = None,
        measure_costs: bool = True,
        cache_idle_slots: bool = True,
    ) -> None:
        if batch_size is not None and batch_size < 1:
            raise BadRequestError(f"batch_size must be >= 1, got {batch_size}")
        self.runner = runner
        self.kv = runner.kv
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.scheduler = Scheduler(runner, tokenizer, batch_size, end_of_context, hooks, speculative, draft,
                                   prompt_cache, measure_costs, cache_idle_slots)
        self.slots = self.scheduler.slots

    # -- what the scheduler holds, as callers read it ----------------------------------------------

    @property
    def hooks(self) -> EngineHooks:
        return self.scheduler.hooks

    @hooks.setter
    def hooks(self, hooks: EngineHooks) -> None:
        self.scheduler.hooks = hooks

    @property
    def running(self) -> list[Running]:
        """The sequences holding slots (a list replaced, never mutated: any thread may read it)."""
        return self.scheduler.running

    @property
    def speculative(self) -> SpeculativeSettings:
        return self.scheduler.speculative

    @property
    def draft(self) -> DraftModel | None:
        return self.scheduler.draft

    @property
    def n_free(self) -> int:
        """Slots a new request can take now."""
        return self.slots.n_free

    # -- requests ----------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Refuse a request this engine can never serve (thread-safe: reads only sizes)."""
        self.scheduler.check(request)

    def check_speculative(self, settings: SpeculativeSettings) -> None:
        """Refuse settings this engine cannot serve: a draft model it does not have, a draft too long."""
        self.scheduler.check_speculative(settings)

    def add(self, request: Request) -> None:
        """Give ``request`` a free slot (reusing the cached prefix it shares) and emit ``Started``."""
        self.scheduler.add(request)

    def cancel_all(self) -> None:
        """End every running sequence now (reason "cancelled")."""
        self.scheduler.cancel_all()

    def fail_all(self, error: Exception) -> None:
        """A pass failed: its sequences fail with ``error`` (logged unless it is the user's mistake)."""
        self.scheduler.fail_all(error)

    def cells_in_use(self) -> int:
        """KV cache positions held by running sequences."""
        return self.scheduler.cells_in_use()

    # -- a free slot's contents (llama-server's /slots actions; on the engine's thread, between steps) ----

    def _slot_fingerprint(self) -> str:
        return cells_fingerprint(self.runner.model, self.kv.cache_type)

    def save_slot(self, slot: int, path: str | os.PathLike[str]) -> tuple[int, int]:
        """Write free slot ``slot``'s tokens and cells to ``path`` (atomically): (tokens, bytes) written.
        :class:`~minfer.runtime.slot_file.SlotBusyError` while a request holds it."""
        state = self.slots.state(slot)
        return len(state.tokens), save_slot(path, state, self._slot_fingerprint(), self.kv.cache_type,
                                            self.slots.capacity)

    def restore_slot(self, slot: int, path: str | os.PathLike[str]) -> tuple[int, int]:
        """Free slot ``slot`` holds what ``path`` holds (a prompt starting with those tokens reuses them), once
        every part of the file checked out: (tokens, bytes) read."""
        kv = self.kv
        layout = [(layer.k.shape[1:], layer.k.dtype, layer.v.shape[1:], layer.v.dtype) for layer in kv.layers]
        self.slots.state(slot)  # (a bad or busy slot is refused before the file is read)
        state, nbytes = load_slot(path, self._slot_fingerprint(), kv.cache_type, self.slots.capacity,
                                  self.runner.model.hparams.n_vocab, layout, len(self.runner.lora_scales))
        self.slots.restore(slot, state)
        return len(state.tokens), nbytes

    def erase_slot(self, slot: int) -> int:
        """Free slot ``slot`` forgets its tokens: how many it held."""
        return self.slots.erase(slot)

    def run(self, request: GenerationRequest) -> Iterator[TokenStep]:
        """Add ``request`` now, then (as the result is iterated) step the engine on the calling thread
        until it ends: its tokens as they come (other running sequences advance in the same passes).
        Raises what failed it; a caller that stops iterating early cancels it."""
        events: list[Event] = []
        request.emit = events.append
        self.add(request)
        return self._drive(request, events)

    def embed(self, requests: Seq[EmbeddingRequest]) -> list[np.ndarray]:
        """Embed ``requests`` on the calling thread (as many at a time as there are free slots, sharing
        passes with whatever else runs): their vectors in order. Raises what failed one of them."""
        out: dict[int, np.ndarray] = {}
        errors: list[Exception] = []
        pending = list(enumerate(requests))
        added: list[EmbeddingRequest] = []
        try:
            while len(out) < len(requests):
                if errors:
                    raise errors[0]
                while pending and self.n_free:
                    i, r = pending.pop(0)

                    def emit(event: Event, i: int = i) -> None:
                        if isinstance(event, Embedded):
                            out[i] = event.vector
                        elif isinstance(event, Failed):
                            errors.append(event.error)
                        elif isinstance(event, Finished):
                            errors.append(BadRequestError("the embedding was cancelled"))

                    r.emit = emit
                    self.add(r)
                    added.append(r)
                if len(out) < len(requests) and not errors and not self.step():
                    raise RuntimeError("the engine has nothing to run for embeddings that have not ended")
        finally:
            if len(out) < len(requests):
                for r in added:
                    r.cancel()
                self.scheduler.drop_cancelled()
        return [out[i] for i in range(len(requests))]

    def _drive(self, request: GenerationRequest, events: list[Event]) -> Iterator[TokenStep]:
        ended = False
        try:
            while True:
                if not events and not self.step():
                    raise RuntimeError("the engine has nothing to run for a request that has not ended")
                for event in events:
                    if isinstance(event, Token):
                        yield event.step
                    elif isinstance(event, Failed):
                        ended = True
                        raise event.error
                    elif isinstance(event, Finished):
                        ended = True
                        return
                events.clear()
        finally:
            if not ended:
                request.cancel()
                self.scheduler.drop_cancelled()

    # -- the step ----------------------------------------------------------------------------------

    def step(self) -> bool:
        """Schedule one batch, run one forward pass, sample, update. False when there was nothing to run."""
        batch = self.scheduler.schedule()
        if batch is None:
            return False
        output = self._forward(batch)
        picks = self._sample(batch, output.logits)
        self.scheduler.update(batch, output, picks)
        return True

    def _forward(self, batch: Batch) -> PassOutput:
        t0 = time.perf_counter()
        hidden = None
        if batch.pooled:  # embeddings in the batch: every token's hidden state too
            out, hidden = self.runner.forward_hidden(batch.tokens, batch.positions, batch.outputs, batch.seqs)
            logits = out if out is not None else np.empty((0, self.runner.model.hparams.n_vocab))
        else:
            logits = self.runner.forward(batch.tokens, batch.positions, output_rows=batch.outputs,
                                         seq_ids=batch.seqs, images=batch.images)
        return PassOutput(logits, hidden, t0, time.perf_counter())

    @staticmethod
    def _sample(batch: Batch, logits: np.ndarray) -> list[int | Exception | None]:
        """Every sampled sequence's token from its row, through sampling's one batched entry (each row by
        its sampler's route; the compiled ones in one call), once its constraint masked the row: the token,
        or the error that fails that sequence alone. None for a sequence with a draft (the scheduler's
        verify stage samples its rows)."""
        picks: list[int | Exception | None] = [None] * len(batch.sampled)
        drafts = batch.drafts
        plain: list[int] = []
        for i, run in enumerate(batch.sampled):
            if drafts is not None and drafts[i] is not None:
                continue
            try:
                run.out.mask(logits[batch.rows[i]])  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - e.g. the constraint broke: this sequence alone
                picks[i] = e
            else:
                plain.append(i)
        if plain:
            samplers = [batch.sampled[i].out.sampler for i in plain]  # type: ignore[union-attr]
            for i, pick in zip(plain, sample_batch(samplers, logits, [batch.rows[i] for i in plain]), strict=True):
                picks[i] = pick
        return picks

    def warm_up(self) -> None:
        """Before the first requests, prepare the plans of the passes that follow a prompt, so that no
        plan is built after a first token (a build costs 13-18 ms on SmolLM2, more on larger models).

        An unpadded engine (the API's): the one-token decode, and when it speculates by default the
        verifying passes' sizes. A padded engine (a server's): size the runner's buffer arena for the
        largest pass it makes (a full batch with an output per slot) and write its pages, then prepare
        the plans of the decode shapes (1..n_slots sequences). Memory is then taken up front, and no later
        batch shape grows it."""
        if self.batch_size is None:
            for n in self.scheduler.after_prompt_sizes():
                self.runner.plan(n, n)
            return
        n_slots = self.slots.n_slots
        # a full pass that also keeps every hidden state (embeddings in the batch) needs a little more
        self.runner.reserve(self.batch_size, self.scheduler.bucket(min(n_slots, self.batch_size)), hidden=True)
        self.runner.plan(self.batch_size, self.scheduler.bucket(min(n_slots, self.batch_size)))
        self.runner.arena.commit()
        for n in range(1, n_slots + 1):
            b = self.scheduler.bucket(n)
            self.runner.plan(b, b)


@dataclass(frozen=True)
class EngineConfig:
    """How an engine is laid out: the API's default (one unpadded slot, an error at the end of the
    context) or a server's (``n_slots`` padded slots sharing the context, ``batch_size`` tokens a pass)."""

    n_slots: int = 1
    batch_size: int | None = None
    end_of_context: EndOfContext = "error"
    max_plans: int = MAX_PLANS  # batch shapes whose prepared plans the runner keeps
    cache_ram: int = 0  # bytes of host memory for KV blocks that left the cache (0: none; --cache-ram)
    cache_disk: str | None = None  # a folder for the blocks that leave host memory (--cache-disk)
    cache_disk_bytes: int = 4 << 30  # at most this many bytes of them there
    # speculation's pass costs: measured on the passes that run ("measured"), or the prior alone ("prior":
    # the same drafts whatever else loads the machine; MINFER_PASS_COSTS sets the default)
    pass_costs: str = field(default_factory=lambda: os.environ.get("MINFER_PASS_COSTS", "measured"))
    # a free slot whose blocks give way to running sequences keeps them in the prompt cache (llama-server's
    # --cache-idle-slots; needs cache_ram or cache_disk)
    cache_idle_slots: bool = True


def build_engine(
    model: TransformerModel,
    backend: Backend,
    tokenizer: Any,
    n_ctx: int,
    cache_type: str | None = None,
    config: EngineConfig = EngineConfig(),
    observers: Seq[Any] = (),
    speculative: SpeculativeSettings | None = None,
    draft_model: TransformerModel | None = None,
) -> Engine:
    """The KV cache, the forward runner and the engine over them: the one construction that
    ``minfer.load`` and ``minfer serve`` share. ``draft_model`` (its vocabulary checked by the caller)
    drafts into a cache of its own with the same slots; ``speculative``: what requests get by default."""
    if config.pass_costs not in ("measured", "prior"):
        raise BadRequestError(f"MINFER_PASS_COSTS must be 'measured' or 'prior', got {config.pass_costs!r}")
    batched = config.n_slots > 1 or config.batch_size is not None  # batches that mix sequences
    backend.compiler.need(sampling_compile_jobs(batched))  # compiled with the first plan's kernels, in one batch
    if batched:
        backend.will_batch_sequences()
    # one pool of n_ctx positions that any sequence may fill (a draft model's cache mirrors the slots: it keeps
    # them split, each of n_ctx / n_slots positions)
    unified = config.n_slots > 1 and draft_model is None
    kv = slots_kv_cache(model.hparams, n_ctx, config.n_slots, cache_type, scratch=config.batch_size is not None,
                        unified=unified)
    # a verifying pass has 1 + draft length tokens: an unpadded engine sees up to draft_max more shapes
    spare = 0 if speculative is None or not speculative.on or config.batch_size is not None else speculative.draft_max
    runner = ForwardRunner(model, backend, kv, observers, max_plans=config.max_plans + spare)
    draft = None
    if draft_model is not None:
        draft = DraftModel(draft_model, backend, kv.capacity, config.n_slots, cache_type,
                           measure_costs=config.pass_costs == "measured")
    prompt_cache = None
    if config.cache_ram > 0 or config.cache_disk:
        disk = None
        if config.cache_disk:
            disk = DiskBlocks(config.cache_disk, config.cache_disk_bytes, cells_fingerprint(model, kv.cache_type))
        prompt_cache = PromptCache(config.cache_ram, disk)
    return Engine(runner, tokenizer, config.batch_size, config.end_of_context, speculative=speculative, draft=draft,
                  prompt_cache=prompt_cache, measure_costs=config.pass_costs == "measured",
                  cache_idle_slots=config.cache_idle_slots)
