"""Several models behind one address: ``minfer serve A.gguf B.gguf`` or ``minfer serve --models-dir DIR``.

Each model is served by a ``minfer serve`` child process of its own on loopback, started on the first request
that names it (requests that arrive meanwhile wait for it; none fails) and stopped when another model needs its
place (``--models-max``, the least recently used one whose requests have all finished: a stream is never cut),
once idle for ``--sleep-idle-seconds`` or for the ``keep_alive`` an ollama request gave it (0: at once; negative:
never), or on ``POST /models/unload``. A process per model, rather than engines sharing one, because numba's
OpenMP kernels run about 3x slower when launched off a process's main thread (each child runs its engine loop on
its own main thread, as a one-model server does), and because an exiting process returns all of its memory.

A vision model is a subfolder of ``--models-dir`` holding its GGUF and an ``mmproj*.gguf`` (llama-server's router
layout): its server is started with ``--mmproj`` that file; ``--allow-image-urls`` goes to every generating model's.

This front answers the routes about the models themselves: ``GET /v1/models`` and ``/models`` (each model with
its ``status``: loaded, loading, unloaded, and its ``capabilities``, read from its files without loading it),
``POST /models/load`` and ``/models/unload`` (llama-server's router shapes), ollama's ``GET /api/tags``, ``/api/ps``
and ``/api/version``, and ``/health``. Every other request goes to the model its body's ``model`` names (or
``?model=``; without one, the first model), answered by that model's own server: the same routes, bodies and errors
as a one-model server. ``NAME:latest`` and ``NAME.gguf`` are
``NAME``. An unknown name is a 404 listing the names there are.

``GET /metrics`` is the front's own: every loaded model's ``/metrics`` with a ``model="NAME"`` label on each sample
(each family's HELP and TYPE once), and the front's gauges (``minfer_models_loaded``, ``minfer_model_loaded{model}``,
``minfer_model_load_seconds{model}``, ``minfer_model_loads_total{model}``); ``?model=NAME``: that model's alone,
labelled. An unloaded model's counters went with its process: it shows in the front's gauges only, and its counters
start again from 0 when it loads again (a counter reset to Prometheus' ``rate()``). ``/api/tags`` and ``/api/ps``
give each model's sha256 digest, as its own server does, computed once per file (path, size, modification time).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import Receive, Scope, Send

from minfer.errors import BadRequestError
from minfer.server.cluster.front import HOP_HEADERS, ClientGone, _read_body, _wait_disconnect, stream_error
from minfer.server.cluster.metrics_merge import merge
from minfer.server.errors import ApiError, error_response
from minfer.server.middleware import has_key, is_page_path, missing_key_error
from minfer.server.model_names import find_model, json_object, model_of

log = logging.getLogger("minfer.server")

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"
START_TIMEOUT = 600.0  # seconds a model's process may take to load and answer /health
SCRAPE_TIMEOUT = 5.0  # seconds a model's server may take to answer the front's /metrics (else it is left out)
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the model servers' (Prometheus text 0.0.4)


@dataclass
class ModelEntry:
    """One configured model and, while it is loaded, its process."""

    name: str
    path: Path
    mmproj: Path | None = None  # the vision tower's GGUF beside the text GGUF (its server gets --mmproj)
    # llama-server's capabilities, read from the files when the front starts (a listing loads nothing)
    capabilities: tuple[str, ...] = ("completion",)
    state: str = UNLOADED
    url: str | None = None
    proc: asyncio.subprocess.Process | None = None
    active: int = 0  # requests being answered (a stream counts until its last byte)
    last_used: float = 0.0
    load_seconds: float | None = None  # the last load's
    loads: int = 0  # times it loaded since the front started
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    keep_alive: float | None = None  # seconds it stays loaded once idle (ollama's keep_alive); None: the server's
    idle_timer: asyncio.Task[None] | None = None

    def card(self, created: int) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": created, "owned_by": "minfer",
                "path": str(self.path), "capabilities": list(self.capabilities), "status": {"value": self.state}}


def model_capabilities(path: Path, mmproj: Path | None = None) -> tuple[str, ...]:
    """A model's capabilities as its own server lists them (routes/service.py's names), from its files alone:
    ``embedding`` for an encoder, else ``completion`` and, with a vision model (an mmproj file beside a GGUF, or an
    HF vision-language folder), ``multimodal``."""
    from minfer.models.bert import is_encoder_checkpoint
    from minfer.models.hf_checkpoint import is_vision_language_folder

    if is_encoder_checkpoint(path):
        return ("embedding",)
    takes_images = mmproj is not None or (path.is_dir() and is_vision_language_folder(path))
    return ("completion", "multimodal") if takes_images else ("completion",)


def is_mmproj(path: Path) -> bool:
    """A vision tower's GGUF (llama.cpp's ``mmproj*.gguf``), which is no model of its own."""
    return path.suffix == ".gguf" and path.name.startswith("mmproj")


def gguf_folder(folder: Path) -> tuple[Path, Path | None] | None:
    """A subfolder of ``--models-dir`` in llama-server's router layout: its one text GGUF and its mmproj file (or
    None), or None when it holds no GGUF; a one-line error when it holds several of either."""
    ggufs = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix == ".gguf")
    if not ggufs:
        return None
    texts = [p for p in ggufs if not is_mmproj(p)]
    projectors = [p for p in ggufs if is_mmproj(p)]
    if len(texts) != 1:
        what = "no model GGUF beside its mmproj file" if not texts else \
            f"{len(texts)} model GGUFs ({', '.join(p.name for p in texts)})"
        raise BadRequestError(f"--models-dir folder {str(folder)!r} holds {what}: a model's folder holds one model "
                              "GGUF and at most one mmproj*.gguf")
    if len(projectors) > 1:
        raise BadRequestError(f"--models-dir folder {str(folder)!r} holds {len(projectors)} mmproj files "
                              f"({', '.join(p.name for p in projectors)}): a model's folder holds at most one")
    return texts[0], (projectors[0] if projectors else None)


def model_entries(models: list[str], models_dir: str | None) -> list[ModelEntry]:
    """The configured models: each positional one (a file, a folder or a name ``minfer pull`` knows) and every
    GGUF file and model folder in ``models_dir``, named by file stem, folder name or known name. A subfolder
    holding one GGUF and, beside it, an ``mmproj*.gguf`` (llama-server's router layout) is a model named by the
    folder, served with ``--mmproj``; an ``mmproj*.gguf`` directly in ``models_dir`` is no model."""
    from minfer.pull import KNOWN_MODELS, resolve_model

    found: list[tuple[str, Path, Path | None]] = []
    for ref in models:
        path = resolve_model(ref)
        name = ref if ref in KNOWN_MODELS else Path(path).name.removesuffix(".gguf")
        found.append((name, Path(path), None))
    if models_dir is not None:
        folder = Path(models_dir)
        if not folder.is_dir():
            raise BadRequestError(f"--models-dir {models_dir!r} is not a folder")
        in_dir = 0
        for p in sorted(folder.iterdir()):
            if p.is_file() and p.suffix == ".gguf" and not is_mmproj(p):
                found.append((p.stem, p, None))
            elif p.is_dir() and (p / "config.json").is_file():
                found.append((p.name, p, None))
            elif p.is_dir() and (files := gguf_folder(p)) is not None:
                found.append((p.name, *files))
            else:
                continue
            in_dir += 1
        if not in_dir:
            raise BadRequestError(f"--models-dir {models_dir!r} holds no GGUF file and no model folder")
    named: dict[str, tuple[Path, Path | None]] = {}
    for name, path, mmproj in found:
        if name in named and named[name] != (path, mmproj):
            raise BadRequestError(f"two models are named {name!r} ({named[name][0]} and {path}): rename one")
        named[name] = (path, mmproj)
    return [ModelEntry(name, path, mmproj, model_capabilities(path, mmproj))
            for name, (path, mmproj) in named.items()]


MAX_CONVERSATIONS = 4096  # streams' ids whose model the front remembers (each a few dozen bytes)


class ModelRouter:
    """The ASGI app of a several-model server (see the module docstring)."""

    def __init__(self, entries: list[ModelEntry], child_args: list[str], models_max: int, api_keys: tuple[str, ...],
                 max_body_size: int, sleep_idle: float | None = None, ui: bool = True,
                 generating_args: list[str] | None = None) -> None:
        if models_max < 1:
            raise BadRequestError(f"--models-max must be >= 1, got {models_max}")
        if sleep_idle is not None and not sleep_idle >= 0:
            raise BadRequestError(f"--sleep-idle-seconds must be >= 0, got {sleep_idle}")
        self.sleep_idle = sleep_idle  # seconds a model stays loaded once idle; None: until another needs its place
        self.entries = {e.name: e for e in entries}
        self.default = entries[0]
        self.child_args = child_args  # every model's server gets these
        self.generating_args = generating_args or []  # and a generating model's these (an encoder's refuses them)
        self.models_max = models_max
        self.api_keys = api_keys  # any one opens the front; empty: no key wanted
        self.internal_key = secrets.token_hex(16)  # the children answer only this front
        self.max_body_size = max_body_size
        self.created = int(time.time())
        self.client: httpx.AsyncClient | None = None
        # a stream's X-Conversation-Id -> the model whose server holds it (llama-server's router keeps this map):
        # GET and DELETE /v1/stream and /v1/streams/lookup go to that server alone; the oldest ids go first
        self.conversations: OrderedDict[str, str] = OrderedDict()
        self._changed = asyncio.Condition()  # a model finished a request, loaded or unloaded
        self._loading = asyncio.Lock()  # one model loads (or is chosen for eviction) at a time
        # each model file's sha256 (ollama's digest), by path: the file's (size, mtime_ns) it was computed for and
        # the task computing it (shared by the requests that arrive meanwhile)
        self._digests: dict[Path, tuple[tuple[int, int], asyncio.Task[str]]] = {}
        self.metrics_registry = CollectorRegistry()  # the front's own families, read from the entries at each scrape
        self.metrics_registry.register(FrontMetrics(self.entries))
        # the chat page, the explorer and their files, served here: open without the key, as a one-model server's,
        # saying whether this front wants one (its models' servers want the front's internal key), and loading no
        # model to show a page
        self.pages = _pages(bool(api_keys)) if ui else None

    # -- ASGI ------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if self.pages is not None and method in ("GET", "HEAD") and is_page_path(path):
            await self.pages(scope, receive, send)
            return
        try:
            if self.api_keys and path != "/health" and not has_key(scope, self.api_keys):
                raise missing_key_error()
            own = self._own_route(method, path)
            if own is not None:
                await own(scope, receive, send)
                return
            await self._proxy(scope, receive, send)
        except ApiError as e:
            await error_response(e, path)(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await asyncio.gather(*(self._stop(e) for e in self.entries.values()))
                if self.client is not None:
                    await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- the front's own routes ------------------------------------------------------------------

    def _own_route(self, method: str, path: str) -> Any:
        routes = {("GET", "/v1/models"): self._models, ("GET", "/models"): self._models,
                  ("POST", "/models/load"): self._load_route, ("POST", "/models/unload"): self._unload_route,
                  ("GET", "/api/tags"): self._tags, ("GET", "/api/ps"): self._ps,
                  ("GET", "/api/version"): self._version, ("GET", "/health"): self._health,
                  ("GET", "/v1/stream"): self._stream_route, ("DELETE", "/v1/stream"): self._stream_route,
                  ("POST", "/v1/streams/lookup"): self._streams_lookup, ("GET", "/metrics"): self._metrics}
        return routes.get((method, path))

    async def _json(self, send: Send, body: Any, status: int = 200) -> None:
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._json(send, {"object": "list", "data": [e.card(self.created) for e in self.entries.values()]})

    async def _raw(self, send: Send, status: int, body: bytes, content_type: str,
                   headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
                                *(headers or [])]})
        await send({"type": "http.response.body", "body": body})

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        # "models": each one's state (as before); "models_detail": also the requests it is answering now
        detail = [{"model": e.name, "status": e.state, "active": e.active} for e in self.entries.values()]
        await self._json(send, {"status": "ok", "models": {e.name: e.state for e in self.entries.values()},
                                "models_detail": detail})

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        from minfer.server.routes.ollama import OLLAMA_API_VERSION

        await self._json(send, {"version": OLLAMA_API_VERSION})

    async def _tags(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._json(send, {"models": await self._listings(list(self.entries.values()))})

    async def _ps(self, scope: Scope, receive: Receive, send: Send) -> None:
        loaded = [e for e in self.entries.values() if e.state == LOADED]
        running = [{**listing, "expires_at": self._expires_at(e), "size_vram": 0}
                   for e, listing in zip(loaded, await self._listings(loaded), strict=True)]
        await self._json(send, {"models": running})

    async def _listings(self, entries: list[ModelEntry]) -> list[dict[str, Any]]:
        """ollama's listings of ``entries``, with their digests (hashed concurrently, on worker threads)."""
        digests = await asyncio.gather(*(self.digest(e.path) for e in entries))
        return [{**_listing(e), "digest": d} for e, d in zip(entries, digests, strict=True)]

    async def digest(self, path: Path) -> str:
        """The sha256 a model's own server gives as its ``digest``, computed on a worker thread once per file
        identity (its size and modification time; of a folder, its files'): a file replaced is hashed again."""
        from minfer.server.ollama_blobs import model_sha256

        try:
            identity = await asyncio.to_thread(_file_identity, path)
        except OSError:
            return ""  # the file is gone: its own server could not answer either
        known = self._digests.get(path)
        if known is None or known[0] != identity:
            known = (identity, asyncio.ensure_future(asyncio.to_thread(model_sha256, path)))
            self._digests[path] = known
        try:
            return await asyncio.shield(known[1])  # a client leaving does not cancel the hashing others wait on
        except OSError:
            self._digests.pop(path, None)
            return ""

    # -- /metrics: each loaded model's, labelled, and the front's own ------------------------------

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model") or [""])[0]
        if name:
            await self._model_metrics(self.find(name, scope["path"]), send)
            return
        loaded = [e for e in self.entries.values() if e.state == LOADED]
        answers = await asyncio.gather(*(self._scrape(e) for e in loaded))
        good = {e.name: r for e, r in zip(loaded, answers, strict=True) if r is not None and r.status_code == 200}
        content_type = next((r.headers.get("content-type", "") for r in good.values()), "") or METRICS_CONTENT_TYPE
        body = merge({n: r.text for n, r in good.items()}, label="model", total=None).encode()
        await self._raw(send, 200, body + generate_latest(self.metrics_registry), content_type)

    async def _model_metrics(self, entry: ModelEntry, send: Send) -> None:
        """``GET /metrics?model=NAME``: that model's own, each sample labelled with its name; its server's error as
        it is. A probe, not a use: it neither loads the model (a 503 while it is not loaded: its counters went with
        its process) nor keeps it loaded."""
        if entry.state != LOADED:
            raise ApiError(f"model {entry.name!r} is not loaded: its counters went with its process (/metrics "
                           "without ?model= has the front's gauges of every model)", status=503,
                           type="unavailable_error", code="model_not_loaded")
        response = await self._scrape(entry)
        if response is None:
            raise ApiError(f"the server of model {entry.name!r} did not answer /metrics", status=503,
                           type="server_error", code="model_unavailable")
        content_type = response.headers.get("content-type", METRICS_CONTENT_TYPE)
        body = response.content
        if response.status_code == 200:
            body = merge({entry.name: response.text}, label="model", total=None).encode()
        await self._raw(send, response.status_code, body, content_type)

    async def _scrape(self, entry: ModelEntry) -> httpx.Response | None:
        """``entry``'s server's ``/metrics`` (None when it did not answer in time, or is not loaded). A probe, not
        a use: it neither loads the model nor keeps it loaded."""
        url = entry.url
        if url is None or self.client is None:
            return None
        try:
            return await self.client.get(url + "/metrics", timeout=SCRAPE_TIMEOUT,
                                         headers={"authorization": f"Bearer {self.internal_key}"})
        except httpx.HTTPError:
            return None

    async def _named(self, receive: Receive, scope: Scope) -> ModelEntry:
        try:
            body = json.loads(await _read_body(receive, self.max_body_size))
        except (ValueError, ClientGone):
            body = None
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise ApiError("'model' is required: the name of a configured model", param="model")
        return self.find(name, scope["path"])

    async def _load_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        entry = await self._named(receive, scope)
        await self.acquire(entry)
        self.release(entry)
        await self._json(send, {"success": True})

    async def _unload_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        entry = await self._named(receive, scope)
        async with self._changed:
            await self._changed.wait_for(lambda: entry.active == 0)
        await self._stop(entry)
        await self._json(send, {"success": True})

    # -- resumable streams: to the model whose server holds them ----------------------------------

    def _stream_owner(self, conv_id: str) -> ModelEntry | None:
        """The loaded model whose server streams ``conv_id`` (also as llama-server's ``<id>::<model>`` keys)."""
        for key, name in reversed(self.conversations.items()):
            if key == conv_id or key.startswith(f"{conv_id}::"):
                entry = self.entries[name]
                return entry if entry.state == LOADED else None
        return None

    async def _stream_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/stream`` (a replay) and ``DELETE /v1/stream`` (a stop), forwarded to the stream's model. Its
        model unloaded took the stream with it: a GET is a 404, a DELETE has nothing left to stop (204)."""
        conv_id = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("conv_id") or [""])[0]
        if not conv_id:
            raise ApiError("missing conversation id: send it as the 'conv_id' query parameter", param="conv_id")
        owner = self._stream_owner(conv_id)
        if scope["method"] == "DELETE":
            for key in [k for k in self.conversations if k == conv_id or k.startswith(f"{conv_id}::")]:
                del self.conversations[key]
        if owner is None:
            if scope["method"] == "DELETE":
                await send({"type": "http.response.start", "status": 204, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            raise ApiError("stream not found or expired", status=404, type="not_found_error", param="conv_id")
        await self._proxy_to(owner, scope, b"", receive, send)

    async def _streams_lookup(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/streams/lookup``: each id asked of the server of its model, the sessions together."""
        try:
            body = json.loads(await _read_body(receive, self.max_body_size))
        except ClientGone:
            return
        except ValueError as e:
            raise ApiError(f"invalid body: {e}") from None
        ids = body.get("conversation_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ApiError("'conversation_ids' must be a list of strings", param="conversation_ids")
        by_owner: dict[str, list[str]] = {}
        for conv_id in dict.fromkeys(i for i in ids if i):
            owner = self._stream_owner(conv_id)
            if owner is not None:
                by_owner.setdefault(owner.name, []).append(conv_id)
        sessions: list[Any] = []
        assert self.client is not None
        for name, owned in by_owner.items():
            entry = self.entries[name]
            if entry.url is None:
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = await self.client.post(entry.url + "/v1/streams/lookup", json={"conversation_ids": owned},
                                           headers={"authorization": f"Bearer {self.internal_key}"}, timeout=10)
                if r.status_code == 200 and isinstance(r.json(), list):
                    sessions += r.json()
        await self._json(send, sessions)

    def _remember_conversation(self, scope: Scope, entry: ModelEntry) -> None:
        for name, value in scope["headers"]:
            if name.lower() == b"x-conversation-id" and value:
                conv_id = value.decode("latin-1")
                self.conversations.pop(conv_id, None)
                self.conversations[conv_id] = entry.name
                while len(self.conversations) > MAX_CONVERSATIONS:
                    self.conversations.popitem(last=False)

    # -- choosing and loading models -------------------------------------------------------------

    def find(self, name: str, path: str = "") -> ModelEntry:
        return find_model(self.entries, name)

    async def acquire(self, entry: ModelEntry) -> str:
        """The URL of ``entry``'s server, loading it first if need be (after making room); counts a request on it
        until :meth:`release`."""
        if entry.idle_timer is not None:
            entry.idle_timer.cancel()
            entry.idle_timer = None
        while True:
            if entry.state == LOADED:
                entry.active += 1
                entry.last_used = time.monotonic()
                assert entry.url is not None
                return entry.url
            if entry.state == LOADING:
                await entry.ready.wait()
                continue
            async with self._loading:
                if entry.state != UNLOADED:
                    continue
                await self._make_room()
                entry.state, entry.ready = LOADING, asyncio.Event()
            try:
                await self._start(entry)
            finally:
                entry.ready.set()
                async with self._changed:
                    self._changed.notify_all()

    def release(self, entry: ModelEntry) -> None:
        entry.active -= 1
        entry.last_used = time.monotonic()

        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        asyncio.ensure_future(notify())
        keep = self._keep_alive(entry)
        if entry.active == 0 and keep is not None and keep != math.inf:
            entry.idle_timer = asyncio.ensure_future(self._unload_when_idle(entry, keep))

    def _keep_alive(self, entry: ModelEntry) -> float | None:
        return entry.keep_alive if entry.keep_alive is not None else self.sleep_idle

    def _expires_at(self, entry: ModelEntry) -> str:
        """When an idle model unloads (ollama's ``expires_at``): far off when nothing unloads it."""
        keep = self._keep_alive(entry)
        if keep is None or keep == math.inf or entry.active:
            return "2318-01-01T00:00:00Z"
        at = time.time() + max(keep - (time.monotonic() - entry.last_used), 0.0)
        return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")

    async def _unload_when_idle(self, entry: ModelEntry, seconds: float) -> None:
        """``--sleep-idle-seconds`` and ``keep_alive``: unload ``entry`` once it has been idle ``seconds``."""
        last = entry.last_used
        await asyncio.sleep(seconds)
        if entry.state == LOADED and entry.active == 0 and entry.last_used == last:
            await self._stop(entry)

    async def _make_room(self) -> None:
        """Unload the least recently used idle model until another fits under ``models_max``."""

        def held() -> int:
            return sum(e.state in (LOADED, LOADING) for e in self.entries.values())

        def idle() -> list[ModelEntry]:
            return [e for e in self.entries.values() if e.state == LOADED and e.active == 0]

        while held() >= self.models_max:
            if idle():
                await self._stop(min(idle(), key=lambda e: e.last_used))
                continue
            async with self._changed:  # every loaded model is answering: wait for one to finish
                await self._changed.wait_for(lambda: bool(idle()) or held() < self.models_max)

    async def _start(self, entry: ModelEntry) -> None:
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(*self._command(entry), stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        entry.proc = proc
        lines: list[str] = []
        url = None
        assert proc.stderr is not None
        try:
            async with asyncio.timeout(START_TIMEOUT):
                while url is None:
                    raw = await proc.stderr.readline()
                    if not raw:
                        break
                    line = raw.decode("utf-8", "replace")
                    lines.append(line)
                    if line.startswith("minfer: serving ") and " on http://" in line:
                        url = line.split(" on ", 1)[1].split()[0]
                if url is not None:
                    while (await self._get(url + "/health")) != 200:
                        await asyncio.sleep(0.05)
        except TimeoutError:
            url = None
        if url is None:
            entry.state, entry.proc = UNLOADED, None
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            tail = "".join(lines[-5:]).strip()
            raise ApiError(f"model {entry.name!r} did not load: {tail or 'its process ended'}", status=500,
                           type="server_error", code="model_load_failed")
        asyncio.ensure_future(self._echo(entry.name, proc))
        entry.url, entry.state = url, LOADED
        entry.load_seconds = time.perf_counter() - started
        entry.loads += 1
        print(f"minfer: loaded {entry.name} in {entry.load_seconds:.1f} s", file=sys.stderr, flush=True)

    def _command(self, entry: ModelEntry) -> list[str]:
        """The command line of ``entry``'s own server, on a free loopback port, answering this front alone."""
        from minfer.models.bert import is_encoder_checkpoint

        return [sys.executable, "-m", "minfer", "serve", str(entry.path), "--host", "127.0.0.1", "--port", "0",
                "--alias", entry.name, "--api-key", self.internal_key, *self.child_args,
                *([] if is_encoder_checkpoint(entry.path) else self.generating_args),
                *([] if entry.mmproj is None else ["--mmproj", str(entry.mmproj)])]

    async def _get(self, url: str) -> int:
        assert self.client is not None
        try:
            return (await self.client.get(url, timeout=5.0)).status_code
        except httpx.HTTPError:
            return 0

    @staticmethod
    async def _echo(name: str, proc: asyncio.subprocess.Process) -> None:
        """The child's log lines on this server's stderr, marked with its model."""
        assert proc.stderr is not None
        while raw := await proc.stderr.readline():
            sys.stderr.write(f"[{name}] {raw.decode('utf-8', 'replace')}")

    async def _stop(self, entry: ModelEntry) -> None:
        proc, entry.proc = entry.proc, None
        entry.state, entry.url = UNLOADED, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                async with asyncio.timeout(30):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
            print(f"minfer: unloaded {entry.name}", file=sys.stderr, flush=True)
        async with self._changed:
            self._changed.notify_all()

    # -- forwarding ------------------------------------------------------------------------------

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await _read_body(receive, self.max_body_size + 1)  # beyond the cap: the model server's 413
        except ClientGone:
            return
        parsed = json_object(body)
        entry = self.find(model_of(scope, parsed) or self.default.name, scope["path"])
        if scope["method"] == "POST":
            if _load_request(scope["path"], parsed) == "unload":
                await self._unload_on_request(entry)
                await self._json(send, _unload_answer(scope["path"], parsed))
                return
            # ollama's: each request to a model sets how long it stays loaded once idle, the server's default
            # when it gives none (a bad one is left to the model's server, which answers its 400)
            entry.keep_alive = _keep_alive_of(parsed)
            self._remember_conversation(scope, entry)
        await self._proxy_to(entry, scope, body, receive, send)

    async def _unload_on_request(self, entry: ModelEntry) -> None:
        """ollama's unload request (no prompt, ``keep_alive`` 0): ``entry`` unloads now, or once its running
        requests finish, without loading it first."""
        if entry.state == LOADING:
            await entry.ready.wait()
        if entry.state != LOADED:
            return
        if entry.active == 0:
            await self._stop(entry)
        else:
            entry.keep_alive = 0.0  # release() unloads it when its last request ends

    async def _proxy_to(self, entry: ModelEntry, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """The request forwarded to ``entry``'s server (loaded first if need be), its answer streamed back; the
        client leaving closes the upstream request, which cancels its sequences."""
        url = await self.acquire(entry)
        forward = asyncio.ensure_future(self._forward(url, scope, body, send))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not forward.done():  # the client left: closing the upstream request cancels its sequences
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward
            self.release(entry)
        if forward.done() and not forward.cancelled() and forward.exception() is not None:
            raise forward.exception()  # type: ignore[misc]

    async def _forward(self, base: str, scope: Scope, body: bytes, send: Send) -> None:
        assert self.client is not None
        query = scope.get("query_string", b"")
        url = base + scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_HEADERS | {b"authorization",
                                                                                          b"x-api-key"}]
        headers.append((b"authorization", f"Bearer {self.internal_key}".encode()))
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise ApiError(f"the server of this model did not answer ({e})", status=503, type="server_error",
                           code="model_unavailable") from None
        try:
            out_headers = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in HOP_HEADERS]
            await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError:
                await send({"type": "http.response.body", "body": stream_error(scope["path"], "model server"),
                            "more_body": False})
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(response.aclose())


def _pages(key_required: bool) -> Any:
    """An ASGI app of the pages alone (:func:`~minfer.server.routes.page.register_pages`)."""
    from fastapi import FastAPI

    from minfer.server.routes.page import register_pages

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    register_pages(app, chat=True, key_required=key_required)
    return app


def _keep_alive_of(body: dict[str, Any] | None) -> float | None:
    """A body's ``keep_alive`` in seconds; None without one, or with a bad one (its model's server answers the
    400)."""
    from minfer.server.protocols.ollama import keep_alive_seconds

    if body is None:
        return None
    with contextlib.suppress(ApiError):
        return keep_alive_seconds(body.get("keep_alive"))
    return None


def _load_request(path: str, body: dict[str, Any] | None) -> str | None:
    """ollama's load (``"load"``) and unload (``"unload"``) requests; None for others and for a bad keep_alive."""
    from minfer.server.protocols.ollama import load_request

    if path not in ("/api/generate", "/api/chat"):
        return None
    with contextlib.suppress(ApiError):
        return load_request(path, body)
    return None


def _unload_answer(path: str, body: dict[str, Any] | None) -> dict[str, Any]:
    from minfer.server.protocols.ollama import load_answer

    return load_answer(path, str((body or {}).get("model", "")), "unload")


class FrontMetrics:
    """The several-model front's own Prometheus families (a prometheus_client collector), read from its models
    at each scrape."""

    def __init__(self, entries: dict[str, ModelEntry]) -> None:
        self.entries = entries

    def collect(self) -> list[Metric]:
        entries = list(self.entries.values())
        configured = GaugeMetricFamily("minfer_models_configured", "models this server can load",
                                       value=len(entries))
        n_loaded = GaugeMetricFamily("minfer_models_loaded", "models loaded now (a process each)",
                                     value=sum(e.state == LOADED for e in entries))
        loaded = GaugeMetricFamily("minfer_model_loaded", "1 while the model is loaded, else 0", labels=["model"])
        active = GaugeMetricFamily("minfer_model_requests_active", "requests the model is answering now",
                                   labels=["model"])
        seconds = GaugeMetricFamily("minfer_model_load_seconds", "how long the model's last load took",
                                    labels=["model"])
        loads = CounterMetricFamily("minfer_model_loads", "times the model was loaded", labels=["model"])
        for e in entries:
            loaded.add_metric([e.name], float(e.state == LOADED))
            active.add_metric([e.name], e.active)
            loads.add_metric([e.name], e.loads)
            if e.load_seconds is not None:
                seconds.add_metric([e.name], e.load_seconds)
        return [configured, n_loaded, loaded, active, seconds, loads]


def _file_identity(path: Path) -> tuple[int, int]:
    """A model file's (size, mtime_ns); a folder's: its files' summed sizes and latest mtime_ns."""
    if path.is_file():
        st = path.stat()
        return st.st_size, st.st_mtime_ns
    stats = [p.stat() for p in path.rglob("*") if p.is_file()]
    return sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)


def _listing(entry: ModelEntry) -> dict[str, Any]:
    """ollama's listing of a configured model, from its file alone (loaded or not); its digest is added by
    :meth:`ModelRouter.digest`."""
    from minfer.models.bert import gguf_architecture
    from minfer.server.ollama_blobs import model_size
    from minfer.server.routes.ollama import modified_at, ollama_name

    path = entry.path
    family = ""
    size = model_size(path)
    if path.is_file():
        family, fmt = gguf_architecture(path) or "", "gguf"
    else:
        with contextlib.suppress(OSError, ValueError):
            family = str(json.loads((path / "config.json").read_text()).get("model_type", ""))
        fmt = "safetensors"
    name = ollama_name(entry.name)
    return {"name": name, "model": name, "modified_at": modified_at(path), "size": size, "digest": "",
            "details": {"parent_model": "", "format": fmt, "family": family, "families": [family]}}
