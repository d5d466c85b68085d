"""The engine: one step that every path drives (the Python API, the CLI, conversations and the server).

A step assembles one batch out of every running sequence (its next token, or a chunk of its prompt),
runs one forward pass, samples every sequence that got an output row (in one compiled call where the
sampler alone picks the token), then advances each sequence: its token, the text it releases, a stop, a
context shift, or the end of its slot. Positions and cache rows are data: token i of the batch belongs
to sequence ``seq_ids[i]`` at position ``positions[i]``, so prefill, decode and many sequences share one
graph, and one attention call per layer serves them all (each token reads its own sequence's rows).

Requests join with :meth:`Engine.add` (a free slot, see :mod:`minfer.runtime.slots`) and leave between
steps (finished, cancelled). An :class:`EmbeddingRequest` runs in the same passes: its prompt is
evaluated chunk by chunk beside the other sequences' work, with no sampling; the pass also keeps every
token's final-normed hidden state, which :mod:`minfer.runtime.pooling` pools into its vector, and the
slot is released once the last chunk is in. :meth:`Engine.run` drives the steps on the caller's thread until one
request ends (the API); :class:`minfer.runtime.scheduler.BatchScheduler` drives them from a queue on a
thread of its own (the server).

Batch shapes of a padded engine (the server's): every new (tokens, outputs) shape costs a graph build
and its own buffers, and a mixed step's token count would otherwise be new almost every time. So a pass
evaluates a bucketed number of tokens (1..4, 8, then steps of about 1.5x up to the batch size): the spare
rows are padding tokens at position 0 of the cache's scratch sequence, which nothing reads, and spare
output rows repeat a real one. An unpadded engine (the API's) evaluates exactly what it has: a whole
prompt in one pass, then one token per step.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from minfer.errors import BadRequestError, ContextOverflowError, MinferError
from minfer.models.model import TransformerModel
from minfer.runtime.forward import MAX_PLANS, ForwardRunner
from minfer.runtime.pooling import Pooler, Pooling
from minfer.runtime.sampling import Sampler, sample_rows
from minfer.runtime.sampling import compile_jobs as sampling_compile_jobs
from minfer.runtime.sampling import warm_up as warm_up_sampling
from minfer.runtime.sequence import Continuation, GenerationStats, TokenStep
from minfer.runtime.slots import Slots, slots_kv_cache
from minfer.runtime.speculative import SpeculativeSettings
from minfer.runtime.speculative.draft_model import DraftJob, DraftModel
from minfer.runtime.speculative.state import Draft, SequenceSpeculation

EndOfContext = Literal["error", "length"]


def batch_buckets(batch_size: int) -> list[int]:
    """Token counts a padded pass is padded to: 1..4, then 8 and about 1.5x apart, and ``batch_size``.

    5..7 tokens go to 8. A pass of 7 costs a little less than one of 8 (SmolLM2: 17.5 against 18.1 ms; 5
    tokens 13.6 ms), but exact buckets there multiply the (tokens, outputs) shapes of mixed passes, each
    a plan built while serving (17-40 ms), and a paired server run with them showed no gain."""
    sizes = [1, 2, 3, 4, 8]
    while sizes[-1] < batch_size:
        nxt = sizes[-1] * 3 // 2 if len(sizes) % 2 else sizes[-1] * 4 // 3
        sizes.append(nxt)
    return sorted({x for x in sizes if x < batch_size} | {batch_size})


@dataclass
class Started:
    """The request got slot ``slot``; ``cached_tokens`` prompt tokens were reused from the cache."""

    cached_tokens: int
    slot: int = field(default=-1, compare=False)  # which slot: informative, not part of what happened


@dataclass
class Token:
    step: TokenStep


@dataclass
class Finished:
    """The last event of a request that ran to its end (``stats.finish_reason`` says why)."""

    stats: GenerationStats
    cached_tokens: int


@dataclass
class Failed:
    """The last event of a request that could not be served; the others go on."""

    error: Exception


@dataclass
class Embedded:
    """The last event of an embedding request: its vector ``[n_embd]`` (``[n_tokens, n_embd]`` with pooling
    ``none``); ``stats.prompt_tokens`` counts the tokens evaluated."""

    vector: np.ndarray
    stats: GenerationStats


Event = Started | Token | Finished | Failed | Embedded


@dataclass(eq=False)
class GenerationRequest:
    """One sequence to generate. ``emit`` receives its events on the thread that drives the engine."""

    prompt_ids: Seq[int]
    sampler: Sampler
    max_tokens: int | None  # None: until the slot's context is full
    emit: Callable[[Event], None] = lambda event: None
    stop: Seq[str] = ()
    logprobs: int | None = None
    constraint: Any = None
    stop_ids: frozenset[int] | None = None  # None: the tokenizer's end-of-generation tokens
    context_shift: bool = False  # at the end of the slot, drop the oldest half after n_keep positions
    n_keep: int = 0
    speculative: SpeculativeSettings | None = None  # None: the engine's
    reuse_prefix: bool = True  # False: evaluate the whole prompt (llama-server's cache_prompt: false)
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Stop generating (thread-safe); the slot is freed before the next forward pass."""
        self.cancelled.set()


@dataclass(eq=False)
class EmbeddingRequest:
    """One sequence to embed: every token evaluated (no cached prefix: each position's hidden state is
    needed), none sampled. ``emit`` gets ``Started`` then ``Embedded`` (or ``Failed``, or ``Finished``
    with reason "cancelled")."""

    prompt_ids: Seq[int]
    pooling: Pooling = "mean"
    normalize: bool = True
    emit: Callable[[Event], None] = lambda event: None
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Stop (thread-safe); the slot is freed before the next forward pass."""
        self.cancelled.set()


Request = GenerationRequest | EmbeddingRequest


@dataclass
class EngineHooks:
    """Callbacks a server's metrics hang on the engine (each called on the engine's thread)."""

    on_first_token: Callable[[float], None] | None = None  # seconds from submission to the first token
    on_token_gap: Callable[[float], None] | None = None  # seconds between two tokens of one sequence
    on_finished: Callable[[GenerationStats, int], None] | None = None  # stats, cached prompt tokens
    on_step: Callable[[int, int, float], None] | None = None  # tokens evaluated, sequences sampled, seconds
    on_verified: Callable[[int, int], None] | None = None  # speculative decoding: tokens drafted, accepted
    # end of each scheduler iteration, once its events were emitted: a consumer that buffers events (the
    # server's event pump) hands them over then, one wake-up for the whole step
    after_events: Callable[[], None] | None = None


@dataclass
class _Batch:
    """One forward pass's inputs: token i of sequence ``seqs[i]`` at ``positions[i]``; the rows of
    ``outputs`` are sampled for ``sampled`` (in order); the first ``n_real`` tokens are not padding.
    ``drafts``: for each sampled sequence its draft, verified by 1 + its length rows (None: one row).
    ``pooled``: the embedding sequences' chunks, (sequence, first token index, length): the pass keeps
    every token's hidden state for them."""

    tokens: list[int]
    positions: list[int]
    seqs: list[int] | int
    outputs: list[int]
    sampled: list[_Running]
    n_real: int
    drafts: list[Draft | None] | None = None  # None: no sequence has a draft this pass
    pooled: list[tuple[_Running, int, int]] = field(default_factory=list)


@dataclass(eq=False)
class _Running:
    request: Request
    slot: int
    out: Continuation | None  # None for an embedding, which has ``pool`` instead
    cached: int  # prompt tokens reused from the cache
    n_done: int  # prompt tokens in the cache so far
    next_token: int | None = None  # sampled, to be evaluated at ``pos`` in the next pass
    pos: int = 0
    started_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    spec: SequenceSpeculation | None = None
    pool: Pooler | None = None


class Engine:
    """Sequences in the slots of ``runner.kv``, advanced together one :meth:`step` at a time.

    ``batch_size``: None for an unpadded engine (every sequence of the cache is a slot, a prompt goes in
    one pass); a number for a padded one (at most that many tokens a pass, decodes first, then prompt
    chunks; the cache's last sequence is the padding scratch, see :func:`~minfer.runtime.slots.slots_kv_cache`).
    ``end_of_context``: what a sequence that fills its slot gets: ``"error"`` (a ContextOverflowError
    naming the position, the API's rule) or ``"length"`` (its ``max_tokens`` is capped by the room left
    and it finishes with reason "length", the server's rule). A request with ``context_shift`` shifts
    instead.
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
    ) -> None:
        if batch_size is not None and batch_size < 1:
            raise BadRequestError(f"batch_size must be >= 1, got {batch_size}")
        self.runner = runner
        self.kv = runner.kv
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.end_of_context = end_of_context
        self.hooks = hooks or EngineHooks()
        if batch_size is None:
            self.slots = Slots(runner, self.kv.n_seq)
            self._pad_seq: int | None = None
            self._buckets: list[int] = []
        else:
            if self.kv.n_seq < 2:
                raise BadRequestError("a padded engine needs a cache with a scratch sequence (slots_kv_cache)")
            self.slots = Slots(runner, self.kv.n_seq - 1)
            self._pad_seq = self.kv.n_seq - 1
            self._buckets = batch_buckets(batch_size)
        # speculative decoding: what a request without its own settings gets, and the draft model if any
        self.speculative = speculative or SpeculativeSettings()
        self.draft = draft
        if draft is not None and (draft.capacity != self.slots.capacity or draft.kv.n_seq < self.slots.n_slots):
            raise BadRequestError("the draft model's cache does not match the engine's slots")
        self.check_speculative(self.speculative)
        # replaced, never mutated: another thread may read a consistent list at any time (metrics)
        self.running: list[_Running] = []
        self._steps = 0

    # -- requests ----------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Refuse a request this engine can never serve (thread-safe: reads only sizes). A bad id is
        refused here: inside a shared forward pass it would fail every sequence of the pass."""
        prompt = request.prompt_ids
        if len(prompt) == 0:
            raise BadRequestError("the prompt is empty (no tokens to start from)")
        n_vocab = self.runner.model.hparams.n_vocab
        for i, t in enumerate(prompt):
            if not 0 <= t < n_vocab:
                raise BadRequestError(f"token id {t} at index {i} is outside the vocabulary (0..{n_vocab - 1})")
        if len(prompt) > self.slots.capacity:
            per_sequence = " tokens per sequence" if self.slots.n_slots > 1 else ""
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens, more than the context of {self.slots.capacity}{per_sequence}"
            )
        if isinstance(request, GenerationRequest) and request.speculative is not None:
            self.check_speculative(request.speculative)

    def check_speculative(self, settings: SpeculativeSettings) -> None:
        """Refuse settings this engine cannot serve: a draft model it does not have, a draft too long."""
        if settings.mode == "draft" and self.draft is None:
            raise BadRequestError("speculative mode 'draft' needs a draft model (load the model with a draft)")
        settings.check_context(self.slots.capacity)

    def add(self, request: Request) -> None:
        """Give ``request`` a free slot (reusing the cached prefix it shares) and emit ``Started``."""
        self.check(request)
        if isinstance(request, EmbeddingRequest):
            slot, _ = self.slots.take(request.prompt_ids, reuse=False)
            request.stats.prompt_tokens = len(request.prompt_ids)
            pool = Pooler(request.pooling, request.normalize)
            self.running = [*self.running, _Running(request, slot, None, cached=0, n_done=0, pool=pool)]
            request.emit(Started(0, slot))
            return
        prompt = list(request.prompt_ids)
        room = self.slots.capacity - len(prompt) + 1  # the first token comes from the prompt's last logits
        max_tokens = request.max_tokens
        if max_tokens is None or (self.end_of_context == "length" and max_tokens > room):
            max_tokens = room
        out = Continuation(self.tokenizer, request.sampler, max_tokens, request.stats, request.stop_ids,
                           request.stop, request.logprobs, request.constraint)
        slot, cached = self.slots.take(prompt, reuse=request.reuse_prefix)
        out.start(prompt)
        settings = request.speculative or self.speculative
        spec = SequenceSpeculation(settings, prompt, request.sampler) if settings.on else None
        request.stats.speculative = settings.mode if spec is not None and spec.enabled else "off"
        self.running = [*self.running, _Running(request, slot, out, cached=cached, n_done=cached, spec=spec)]
        request.emit(Started(cached, slot))

    def cancel_all(self) -> None:
        """End every running sequence now (reason "cancelled")."""
        for run in self.running:
            self._finish(run, "cancelled")

    def fail_all(self, error: Exception) -> None:
        """A pass failed: its sequences fail with ``error`` (logged unless it is the user's mistake)."""
        if not isinstance(error, MinferError):
            traceback.print_exception(error)
        for run in self.running:
            run.request.emit(Failed(error))
            self._release(run)

    @property
    def n_free(self) -> int:
        """Slots a new request can take now."""
        return self.slots.n_free

    def cells_in_use(self) -> int:
        """KV cache positions held by running sequences."""
        return sum(r.n_done if r.next_token is None else r.pos for r in self.running)

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
                self._drop_cancelled()
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
                self._drop_cancelled()

    # -- the step ----------------------------------------------------------------------------------

    def step(self) -> bool:
        """Assemble one batch, run one forward pass, sample, advance. False when there was nothing to run."""
        self._drop_cancelled()
        for run in [r for r in self.running if r.out is not None and r.out.done]:  # max_tokens 0
            self._finish(run)
        batch = self._assemble(self._draft())
        if batch is None:
            return False
        sampled = batch.sampled
        t0 = time.perf_counter()
        if batch.pooled:
            out, hidden = self.runner.forward_hidden(batch.tokens, batch.positions, batch.outputs, batch.seqs)
            logits = out if out is not None else np.empty((0, self.runner.model.hparams.n_vocab))
        else:
            logits = self.runner.forward(batch.tokens, batch.positions, output_rows=batch.outputs,
                                         seq_ids=batch.seqs)
        t1 = time.perf_counter()
        for run, start, n in batch.pooled:
            assert run.pool is not None
            run.pool.add(hidden[start : start + n])
            if run.n_done == len(run.request.prompt_ids):
                self._embedded(run, t1)
        for run in sampled:
            run.request.stats.target_passes += 1
            if run.next_token is None:
                run.request.stats.prefill_seconds = t1 - run.started_at
        self._steps += 1
        if self.hooks.on_step:
            self.hooks.on_step(batch.n_real, len(sampled), t1 - t0)
        if batch.drafts is None:  # plain decoding: one row per sequence
            logits = logits[: len(sampled)]
            for run, row, token in zip(sampled, logits, self._sample(sampled, logits), strict=True):
                self._advance(run, row, token)
            return True
        first = np.cumsum([0] + [1 + (len(d.tokens) if d is not None else 0) for d in batch.drafts])
        plain = [i for i, d in enumerate(batch.drafts) if d is None]
        plain_rows = logits[first[plain]] if plain else logits[:0]
        picks = dict(zip(plain, self._sample([sampled[i] for i in plain], plain_rows), strict=True))
        for i, (run, draft) in enumerate(zip(sampled, batch.drafts, strict=True)):
            if draft is None:
                self._advance(run, logits[first[i]], picks[i])
            else:
                self._verify(run, logits[first[i] : first[i + 1]], draft)
        return True

    # -- speculative decoding ------------------------------------------------------------------------

    def _draft(self) -> dict[int, Draft] | None:
        """This step's drafts of the decoding sequences that speculate (by index in ``running``)."""
        jobs: list[tuple[int, DraftJob]] = []
        drafts: dict[int, Draft] = {}
        budget = None if self.batch_size is None else self.batch_size - sum(
            1 for r in self.running if r.next_token is not None)
        for i, run in enumerate(self.running):
            spec = run.spec
            if spec is None or not spec.enabled or run.next_token is None:
                continue
            out = run.out
            # a pass emits at most 1 + k tokens; the draft's positions pos+1..pos+k must fit in the slot
            room = min(out.max_tokens - out.stats.generated_tokens - 1, self.slots.capacity - 1 - run.pos)
            if budget is not None:
                room = min(room, budget)
            k = spec.limit(room)
            if k < max(1, spec.settings.draft_min):
                continue
            if spec.settings.mode == "lookup":
                draft = spec.lookup(out.stats.tokens, k)
                if draft is not None and out.constraint is not None:  # the grammar's allowed prefix only
                    draft = spec.kept(Draft(draft.tokens[: out.constraint.valid_prefix(draft.tokens)]))
                if draft is not None:
                    drafts[i] = draft
                    if budget is not None:
                        budget -= len(draft.tokens)
            else:
                assert spec.draft_sampler is not None
                context = self.kv.tokens(run.slot)[: run.pos] + [run.next_token]
                jobs.append((i, DraftJob(run.slot, context, k, spec.draft_sampler, spec.settings.draft_p_min,
                                         out.stop_ids, out.constraint)))
                if budget is not None:
                    budget -= k
        if jobs:
            assert self.draft is not None
            for (i, _), draft in zip(jobs, self.draft.propose([job for _, job in jobs]), strict=True):
                if draft is not None:
                    kept = self.running[i].spec.kept(draft)  # type: ignore[union-attr]
                    if kept is not None:
                        drafts[i] = kept
        return drafts or None

    def _verify(self, run: _Running, rows: np.ndarray, draft: Draft) -> None:
        """The target's rows after the next token and each draft token (see ``Continuation.verify``): the
        draft tokens it keeps, then its own token in place of the first rejected one or after them all."""
        k = len(draft.tokens)
        accepted = 0
        try:
            steps, accepted = run.out.verify(rows, draft)
        except Exception as e:  # noqa: BLE001 - e.g. a constraint with no allowed token: this request only
            run.request.emit(Failed(e))
            self._release(run)
            return
        finally:
            # the cache holds the next token and the kept draft tokens; the rows after them are stale
            self.kv.truncate(run.slot, run.pos + 1 + accepted)
            stats = run.request.stats
            stats.drafted_tokens += k
            stats.accepted_tokens += accepted
            assert run.spec is not None
            run.spec.verified(k, accepted)
            if self.hooks.on_verified:
                self.hooks.on_verified(k, accepted)
        for step in steps:
            self._emit(run, step)
        if run.out.done:
            self._finish(run)
            return
        last = steps[-1]
        assert last is not None and last.token is not None
        self._move_on(run, last.token, run.pos + len(steps))

    def _assemble(self, drafts: dict[int, Draft] | None = None) -> _Batch | None:
        """Every running sequence's next token (and its draft, if any), then as much waiting prompt as the
        budget allows."""
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[int] = []
        outputs: list[int] = []
        sampled: list[_Running] = []
        drafted: list[Draft | None] = []
        pooled: list[tuple[_Running, int, int]] = []
        for i, run in enumerate(self.running):
            if run.next_token is not None:
                outputs.append(len(tokens))
                sampled.append(run)
                tokens.append(run.next_token)
                positions.append(run.pos)
                seqs.append(run.slot)
                draft = drafts.get(i) if drafts else None
                drafted.append(draft)
                if draft is not None:  # each draft token is evaluated after the one before, its row sampled
                    k = len(draft.tokens)
                    outputs.extend(range(len(tokens), len(tokens) + k))
                    tokens.extend(draft.tokens)
                    positions.extend(range(run.pos + 1, run.pos + 1 + k))
                    seqs.extend([run.slot] * k)
        budget = self._prompt_budget(len(tokens))
        for run in self.running:
            if run.next_token is not None or budget <= 0:
                continue
            prompt = run.request.prompt_ids
            chunk = min(len(prompt) - run.n_done, budget)
            tokens.extend(prompt[run.n_done : run.n_done + chunk])
            positions.extend(range(run.n_done, run.n_done + chunk))
            seqs.extend([run.slot] * chunk)
            run.n_done += chunk
            budget -= chunk
            if run.pool is not None:  # an embedding: its hidden states, no logits
                pooled.append((run, len(tokens) - chunk, chunk))
            elif run.n_done == len(prompt):
                outputs.append(len(tokens) - 1)
                sampled.append(run)
                drafted.append(None)
        if not tokens:
            return None
        n_real, n_out = len(tokens), len(outputs)
        spec = drafted if drafts else None
        if self._pad_seq is None:
            one_seq = len(set(seqs)) == 1  # then the runner records the tokens in one go
            return _Batch(tokens, positions, seqs[0] if one_seq else seqs, outputs, sampled, n_real, spec, pooled)
        pad = self._bucket(n_real) - n_real
        tokens += [0] * pad
        positions += [0] * pad
        seqs += [self._pad_seq] * pad
        if n_out or not pooled:
            # a pass of prompt chunks only still gets one (unused) output row; one with embeddings needs none
            spare = outputs[-1] if outputs else 0
            outputs += [spare] * (self._bucket(max(n_out, 1)) - n_out)
        return _Batch(tokens, positions, seqs, outputs, sampled, n_real, spec, pooled)

    def _bucket(self, n: int) -> int:
        return next(b for b in self._buckets if b >= n)

    def _prompt_budget(self, n_decode: int) -> int:
        """Prompt tokens this pass takes beside its ``n_decode`` decodes: as many as wait (up to the batch
        size), or fewer when that ends the pass exactly on a bucket instead of padding it to the next one.
        The tokens left out go first in the next pass, so nothing is computed twice; a cut of more than a
        quarter of the prompt tokens is not worth the delay (it would also starve a small pass)."""
        waiting = sum(len(r.request.prompt_ids) - r.n_done for r in self.running if r.next_token is None)
        if self.batch_size is None:
            return waiting
        take = min(waiting, self.batch_size - n_decode)
        n = n_decode + take
        if take == 0 or self._bucket(n) == n:
            return take
        fit = max(b for b in self._buckets if b <= n)
        return fit - n_decode if 4 * (fit - n_decode) >= 3 * take else take

    def _sample(self, sampled: list[_Running], logits: np.ndarray) -> list[int | None]:
        """The sequences whose sampler alone picks the token draw together: one compiled call for all rows.
        The others (a constraint, logprobs) pick in their own step."""
        alone = [i for i, run in enumerate(sampled) if run.out.samples_alone]
        picks: list[int | None] = [None] * len(sampled)
        if len(alone) > 1:
            rows = logits[alone] if len(alone) < len(sampled) else logits  # a gather is a contiguous copy
            for i, token in zip(alone, sample_rows([sampled[i].out.sampler for i in alone], rows), strict=True):
                picks[i] = token
        return picks

    def warm_up(self) -> None:
        """Before the first requests of a padded engine: size the runner's buffer arena for the largest
        pass it makes (a full batch with an output per slot) and write its pages, then prepare the plans
        of the decode shapes (1..n_slots sequences). Memory is then taken up front, and no later batch
        shape grows it."""
        if self.batch_size is None:
            return
        n_slots = self.slots.n_slots
        # a full pass that also keeps every hidden state (embeddings in the batch) needs a little more
        self.runner.reserve(self.batch_size, self._bucket(min(n_slots, self.batch_size)), hidden=True)
        self.runner.plan(self.batch_size, self._bucket(min(n_slots, self.batch_size)))
        self.runner.arena.commit()
        for n in range(1, n_slots + 1):
            b = self._bucket(n)
            self.runner.plan(b, b)

    def _advance(self, run: _Running, logits: np.ndarray, token: int | None) -> None:
        try:
            step = run.out.step(logits, token)
        except Exception as e:  # noqa: BLE001 - e.g. a constraint with no allowed token: this request only
            run.request.emit(Failed(e))
            self._release(run)
            return
        self._emit(run, step)
        if run.out.done:
            self._finish(run)
            return
        assert step is not None and step.token is not None
        # the token just sampled is evaluated next, right after the prompt or the token before it
        self._move_on(run, step.token, len(run.request.prompt_ids) if run.next_token is None else run.pos + 1)

    def _emit(self, run: _Running, step: TokenStep | None) -> bool:
        """Hand a token's step to the request (with its timings); whether the sequence goes on after it."""
        now = time.perf_counter()
        hooks = self.hooks
        if run.first_token_at is None:
            run.first_token_at = now
            if hooks.on_first_token:
                hooks.on_first_token(now - run.request.submitted_at)
        elif hooks.on_token_gap and run.last_token_at is not None:
            hooks.on_token_gap(now - run.last_token_at)
        run.last_token_at = now
        run.request.stats.decode_seconds = now - run.first_token_at
        if step is not None:
            run.request.emit(Token(step))
        return not run.out.done

    def _move_on(self, run: _Running, token: int, next_pos: int) -> None:
        """``token`` is evaluated in the next pass, at ``next_pos`` (or after a context shift)."""
        if next_pos >= self.slots.capacity:
            if run.request.context_shift:
                next_pos = self.slots.shift(run.slot, run.request.n_keep, next_pos)
            elif self.end_of_context == "length":  # not reached: max_tokens is capped by the room left
                self._finish(run, "length")
                return
            else:
                run.request.emit(Failed(ContextOverflowError(
                    f"generation reached the end of the context: the next token would be at position {next_pos}, "
                    f"n_ctx is {self.slots.capacity} (use a larger context)"
                )))
                self._release(run)
                return
        run.next_token, run.pos = token, next_pos

    def _drop_cancelled(self) -> None:
        for run in [r for r in self.running if r.request.cancelled.is_set()]:
            self._finish(run, "cancelled")

    def _embedded(self, run: _Running, now: float) -> None:
        assert run.pool is not None
        stats = run.request.stats
        stats.prefill_seconds, stats.finish_reason = now - run.started_at, "stop"
        try:
            vector = run.pool.result()
        except Exception as e:  # noqa: BLE001 - this request only
            run.request.emit(Failed(e))
        else:
            if self.hooks.on_finished:
                self.hooks.on_finished(stats, 0)
            run.request.emit(Embedded(vector, stats))
        self._release(run)

    def _finish(self, run: _Running, reason: str | None = None) -> None:
        if run.out is None:  # an embedding ended before its vector (cancelled)
            run.request.stats.finish_reason = reason or "cancelled"
            run.request.emit(Finished(run.request.stats, 0))
            self._release(run)
            return
        tail = run.out.finish(reason)
        if tail is not None:
            run.request.emit(Token(tail))
        if self.hooks.on_finished:
            self.hooks.on_finished(run.request.stats, run.cached)
        run.request.emit(Finished(run.request.stats, run.cached))
        self._release(run)

    def _release(self, run: _Running) -> None:
        self.running = [r for r in self.running if r is not run]
        self.slots.release(run.slot, self._steps)


@dataclass(frozen=True)
class EngineConfig:
    """How an engine is laid out: the API's default (one unpadded slot, an error at the end of the
    context) or a server's (``n_slots`` padded slots sharing the context, ``batch_size`` tokens a pass)."""

    n_slots: int = 1
    batch_size: int | None = None
    end_of_context: EndOfContext = "error"
    max_plans: int = MAX_PLANS  # batch shapes whose prepared plans the runner keeps


def build_engine(
    model: TransformerModel,
    backend: Any,
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
    batched = config.n_slots > 1 or config.batch_size is not None  # batches that mix sequences
    compiler = getattr(backend, "compiler", None)
    if compiler is not None:  # compiled with the first plan's kernels, in one announced batch
        compiler.need(sampling_compile_jobs(batched))
        if batched:
            backend.will_batch_sequences()
    else:
        warm_up_sampling()
    kv = slots_kv_cache(model.hparams, n_ctx, config.n_slots, cache_type, scratch=config.batch_size is not None)
    # a verifying pass has 1 + draft length tokens: an unpadded engine sees up to draft_max more shapes
    spare = 0 if speculative is None or not speculative.on or config.batch_size is not None else speculative.draft_max
    runner = ForwardRunner(model, backend, kv, observers, max_plans=config.max_plans + spare)
    draft = None
    if draft_model is not None:
        draft = DraftModel(draft_model, backend, kv.capacity, config.n_slots, cache_type)
    return Engine(runner, tokenizer, config.batch_size, config.end_of_context, speculative=speculative, draft=draft)
