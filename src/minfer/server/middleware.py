"""Pure ASGI middleware (keeps streaming and disconnects intact), outermost first:

- :class:`CatchAll`: an exception no handler answered is logged once, with its traceback, and answered
  with a 500 OpenAI error body when the response has not started (never a traceback to the client);
- :class:`AuthAndCount`: the access log line, the request counter, the body-size cap (``Content-Length``
  beyond it is a 413 before a byte is read; a chunked body is cut off, and answered 413, once it passes the
  cap) and the API key check (any of the server's keys, as ``Authorization: Bearer <key>``, a bare
  ``Authorization: <key>`` as llama-server takes it, or Anthropic's ``x-api-key``).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minfer.server.access_log import RequestRecord, current_request, format_line
from minfer.server.access_log import log as access_log
from minfer.server.context import DEFAULT_MAX_BODY_SIZE
from minfer.server.errors import ApiError, error_response, internal_error
from minfer.server.metrics import ServerMetrics

OPEN_PATHS = frozenset({"/health", "/v1/health"})  # answered without the key (load balancers probe them)
# the pages and their static files load without the key: they ask for it once and send it on API calls
OPEN_PAGE_PATHS = frozenset({"/", "/trace", "/favicon.ico"})
OPEN_PAGE_PREFIX = "/static/"

log = logging.getLogger("minfer.server")


class BodyTooLargeError(ApiError):
    def __init__(self, limit: int, size: int | None = None) -> None:
        has = f"has {size} bytes" if size is not None else "is larger than that"
        super().__init__(f"the request body {has}: the server's limit is {limit} bytes (minfer serve "
                         "--max-body-size)", status=413, code="request_too_large")


class CatchAll:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("internal error answering %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await error_response(internal_error(), scope.get("path", ""))(scope, receive, send)


class AuthAndCount:
    def __init__(self, app: ASGIApp, api_keys: Collection[str], metrics: ServerMetrics, endpoints: Collection[str],
                 max_body_size: int = DEFAULT_MAX_BODY_SIZE, log_format: str = "text") -> None:
        self.app = app
        self.api_keys = tuple(api_keys)  # empty: no key wanted
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)  # the metric's label: a known route's path, else "other"
        self.max_body_size = max_body_size
        self.log_format = log_format

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"
        client = scope.get("client")
        record = RequestRecord(scope.get("method", ""), path, f"{client[0]}:{client[1]}" if client else "-")
        record.status = 500
        token = current_request.set(record)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            if self.api_keys and not _open(path) and not has_key(scope, self.api_keys):
                await error_response(missing_key_error(), path)(scope, receive, counting_send)
                return
            size = self._content_length(scope)
            if size is not None and size > self.max_body_size:
                await error_response(BodyTooLargeError(self.max_body_size, size), path)(scope, receive,
                                                                                        counting_send)
                return
            await self.app(scope, self._capped(receive), counting_send)
        finally:
            current_request.reset(token)
            self.metrics.requests.labels(endpoint, str(record.status)).inc()
            if self.log_format != "off":
                access_log.info(format_line(record, self.log_format))

    def _capped(self, receive: Receive) -> Receive:
        limit, received = self.max_body_size, 0

        async def capped_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLargeError(limit)
            return message

        return capped_receive

    @staticmethod
    def _content_length(scope: Scope) -> int | None:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None


def missing_key_error() -> ApiError:
    """llama-server's 401: ``Invalid API Key``, type ``authentication_error`` (its ``code`` is the status, 401;
    minfer's codes are strings, and this one is OpenAI's own for the case)."""
    return ApiError("Invalid API Key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')", status=401,
                    type="authentication_error", code="invalid_api_key")


def has_key(scope: Scope, api_keys: Collection[str]) -> bool:
    """Whether the request carries one of ``api_keys`` (also the Ray front's and the model router's check)."""
    # bytes, not str: compare_digest refuses non-ASCII strings (a TypeError, a 500)
    expected = [k.encode() for k in api_keys]
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, key = value.partition(b" ")
            # "Bearer <key>", or the bare key (llama-server takes an Authorization without a scheme too)
            if _one_of(key.strip() if scheme.lower() == b"bearer" else value.strip(), expected):
                return True
        # Anthropic's clients send the key as x-api-key (the Messages API); any route takes either header
        elif name == b"x-api-key" and _one_of(value.strip(), expected):
            return True
    return False


def _one_of(given: bytes, expected: list[bytes]) -> bool:
    found = False
    for key in expected:  # every key compared, in constant time each: the time says nothing of which matched
        found |= secrets.compare_digest(given, key)
    return found


def is_page_path(path: str) -> bool:
    """The pages' own paths (the chat page, the explorer and their static files)."""
    return path in OPEN_PAGE_PATHS or path.startswith(OPEN_PAGE_PREFIX)


def _open(path: str) -> bool:
    return path in OPEN_PATHS or is_page_path(path)
