"""What the command line says while numba compiles kernels: a notice the moment a batch starts, a progress
bar while it runs (on a terminal; a single line otherwise), how long it took; and a line for any kernel
compiled outside a batch (a path the jobs did not foresee), so that no first use stalls in silence.

The batches and their jobs are :mod:`minfer.compiling`'s events; a kernel compiled outside them is numba's
own ``numba:compile`` event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from minfer.compiling import BATCH_EVENT, JOB_EVENT


class CompileNotice:
    """Listens to the compile events and writes to ``stream``."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._lock = threading.Lock()
        self._batch_start: float | None = None
        self._bar: Any = None
        self._depth = 0  # nested numba compiles outside a batch
        self._announced: set[str] = set()
        self.batches = 0  # batches announced (tests and `minfer warmup` read them)
        self.compiled_s = 0.0

    # -- minfer's batches --------------------------------------------------------------------------------

    def batch(self, ev: Any) -> None:
        data = ev.data
        if ev.status.name == "START":
            self._batch_start = time.perf_counter()
            self.batches += 1
            workers = data["workers"]
            spread = f", {workers} processes" if workers > 1 else ""
            self._write(f"minfer: compiling kernels for {data['label']} (first run only, ~{data['estimate_s']:.0f} s"
                        f"{spread})\n")
            if self.tty:
                from tqdm import tqdm

                self._bar = tqdm(total=data["jobs"], desc="minfer: compiling", unit="kernel", file=self.stream,
                                 leave=False, dynamic_ncols=True)
            return
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        elapsed = time.perf_counter() - (self._batch_start or time.perf_counter())
        self.compiled_s += elapsed
        self._batch_start = None
        self._write(f"minfer: kernels compiled in {elapsed:.1f} s (cached for later runs)\n")

    def job(self, ev: Any) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.update(1)

    # -- numba's own compiles, outside a batch ----------------------------------------------------------

    def numba_start(self, ev: Any) -> None:
        self._depth += 1
        if self._depth > 1 or self._batch_start is not None:
            return
        fn = ev.data["dispatcher"].py_func
        name = f"{fn.__module__.removeprefix('minfer.')}.{fn.__qualname__}"
        if name not in self._announced:
            self._announced.add(name)
            self._write(f"minfer: compiling kernel {name} (first use only)\n")

    def numba_end(self, ev: Any) -> None:
        self._depth -= 1

    def _write(self, text: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.clear()
            self.stream.write(text)
            self.stream.flush()
            if self._bar is not None:
                self._bar.refresh()


class _Listener:
    """A numba event listener calling ``on_start`` / ``on_end``."""

    def __init__(self, on_start: Any, on_end: Any) -> None:
        from numba.core import event

        class L(event.Listener):
            def on_start(self, ev: Any) -> None:
                on_start(ev)

            def on_end(self, ev: Any) -> None:
                on_end(ev)

        self.listener = L()


@contextmanager
def compile_notices(stream: TextIO) -> Iterator[CompileNotice]:
    """Announce compiles on ``stream`` while the block runs."""
    from numba.core import event

    notice = CompileNotice(stream)
    listeners = {
        BATCH_EVENT: _Listener(notice.batch, notice.batch).listener,
        JOB_EVENT: _Listener(notice.job, notice.job).listener,
        "numba:compile": _Listener(notice.numba_start, notice.numba_end).listener,
    }
    for kind, listener in listeners.items():
        event.register(kind, listener)
    try:
        yield notice
    finally:
        for kind, listener in listeners.items():
            event.unregister(kind, listener)
