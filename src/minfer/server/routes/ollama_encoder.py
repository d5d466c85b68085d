"""ollama's embedding routes on an encoder's server (``minfer serve all-minilm``, nomic-embed-text, bge): what
ollama's clients ask an embedding model for. ``POST /api/embed`` (L2-normalized vectors, ``truncate`` true unless
false), the older ``POST /api/embeddings`` (the pooled vector as it is), ``GET /api/tags``, ``GET /api/ps``,
``POST /api/show`` and ``GET /api/version``; ``/api/chat`` and ``/api/generate`` answer 400 (the encoder app's
generating routes). Errors are ollama's ``{"error": "..."}`` bodies, as on a generating model's server."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minfer.api_encoder import Encoder
from minfer.runtime.pooling import l2_normalize, pool_rows
from minfer.server.errors import ApiError
from minfer.server.protocols.ollama import nanoseconds, parse_embed, parse_embeddings_prompt
from minfer.server.routes.ollama import OLLAMA_API_VERSION, ModelFacts, model_info, model_name

Tokenized = Callable[[Sequence[str], bool, str], Awaitable[tuple[list[list[int]], int]]]
Evaluate = Callable[[list[list[int]], Any, str], Awaitable[list[np.ndarray]]]


def register(app: FastAPI, encoder: Encoder, model_id: str, pooling: str, check_model: Callable[[str], None],
             body_of: Callable[[Request], Awaitable[Any]], tokenized: Tokenized, evaluate: Evaluate) -> None:
    """The routes above, on ``app``: ``tokenized`` and ``evaluate`` are the encoder app's own (its tokenizer's
    truncation and errors, its encoder thread)."""
    model = encoder.model
    facts = ModelFacts(model_id, model.path, model.hparams.arch, model.tensors.values())

    def check(body: Any) -> None:
        check_model(model_name(body).removesuffix(":latest"))

    async def pooled(texts: list[str], truncate: bool, field: str) -> tuple[list[np.ndarray], int]:
        if pooling == "none":
            raise ApiError("the server pools no vectors (--pooling none): start it with another --pooling",
                           param=field)
        ids, _ = await tokenized(texts, truncate, field)
        hidden = await evaluate(ids, None, field)
        return [pool_rows(h, pooling) for h in hidden], sum(len(i) for i in ids)

    @app.post("/api/embed")
    async def embed(request: Request) -> Response:
        started = time.perf_counter()
        body = await body_of(request)
        check(body)
        texts, truncate = parse_embed(body, encoder.n_embd)
        vectors, n = await pooled(texts, truncate, "input")
        return JSONResponse({"model": body["model"], "embeddings": [l2_normalize(v).tolist() for v in vectors],
                             "total_duration": nanoseconds(time.perf_counter() - started), "load_duration": 0,
                             "prompt_eval_count": n})

    @app.post("/api/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await body_of(request)
        check(body)
        prompt = parse_embeddings_prompt(body)
        if not prompt:  # ollama answers an empty prompt with an empty vector
            return JSONResponse({"embedding": []})
        vectors, _ = await pooled([prompt], False, "prompt")
        return JSONResponse({"embedding": vectors[0].tolist()})

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [await facts.listing()]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        return {"models": [await facts.running(encoder.max_length)]}

    @app.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        check(body)
        info = model_info(model.gguf.metadata if model.gguf is not None else {
            f"{model.hparams.arch}.{k}": v for k, v in vars(model.hparams).items()})
        capabilities = ["embedding"] + (["rerank"] if encoder.can_rerank else [])
        return {"modelfile": f"FROM {model.path}\n", "parameters": "", "template": "", "details": facts.details(),
                "model_info": info, "capabilities": capabilities, "modified_at": facts.modified_at()}

    @app.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION}
