"""The OpenAI routes without their ``/v1`` prefix (``/chat/completions``, ``/completions``, ``/embeddings``,
``/models``, ...), as llama-server answers them: clients configured with a bare ``http://host:port``
base URL call those. Generic: any path that no route matches is tried under ``/v1``, so routes added
later get their alias too; a path that is a route of its own (llama-server's native ``/embeddings``,
``/completion``) is left alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

PREFIX = "/v1"


class V1Alias:
    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.routes = routes

    def _matches(self, scope: dict[str, Any]) -> bool:
        return any(route.matches(scope)[0] is not Match.NONE for route in self.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and not path.startswith(PREFIX + "/") and not self._matches(dict(scope)):
            aliased = {**scope, "path": PREFIX + path, "raw_path": (PREFIX + path).encode()}
            if self._matches(aliased):
                scope = aliased
        await self.app(scope, receive, send)
