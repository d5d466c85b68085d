"""The OpenAI-compatible HTTP API over a :class:`~minfer.runtime.scheduler.BatchScheduler`.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both streamed as server-sent events
with ``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). Every error is
an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``; with an API key configured,
every endpoint but ``/health`` wants ``Authorization: Bearer <key>``.

Request handlers run on the event loop: they parse, render the chat template, tokenize and submit
sequences to the scheduler thread, whose events come back through an :class:`_EventPump`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minfer.api import Model
from minfer.errors import BadRequestError, ContextOverflowError, MinferError
from minfer.runtime.engine import Event, Failed, Finished, GenerationRequest, Started, Token
from minfer.runtime.sampling import TokenLogprob
from minfer.runtime.scheduler import BatchScheduler, QueueFullError, ShuttingDownError
from minfer.runtime.sequence import GenerationStats
from minfer.server.metrics import ServerMetrics
from minfer.server.protocol import ApiError, GenerationParams, parse_chat, parse_completion


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    api_key: str | None = None
    retry_after_seconds: int = 1


@dataclass
class _Choice:
    """What one generated sequence has produced so far."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: GenerationStats | None = None
    cached_tokens: int = 0
    error: Exception | None = None

    @property
    def finished(self) -> bool:
        return self.stats is not None or self.error is not None

    @property
    def cancelled(self) -> bool:
        """Ended by the scheduler, not by the model (the server is shutting down)."""
        return self.stats is not None and self.stats.finish_reason == "cancelled"


class _EventPump:
    """Carries events from the scheduler thread to the event loop's queues.

    One forward pass emits a token to every running sequence; waking the loop once per event (a
    ``call_soon_threadsafe`` each, a write to its wake-up pipe each) cost more than sampling that token.
    Events wait in a list; the scheduler calls :meth:`flush` once per step, which wakes the loop once.
    """

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[tuple[int, Event]], tuple[int, Event]]] = []
        self._scheduled = False

    def put(self, queue: asyncio.Queue[tuple[int, Event]], item: tuple[int, Event]) -> None:
        """On the scheduler thread."""
        with self._lock:
            self._pending.append((queue, item))

    def flush(self) -> None:
        """On the scheduler thread: have the loop take what is pending (unless it is about to)."""
        with self._lock:
            if not self._pending or self._scheduled or self.loop is None:
                return
            self._scheduled = True
            loop = self.loop
        try:
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is gone: the server has stopped
            with self._lock:
                self._scheduled = False

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for queue, item in pending:
            queue.put_nowait(item)


class _Job:
    """The sequences of one HTTP request, and the queue their events arrive in."""

    def __init__(self, pump: _EventPump) -> None:
        self.pump = pump
        self.events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.requests: list[GenerationRequest] = []
        self.choices: list[_Choice] = []

    def emitter(self, index: int) -> Callable[[Event], None]:
        def emit(event: Event) -> None:  # on the scheduler thread
            self.pump.put(self.events, (index, event))

        return emit

    def cancel(self) -> None:
        for r in self.requests:
            r.cancel()

    def apply(self, index: int, event: Event) -> _Choice:
        c = self.choices[index]
        if isinstance(event, Started):
            c.cached_tokens = event.cached_tokens
        elif isinstance(event, Token):
            c.text.append(event.step.text)
            if event.step.logprob is not None:
                c.logprobs.append(event.step.logprob)
        elif isinstance(event, Finished):
            c.stats, c.cached_tokens = event.stats, event.cached_tokens
        elif isinstance(event, Failed):
            c.error = event.error
        return c

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _cancelled_error() -> ApiError:
    return ApiError("the request was cancelled before it finished (server shutting down)", status=503,
                    type="server_error", code="cancelled")


def _api_error(e: Exception) -> ApiError:
    """The HTTP answer to an engine error."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, QueueFullError):
        return ApiError(str(e), status=429, type="rate_limit_error", code="queue_full")
    if isinstance(e, ShuttingDownError):
        return ApiError(str(e), status=503, type="server_error", code="shutting_down")
    if isinstance(e, ContextOverflowError):
        return ApiError(str(e), code="context_length_exceeded", param="messages")
    if isinstance(e, BadRequestError | MinferError):
        return ApiError(str(e))
    return ApiError(f"internal error: {type(e).__name__}: {e}", status=500, type="server_error")


class _AuthAndCount:
    """Pure ASGI middleware (keeps streaming and disconnects intact): Bearer key check, request counter."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                                    "/metrics") else "other"
        status = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key is not None and path != "/health" and not self._authorized(scope):
                e = ApiError("invalid or missing API key (send 'Authorization: Bearer <key>')", status=401,
                             code="invalid_api_key")
                await _error_response(e)(scope, receive, counting_send)
                return
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, key = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(key.strip(), self.api_key or "")
        return False


def create_app(
    model: Model, scheduler: BatchScheduler, config: ServerConfig, shutdown_timeout: float = 0.0,
    start_scheduler: bool = True,
) -> Any:
    """The ASGI app; the scheduler is stopped with the app's lifespan, and started with it unless
    ``start_scheduler`` is False (the caller runs ``scheduler.run()`` on a thread of its choice)."""
    metrics = ServerMetrics(scheduler.load, scheduler.cells_in_use, scheduler.n_slots * scheduler.slot_context)
    pump = _EventPump()
    scheduler.metrics = replace(metrics.batch_hooks(), after_events=pump.flush)
    created = int(time.time())
    names = {config.model_id, str(model.path), Path(model.path).name, Path(model.path).stem}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if start_scheduler:
            scheduler.start()
        yield
        # uvicorn has waited for open requests (--shutdown-timeout); what is left gets cancelled
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop, shutdown_timeout)

    app = FastAPI(title="minfer", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def on_api_error(_request: Request, e: ApiError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(str(e.detail), status=e.status_code, type=kind))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        running, waiting = scheduler.load()
        return {"status": "ok", "slots_running": running, "slots_waiting": waiting}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        hp = model.hparams
        return {"id": config.model_id, "object": "model", "created": created, "owned_by": "minfer",
                "meta": {"architecture": hp.arch, "n_vocab": hp.n_vocab, "n_ctx_train": hp.n_ctx_train,
                         "n_ctx_per_sequence": scheduler.slot_context, "parallel": scheduler.n_slots}}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        if model_id not in names:
            raise ApiError(f"the model {model_id!r} does not exist (this server has {config.model_id!r})",
                           status=404, type="not_found_error", param="model", code="model_not_found")
        return model_card()

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise ApiError(f"the model {name!r} does not exist (this server has {config.model_id!r})",
                           param="model", code="model_not_found")

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not valid JSON: {e}") from None

    def submit(prompts: Sequence[list[int]], params: GenerationParams) -> _Job:
        pump.loop = asyncio.get_running_loop()  # the loop exists only once the server runs
        job = _Job(pump)
        try:
            for p, ids in enumerate(prompts):
                for j in range(params.n):
                    index = len(job.choices)
                    seed = None if params.seed is None else params.seed + j
                    sampler = model.sampler(**params.sampling, seed=seed)
                    constraint = model.constraint(params.grammar, params.json_schema)
                    job.choices.append(_Choice(index, p))
                    job.requests.append(GenerationRequest(ids, sampler, params.max_tokens, job.emitter(index),
                                                          stop=params.stop, logprobs=params.logprobs,
                                                          constraint=constraint))
            scheduler.submit(job.requests)
        except QueueFullError as e:
            raise ApiError(str(e), status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(config.retry_after_seconds)}) from None
        except MinferError as e:
            raise _api_error(e) from None
        return job

    async def wait_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def collect(job: _Job, request: Request) -> None:
        """Wait until every sequence of ``job`` is done, or cancel them when the client goes away."""

        async def drain() -> None:
            while not job.done:
                job.apply(*await job.events.get())

        gone = asyncio.ensure_future(wait_disconnect(request))
        work = asyncio.ensure_future(drain())
        try:
            await asyncio.wait({gone, work}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                job.cancel()
        for c in job.choices:
            if c.error is not None:
                raise _api_error(c.error)
            if c.cancelled:
                raise _cancelled_error()

    def usage(job: _Job, prompts: Sequence[list[int]]) -> dict[str, Any]:
        completion = sum(c.stats.generated_tokens for c in job.choices if c.stats is not None)
        prompt = sum(len(p) for p in prompts)
        cached = sum(next(c.cached_tokens for c in job.choices if c.prompt_index == i) for i in range(len(prompts)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def token_text(token: int) -> str:
        return model.tokenizer.token_bytes(token).decode("utf-8", errors="replace")

    def chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
        def entry(token: int, lp: float) -> dict[str, Any]:
            return {"token": token_text(token), "logprob": lp, "bytes": list(model.tokenizer.token_bytes(token))}

        return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top_logprobs]}
                            for x in items]}

    def completion_logprobs(items: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
        offsets = []
        for x in items:
            offsets.append(offset)
            offset += len(token_text(x.token))
        return {"tokens": [token_text(x.token) for x in items], "token_logprobs": [x.logprob for x in items],
                "top_logprobs": [{token_text(t): v for t, v in x.top_logprobs} for x in items],
                "text_offset": offsets}

    def finish_reason(c: _Choice) -> str:
        assert c.stats is not None
        return c.stats.finish_reason

    def sse(obj: Any) -> bytes:
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    def stream_response(job: _Job, chunk: Callable[[_Choice, Event | None], dict[str, Any] | None],
                        final_usage: Callable[[], dict[str, Any]] | None) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            try:
                while not job.done:
                    # every event already queued goes out in one write (a client that fell behind, n > 1)
                    out: list[bytes] = []
                    item = await job.events.get()
                    while True:
                        index, event = item
                        c = job.apply(index, event)
                        if isinstance(event, Failed) or c.cancelled:
                            e = _api_error(event.error) if isinstance(event, Failed) else _cancelled_error()
                            job.cancel()
                            yield b"".join(out) + sse(e.body())
                            return
                        body = chunk(c, event)
                        if body is not None:
                            out.append(sse(body))
                        if job.done or job.events.empty():
                            break
                        item = job.events.get_nowait()
                    if out:
                        yield b"".join(out)
                if final_usage is not None:
                    yield sse(final_usage())
                yield b"data: [DONE]\n\n"
            finally:
                job.cancel()  # a no-op when every sequence finished; frees the slots when the client left

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_chat(await read_json(request))
        params = req.params
        check_model(params.model)
        try:
            prompt = model.render_chat(req.messages)
        except MinferError as e:
            raise _api_error(e) from None
        ids = model.tokenize(prompt, add_special=False)
        job = submit([ids], params)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": now, "model": config.model_id, "system_fingerprint": "minfer"}
        if not params.stream:
            await collect(job, request)
            return JSONResponse({
                **base, "object": "chat.completion",
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
                             "logprobs": chat_logprobs(c.logprobs) if params.logprobs is not None else None,
                             "finish_reason": finish_reason(c)} for c in job.choices],
                "usage": usage(job, [ids]),
            })
        extra = {"usage": None} if params.include_usage else {}

        def chunk(c: _Choice, event: Event | None) -> dict[str, Any] | None:
            if isinstance(event, Started):
                delta: dict[str, Any] = {"role": "assistant", "content": ""}
                choice = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}
            elif isinstance(event, Token):
                if not event.step.text and event.step.logprob is None:
                    return None
                lp = chat_logprobs([event.step.logprob]) if event.step.logprob is not None else None
                choice = {"index": c.index, "delta": {"content": event.step.text}, "logprobs": lp,
                          "finish_reason": None}
            elif isinstance(event, Finished):
                choice = {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish_reason(c)}
            else:
                return None
            return {**base, "object": "chat.completion.chunk", "choices": [choice], **extra}

        def final() -> dict[str, Any]:
            return {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage(job, [ids])}

        return stream_response(job, chunk, final if params.include_usage else None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_completion(await read_json(request))
        params = req.params
        check_model(params.model)
        prompts = [model.tokenize(p, add_special=True) if isinstance(p, str) else p for p in req.prompts]
        echo = [(p if isinstance(p, str) else model.detokenize(p)) if req.echo else "" for p in req.prompts]
        job = submit(prompts, params)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": now, "model": config.model_id, "system_fingerprint": "minfer"}
        if not params.stream:
            await collect(job, request)
            choices = []
            for c in job.choices:
                head = echo[c.prompt_index]
                lp = completion_logprobs(c.logprobs, len(head)) if params.logprobs is not None else None
                choices.append({"index": c.index, "text": head + "".join(c.text), "logprobs": lp,
                                "finish_reason": finish_reason(c)})
            return JSONResponse({**base, "object": "text_completion", "choices": choices,
                                 "usage": usage(job, prompts)})
        extra = {"usage": None} if params.include_usage else {}
        offsets = [len(echo[c.prompt_index]) for c in job.choices]

        def chunk(c: _Choice, event: Event | None) -> dict[str, Any] | None:
            if isinstance(event, Started):
                if not echo[c.prompt_index]:
                    return None
                choice = {"index": c.index, "text": echo[c.prompt_index], "logprobs": None, "finish_reason": None}
            elif isinstance(event, Token):
                step = event.step
                if not step.text and step.logprob is None:
                    return None
                lp = None
                if step.logprob is not None:
                    lp = completion_logprobs([step.logprob], offsets[c.index])
                offsets[c.index] += len(step.text)
                choice = {"index": c.index, "text": step.text, "logprobs": lp, "finish_reason": None}
            elif isinstance(event, Finished):
                choice = {"index": c.index, "text": "", "logprobs": None, "finish_reason": finish_reason(c)}
            else:
                return None
            return {**base, "object": "text_completion", "choices": [choice], **extra}

        def final() -> dict[str, Any]:
            return {**base, "object": "text_completion", "choices": [], "usage": usage(job, prompts)}

        return stream_response(job, chunk, final if params.include_usage else None)

    return _AuthAndCount(app, config.api_key, metrics)
