"""The server's encoder thread: requests from many clients evaluated together.

Each request (its sequences, their token types) is queued with a future. The thread takes every request
waiting when it is free, evaluates all their sequences in one :meth:`EncoderRunner.hidden_states` call (which
packs them into passes by length), and hands each request its own sequences' hidden states. A request that
arrives while a batch runs waits for the next one: concurrent clients share passes instead of queueing pass
after pass. The loop decides nothing about what a request means (pooling and heads are the caller's).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from minfer.errors import BadRequestError, MinferError
from minfer.runtime.encoder import EncoderRunner


@dataclass
class EncoderJob:
    sequences: list[list[int]]
    token_types: list[list[int]]
    future: Future = field(default_factory=Future)


class EncoderLoop:
    """A thread evaluating queued :class:`EncoderJob`\\ s in shared batches (see the module docstring)."""

    def __init__(self, runner: EncoderRunner, max_queue: int = 256) -> None:
        self.runner = runner
        self._queue: queue.Queue[EncoderJob | None] = queue.Queue(max_queue)
        self._thread: threading.Thread | None = None
        self.batches = 0  # batches evaluated (several requests each, when they arrive together)
        self.running = 0  # sequences in the batch being evaluated now

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="minfer-encoder", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def submit(self, sequences: Sequence[Sequence[int]], token_types: Sequence[Sequence[int]] | None = None,
               what: str = "input") -> Future:
        """Queue the sequences; the future gets their hidden states (a list of ``[len, n_embd]`` arrays). A bad
        sequence is a :class:`BadRequestError` naming ``what[k]``."""
        types = [list(t) for t in token_types] if token_types is not None else [[0] * len(s) for s in sequences]
        job = EncoderJob([list(s) for s in sequences], types)
        for k, (ids, tt) in enumerate(zip(job.sequences, job.token_types, strict=True)):
            self.runner.check(ids, tt, k, what)  # a bad input fails its own request now, never a shared batch
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise BadRequestError(f"the server is busy: {self._queue.maxsize} requests are waiting") from None
        return job.future

    def run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            stop = False
            while True:  # everything waiting joins this batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                jobs.append(more)
            self._evaluate(jobs)
            if stop:
                return

    def _evaluate(self, jobs: list[EncoderJob]) -> None:
        sequences = [s for j in jobs for s in j.sequences]
        types = [t for j in jobs for t in j.token_types]
        self.running = len(sequences)
        try:
            hidden: list[np.ndarray] = self.runner.hidden_states(sequences, types)
        except MinferError as e:
            for j in jobs:
                j.future.set_exception(e)
            return
        except Exception as e:  # an engine bug: every job of the batch answers with it, the loop goes on
            for j in jobs:
                j.future.set_exception(e)
            return
        finally:
            self.running = 0
        self.batches += 1
        k = 0
        for j in jobs:
            n = len(j.sequences)
            j.future.set_result(hidden[k:k + n])
            k += n
