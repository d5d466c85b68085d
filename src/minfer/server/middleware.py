"""Pure ASGI middleware (keeps streaming and disconnects intact): the API key check and the request counter."""

from __future__ import annotations

import secrets
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minfer.server.errors import error_response
from minfer.server.metrics import ServerMetrics
from minfer.server.protocol import ApiError

OPEN_PATHS = frozenset({"/health"})  # answered without the key (load balancers probe them)
# the pages and their static files load without the key: they ask for it once and send it on API calls
OPEN_PAGE_PATHS = frozenset({"/", "/trace", "/favicon.ico"})
OPEN_PAGE_PREFIX = "/static/"


class AuthAndCount:
    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics, endpoints: Collection[str]) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)  # the metric's label: a known route's path, else "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"
        status = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key is not None and not _open(path) and not self._authorized(scope):
                e = ApiError("invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                             status=401, code="invalid_api_key")
                await error_response(e, path)(scope, receive, counting_send)
                return
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, key = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and secrets.compare_digest(key.strip(), self.api_key or ""):
                    return True
            # Anthropic's clients send the key as x-api-key (the Messages API); any route takes either header
            elif name == b"x-api-key" and secrets.compare_digest(value.decode("latin-1").strip(), self.api_key or ""):
                return True
        return False


def _open(path: str) -> bool:
    return path in OPEN_PATHS or path in OPEN_PAGE_PATHS or path.startswith(OPEN_PAGE_PREFIX)
