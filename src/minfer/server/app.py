"""The HTTP API over a :class:`~minfer.runtime.engine_loop.EngineLoop`: one FastAPI app whose routes
live in :mod:`minfer.server.routes`, one module per group (OpenAI's chat and completions, the service
probes), each registered with the :class:`~minfer.server.context.ServerContext` they share.

Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` (the handlers of
:mod:`minfer.server.errors` and the middleware of :mod:`minfer.server.middleware` apply it to every route);
with API keys configured, every endpoint but ``/health`` wants one (``Authorization: Bearer <key>``), and a
CORS preflight (any ``OPTIONS``) is answered before that check (:mod:`minfer.server.cors`).

Request handlers run on the event loop: they parse, render the chat template, tokenize (large inputs on a
worker thread) and submit sequences to the engine thread, whose events come back through an
:class:`~minfer.server.jobs.EventPump`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from minfer.api import Model
from minfer.runtime.engine_loop import EngineLoop
from minfer.server.aliases import V1Alias
from minfer.server.context import ServerConfig, ServerContext
from minfer.server.cors import with_cors
from minfer.server.errors import install_error_handlers
from minfer.server.middleware import AuthAndCount, CatchAll
from minfer.server.openapi import document_errors
from minfer.server.resumable_streams import StreamSessions, StreamTee
from minfer.server.resumable_streams import register as register_resumable_streams
from minfer.server.routes import (
    chat_completions,
    completions,
    embeddings,
    llama_native,
    lora_adapters,
    messages,
    ollama,
    page,
    responses,
    service,
    tokens,
    trace,
    vertex,
)

__all__ = ["MinferApp", "ServerConfig", "create_app"]

ROUTE_GROUPS = (service, chat_completions, completions, embeddings, tokens, llama_native, lora_adapters, responses,
                messages, ollama, page, trace, vertex)  # vertex last: its /predict dispatches to the others


class MinferApp:
    """The ASGI app with its middleware, and the context its routes share (``begin_shutdown``)."""

    def __init__(self, asgi: Any, ctx: ServerContext) -> None:
        self.asgi = asgi
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.asgi(scope, receive, send)


def create_app(
    model: Model, engine_loop: EngineLoop, config: ServerConfig, shutdown_timeout: float = 0.0,
    start_engine_loop: bool = True,
) -> MinferApp:
    """The ASGI app; the engine loop is stopped with the app's lifespan, and started with it unless
    ``start_engine_loop`` is False (the caller runs ``engine_loop.run()`` on a thread of its choice)."""
    ctx = ServerContext.create(model, engine_loop, config, created=int(time.time()))
    engine_loop.metrics = replace(ctx.metrics.batch_hooks(), after_events=ctx.pump.flush)
    stream_sessions = StreamSessions()  # X-Conversation-Id streams, resumable after a dropped connection

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        ctx.loop = asyncio.get_running_loop()
        if start_engine_loop:
            engine_loop.start()
        yield
        # uvicorn has waited for open requests (--shutdown-timeout); what is left gets cancelled
        await asyncio.get_running_loop().run_in_executor(None, engine_loop.stop, shutdown_timeout)
        stream_sessions.cancel_all()  # and the resumable streams that outlived their clients with it
        if ctx.parser_pool is not None:
            ctx.parser_pool.shutdown(cancel_futures=True)

    app = FastAPI(title="minfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)  # (Anthropic's error bodies under /v1/messages: errors.error_response)
    for group in ROUTE_GROUPS:
        group.register(app, ctx)
    register_resumable_streams(app, stream_sessions)
    document_errors(app)
    endpoints = {path for route in app.routes if "{" not in (path := getattr(route, "path", "{"))}
    counted = AuthAndCount(StreamTee(app, stream_sessions), config.api_keys, ctx.metrics, endpoints,
                           max_body_size=config.max_body_size, log_format=config.log_format)
    # outside in: the catch-all for 500s, CORS (a preflight is answered before the key check), the
    # /v1-less aliases, the key check, body cap and access log, then the resumable streams' tee
    return MinferApp(CatchAll(with_cors(V1Alias(counted, app.routes), config.cors)), ctx)
