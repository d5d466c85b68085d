"""The HTTP API over a :class:`~minfer.runtime.scheduler.BatchScheduler`: one FastAPI app whose routes
live in :mod:`minfer.server.routes`, one module per group (OpenAI's chat and completions, the service
probes), each registered with the :class:`~minfer.server.context.ServerContext` they share.

Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``; with an API key
configured, every endpoint but ``/health`` wants ``Authorization: Bearer <key>``.

Request handlers run on the event loop: they parse, render the chat template, tokenize and submit
sequences to the scheduler thread, whose events come back through an :class:`~minfer.server.jobs.EventPump`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minfer.api import Model
from minfer.runtime.scheduler import BatchScheduler
from minfer.server.aliases import V1Alias
from minfer.server.context import ServerConfig, ServerContext
from minfer.server.cors import with_cors
from minfer.server.errors import error_response
from minfer.server.middleware import AuthAndCount
from minfer.server.protocol import ApiError
from minfer.server.routes import (
    chat_completions,
    completions,
    embeddings,
    llama_native,
    messages,
    page,
    responses,
    service,
    tokens,
    trace,
)

__all__ = ["ServerConfig", "create_app"]

ROUTE_GROUPS = (service, chat_completions, completions, embeddings, tokens, llama_native, responses, messages, page,
                trace)


def create_app(
    model: Model, scheduler: BatchScheduler, config: ServerConfig, shutdown_timeout: float = 0.0,
    start_scheduler: bool = True,
) -> Any:
    """The ASGI app; the scheduler is stopped with the app's lifespan, and started with it unless
    ``start_scheduler`` is False (the caller runs ``scheduler.run()`` on a thread of its choice)."""
    ctx = ServerContext.create(model, scheduler, config, created=int(time.time()))
    scheduler.metrics = replace(ctx.metrics.batch_hooks(), after_events=ctx.pump.flush)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if start_scheduler:
            scheduler.start()
        yield
        # uvicorn has waited for open requests (--shutdown-timeout); what is left gets cancelled
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop, shutdown_timeout)

    app = FastAPI(title="minfer", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(str(e.detail), status=e.status_code, type=kind), request.url.path)

    for group in ROUTE_GROUPS:
        group.register(app, ctx)
    endpoints = {path for route in app.routes if "{" not in (path := getattr(route, "path", "{"))}
    # outside in: CORS (a preflight is answered before the key check), the /v1-less aliases, the key check
    return with_cors(V1Alias(AuthAndCount(app, config.api_key, ctx.metrics, endpoints), app.routes),
                     config.cors_origins)
