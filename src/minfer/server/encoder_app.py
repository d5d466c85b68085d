"""The HTTP API of an encoder model (``minfer serve all-minilm``, a BERT folder): embeddings and reranking, with
the hardening every minfer route has (errors, key check, body cap, CORS, the ``/v1``-less aliases, the access
log and ``/metrics``).

Routes: ``POST /v1/embeddings`` (OpenAI; also ``/embeddings``), ``POST /embedding`` (llama-server's native shape),
``POST /v1/rerank`` (also ``/rerank``, ``/reranking``, ``/v1/reranking``: llama-server's, Jina's, Cohere's and TEI's
shapes, :mod:`minfer.server.protocols.rerank`), ``POST /tokenize`` / ``/detokenize``, ``GET /health``,
``/v1/models``, ``/props`` and ``/metrics``. The generating endpoints (chat, completions, messages, responses,
llama-server's ``/completion``, ollama's ``/api/chat`` and ``/api/generate``) answer 400 naming the model as an
encoder, never 404 or 500. ollama's embedding routes (``/api/embed``, ``/api/tags``, ...) are
:mod:`minfer.server.routes.ollama_encoder`'s.

Requests are tokenized on the event loop (off it when large) and evaluated on the encoder thread
(:class:`~minfer.runtime.encoder_loop.EncoderLoop`), which batches concurrent requests into shared passes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector, generate_latest

from minfer.api_encoder import Encoder
from minfer.errors import BadRequestError
from minfer.runtime.encoder_loop import EncoderLoop
from minfer.runtime.pooling import ENCODER_POOLINGS, l2_normalize, pool_rows
from minfer.server.aliases import V1Alias
from minfer.server.context import ServerConfig
from minfer.server.cors import with_cors
from minfer.server.errors import ApiError, install_error_handlers
from minfer.server.json_body import parse_body
from minfer.server.middleware import AuthAndCount, CatchAll
from minfer.server.protocols.embeddings import parse_embeddings
from minfer.server.protocols.rerank import parse_rerank

GENERATING_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/completion",
                     "/completions", "/chat/completions", "/infill", "/api/chat", "/api/generate")
LARGE_TEXT = 64 * 1024  # characters tokenized off the event loop


class EncoderMetrics:
    """What ``/metrics`` shows of an encoder server (and what the middleware counts requests into)."""

    def __init__(self, loop: EncoderLoop) -> None:
        self.registry = reg = CollectorRegistry()
        ProcessCollector(registry=reg)
        self.requests = Counter("minfer_requests", "HTTP requests answered", ["endpoint", "status"], registry=reg)
        self.prompt_tokens = Counter("minfer_prompt_tokens", "tokens evaluated", registry=reg)
        Gauge("minfer_encoder_batches", "batches the encoder thread evaluated", registry=reg).set_function(
            lambda: loop.batches)
        Gauge("minfer_queue_depth", "requests waiting for the encoder thread", registry=reg).set_function(
            lambda: loop.waiting)
        Gauge("minfer_requests_running", "sequences being evaluated", registry=reg).set_function(lambda: loop.running)
        Gauge("minfer_encoder_passes", "forward passes the encoder ran", registry=reg).set_function(
            lambda: loop.runner.passes)
        Gauge("minfer_plans_built", "forward-pass plans built since the start", registry=reg).set_function(
            lambda: loop.runner.plans_built)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def create_encoder_app(encoder: Encoder, loop: EncoderLoop, config: ServerConfig,
                       pooling: str | None = None, start_loop: bool = True) -> Any:
    """The ASGI app of an encoder; the encoder thread starts and stops with the app's lifespan (unless
    ``start_loop`` is False: the caller runs it). ``pooling``: the server's (``--pooling``), else the model's."""
    pooling = pooling or encoder.pooling
    if pooling not in ENCODER_POOLINGS:
        raise BadRequestError(f"--pooling must be one of {', '.join(ENCODER_POOLINGS)}, got {pooling!r}")
    metrics = EncoderMetrics(loop)
    created = int(time.time())
    names = {config.model_id, str(encoder.path), encoder.path.name}
    n_params = sum(int(math.prod(t.shape)) for t in encoder.model.tensors.values())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if start_loop:
            loop.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, loop.stop, 5.0)

    app = FastAPI(title="minfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    from minfer.server.routes.page import register_encoder_page

    register_encoder_page(app, key_required=bool(config.api_keys))  # the page at /

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        return await asyncio.to_thread(parse_body, raw) if len(raw) > LARGE_TEXT else parse_body(raw)

    def check_model(name: str | None) -> None:
        if name is not None and config.strict_model and name not in names:
            raise ApiError(f"the model {name!r} does not exist (this server has {config.model_id!r})",
                           param="model", code="model_not_found")

    async def tokenized(texts: Sequence[str | list[int]], truncate: bool, field: str) -> tuple[list[list[int]], int]:
        size = sum(len(t) for t in texts if isinstance(t, str))
        try:
            if size > LARGE_TEXT:
                return await asyncio.to_thread(encoder.embed_inputs, list(texts), truncate)
            return encoder.embed_inputs(list(texts), truncate)
        except BadRequestError as e:
            raise ApiError(str(e).replace("input[", f"{field}["), param=field) from None

    async def evaluate(sequences: list[list[int]], types: list[list[int]] | None, field: str) -> list[np.ndarray]:
        try:
            future = loop.submit(sequences, types, field)
        except BadRequestError as e:
            raise ApiError(str(e), param=field) from None
        hidden = await asyncio.wrap_future(future)
        metrics.prompt_tokens.inc(sum(len(s) for s in sequences))
        return hidden

    def truncate_flag(body: Any) -> bool:
        value = body.get("truncate", False) if isinstance(body, dict) else False
        if not isinstance(value, bool):
            raise ApiError(f"'truncate' must be true or false, got {value!r:.60}", param="truncate")
        return value

    async def vectors(body: Any, native: bool) -> tuple[list[np.ndarray], list[list[int]], Any]:
        req = parse_embeddings(body, native=native)
        check_model(req.model)
        field = "content" if native and "content" in body else "input"
        ids, _ = await tokenized(req.inputs, truncate_flag(body), field)
        hidden = await evaluate(ids, None, field)
        # the request's embd_normalize, else the model's Normalize module (unless the server says --no-normalize)
        normalize = config.normalize and encoder.config.normalize if req.normalize is None else req.normalize
        out = [pool_rows(h, pooling) for h in hidden]
        if normalize and pooling != "none":
            out = [l2_normalize(v) for v in out]
        return out, ids, req

    @app.post("/v1/embeddings")
    async def v1_embeddings(request: Request) -> Response:
        return await openai_embeddings(await body_of(request))

    async def openai_embeddings(body: Any) -> Response:
        if pooling == "none":
            raise ApiError("pooling 'none' gives one vector per token, which /v1/embeddings cannot return: start "
                           "the server with another --pooling, or use /embedding", param="input")
        if isinstance(body, dict) and body.get("dimensions") not in (None, encoder.n_embd):
            raise ApiError(f"'dimensions' must be {encoder.n_embd} for this model (it cannot shorten vectors), got "
                           f"{body.get('dimensions')!r:.60}", param="dimensions")
        out, ids, req = await vectors(body, native=False)
        data = []
        for k, v in enumerate(out):
            vec = v.astype("<f4")
            value: Any = base64.b64encode(vec.tobytes()).decode() if req.encoding_format == "base64" else vec.tolist()
            data.append({"object": "embedding", "index": k, "embedding": value})
        n = sum(len(p) for p in ids)
        return JSONResponse({"object": "list", "data": data, "model": config.model_id,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    @app.post("/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, dict) and "content" in body and "input" not in body:
            return await native_embeddings(body)
        return await openai_embeddings(body)

    @app.post("/embedding")
    async def embedding(request: Request) -> Response:
        return await native_embeddings(await body_of(request))

    async def native_embeddings(body: Any) -> Response:
        out, _, _ = await vectors(body, native=True)
        return JSONResponse([{"index": k, "embedding": np.atleast_2d(v).tolist()} for k, v in enumerate(out)])

    async def rerank(request: Request) -> Response:
        req = parse_rerank(await body_of(request))
        check_model(req.model)
        if not encoder.can_rerank:
            raise ApiError(f"the model {config.model_id!r} has no classification head, so it cannot rerank: serve a "
                           "cross-encoder (a *ForSequenceClassification checkpoint such as bge-reranker)",
                           param="model")
        field = "texts" if req.tei else "documents"
        pairs = []
        for k, d in enumerate(req.documents):
            try:
                pairs.append(encoder.tokenizer.encode(req.query, d, truncate=req.truncate,
                                                      what=f"{field}[{k}] with the query"))
            except BadRequestError as e:
                raise ApiError(str(e), param=field) from None
        hidden = await evaluate([p.ids for p in pairs], [p.token_types for p in pairs], field)
        from minfer.models.bert import classification_head

        scores = classification_head(encoder.model, np.stack([h[0] for h in hidden]), encoder.backend.dequantize)[:, 0]
        order = sorted(range(len(pairs)), key=lambda k: -float(scores[k]))[:req.top_n]
        label = "score" if req.tei else "relevance_score"
        results = []
        for k in order:
            item: dict[str, Any] = {"index": k, label: float(scores[k])}
            if req.return_documents:
                item["text" if req.tei else "document"] = req.documents[k] if req.tei else {"text": req.documents[k]}
            results.append(item)
        if req.tei:
            return JSONResponse(results)
        n = sum(len(p.ids) for p in pairs)
        return JSONResponse({"model": req.model or config.model_id, "object": "list", "results": results,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    for path in ("/v1/rerank", "/rerank", "/reranking", "/v1/reranking"):
        app.post(path)(rerank)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        content = body.get("content") if isinstance(body, dict) else None
        if not isinstance(content, str):
            raise ApiError("'content' must be a string", param="content")
        return {"tokens": encoder.tokenizer.encode(content, truncate=True).ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                   0 <= t < encoder.tokenizer.vocab_size for t in tokens):
            raise ApiError(f"'tokens' must be a list of token ids in 0..{encoder.tokenizer.vocab_size - 1}",
                           param="tokens")
        return {"content": encoder.tokenizer.decode(tokens)}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        # slots_running / slots_waiting: the names a generating server's load goes by (the Ray front routes on them)
        return {"status": "ok", "kind": "encoder", "slots_running": loop.running, "slots_waiting": loop.waiting}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        hp = encoder.hparams
        return {"id": config.model_id, "object": "model", "created": created, "owned_by": "minfer",
                "meta": {"architecture": hp.arch, "n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train,
                         "n_embd": hp.n_embd, "n_params": n_params, "size": encoder.model.weight_bytes,
                         "kind": "encoder", "pooling": pooling, "max_seq_length": encoder.max_length,
                         "rerank": encoder.can_rerank}}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/props")
    async def props() -> dict[str, Any]:
        return {"model_path": str(encoder.path), "model_alias": config.model_id, "embedding": True,
                "pooling": pooling, "n_ctx": encoder.max_length, "rerank": encoder.can_rerank,
                "chat_template": None, "modalities": {"vision": False, "audio": False}}

    from minfer.server.routes import ollama_encoder

    ollama_encoder.register(app, encoder, config.model_id, pooling, check_model, body_of, tokenized, evaluate)
    what = "embeds and reranks" if encoder.can_rerank else "embeds"

    async def not_generating(request: Request) -> Response:
        raise ApiError(f"the model {config.model_id!r} is an encoder: it {what}, it does not generate "
                       f"text ({request.url.path} needs a generating model; use /v1/embeddings or /v1/rerank)",
                       param="model", code="model_not_supported")

    for path in GENERATING_ROUTES:
        app.post(path)(not_generating)

    endpoints = {path for route in app.routes if "{" not in (path := getattr(route, "path", "{"))}
    counted = AuthAndCount(app, config.api_keys, metrics, endpoints,  # type: ignore[arg-type]
                           max_body_size=config.max_body_size, log_format=config.log_format)
    return CatchAll(with_cors(V1Alias(counted, app.routes), config.cors))
