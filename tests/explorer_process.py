"""``minfer trace ... --serve`` run as a user runs it: a subprocess on a free port, its URL read from stderr."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def explorer_process(args: list[str], start_timeout: float = 120) -> Iterator[str]:
    """Start ``minfer trace <args> --serve --port 0``; yield the page URL it prints (``http://host:port/trace``,
    with ``?run=...`` when it ran a model)."""
    proc = subprocess.Popen([sys.executable, "-m", "minfer", "trace", *args, "--serve", "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    url: list[str] = []
    ready = threading.Event()

    def drain() -> None:  # reads stderr to its end, so the explorer never blocks on a full pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.search(r"explorer on (http://\S+)", line)
            if m and not url:
                url.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert ready.wait(start_timeout) and url, "the explorer did not start"
        yield url[0]
    finally:
        proc.terminate()
        proc.wait(30)
