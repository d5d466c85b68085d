"""Resumable streams, as llama-server has them (its ``server-stream.cpp``): a streamed generation request sent
with an ``X-Conversation-Id`` header keeps its server-sent events in a buffer under that id, and runs to its
end even when the client's connection drops. The client comes back with

- ``GET /v1/stream?conv_id=ID&from=N``: the stream's bytes from byte offset ``N`` (0 when absent), then its
  live bytes until it ends (``text/event-stream``);
- ``POST /v1/streams/lookup`` ``{"conversation_ids": [...]}``: what the server holds for those ids (an id
  also matches the keys ``<id>::<model>``, the form llama-server's web UI sends); it never lists ids it was
  not asked about;
- ``DELETE /v1/stream?conv_id=ID``: stops the generation and forgets its buffer (204, also for an id it
  does not know); later GETs are 404.

The ids are opaque strings carried in the query string, so a model name with a slash inside the id is no
path segment. Memory is bounded: each buffer keeps the last :data:`MAX_SESSION_BYTES` bytes (an offset
before them is a 400 "offset lost"), a finished stream is kept :data:`SESSION_TTL_SECONDS`, and at most
:data:`MAX_FINISHED_SESSIONS` finished ones are kept (the oldest go first); a live session is a request in
flight, which the server bounds already.

:class:`StreamTee` is the ASGI layer that runs such a request's response in a task of its own, detached from
the client's connection, and tees its body into the session; the client's own connection reads the session
like any resuming reader does. The :class:`StreamSessions` registry lives on the app (no module state).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minfer.server.errors import ApiError, error_response

__all__ = ["GENERATION_PATHS", "StreamSession", "StreamSessions", "StreamTee", "register"]

# llama-server's values (server-stream.cpp): 4 MiB per session, finished sessions kept 5 minutes
MAX_SESSION_BYTES = 4 * 1024 * 1024
SESSION_TTL_SECONDS = 300.0
# llama-server keeps any number of finished sessions; minfer caps them so that clients cannot pile up
# buffers by sending new ids: 64 x 4 MiB at worst
MAX_FINISHED_SESSIONS = 64

# the routes llama-server tees (the ones answered by its handle_completions_impl), as minfer's app sees
# them after the /v1 aliases (/chat/completions and /completions arrive as their /v1 forms)
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/completion", "/infill", "/v1/responses",
                              "/v1/messages"})
CONVERSATION_HEADER = b"x-conversation-id"

log = logging.getLogger("minfer.server")


class OffsetLostError(Exception):
    """The reader's offset is before the bytes the buffer still holds."""


class StreamSession:
    """One generation's server-sent events: a byte buffer that keeps its last ``max_bytes``, readable from
    any offset still held, while the generation appends to it."""

    def __init__(self, conversation_id: str, max_bytes: int = MAX_SESSION_BYTES,
                 clock: Callable[[], float] = time.time) -> None:
        self.conversation_id = conversation_id
        self.max_bytes = max_bytes
        self.clock = clock
        self.started_at = clock()
        self.completed_at: float | None = None
        self.task: asyncio.Task[None] | None = None  # the detached generation, cancelled by a DELETE
        self._buffer = bytearray()
        self._dropped = 0  # bytes dropped from the front to stay under max_bytes
        self._grown = asyncio.Event()  # set (and replaced) each time bytes arrive or the stream ends

    @property
    def done(self) -> bool:
        return self.completed_at is not None

    @property
    def total_bytes(self) -> int:
        return self._dropped + len(self._buffer)

    @property
    def dropped_bytes(self) -> int:
        return self._dropped

    def append(self, data: bytes) -> None:
        if self.done or not data:
            return
        self._buffer += data
        if len(self._buffer) > self.max_bytes:
            excess = len(self._buffer) - self.max_bytes
            del self._buffer[:excess]
            self._dropped += excess
        self._wake()

    def finish(self) -> None:
        if not self.done:
            self.completed_at = self.clock()
            self._wake()

    def cancel(self) -> None:
        """Stops the generation (its task's cancellation cancels the engine's job) and ends the readers."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.finish()

    def _wake(self) -> None:
        grown, self._grown = self._grown, asyncio.Event()
        grown.set()

    async def read_from(self, offset: int) -> AsyncIterator[bytes]:
        """The bytes from ``offset`` on, as they come, until the stream ends. An offset past the end waits for
        the stream to reach it (as llama-server). Raises :class:`OffsetLostError` when the offset is (or,
        for a reader slower than the generation, falls) before the bytes still held."""
        while True:
            if offset < self._dropped:
                raise OffsetLostError
            end = self.total_bytes
            if offset < end:
                chunk = bytes(self._buffer[offset - self._dropped:])
                offset = end
                yield chunk
                continue
            if self.done:
                return
            await self._grown.wait()


class StreamSessions:
    """The sessions by conversation id: at most one per id (a new request on an id replaces, and stops,
    the old one). Expired sessions are swept on each use, so no timer thread is needed."""

    def __init__(self, max_bytes: int = MAX_SESSION_BYTES, ttl: float = SESSION_TTL_SECONDS,
                 max_finished: int = MAX_FINISHED_SESSIONS, clock: Callable[[], float] = time.time) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.max_finished = max_finished
        self.clock = clock
        self._sessions: dict[str, StreamSession] = {}

    def create_or_replace(self, conversation_id: str) -> StreamSession:
        self._sweep()
        previous = self._sessions.pop(conversation_id, None)
        if previous is not None:
            previous.cancel()
        session = StreamSession(conversation_id, self.max_bytes, self.clock)
        self._sessions[conversation_id] = session
        return session

    def get(self, conversation_id: str) -> StreamSession | None:
        self._sweep()
        return self._sessions.get(conversation_id)

    def lookup(self, requested: list[str]) -> list[StreamSession]:
        """The sessions of each requested id: its own key and its ``<id>::<model>`` keys."""
        self._sweep()
        return [s for rid in requested for key, s in self._sessions.items()
                if key == rid or key.startswith(rid + "::")]

    def discard(self, session: StreamSession) -> None:
        """Forgets ``session`` if it is still the one under its id (a newer request may have replaced it)."""
        if self._sessions.get(session.conversation_id) is session:
            del self._sessions[session.conversation_id]
        session.finish()

    def cancel(self, conversation_id: str) -> None:
        session = self._sessions.pop(conversation_id, None)
        if session is not None:
            session.cancel()

    def cancel_all(self) -> None:
        for conversation_id in list(self._sessions):
            self.cancel(conversation_id)

    def _sweep(self) -> None:
        cutoff = self.clock() - self.ttl
        finished = sorted((s for s in self._sessions.values() if s.completed_at is not None),
                          key=lambda s: s.completed_at or 0.0)
        over = len(finished) - self.max_finished
        for i, s in enumerate(finished):
            if i < over or (s.completed_at or 0.0) <= cutoff:
                del self._sessions[s.conversation_id]


def conversation_id(scope: Scope) -> str:
    for name, value in scope.get("headers", []):
        if name == CONVERSATION_HEADER:
            return value.decode("latin-1").strip()
    return ""


def is_event_stream(start: Message) -> bool:
    if start["status"] != 200:
        return False
    for name, value in start.get("headers", []):
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == b"text/event-stream"
    return False


class StreamTee:
    """ASGI: a POST to a generation route with ``X-Conversation-Id`` runs detached from its connection. A
    streamed answer (200, ``text/event-stream``) goes into the session, and the client reads it from there;
    any other answer (an error, a whole answer) is passed through and leaves no session, as llama-server's.
    The client leaving before the answer starts cancels the request (llama-server stops too when the client
    leaves before the first token); leaving during a stream does not."""

    def __init__(self, app: ASGIApp, sessions: StreamSessions, paths: Collection[str] = GENERATION_PATHS) -> None:
        self.app = app
        self.sessions = sessions
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        conv_id = conversation_id(scope)
        if not conv_id:
            await self.app(scope, receive, send)
            return
        await _DetachedRequest(self.app, self.sessions, self.sessions.create_or_replace(conv_id)).serve(
            scope, receive, send)


class _DetachedRequest:
    """One teed request: the app runs in ``session.task``; ``serve`` relays its answer to the client."""

    def __init__(self, app: ASGIApp, sessions: StreamSessions, session: StreamSession) -> None:
        self.app = app
        self.sessions = sessions
        self.session = session
        self.start: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.streaming = False
        self.plain: asyncio.Queue[Message | None] = asyncio.Queue()  # a non-stream answer's body messages
        self.body_read = asyncio.Event()  # the app has read the request body: receive is the client's again

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.create_task(self._produce(scope, receive))
        self.session.task = task
        client_gone = asyncio.create_task(self._client_gone(receive))
        try:
            await asyncio.wait({self.start, client_gone}, return_when=asyncio.FIRST_COMPLETED)
            if not self.start.done():  # left before the answer started: stop as llama-server does
                task.cancel()
                self.sessions.discard(self.session)
                return
            if self.start.cancelled():  # stopped (DELETE, or a newer request on the id) before it answered
                await error_response(ApiError("the stream was stopped before it started (DELETE /v1/stream, or a "
                                              "newer request with the same X-Conversation-Id)", status=409,
                                              code="stream_stopped"), scope.get("path", ""))(scope, receive, send)
                return
            start = self.start.result()  # the app's exception when it failed before answering (a 500 outside)
            await send(start)
            relay = asyncio.create_task(self._relay(send))
            await asyncio.wait({relay, client_gone}, return_when=asyncio.FIRST_COMPLETED)
            if not relay.done():
                relay.cancel()
                if not self.streaming:  # a whole answer nobody waits for: llama-server stops it too
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await relay
        finally:
            client_gone.cancel()

    async def _relay(self, send: Send) -> None:
        if self.streaming:
            with contextlib.suppress(OffsetLostError):  # a client slower than the generation by a whole buffer
                async for chunk in self.session.read_from(0):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        while (message := await self.plain.get()) is not None:
            await send(message)

    async def _client_gone(self, receive: Receive) -> None:
        await self.body_read.wait()
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _produce(self, scope: Scope, receive: Receive) -> None:
        async def app_receive() -> Message:
            if self.body_read.is_set():
                await asyncio.Future()  # the app never hears of the client leaving; cancellation ends this
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                self.body_read.set()
            return message

        try:
            await self.app(scope, app_receive, self._app_send)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not self.start.done():
                self.start.set_exception(e)
            else:
                log.exception("internal error in a resumable stream (%s)", self.session.conversation_id)
        finally:
            if self.streaming:
                self.session.finish()
            else:
                self.sessions.discard(self.session)
                self.plain.put_nowait(None)
            if not self.start.done():
                self.start.cancel()

    async def _app_send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.streaming = is_event_stream(message)
            if not self.streaming:
                self.sessions.discard(self.session)
            self.start.set_result(message)
        elif message["type"] == "http.response.body":
            if not self.streaming:
                self.plain.put_nowait(message)
                return
            self.session.append(message.get("body", b""))
            if not message.get("more_body", False):
                self.session.finish()


def _conv_id_param(request: Request) -> str:
    conv_id = request.query_params.get("conv_id", "")
    if not conv_id:
        raise ApiError("missing conversation id: send it as the 'conv_id' query parameter", param="conv_id")
    return conv_id


def _offset_param(request: Request) -> int:
    raw = request.query_params.get("from", "")
    if not raw:
        return 0
    if not raw.isdigit():
        raise ApiError(f"invalid 'from' offset {raw!r}: a byte offset, 0 or more", param="from")
    return int(raw)


# the OpenAPI document's view of the routes (they read their query and body themselves, to answer llama-server's
# errors in its order: a missing id, an unknown id, then a bad offset)
_CONV_ID = {"name": "conv_id", "in": "query", "required": True, "schema": {"type": "string", "minLength": 1},
            "description": "the request's X-Conversation-Id"}
_FROM = {"name": "from", "in": "query", "required": False, "schema": {"type": "string", "pattern": "^[0-9]+$"},
         "description": "the byte offset to replay from (default 0)"}
_EVENT_STREAM = {200: {"description": "the stream's bytes from the offset, then its live bytes",
                       "content": {"text/event-stream": {"schema": {"type": "string"}}}}}
_LOOKUP_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["conversation_ids"],
    "properties": {"conversation_ids": {"type": "array", "items": {"type": "string"}}}}}}}


def register(app: FastAPI, sessions: StreamSessions) -> None:
    @app.get("/v1/stream", responses=_EVENT_STREAM, response_class=StreamingResponse,
             openapi_extra={"parameters": [_CONV_ID, _FROM]})
    async def read_stream(request: Request) -> Response:
        conv_id = _conv_id_param(request)
        session = sessions.get(conv_id)
        if session is None:
            raise ApiError("stream not found or expired", status=404, type="not_found_error", param="conv_id")
        offset = _offset_param(request)
        if offset < session.dropped_bytes:
            raise ApiError(f"stream offset lost, please restart: offset {offset} is before the first byte still "
                           f"held ({session.dropped_bytes})", param="from")

        async def body() -> AsyncIterator[bytes]:
            with contextlib.suppress(OffsetLostError):
                async for chunk in session.read_from(offset):
                    yield chunk

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/streams/lookup", openapi_extra={"requestBody": _LOOKUP_BODY})
    async def lookup_streams(request: Request) -> JSONResponse:
        try:
            body: Any = await request.json()
        except ValueError as e:
            raise ApiError(f"invalid body: {e}") from None
        ids = body.get("conversation_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ApiError("'conversation_ids' must be a list of strings", param="conversation_ids")
        return JSONResponse([{"conversation_id": s.conversation_id, "is_done": s.done, "total_bytes": s.total_bytes,
                              "started_at": int(s.started_at), "completed_at": int(s.completed_at or 0)}
                             for s in sessions.lookup([i for i in ids if i])])

    @app.delete("/v1/stream", status_code=204, response_class=Response, openapi_extra={"parameters": [_CONV_ID]})
    async def stop_stream(request: Request) -> Response:
        sessions.cancel(_conv_id_param(request))
        return Response(status_code=204)
