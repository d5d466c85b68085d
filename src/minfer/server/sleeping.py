"""One model that sleeps when idle: ``minfer serve MODEL --sleep-idle-seconds S`` (llama-server's flag).

The model is served by a ``minfer serve`` process of its own on loopback (the several-model router's machinery,
:class:`~minfer.server.model_router.ModelRouter`, with one model), loaded at the start. Once no request has run
for S seconds that process exits, which gives all of the model's memory back (weights, KV cache, compiled plans):
the server sleeps. While it sleeps, ``/health``, ``/props`` (``"is_sleeping": true``), ``/v1/models`` and
``/metrics`` are answered here from what the model's server last said, without waking it, as llama-server answers
them from its cached responses; any other request wakes it (the model loads again) and is answered once it has.
``/metrics`` totals run on across sleeps: each new process's counters are added to those its predecessors ended
with, and its ``Process-Start-Time-Unix`` is this server's start.

A process rather than freeing the model in this one: an exiting process returns every byte, where a Python
process keeps what its allocator and numba's compiled kernels hold; and numba's kernels must run on a process's
main thread (see the router's docstring), which the model's own server has.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from minfer.server.metrics import add_carried_totals
from minfer.server.model_router import LOADED, ModelEntry, ModelRouter

# the routes answered while the model sleeps (llama-server's create_response(bypass_sleep = true))
_MODELS_PATHS = ("/v1/models", "/models")


class SleepingServer(ModelRouter):
    """The ASGI app of a one-model server that sleeps when idle (see the module docstring)."""

    def __init__(self, entry: ModelEntry, arguments: list[str], api_keys: tuple[str, ...], max_body_size: int,
                 sleep_idle: float, ui: bool = True) -> None:
        super().__init__([entry], [], 1, api_keys, max_body_size, sleep_idle, ui=ui)
        self.arguments = arguments  # this server's own command line after `serve`
        self.start_time = int(time.time())
        self.cached_props: dict[str, Any] | None = None
        self.cached_models: bytes | None = None
        self.cached_metrics: tuple[int, bytes, str] | None = None  # status, body, content type
        self.carried: dict[str, float] = {}  # the counters' totals of the model's earlier processes
        self.released = False  # the model's process has exited: what /props calls sleeping (llama-server's order)

    @property
    def sleeping(self) -> bool:
        """Whether the model's server cannot answer now (asleep, falling asleep or waking): answer from the cache."""
        return self.default.state != LOADED

    def _command(self, entry: ModelEntry) -> list[str]:
        # the flags given here, then the model server's own address, key, and no sleeping of its own (-1)
        return [sys.executable, "-m", "minfer", "serve", *_without_keep_alive(self.arguments), "--host", "127.0.0.1",
                "--port", "0", "--api-key", self.internal_key, "--sleep-idle-seconds", "-1"]

    def find(self, name: str, path: str = "") -> ModelEntry:
        return self.default  # one model: any name reaches it (its server refuses others under --strict-model)

    # -- lifespan: the model loads before the server answers, as a one-model server's ---------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        try:
            await self.acquire(self.default)
        except Exception as e:  # noqa: BLE001 - the model did not load: the server does not start
            await send({"type": "lifespan.startup.failed", "message": str(e)})
            return
        self.release(self.default)  # the idle clock starts now
        await send({"type": "lifespan.startup.complete"})
        message = await receive()
        await self._stop(self.default)
        await self.client.aclose()
        await send({"type": "lifespan.shutdown.complete"})

    async def _start(self, entry: ModelEntry) -> None:
        await super()._start(entry)
        self.released = False
        props = await self._fetch("/props")
        if props is not None and props.status_code == 200:
            self.cached_props = props.json()
        models = await self._fetch("/v1/models")
        if models is not None and models.status_code == 200:
            self.cached_models = models.content

    async def _stop(self, entry: ModelEntry) -> None:
        if entry.state == LOADED:
            totals = await self._scrape_metrics()
            if totals is not None:
                self.carried = totals  # the totals this process ends with carry on into the next one
        await super()._stop(entry)
        self.released = True

    async def _fetch(self, path: str) -> httpx.Response | None:
        url = self.default.url
        if url is None or self.client is None:
            return None
        try:
            return await self.client.get(url + path, timeout=30.0,
                                         headers={"authorization": f"Bearer {self.internal_key}"})
        except httpx.HTTPError:
            return None

    async def _scrape_metrics(self) -> dict[str, float] | None:
        """The model server's ``/metrics`` with the earlier processes' totals added, kept for the scrapes while it
        sleeps; its counters' totals (None when it did not answer them)."""
        response = await self._fetch("/metrics")
        if response is None:
            return None
        content_type = response.headers.get("content-type", "text/plain; version=0.0.4")
        if response.status_code != 200:  # --no-metrics: its 501, as it is
            self.cached_metrics = (response.status_code, response.content, content_type)
            return None
        text, totals = add_carried_totals(response.text, self.carried)
        self.cached_metrics = (200, text.encode(), content_type)
        return totals

    # -- the routes answered without waking the model ---------------------------------------------

    def _own_route(self, method: str, path: str) -> Any:
        if method != "GET":
            return None
        if path == "/metrics":
            return self._metrics
        if path == "/health":
            return self._health_route
        if path == "/props":
            return self._props
        if path in _MODELS_PATHS:
            return self._models_route
        return None

    async def _pass_through(self, scope: Scope, send: Send) -> None:
        """Forward to the awake model's server without counting it as use: probes do not keep a model awake."""
        assert self.default.url is not None
        await self._forward(self.default.url, scope, b"", send)

    async def _health_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.sleeping:
            await self._json(send, {"status": "ok"})
        else:
            await self._pass_through(scope, send)

    async def _props(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.sleeping and self.cached_props is not None:
            await self._json(send, {**self.cached_props, "is_sleeping": self.released})
        else:
            await self._pass_through(scope, send)

    async def _models_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.sleeping and self.cached_models is not None:
            await self._raw(send, 200, self.cached_models, "application/json")
        else:
            await self._pass_through(scope, send)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.sleeping:
            await self._scrape_metrics()
        if self.cached_metrics is None:
            await self._raw(send, 503, b'{"error": {"code": 503, "message": "Loading model", '
                            b'"type": "unavailable_error"}}', "application/json")
            return
        status, body, content_type = self.cached_metrics
        await self._raw(send, status, body, content_type,
                        [(b"process-start-time-unix", str(self.start_time).encode())] if status == 200 else [])


def _without_keep_alive(arguments: list[str]) -> list[str]:
    """``arguments`` less ``--keep-alive`` (which would make the model's server a sleeping front of its own)."""
    out: list[str] = []
    skip = False
    for arg in arguments:
        if skip:
            skip = False
        elif arg == "--keep-alive":
            skip = True
        elif not arg.startswith("--keep-alive="):
            out.append(arg)
    return out


def serve_sleeping(opts: Any, arguments: list[str], sleep_idle: float) -> None:
    """Serve ``opts.model`` (a :class:`~minfer.server.ServeOptions`), sleeping once idle ``sleep_idle`` seconds,
    until SIGINT/SIGTERM; ``arguments``: the command line after ``serve``, which the model's server gets."""

    import uvicorn

    from minfer.pull import resolve_model
    from minfer.server import SHUTDOWN_GRACE_SECONDS, cors_policy, errors_to_stderr, listening_socket, with_keys
    from minfer.server.api_keys import resolve_api_keys
    from minfer.server.cors import with_cors
    from minfer.server.http_protocols import http_protocol

    path = Path(resolve_model(opts.model))
    name = opts.alias or path.name
    api_keys = resolve_api_keys(opts.api_keys)
    server_app = SleepingServer(ModelEntry(name, path), arguments, api_keys, opts.max_body_size, sleep_idle,
                                ui=opts.ui)
    # CORS here, in front: a preflight is answered without the key and without waking the model, and the
    # answers given while it sleeps carry the headers too (the model's server's own give way to these)
    app = with_cors(server_app, cors_policy(opts))
    errors_to_stderr()
    sock = listening_socket(opts.host, opts.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=opts.log_level, access_log=False, http=http_protocol(),
                                           timeout_graceful_shutdown=opts.shutdown_timeout + SHUTDOWN_GRACE_SECONDS))
    idle = "unloaded on request only" if sleep_idle == math.inf else f"sleeping after {sleep_idle:g} idle seconds"
    print(f"minfer: serving {name} on http://{host}:{port} ({idle}; this "
          f"process holds {_rss_mib():.0f} MiB before the model loads){with_keys(api_keys)}",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])


def _rss_mib() -> float:
    """This process's resident memory (Linux; 0 elsewhere), logged so a sleeping server's can be compared."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0

