"""Embeddings: OpenAI's ``POST /v1/embeddings`` and llama-server's native ``POST /embedding``.

``POST /embeddings`` answers in OpenAI's shape (what an OpenAI client whose base URL lacks ``/v1``
expects), or in llama-server's native shape when the body uses the native ``content`` field. Vectors are
pooled from the final-normed hidden states with the server's pooling (``--pooling``, else the model's);
with pooling ``none`` only the native shape can carry them (one vector per token), and
``/v1/embeddings`` answers 400 as llama-server does.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minfer.server.context import ServerContext
from minfer.server.errors import ApiError
from minfer.server.jobs import Job
from minfer.server.protocols.embeddings import EmbeddingsRequest, parse_embeddings


def register(app: FastAPI, ctx: ServerContext) -> None:
    model = ctx.model

    async def embed(request: Request, req: EmbeddingsRequest, field: str) -> tuple[Job, list[list[int]]]:
        ctx.check_model(req.model)
        prompts = [await ctx.tokenize(x, True, param=field) if isinstance(x, str) else x for x in req.inputs]
        normalize = ctx.config.normalize if req.normalize is None else req.normalize
        try:
            job = ctx.submit_embeddings(prompts, ctx.pooling, normalize)
        except ApiError as e:
            if e.status == 400:
                e.param = field  # a bad token id, a prompt longer than a slot: the input's fault
            raise
        await ctx.collect(job, request)
        return job, prompts

    async def openai(request: Request, body: Any) -> Response:
        req = parse_embeddings(body)
        if ctx.pooling == "none":
            raise ApiError("pooling 'none' gives one vector per token, which /v1/embeddings cannot return: start "
                           "the server with another --pooling, or use /embedding", param="input")
        if req.dimensions is not None and req.dimensions != model.hparams.n_embd:
            raise ApiError(f"'dimensions' must be {model.hparams.n_embd} for this model (it cannot shorten "
                           f"vectors), got {req.dimensions}", param="dimensions")
        job, prompts = await embed(request, req, "input")
        data = []
        for c in job.choices:
            assert c.embedding is not None
            vec = c.embedding.astype("<f4")
            value: Any = base64.b64encode(vec.tobytes()).decode() if req.encoding_format == "base64" else vec.tolist()
            data.append({"object": "embedding", "index": c.index, "embedding": value})
        n = sum(len(p) for p in prompts)
        return JSONResponse({"object": "list", "data": data, "model": ctx.config.model_id,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def native(request: Request, body: Any) -> Response:
        req = parse_embeddings(body, native=True)
        job, _ = await embed(request, req, "content" if "content" in body else "input")
        out = []
        for c in job.choices:
            assert c.embedding is not None
            rows = np.atleast_2d(c.embedding)  # pooled: one row; pooling none: one row per token
            out.append({"index": c.index, "embedding": rows.tolist()})
        return JSONResponse(out)

    @app.post("/v1/embeddings")
    async def v1_embeddings(request: Request) -> Response:
        return await openai(request, await ctx.read_json(request))

    @app.post("/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await ctx.read_json(request)
        if isinstance(body, dict) and "content" in body and "input" not in body:
            return await native(request, body)
        return await openai(request, body)

    @app.post("/embedding")
    async def embedding(request: Request) -> Response:
        return await native(request, await ctx.read_json(request))
