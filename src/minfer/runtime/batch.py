"""Continuous batching: one scheduler thread owns the model and serves many sequences at once.

Each running request holds a *slot*, one sequence of a shared KV cache (``KVCache(n_seq=n_slots)``, each
slot ``n_ctx // n_slots`` positions). Between two forward passes requests join (a free slot, their prompt
prefilled in chunks) and leave (finished, cancelled): one forward call evaluates every running
sequence's next token plus as much waiting prompt as the token budget allows, each token with its own
sequence id and position (positions and cache rows are data), so a decode step of eight streams costs
one pass over the weights instead of eight, and one attention call per layer for all of them (the fast
backend's ``attention_rows``: each token reads its own sequence's rows).

Prefix reuse: a finished request leaves its tokens in its slot. A new request takes the free slot whose
cached tokens share the longest prefix with its prompt, or copies the longest shared prefix from any
slot, and evaluates only the rest of its prompt.

Batch shapes: every new (tokens, outputs) shape costs a graph build and its own buffers, and a mixed
step's token count would otherwise be new almost every time. So a pass evaluates a bucketed number of
tokens (1..4, 8, then steps of about 1.5x up to the batch size): the spare rows are padding tokens at
position 0 of one extra scratch sequence that nothing reads (its rows never mix with a real sequence's:
each token attends to its own sequence only), and spare output rows repeat a real one.

Everything that touches the model, the cache or a request's decoder runs on the scheduler thread;
callers submit requests and receive events through the request's ``emit`` callback (called on that
thread: hand them to another thread or event loop from there).
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minfer.errors import BadRequestError, ContextOverflowError, MinferError
from minfer.models.hparams import HParams
from minfer.runtime.forward import ForwardRunner
from minfer.runtime.generate import GenerationStats, SequenceDecoder, TokenStep
from minfer.runtime.kv_cache import KVCache, common_prefix
from minfer.runtime.sampling import Sampler, sample_rows


def batch_kv_cache(hparams: HParams, n_ctx: int, n_slots: int, cache_type: str | None = None) -> KVCache:
    """A cache for ``n_slots`` sequences of ``n_ctx // n_slots`` positions each, plus the scratch
    sequence the scheduler pads batches with. Its memory is committed at creation: a server's resident
    memory does not grow as slots fill, and no pass waits on page faults (measured with 8 slots: copying a
    40-token prefix into fresh pages took 183-221 ms on this sandbox, into committed ones 0.2-0.3 ms)."""
    if n_slots < 1 or n_ctx < n_slots:
        raise BadRequestError(f"a context of {n_ctx} cannot hold {n_slots} sequences")
    capacity = n_ctx // n_slots
    return KVCache(hparams, capacity * (n_slots + 1), cache_type, n_seq=n_slots + 1, commit=True)


def batch_buckets(batch_size: int) -> list[int]:
    """Token counts a forward pass is padded to: 1..4, then 8 and about 1.5x apart, and ``batch_size``.

    5..7 tokens go to 8. A pass of 7 costs a little less than one of 8 (SmolLM2: 17.5 against 18.1 ms; 5
    tokens 13.6 ms), but exact buckets there multiply the (tokens, outputs) shapes of mixed passes, each
    a plan built while serving (17-40 ms), and a paired server run with them showed no gain."""
    sizes = [1, 2, 3, 4, 8]
    while sizes[-1] < batch_size:
        nxt = sizes[-1] * 3 // 2 if len(sizes) % 2 else sizes[-1] * 4 // 3
        sizes.append(nxt)
    return sorted({x for x in sizes if x < batch_size} | {batch_size})


class QueueFullError(MinferError):
    """The waiting queue is full: the caller should retry later."""


class ShuttingDownError(MinferError):
    """The scheduler no longer accepts requests."""


@dataclass
class Started:
    """The request got a slot; ``cached_tokens`` prompt tokens were reused from the cache."""

    cached_tokens: int


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


Event = Started | Token | Finished | Failed


@dataclass(eq=False)
class BatchRequest:
    """One sequence to generate. ``emit`` receives its events on the scheduler thread."""

    prompt_ids: Sequence[int]
    sampler: Sampler
    max_tokens: int | None  # None: until the slot's context is full
    emit: Callable[[Event], None]
    stop: Sequence[str] = ()
    logprobs: int | None = None
    constraint: Any = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Stop generating (thread-safe); the slot is freed before the next forward pass."""
        self.cancelled.set()


@dataclass(eq=False)
class _Running:
    request: BatchRequest
    slot: int
    decoder: SequenceDecoder
    stats: GenerationStats
    cached: int  # prompt tokens reused from the cache
    n_done: int  # prompt tokens in the cache so far (prefill progress)
    next_token: int | None = None  # the token to evaluate at ``pos`` once prefill is done
    pos: int = 0
    started_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None


@dataclass
class BatchMetrics:
    """Hooks the scheduler calls (on its thread) so a server can count what happens; all optional."""

    on_first_token: Callable[[float], None] | None = None  # seconds from submit to first token
    on_token_gap: Callable[[float], None] | None = None  # seconds between two tokens of a sequence
    on_finished: Callable[[GenerationStats, int], None] | None = None  # stats, cached prompt tokens
    on_step: Callable[[int, int, float], None] | None = None  # tokens evaluated, sequences, seconds
    # end of each loop iteration, once its events were emitted: a consumer that buffers events (the
    # server's event pump) hands them over then, one wake-up for the whole step
    after_events: Callable[[], None] | None = None


class BatchScheduler:
    """Serve :class:`BatchRequest` s from a bounded queue, up to ``kv.n_seq - 1`` running at once (the
    runner's cache comes from :func:`batch_kv_cache`: its last sequence is the padding scratch).

    ``batch_size``: most tokens one forward pass evaluates (decodes first, then prompt chunks).
    ``max_queue``: requests waiting for a slot beyond which :meth:`submit` raises :class:`QueueFullError`.
    """

    def __init__(
        self,
        runner: ForwardRunner,
        tokenizer: Any,
        batch_size: int = 512,
        max_queue: int = 64,
        metrics: BatchMetrics | None = None,
    ) -> None:
        if batch_size < 1:
            raise BadRequestError(f"batch_size must be >= 1, got {batch_size}")
        if max_queue < 0:
            raise BadRequestError(f"max_queue must be >= 0, got {max_queue}")
        self.runner = runner
        self.kv: KVCache = runner.kv
        if self.kv.n_seq < 2:
            raise BadRequestError("the batch scheduler needs a cache from batch_kv_cache (one sequence + scratch)")
        self.n_slots = self.kv.n_seq - 1
        self._pad_seq = self.kv.n_seq - 1
        self._buckets = batch_buckets(batch_size)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_queue = max_queue
        self.metrics = metrics or BatchMetrics()
        self._waiting: collections.deque[BatchRequest] = collections.deque()
        self._running: list[_Running] = []
        self._free_since: dict[int, int] = {s: 0 for s in range(self.kv.n_seq)}  # slot -> step it was freed
        self._step = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._finished = threading.Event()

    # -- caller side (any thread) -----------------------------------------------------------------

    @property
    def slot_context(self) -> int:
        """Positions each sequence can hold (prompt + generated)."""
        return self.kv.capacity

    def start(self) -> None:
        """Run the scheduler loop on a thread of its own (see :meth:`run`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="minfer-batch", daemon=True)
            self._thread.start()

    def run(self) -> None:
        """Run the scheduler loop on the calling thread until :meth:`stop` (from another thread).

        A server runs this on the main thread: numba's OpenMP kernels run about 3x slower when they are
        launched from a thread other than the main one (measured: a SmolLM2 decode step 8 ms on the main
        thread, 25-31 ms on another)."""
        self._started.set()
        try:
            self._loop()
        finally:
            self._finished.set()

    def submit(self, requests: Sequence[BatchRequest]) -> None:
        """Queue requests (all or none): QueueFullError when they do not fit in the waiting queue."""
        n_vocab = self.runner.model.hparams.n_vocab
        for r in requests:
            n = len(r.prompt_ids)
            if n == 0:
                raise BadRequestError("the prompt is empty (no tokens to start from)")
            # checked here: a bad id inside a shared forward pass would fail every sequence in it
            for i, t in enumerate(r.prompt_ids):
                if not 0 <= t < n_vocab:
                    raise BadRequestError(f"token id {t} at index {i} is outside the vocabulary (0..{n_vocab - 1})")
            if n > self.slot_context:
                raise ContextOverflowError(
                    f"the prompt has {n} tokens, more than the context of {self.slot_context} tokens per sequence"
                )
        with self._lock:
            if not self._accepting:
                raise ShuttingDownError("the server is shutting down")
            free = self.n_slots - len(self._running)
            if len(self._waiting) + len(requests) > self.max_queue + max(free, 0):
                raise QueueFullError(
                    f"too many requests: {len(self._waiting)} waiting for {self.n_slots} slots "
                    f"(queue limit {self.max_queue})"
                )
            self._waiting.extend(requests)
            self._wake.notify()

    def load(self) -> tuple[int, int]:
        """(running, waiting) sequences right now."""
        with self._lock:
            return len(self._running), len(self._waiting)

    def cells_in_use(self) -> int:
        """KV cache positions held by running sequences."""
        with self._lock:
            return sum(r.n_done if r.next_token is None else r.pos for r in self._running)

    def stop(self, timeout: float | None = None) -> None:
        """Stop accepting; let running and queued requests finish for up to ``timeout`` seconds (None:
        wait for all), then cancel what is left and end the thread."""
        with self._lock:
            self._accepting = False
            self._wake.notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            running, waiting = self.load()
            if not running and not waiting:
                break
            if deadline is not None and time.monotonic() >= deadline:
                with self._lock:
                    for r in [*self._waiting, *(x.request for x in self._running)]:
                        r.cancel()
                    self._wake.notify()
                break
            time.sleep(0.01)
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._started.is_set():
            self._finished.wait()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- scheduler thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._running and not self._waiting:
                    self._wake.wait(1.0)  # a timeout lets signal handlers run when this is the main thread
                if self._stopping and not self._running and not self._waiting:
                    return
                self._drop_cancelled_waiting()
                admitted = self._admit()
            for run in admitted:
                run.request.emit(Started(run.cached))
            self._drop_cancelled_running()
            if self._running:
                try:
                    self._step_once()
                except Exception as e:  # noqa: BLE001 - a failed pass fails its requests, never the server
                    self._fail_all(e)
            if self._stopping:
                with self._lock:
                    for r in self._waiting:
                        r.emit(Failed(ShuttingDownError("the server shut down before this request started")))
                    self._waiting.clear()
            if self.metrics.after_events:
                self.metrics.after_events()

    def _drop_cancelled_waiting(self) -> None:
        """Called with the lock held."""
        if not any(r.cancelled.is_set() for r in self._waiting):
            return
        for r in self._waiting:
            if r.cancelled.is_set():
                r.emit(Finished(GenerationStats(prompt_tokens=len(r.prompt_ids), finish_reason="cancelled"), 0))
        self._waiting = collections.deque(r for r in self._waiting if not r.cancelled.is_set())

    def _drop_cancelled_running(self) -> None:
        for run in [r for r in self._running if r.request.cancelled.is_set()]:
            self._finish(run, "cancelled")

    def _admit(self) -> list[_Running]:
        """Give free slots to waiting requests, in arrival order (called with the lock held)."""
        admitted = []
        while self._waiting and len(self._running) < self.n_slots:
            req = self._waiting.popleft()
            try:
                run = self._place(req)
            except Exception as e:  # noqa: BLE001 - a request whose setup fails fails alone
                req.emit(Failed(e))
                continue
            self._running.append(run)
            admitted.append(run)
        return admitted

    def _place(self, req: BatchRequest) -> _Running:
        prompt = list(req.prompt_ids)
        limit = len(prompt) - 1  # the last prompt token is always evaluated: its logits are needed
        busy = {r.slot for r in self._running}
        free = [s for s in range(self.n_slots) if s not in busy]
        best_src, best_n = -1, 0
        for s in range(self.n_slots):
            n = common_prefix(self.kv.tokens(s), prompt, limit)
            if n > best_n or (n == best_n and n > 0 and s in free and best_src not in free):
                best_src, best_n = s, n

        def lost(s: int) -> tuple[int, int, int]:
            """Cached tokens that taking slot ``s`` throws away (then: prefer no copy, the longest unused)."""
            held = len(self.kv.tokens(s))
            return (held - best_n if s == best_src else held, s != best_src, self._free_since[s])

        slot = min(free, key=lost)
        if best_n and slot != best_src:
            self.kv.copy_prefix(best_src, slot, best_n)
        self.kv.truncate(slot, best_n)
        stats = GenerationStats()
        room = self.slot_context - len(prompt) + 1  # the first token comes from the prompt's last logits
        max_tokens = room if req.max_tokens is None else min(req.max_tokens, room)
        decoder = SequenceDecoder(self.tokenizer, req.sampler, max_tokens, stats, stop=req.stop,
                                  logprobs=req.logprobs, constraint=req.constraint)
        decoder.start(prompt)
        return _Running(req, slot, decoder, stats, cached=best_n, n_done=best_n)

    def _step_once(self) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[int] = []
        outputs: list[int] = []
        sampled: list[_Running] = []
        finished_now = [r for r in self._running if r.decoder.done]  # max_tokens 0
        for run in finished_now:
            self._finish(run)
        for run in self._running:
            if run.next_token is not None:
                outputs.append(len(tokens))
                sampled.append(run)
                tokens.append(run.next_token)
                positions.append(run.pos)
                seqs.append(run.slot)
        budget = self._prompt_budget(len(tokens))
        for run in self._running:
            if run.next_token is not None or budget <= 0:
                continue
            prompt = run.request.prompt_ids
            chunk = min(len(prompt) - run.n_done, budget)
            tokens.extend(prompt[run.n_done : run.n_done + chunk])
            positions.extend(range(run.n_done, run.n_done + chunk))
            seqs.extend([run.slot] * chunk)
            run.n_done += chunk
            budget -= chunk
            if run.n_done == len(prompt):
                outputs.append(len(tokens) - 1)
                sampled.append(run)
        if not tokens:
            return
        n_real, n_out = len(tokens), len(outputs)
        pad = self._bucket(n_real) - n_real
        tokens += [0] * pad
        positions += [0] * pad
        seqs += [self._pad_seq] * pad
        spare = outputs[-1] if outputs else 0  # a pass of prompt chunks only still gets one (unused) output row
        outputs += [spare] * (self._bucket(max(n_out, 1)) - n_out)
        t0 = time.perf_counter()
        logits = self.runner.forward(tokens, positions, output_rows=outputs, seq_ids=seqs)[:n_out]
        t1 = time.perf_counter()
        for run in sampled:
            if run.next_token is None:
                run.stats.prefill_seconds = t1 - run.started_at
        self._step += 1
        if self.metrics.on_step:
            self.metrics.on_step(n_real, len(sampled), t1 - t0)
        # the sequences whose sampler alone picks the token draw together: one compiled call for all rows
        alone = [i for i, run in enumerate(sampled) if run.decoder.samples_alone]
        picks: list[int | None] = [None] * len(sampled)
        if len(alone) > 1:
            rows = logits[alone] if len(alone) < len(sampled) else logits  # a gather is a contiguous copy
            for i, token in zip(alone, sample_rows([sampled[i].decoder.sampler for i in alone], rows), strict=True):
                picks[i] = token
        for run, row, token in zip(sampled, logits, picks, strict=True):
            self._advance(run, row, token)

    def _bucket(self, n: int) -> int:
        return next(b for b in self._buckets if b >= n)

    def _prompt_budget(self, n_decode: int) -> int:
        """Prompt tokens this pass takes beside its ``n_decode`` decodes: as many as wait (up to the batch
        size), or fewer when that ends the pass exactly on a bucket instead of padding it to the next one.
        The tokens left out go first in the next pass, so nothing is computed twice; a cut of more than a
        quarter of the prompt tokens is not worth the delay (it would also starve a small pass)."""
        waiting = sum(len(r.request.prompt_ids) - r.n_done for r in self._running if r.next_token is None)
        take = min(waiting, self.batch_size - n_decode)
        n = n_decode + take
        if take == 0 or self._bucket(n) == n:
            return take
        fit = max(b for b in self._buckets if b <= n)
        return fit - n_decode if 4 * (fit - n_decode) >= 3 * take else take

    def warm_up(self) -> None:
        """Before the first requests: size the runner's buffer arena for the largest pass this scheduler
        makes (a full batch with an output per slot) and write its pages, then prepare the plans of the
        decode shapes (1..n_slots sequences). Memory is then taken up front, and no later batch shape
        grows it."""
        self.runner.plan(self.batch_size, self._bucket(min(self.n_slots, self.batch_size)))
        self.runner.arena.commit()
        for n in range(1, self.n_slots + 1):
            b = self._bucket(n)
            self.runner.plan(b, b)

    def _advance(self, run: _Running, logits: np.ndarray, token: int | None = None) -> None:
        try:
            step = run.decoder.step(logits, token)
        except Exception as e:  # noqa: BLE001 - e.g. a constraint with no allowed token: this request only
            run.request.emit(Failed(e))
            self._release(run)
            return
        now = time.perf_counter()
        if run.first_token_at is None:
            run.first_token_at = now
            if self.metrics.on_first_token:
                self.metrics.on_first_token(now - run.request.submitted_at)
        elif self.metrics.on_token_gap and run.last_token_at is not None:
            self.metrics.on_token_gap(now - run.last_token_at)
        run.last_token_at = now
        run.stats.decode_seconds = now - run.first_token_at
        if step is not None:
            run.request.emit(Token(step))
        if run.decoder.done:
            self._finish(run)
            return
        # the token just sampled is evaluated next, right after the prompt or the token before it
        next_pos = len(run.request.prompt_ids) if run.next_token is None else run.pos + 1
        if next_pos >= self.slot_context:  # not reached: max_tokens is capped by the room left
            self._finish(run, "length")
            return
        assert step is not None
        run.next_token, run.pos = step.token, next_pos

    def _finish(self, run: _Running, reason: str | None = None) -> None:
        tail = run.decoder.finish(reason)
        if tail is not None:
            run.request.emit(Token(tail))
        if self.metrics.on_finished:
            self.metrics.on_finished(run.stats, run.cached)
        run.request.emit(Finished(run.stats, run.cached))
        self._release(run)

    def _release(self, run: _Running) -> None:
        with self._lock:
            self._running.remove(run)
            self._free_since[run.slot] = self._step

    def _fail_all(self, error: Exception) -> None:
        if not isinstance(error, MinferError):
            traceback.print_exception(error)
        for run in list(self._running):
            run.request.emit(Failed(error))
            self._release(run)

