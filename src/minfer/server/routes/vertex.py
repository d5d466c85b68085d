"""Google Cloud Vertex AI's prediction protocol, as llama-server serves it when started with
``AIP_MODE=PREDICTION`` in its environment (Vertex AI's custom-container variables).

``POST /predict`` (or ``$AIP_PREDICT_ROUTE``) takes ``{"instances": [...], "parameters": ...}``: each instance is
the body of another endpoint, named by its ``@requestFormat``, either the endpoint's path (``"/completion"``) or
its camelCase name (the path without ``/v1``, each ``/``, ``-`` or ``_`` starting a capital:
``"chatCompletions"``, ``"applyTemplate"``; where two paths give one name, the ``/v1`` one). The instances run
at once, each answered as that endpoint answers it (never streamed: a ``stream`` field is set false); the
answer is ``{"predictions": [...]}``, one per instance in order, an instance's failure its error body
(``{"error": {...}}``) in its place. ``$AIP_HEALTH_ROUTE`` answers as ``/health``.

Not taken over: ``$AIP_HTTP_PORT`` (llama-server's port override); give the port with ``--port``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from minfer.server.context import ServerContext
from minfer.server.errors import ApiError

MAX_INSTANCES = 128  # llama-server's limit on one request's instances
# request headers not passed on to an instance's endpoint: they describe the outer request's body
_OUTER_ONLY = {"content-length", "content-type", "transfer-encoding", "host", "accept-encoding"}


def request_format(path: str) -> str:
    """An endpoint's camelCase name: ``/v1/chat/completions`` -> ``chatCompletions``, ``/apply-template`` ->
    ``applyTemplate``; a path's parameters (``{...}``) and what follows them are left out."""
    rest = path.removeprefix("/v1") if path.startswith("/v1/") else path
    out: list[str] = []
    capital = False
    for ch in rest.lstrip("/"):
        if ch == "{":
            break
        if ch in "/-_":
            capital = True
        else:
            out.append(ch.upper() if capital else ch)
            capital = False
    return "".join(out)


def _with_slash(path: str) -> str:
    return path if path.startswith("/") else "/" + path


def register(app: FastAPI, ctx: ServerContext, environ: Mapping[str, str] | None = None) -> None:
    """Register the prediction route when ``AIP_MODE`` is ``PREDICTION`` (after every other route: it
    dispatches to them). ``environ``: the process's environment unless given."""
    env = os.environ if environ is None else environ
    if env.get("AIP_MODE", "") != "PREDICTION":
        return
    endpoints: dict[str, APIRoute] = {r.path: r for r in app.routes if isinstance(r, APIRoute)}
    predict_path = _with_slash(env.get("AIP_PREDICT_ROUTE") or "/predict")
    if predict_path in endpoints:
        raise ValueError(f"AIP_PREDICT_ROUTE={predict_path} is one of the server's own routes; choose another")
    # the /v1 path wins a shared name (llama-server answers "completions" as /v1/completions)
    by_name: dict[str, str] = {}
    for path in sorted(endpoints, key=lambda p: not p.startswith("/v1/")):
        by_name.setdefault(request_format(path), path)
    health_path = env.get("AIP_HEALTH_ROUTE")
    if health_path:
        health = endpoints["/health"]
        app.add_api_route(_with_slash(health_path), health.endpoint, methods=["GET"], include_in_schema=False)

    async def one(client: httpx.AsyncClient, headers: dict[str, str], instance: Any) -> Any:
        if not isinstance(instance, Mapping):
            return ApiError("each instance must be a JSON object").body()
        name = instance.get("@requestFormat")
        if not isinstance(name, str):
            return ApiError("each instance must include a string @requestFormat", param="@requestFormat").body()
        path = by_name.get(name) or (name if name in endpoints else None)
        if path is None:
            return ApiError(f"no handler registered for @requestFormat: {name}", param="@requestFormat").body()
        payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
        if "stream" in payload:
            payload["stream"] = False  # one answer per instance: the prediction protocol does not stream
        methods = endpoints[path].methods or {"POST"}
        try:
            if "POST" in methods:
                r = await client.post(path, json=payload, headers=headers)
            else:
                r = await client.request(sorted(methods)[0], path, headers=headers)
        except Exception as e:  # the endpoint's own failure is this instance's, not the others'
            return ApiError(f"{type(e).__name__}: {e}", status=500, type="server_error").body()
        if not r.content:
            return None
        try:
            return r.json()
        except json.JSONDecodeError:
            return r.text

    @app.post(predict_path, include_in_schema=False)
    async def predict(request: Request) -> Response:
        body = await ctx.read_json(request)
        if not isinstance(body, Mapping):
            raise ApiError("request body must be a JSON object")
        instances = body.get("instances")
        if not isinstance(instances, list):
            raise ApiError("request body must include an array field named instances", param="instances")
        if len(instances) > MAX_INSTANCES:
            raise ApiError(f"instances array exceeds maximum size of {MAX_INSTANCES}", param="instances")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _OUTER_ONLY}
        # each instance through the app's own routes, in process (the outer request passed the key check)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://predict", timeout=None) as client:
            predictions = await asyncio.gather(*(one(client, headers, x) for x in instances))
        return JSONResponse({"predictions": list(predictions)})
