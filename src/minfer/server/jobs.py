"""The bridge between HTTP requests on the event loop and sequences on the engine thread.

A :class:`Job` is the sequences of one HTTP request and the queue their events arrive in; the
:class:`EventPump` carries the engine loop's events to the loop once per step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from minfer.runtime.requests import Embedded, Event, Failed, Finished, Request, Started, Token
from minfer.runtime.sampling import TokenLogprob
from minfer.runtime.sequence import GenerationStats


@dataclass
class Choice:
    """What one generated sequence has produced so far."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: GenerationStats | None = None
    cached_tokens: int = 0
    slot: int = -1  # the slot it runs in
    error: Exception | None = None
    embedding: np.ndarray | None = None  # an embedding request's vector

    @property
    def finished(self) -> bool:
        return self.stats is not None or self.error is not None

    @property
    def cancelled(self) -> bool:
        """Ended by the engine loop, not by the model (the server is shutting down)."""
        return self.stats is not None and self.stats.finish_reason == "cancelled"


class EventPump:
    """Carries events from the engine thread to the event loop's queues.

    One forward pass emits a token to every running sequence; waking the loop once per event (a
    ``call_soon_threadsafe`` each, a write to its wake-up pipe each) cost more than sampling that token.
    Events wait in a list; the engine loop calls :meth:`flush` once per step, which wakes the loop once.
    """

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[tuple[int, Event]], tuple[int, Event]]] = []
        self._scheduled = False

    def put(self, queue: asyncio.Queue[tuple[int, Event]], item: tuple[int, Event]) -> None:
        """On the engine thread."""
        with self._lock:
            self._pending.append((queue, item))

    def flush(self) -> None:
        """On the engine thread: have the loop take what is pending (unless it is about to)."""
        with self._lock:
            if not self._pending or self._scheduled or self.loop is None:
                return
            self._scheduled = True
            loop = self.loop
        try:
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is gone: the server has stopped
            with self._lock:
                self._scheduled = False

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for queue, item in pending:
            queue.put_nowait(item)


class Job:
    """The sequences of one HTTP request, and the queue their events arrive in."""

    def __init__(self, pump: EventPump) -> None:
        self.pump = pump
        self.events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.requests: list[Request] = []
        self.choices: list[Choice] = []

    def emitter(self, index: int) -> Callable[[Event], None]:
        def emit(event: Event) -> None:  # on the engine thread
            self.pump.put(self.events, (index, event))

        return emit

    def cancel(self) -> None:
        for r in self.requests:
            r.cancel()

    def apply(self, index: int, event: Event) -> Choice:
        c = self.choices[index]
        if isinstance(event, Started):
            c.cached_tokens, c.slot = event.cached_tokens, event.slot
        elif isinstance(event, Token):
            c.text.append(event.step.text)
            if event.step.logprob is not None:
                c.logprobs.append(event.step.logprob)
        elif isinstance(event, Finished):
            c.stats, c.cached_tokens = event.stats, event.cached_tokens
        elif isinstance(event, Failed):
            c.error = event.error
        elif isinstance(event, Embedded):
            c.stats, c.embedding = event.stats, event.vector
        return c

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)
