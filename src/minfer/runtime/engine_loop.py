"""The engine loop: the server's side of the engine, a bounded queue of requests and one thread that
steps the engine.

It is a loop, not a scheduler: what runs in a step is decided by :mod:`minfer.runtime.scheduler`; this
only feeds the engine and keeps stepping it. Callers on any thread :meth:`~EngineLoop.submit` requests
(all or none; :class:`QueueFullError` when the queue is full) and receive events through each request's
``emit`` callback, called on the engine's thread (hand them to another thread or event loop from there).
Between two engine steps, waiting requests are handed to the engine (its scheduler admits them into the
free slots), in arrival order. Everything that touches the model, the cache or a running sequence happens
on the engine's thread: this module only adds the queue, the lock and a graceful stop.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from minfer.errors import BadRequestError, MinferError
from minfer.runtime.engine import Engine
from minfer.runtime.forward import ForwardRunner
from minfer.runtime.kv_cache import KVCache
from minfer.runtime.requests import EngineHooks, Failed, Finished, Request


class QueueFullError(MinferError):
    """The waiting queue is full: the caller should retry later."""


class ShuttingDownError(MinferError):
    """The loop no longer accepts requests."""


@dataclass
class _Call:
    """Work for the engine's thread between two steps: ``fn()`` at once, or, ``sliced``, the generator ``fn()``
    makes, advanced one slice (up to its next ``yield``) between each two steps, its return value the result."""

    fn: Callable[[], Any]
    future: Future[Any]
    sliced: bool = False
    slices: Generator[None, None, Any] | None = None

    def advance(self) -> bool:
        """Run this call (a sliced one: its next slice); whether it is done (its future then holds the result)."""
        try:
            if self.slices is None:
                if not self.future.set_running_or_notify_cancel():
                    return True
                if not self.sliced:
                    self.future.set_result(self.fn())
                    return True
                self.slices = self.fn()
            next(self.slices)
            return False
        except StopIteration as done:
            self.future.set_result(done.value)
        except Exception as e:  # noqa: BLE001 - the caller gets it through the future
            self.future.set_exception(e)
        return True


class EngineLoop:
    """Serve :class:`~minfer.runtime.requests.GenerationRequest` s (and ``EmbeddingRequest`` s, which share
    the passes) from a bounded queue on a padded ``engine``.

    ``max_queue``: requests waiting for a slot beyond which :meth:`submit` raises :class:`QueueFullError`.
    """

    def __init__(self, engine: Engine, max_queue: int = 64) -> None:
        if max_queue < 0:
            raise BadRequestError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self._waiting: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._finished = threading.Event()
        # work that must run on the engine's thread between two steps (a traced forward pass, an image's
        # encoding), in arrival order: the calls handed over (under the lock) and those the engine's thread holds
        self._calls: collections.deque[_Call] = collections.deque()
        self._held_calls: collections.deque[_Call] = collections.deque()

    @property
    def metrics(self) -> EngineHooks:
        return self.engine.hooks

    @metrics.setter
    def metrics(self, hooks: EngineHooks) -> None:
        self.engine.hooks = hooks

    @property
    def kv(self) -> KVCache:
        return self.engine.kv

    @property
    def runner(self) -> ForwardRunner:
        return self.engine.runner

    @property
    def n_slots(self) -> int:
        return self.engine.slots.n_slots

    @property
    def slot_context(self) -> int:
        """Positions each sequence can hold (prompt + generated)."""
        return self.engine.slots.capacity

    # -- caller side (any thread) -----------------------------------------------------------------

    def start(self) -> None:
        """Run the loop on a thread of its own (see :meth:`run`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="minfer-batch", daemon=True)
            self._thread.start()

    def run(self) -> None:
        """Run the loop on the calling thread until :meth:`stop` (from another thread).

        A server runs this on the main thread: numba's OpenMP kernels run about 3x slower when they are
        launched from a thread other than the main one (measured: a SmolLM2 decode step 8 ms on the main
        thread, 25-31 ms on another)."""
        self._started.set()
        try:
            self._loop()
        finally:
            self._finished.set()

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests (all or none): the engine's refusal of one that can never run, or QueueFullError
        when they do not fit in the waiting queue."""
        for r in requests:
            self.engine.check(r)
        with self._lock:
            if not self._accepting:
                raise ShuttingDownError("the server is shutting down")
            free = self.n_slots - len(self.engine.running)
            if len(self._waiting) + len(requests) > self.max_queue + max(free, 0):
                raise QueueFullError(
                    f"too many requests: {len(self._waiting)} waiting for {self.n_slots} slots "
                    f"(queue limit {self.max_queue})"
                )
            self._waiting.extend(requests)
            self._wake.notify()

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn()`` on the engine's thread between two steps (never during one), e.g. a traced forward
        pass sharing the backend; its result or exception comes back through the future."""
        return self._queue_call(_Call(fn, Future()))

    def call_in_slices(self, fn: Callable[[], Generator[None, None, Any]]) -> Future[Any]:
        """Run the generator ``fn()`` makes on the engine's thread, one slice (up to its next ``yield``) between
        each two steps, so that running sequences go on decoding while it works (an image's pass through the
        vision tower, a layer at a time); its return value or exception comes back through the future. Calls run
        in arrival order: one queued behind a sliced call waits for it to end (they may share buffers)."""
        return self._queue_call(_Call(fn, Future(), sliced=True))

    def _queue_call(self, call: _Call) -> Future[Any]:
        with self._lock:
            if self._stopping or not self._accepting:
                raise ShuttingDownError("the server is shutting down")
            self._calls.append(call)
            self._wake.notify()
        return call.future

    def load(self) -> tuple[int, int]:
        """(running, waiting) sequences right now."""
        with self._lock:
            return len(self.engine.running), len(self._waiting)

    def cells_in_use(self) -> int:
        """KV cache positions held by running sequences."""
        return self.engine.cells_in_use()

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
                    for r in [*self._waiting, *(x.request for x in self.engine.running)]:
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

    # -- the engine's thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                while (not self._stopping and not engine.running and not self._waiting and not self._calls
                       and not self._held_calls):
                    self._wake.wait(1.0)  # a timeout lets signal handlers run when this is the main thread
                self._held_calls.extend(self._calls)
                self._calls.clear()
                if self._stopping and not engine.running and not self._waiting and not self._held_calls:
                    return
                self._drop_cancelled_waiting()
                self._admit()
            ran_calls = self._run_calls()
            if ran_calls and not engine.running:
                continue
            try:
                engine.step()
            except Exception as e:  # noqa: BLE001 - a failed pass fails its requests, never the server
                engine.fail_all(e)
            if self._stopping:
                with self._lock:
                    for r in self._waiting:
                        r.emit(Failed(ShuttingDownError("the server shut down before this request started")))
                    self._waiting.clear()
            if engine.hooks.after_events:
                engine.hooks.after_events()

    def _run_calls(self) -> bool:
        """Run the held calls in order, up to and including one slice of the first sliced one still going (then
        the engine steps); whether any ran."""
        ran = bool(self._held_calls)
        while self._held_calls:
            call = self._held_calls[0]
            if not call.advance():
                break
            self._held_calls.popleft()
        return ran

    def _drop_cancelled_waiting(self) -> None:
        """Called with the lock held."""
        if not any(r.cancelled.is_set() for r in self._waiting):
            return
        for r in self._waiting:
            if r.cancelled.is_set():
                r.stats.prompt_tokens, r.stats.finish_reason = len(r.prompt_ids), "cancelled"
                r.emit(Finished(r.stats, 0))
        self._waiting = collections.deque(r for r in self._waiting if not r.cancelled.is_set())

    def _admit(self) -> None:
        """Give free slots to waiting requests, in arrival order (called with the lock held)."""
        while self._waiting and self.engine.n_free:
            req = self._waiting.popleft()
            try:
                self.engine.add(req)
            except Exception as e:  # noqa: BLE001 - a request whose setup fails fails alone
                req.emit(Failed(e))
