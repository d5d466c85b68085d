"""The one HTTP endpoint in front of the replicas (an ASGI app; no Ray here: the replica list comes from
a ``registry`` callable).

``/health`` and ``/metrics`` are its own: the replicas with their pid and state, and their metrics with a
``replica`` label, summed, next to the router's. Every other request is passed through, bytes in and
bytes out, to the replica the :class:`~.prefix.PrefixRouter` picks: each replica runs the single-process
server, so routes, errors, the API key, the body cap and streaming are that server's own.

Several models: each has its own group of replicas and its own router. A request goes to the group of the
model it names (its body's ``model``, else ``?model=``, else the first model; an unknown name is a 404
listing the names), then to a replica of that group as above. ``/v1/models`` (and ``/models``) lists the
models, ``/health`` groups the replicas by model and ``/metrics`` labels each sample with its ``model`` too.
With one model every name goes to it and those routes are the replica's own.

Faults: a replica that cannot be reached, or that dies before its answer has started (a non-streamed
answer before its last byte, a stream before its first event), is marked dead and the request is sent
to another one. A stream already under way when its replica dies ends with the endpoint's own error
event (and ``[DONE]`` where the stream has one), never a hang: the connection's end, or the monitor
finding the replica dead, ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.types import Message, Receive, Scope, Send

from minfer.server.access_log import log as access_log
from minfer.server.cluster.metrics_merge import merge
from minfer.server.cluster.prefix import PrefixRouter, ReplicaLoad
from minfer.server.cluster.routing_key import PromptKeys
from minfer.server.context import OFF_LOOP_BYTES, sse
from minfer.server.errors import ApiError, anthropic_error_body, error_response
from minfer.server.middleware import has_key, missing_key_error
from minfer.server.model_names import find_model, json_object, model_of
from minfer.server.typed_stream import sse_event

log = logging.getLogger("minfer.server")

PROBE_SECONDS = 0.5  # how often the replica list and each replica's /health are read
PROBE_TIMEOUT = 5.0
STALE_SECONDS = 15.0  # a replica whose heartbeat is older is dead (its node went away)
DEAD_KEPT_SECONDS = 60.0  # a dead replica stays listed in /health this long
# not passed on: this hop's own (uvicorn writes its date, server and framing headers again)
HOP_HEADERS = frozenset({b"host", b"date", b"server", b"connection", b"keep-alive", b"transfer-encoding",
                         b"content-length", b"upgrade", b"te", b"trailer", b"proxy-connection"})
REPLICA_DEAD = "minfer: replica dead"
STARTING, READY, DEAD = "starting", "ready", "dead"


@dataclass(frozen=True)
class FrontConfig:
    api_keys: tuple[str, ...] = ()  # any one opens the front (and the replicas, which check the same)
    max_body_size: int = 8 * 1024 * 1024
    policy: str = "prefix"  # prefix, least-loaded or random (to measure what affinity buys)
    queue_threshold: int = 2  # requests waiting beyond a replica's slots past which its prefixes go elsewhere
    ready_wait: float = 60.0  # seconds a request waits for a ready replica (all starting, or all tried) before a 503
    max_attempts: int = 4
    log_format: str = "text"  # the front's access log (the replicas' is off: the front sees every request)


@dataclass
class Replica:
    id: str
    model: str = ""  # the name of the model it serves (its group)
    pid: int | None = None
    url: str | None = None
    node: str | None = None
    slots: int = 1
    state: str = STARTING
    in_flight: int = 0  # requests sent to it and not yet answered: the router's view of its load
    running: int = 0  # its own /health's slots_running, slots_waiting
    waiting: int = 0
    died_at: float | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)  # what forwards to it (cancelled when it dies)

    def card(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "pid": self.pid, "state": self.state, "url": self.url,
                "node": self.node, "slots": self.slots, "in_flight": self.in_flight, "slots_running": self.running,
                "slots_waiting": self.waiting}


class UpstreamGone(Exception):
    """The replica died or could not be reached."""


class ClientGone(Exception):
    """The client left before its request's body had arrived."""


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        self.decisions = Counter("minfer_router_decisions", "requests routed, by replica and why it was chosen "
                                 "(prefix: it last served the prompt's prefix; saturated: the holder's queue was "
                                 "over the threshold; least_loaded; random)", ["replica", "kind"], registry=reg)
        self.keyed = Counter("minfer_router_keyed_requests", "routed requests with at least one hashed prompt block",
                             registry=reg)
        self.hits = Counter("minfer_router_prefix_hits", "keyed requests sent to the replica holding their prefix",
                            registry=reg)
        self.hit_ratio = Gauge("minfer_router_prefix_hit_ratio", "prefix hits / keyed requests", registry=reg)
        self.retries = Counter("minfer_router_retries", "requests sent again elsewhere because their replica died "
                               "before answering", ["replica"], registry=reg)
        self.stream_errors = Counter("minfer_router_stream_errors", "streams ended with an error event because "
                                     "their replica died", ["replica"], registry=reg)
        self.unavailable = Counter("minfer_router_unavailable", "requests answered 503: no replica ready in time",
                                   registry=reg)
        self.in_flight = Gauge("minfer_router_in_flight", "requests sent to a replica and not yet answered",
                               ["replica"], registry=reg)
        self.replicas = Gauge("minfer_replicas", "replicas by state", ["state"], registry=reg)


class Front:
    """The ASGI app (see the module docstring). ``registry()`` (called on a thread) returns the replicas'
    entries ``{"id", "model", "pid", "url", "node", "slots", "state", "beat"}``; ``forget(id)`` drops a dead
    one. ``models``: each model's name and the keys its prompts are routed by (None: no prefix routing), the
    first the default; an entry without a known ``model`` is the first model's."""

    def __init__(self, config: FrontConfig, registry: Callable[[], list[dict[str, Any]]],
                 forget: Callable[[str], None] = lambda _id: None,
                 models: Mapping[str, PromptKeys | None] | None = None) -> None:
        self.config = config
        self.registry = registry
        self.forget = forget
        self.models = dict(models or {"model": None})
        self.default = next(iter(self.models))
        self.routers = {name: PrefixRouter(config.policy, config.queue_threshold) for name in self.models}
        self.created = int(time.time())
        self.metrics = FrontMetrics()
        self.replicas: dict[str, Replica] = {}
        self.client: httpx.AsyncClient | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    # -- ASGI ------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":  # open: load balancers probe it
            await self._health(send)
            return
        own = self._own_route(scope["method"], path)
        if own is None:
            await self._proxy(scope, receive, send)
            return
        try:
            if self.config.api_keys and not has_key(scope, self.config.api_keys):
                raise missing_key_error()
            await own(scope, receive, send)
        except ApiError as e:
            await error_response(e, path)(scope, receive, send)

    def _own_route(self, method: str, path: str) -> Callable[[Scope, Receive, Send], Awaitable[None]] | None:
        """The front's own answer to ``method path`` (behind the key), or None: the request goes to a replica.
        ``/metrics`` always; with several models also the routes about the models."""
        if path == "/metrics":
            return self._metrics
        if len(self.models) > 1 and (method, path) in _MODELS_ROUTES:
            route = _MODELS_ROUTES[method, path]
            return lambda scope, receive, send: route(self, scope, receive, send)
        return None

    async def _model_list_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, self.model_list())

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(PROBE_TIMEOUT, read=None),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self._changed = asyncio.Event()
        await self.refresh()
        self._monitor = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        if self.client is not None:
            await self.client.aclose()

    # -- the replica set -------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(PROBE_SECONDS)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the monitor must outlive a failed look-up (the cluster restarting)
                log.exception("reading the replica list failed")

    async def refresh(self) -> None:
        """Read the registry, probe the replicas that say they are ready, retire the dead."""
        entries = await asyncio.to_thread(self.registry)
        now = time.time()
        seen = set()
        probes = []
        for e in entries:
            rid = str(e["id"])
            seen.add(rid)
            r = self.replicas.get(rid)
            if r is None:
                model = e.get("model")
                r = self.replicas[rid] = Replica(rid, model if model in self.models else self.default)
            r.pid, r.url, r.node, r.slots = e.get("pid"), e.get("url"), e.get("node"), int(e.get("slots") or 1)
            if r.state == DEAD:
                if r.died_at is not None and now - r.died_at > DEAD_KEPT_SECONDS:
                    await asyncio.to_thread(self.forget, rid)
                    del self.replicas[rid]
                continue
            if e.get("state") == DEAD or now - float(e.get("beat", now)) > STALE_SECONDS:
                self.mark_dead(r)
            elif e.get("state") == READY and r.url:
                probes.append(self._probe(r))
        await asyncio.gather(*probes)
        for rid in [rid for rid in self.replicas if rid not in seen]:
            self.mark_dead(self.replicas.pop(rid))
        self._changed.set()
        self._changed = asyncio.Event()

    async def _probe(self, r: Replica) -> None:
        assert self.client is not None and r.url is not None
        try:
            response = await self.client.get(r.url + "/health", timeout=PROBE_TIMEOUT)
            health = response.json()
            r.running, r.waiting = int(health.get("slots_running", 0)), int(health.get("slots_waiting", 0))
            if r.state == STARTING:
                r.state = READY
        except httpx.TimeoutException:
            pass  # a busy replica answers late; the heartbeat and the connection tell death apart
        except (httpx.HTTPError, ValueError):
            self.mark_dead(r)

    def mark_dead(self, r: Replica) -> None:
        if r.state == DEAD:
            return
        log.warning("replica %s (pid %s) is dead", r.id, r.pid)
        r.state, r.died_at = DEAD, time.time()
        self.routers[r.model].forget(r.id)
        for task in list(r.tasks):
            task.cancel(REPLICA_DEAD)

    def ready(self, model: str | None = None) -> list[Replica]:
        """The ready replicas (of ``model`` alone, when given)."""
        return [r for r in self.replicas.values() if r.state == READY and model in (None, r.model)]

    # -- own routes ------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """The replicas' states; with several models also grouped by model, ``ok`` once each has a ready one."""
        body = _health_of(list(self.replicas.values()))
        if len(self.models) > 1:
            groups = {name: _health_of([r for r in self.replicas.values() if r.model == name])
                      for name in self.models}
            statuses = {g["status"] for g in groups.values()}
            body["status"] = "ok" if statuses == {"ok"} else STARTING if STARTING in statuses else "unavailable"
            body["models"] = groups
        return body

    def model_list(self) -> dict[str, Any]:
        """``/v1/models`` of several models: each with its ready replicas and, as llama-server's router, a status."""
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "minfer",
             "replicas": len(self.ready(name)), "status": {"value": "loaded" if self.ready(name) else "loading"}}
            for name in self.models]}

    async def _ollama_listing(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ollama's ``/api/tags`` and ``/api/ps`` of several models: each model's entries as a ready replica of it
        lists them (its file's details and digest; every replica is loaded, so both list the same), in the
        models' order. A model with no replica ready is left out until one is."""
        assert self.client is not None
        headers = {"Authorization": f"Bearer {self.config.api_keys[0]}"} if self.config.api_keys else {}

        async def listing(name: str) -> list[Any]:
            for r in self.ready(name):
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    response = await self.client.get(f"{r.url}{scope['path']}", headers=headers,  # type: ignore[union-attr]
                                                     timeout=PROBE_TIMEOUT)
                    if response.status_code == 200:
                        return list(response.json().get("models", []))
            return []

        lists = await asyncio.gather(*(listing(name) for name in self.models))
        await _send_json(send, 200, {"models": [m for found in lists for m in found]})

    async def _load_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """llama-server's router ``POST /models/load``: every model's replicas load at start, so a known one is
        loaded already; ``/models/unload`` is refused (the replicas hold their models for the cluster's life)."""
        try:
            body = json.loads(await _read_body(receive, self.config.max_body_size))
        except (ValueError, ClientGone):
            body = None
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise ApiError("'model' is required: the name of a configured model", param="model")
        find_model({n: n for n in self.models}, name)
        if scope["path"] == "/models/unload":
            raise ApiError("with --ray each model's replicas stay loaded for the cluster's life: serve without --ray "
                           "to load and unload models on demand", param="model")
        await _send_json(send, 200, {"success": True})

    async def _health(self, send: Send) -> None:
        body = self.health()
        await _send_json(send, 200 if body["status"] == "ok" else 503, body)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.client is not None
        headers = {"Authorization": f"Bearer {self.config.api_keys[0]}"} if self.config.api_keys else {}

        async def scrape(r: Replica) -> tuple[str, str | None]:
            try:
                response = await self.client.get(f"{r.url}/metrics", headers=headers, timeout=PROBE_TIMEOUT)  # type: ignore[union-attr]
                return r.id, response.text if response.status_code == 200 else None
            except httpx.HTTPError:
                return r.id, None

        texts = {rid: text for rid, text in await asyncio.gather(*(scrape(r) for r in self.ready())) if text}
        labels = {rid: {"model": self.replicas[rid].model} for rid in texts} if len(self.models) > 1 else None
        m = self.metrics
        for r in self.replicas.values():
            m.in_flight.labels(r.id).set(r.in_flight)
        for state in (STARTING, READY, DEAD):
            m.replicas.labels(state).set(sum(1 for r in self.replicas.values() if r.state == state))
        keyed = m.keyed._value.get()
        m.hit_ratio.set(m.hits._value.get() / keyed if keyed else 0.0)
        body = merge(texts, extra_labels=labels).encode() + generate_latest(m.registry)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    # -- passing requests through ----------------------------------------------------------------

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await _read_body(receive, self.config.max_body_size + 1)  # beyond the cap: the replica's 413
        except ClientGone:
            return
        path = scope["path"]
        try:
            if len(self.models) > 1 and self.config.api_keys and not has_key(scope, self.config.api_keys):
                raise missing_key_error()  # before the model's name is looked up: no names for a keyless client
            model = self.model_named(scope, body)
        except ApiError as e:
            await error_response(e, path)(scope, _no_receive, send)
            return
        hashes: list[bytes] = []
        keys = self.models[model]
        if keys is not None and scope["method"] == "POST":
            hashes = keys.key(path, body) if len(body) <= OFF_LOOP_BYTES else \
                await asyncio.to_thread(keys.key, path, body)
        record = {"status": 0, "replica": None}

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
                record["replica"] = dict(message.get("headers", [])).get(b"x-minfer-replica", b"-").decode()
            await send(message)

        t0 = time.perf_counter()
        forward = asyncio.ensure_future(self._route(scope, body, model, hashes, noting_send))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not forward.done():  # the client left: the replica sees its connection close and cancels
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward
            if self.config.log_format != "off":
                access_log.info(access_line(scope, record["status"], record["replica"], time.perf_counter() - t0,
                                            self.config.log_format))
        if forward.done() and not forward.cancelled() and forward.exception() is not None:
            raise forward.exception()  # type: ignore[misc]

    def model_named(self, scope: Scope, body: bytes) -> str:
        """The model whose replicas answer the request (one model: that one, whatever the name)."""
        if len(self.models) == 1:
            return self.default
        name = model_of(scope, json_object(body))
        return self.default if name is None else find_model({n: n for n in self.models}, name)

    async def _route(self, scope: Scope, body: bytes, model: str, hashes: list[bytes], send: Send) -> None:
        path = scope["path"]
        deadline = time.monotonic() + self.config.ready_wait
        tried: set[str] = set()
        attempts = 0
        while True:
            loads = {r.id: ReplicaLoad(r.in_flight, r.slots) for r in self.ready(model) if r.id not in tried}
            decision = self.routers[model].choose(hashes, loads) if attempts < self.config.max_attempts else None
            if decision is None:
                if attempts < self.config.max_attempts and time.monotonic() < deadline:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), PROBE_SECONDS * 2)
                    continue
                self.metrics.unavailable.inc()
                e = ApiError("no replica is ready to answer (see /health); retry later", status=503,
                             type="server_error", code="no_replica_ready", headers={"Retry-After": "5"})
                await error_response(e, path)(scope, _no_receive, send)
                return
            replica = self.replicas[decision.replica]
            attempts += 1
            self.metrics.decisions.labels(replica.id, decision.kind).inc()
            if hashes and attempts == 1:
                self.metrics.keyed.inc()
                if decision.kind == "prefix":
                    self.metrics.hits.inc()
            try:
                await self._forward(replica, scope, body, send)
                return
            except UpstreamGone:
                log.warning("replica %s died before answering %s %s: sending it elsewhere", replica.id,
                            scope["method"], path)
                self.mark_dead(replica)
                self.metrics.retries.labels(replica.id).inc()
                tried.add(replica.id)

    async def _forward(self, replica: Replica, scope: Scope, body: bytes, send: Send) -> None:
        """Answer the request from ``replica``; UpstreamGone when it died before anything was sent."""
        assert self.client is not None and replica.url is not None
        task = asyncio.current_task()
        assert task is not None
        replica.in_flight += 1
        replica.tasks.add(task)
        started = False
        try:
            query = scope.get("query_string", b"")
            url = replica.url + scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
            headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_HEADERS]
            request = self.client.build_request(scope["method"], url, headers=headers, content=body)
            try:
                response = await self.client.send(request, stream=True)
            except asyncio.CancelledError as e:
                raise _gone_or_cancelled(e, task) from None
            except httpx.HTTPError as e:
                raise UpstreamGone(str(e)) from None
            try:
                out_headers = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in HOP_HEADERS]
                out_headers.append((b"x-minfer-replica", replica.id.encode()))
                start = {"type": "http.response.start", "status": response.status_code, "headers": out_headers}
                kind = response.headers.get("content-type", "")
                if kind.startswith(("text/event-stream", "application/x-ndjson")):  # SSE, ollama's NDJSON
                    chunks = response.aiter_raw()
                    try:
                        async for chunk in chunks:
                            if not started:  # the client sees nothing until the first event: before it, a retry
                                await send(start)
                                started = True
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    except (httpx.HTTPError, asyncio.CancelledError) as e:
                        if isinstance(e, asyncio.CancelledError):
                            _gone_or_cancelled(e, task)
                        if not started:
                            raise UpstreamGone(str(e)) from None
                        self.metrics.stream_errors.labels(replica.id).inc()
                        log.warning("replica %s died during a stream of %s", replica.id, scope["path"])
                        self.mark_dead(replica)
                        await send({"type": "http.response.body", "body": stream_error(scope["path"], replica.id),
                                    "more_body": False})
                        return
                    if not started:
                        await send(start)
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                else:
                    try:
                        data = await response.aread()
                    except asyncio.CancelledError as e:
                        raise _gone_or_cancelled(e, task) from None
                    except httpx.HTTPError as e:
                        raise UpstreamGone(str(e)) from None
                    start["headers"].append((b"content-length", str(len(data)).encode()))
                    await send(start)
                    await send({"type": "http.response.body", "body": data})
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.shield(response.aclose())
        finally:
            replica.in_flight -= 1
            replica.tasks.discard(task)


def _health_of(replicas: list[Replica]) -> dict[str, Any]:
    ready = [r for r in replicas if r.state == READY]
    status = "ok" if ready else STARTING if any(r.state == STARTING for r in replicas) else "unavailable"
    return {"status": status, "replicas": [r.card() for r in sorted(replicas, key=lambda r: r.id)],
            "slots_running": sum(r.running for r in ready), "slots_waiting": sum(r.waiting for r in ready)}


def access_line(scope: Scope, status: int, replica: str | None, seconds: float, fmt: str) -> str:
    """The front's access log line: the request, its answer's status, the replica that gave it."""
    client = scope.get("client")
    fields = {"client": f"{client[0]}:{client[1]}" if client else "-", "method": scope["method"],
              "path": scope["path"], "status": status, "replica": replica or "-", "ms": round(seconds * 1000, 1)}
    if fmt == "json":
        return json.dumps(fields)
    return " ".join(str(fields[k]) for k in ("client", "method", "path", "status")) + \
        f" replica={fields['replica']} {fields['ms']}ms"


def stream_error(path: str, replica: str) -> bytes:
    """The last event of a stream whose replica died, in the endpoint's own error shape."""
    e = ApiError(f"the replica serving this stream ({replica}) died; the reply is incomplete, send the request "
                 "again", status=503, type="server_error", code="replica_died")
    if path.startswith("/api/"):  # ollama's NDJSON streams end with an {"error"} line
        return json.dumps({"error": e.message}).encode() + b"\n"
    p = path if path.startswith("/v1/") else "/v1" + path
    if p.startswith("/v1/messages"):
        return sse_event(anthropic_error_body(e))
    if p.startswith("/v1/responses"):
        return sse_event({"type": "error", "code": e.code, "message": e.message, "param": None})
    if path in ("/completion", "/infill"):  # llama-server's native streams end with their last chunk, no [DONE]
        return sse(e.body())
    return sse(e.body()) + b"data: [DONE]\n\n"


def _gone_or_cancelled(e: asyncio.CancelledError, task: asyncio.Task[Any]) -> UpstreamGone:
    """A cancel from :meth:`Front.mark_dead` is the replica's death; any other is the client leaving (re-raised)."""
    if e.args and e.args[0] == REPLICA_DEAD:
        task.uncancel()
        return UpstreamGone("the replica died")
    raise e


# the routes about the models that a front of several answers itself (the rest go to a model's replica)
_MODELS_ROUTES: dict[tuple[str, str], Callable[[Front, Scope, Receive, Send], Awaitable[None]]] = {
    ("GET", "/v1/models"): Front._model_list_route, ("GET", "/models"): Front._model_list_route,
    ("GET", "/api/tags"): Front._ollama_listing, ("GET", "/api/ps"): Front._ollama_listing,
    ("POST", "/models/load"): Front._load_route, ("POST", "/models/unload"): Front._load_route}


async def _read_body(receive: Receive, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if size < limit:
            parts.append(chunk[: limit - size])
        size += len(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


async def _send_json(send: Callable[[Message], Awaitable[None]], status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
