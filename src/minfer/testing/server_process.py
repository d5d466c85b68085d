"""A real ``minfer serve`` process on a loopback port, for the server tests and the load benchmark."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


class ServerProcess:
    """``with ServerProcess(model, ["--parallel", "8"]) as s: httpx.get(s.url + "/health")``."""

    def __init__(self, model: str | Path, args: Sequence[str] = (), env: dict[str, str] | None = None,
                 startup_timeout: float = 300.0, health_timeout: float = 30.0) -> None:
        self.cmd = [sys.executable, "-m", "minfer", "serve", str(model), "--port", "0", *args]
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.health_timeout = health_timeout  # after the URL: a Ray front answers 200 once a replica is ready
        self.url = ""
        self.log: list[str] = []
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env=self.env)
        ready = threading.Event()

        def drain() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"on (http://\S+) ", line)
                if m and not self.url:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(self.startup_timeout) or not self.url:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.log))
        deadline = time.monotonic() + self.health_timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server never answered /health:\n" + "".join(self.log))
            time.sleep(0.05)
        return self

    def terminate(self) -> None:
        """SIGTERM: graceful shutdown."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of ``GET /metrics`` (``labels`` as written there, e.g. ``reason="cancelled"``)."""
        text = httpx.get(self.url + "/metrics", headers=self.auth_headers, timeout=10).text
        key = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0

    auth_headers: dict[str, str] = {}
