"""What every route shares: the model, the scheduler, and the steps of answering a generation request
(parse the body, submit sequences, wait for them or stream their events, count usage)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from minfer.api import Model
from minfer.errors import MinferError
from minfer.runtime.engine import EmbeddingRequest, Event, Failed, GenerationRequest
from minfer.runtime.pooling import Pooling
from minfer.runtime.scheduler import BatchScheduler, QueueFullError
from minfer.server.errors import api_error, cancelled_error
from minfer.server.jobs import Choice, EventPump, Job
from minfer.server.metrics import ServerMetrics
from minfer.server.protocol import ApiError, GenerationParams
from minfer.server.timings import timings


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    api_key: str | None = None
    retry_after_seconds: int = 1
    strict_model: bool = False  # refuse a request's "model" unless it names this model (else any name is fine)
    pooling: Pooling | None = None  # embeddings' pooling; None: the model's own (GGUF pooling_type, else mean)
    normalize: bool = True  # L2-normalise pooled embeddings
    cors_origins: tuple[str, ...] = ()  # origins browsers may call from ("*": any); empty: no CORS headers
    slots_endpoint: bool = False  # GET /slots (llama-server's --slots)


@dataclass
class ServerContext:
    model: Model
    scheduler: BatchScheduler
    config: ServerConfig
    metrics: ServerMetrics
    pump: EventPump
    created: int
    names: set[str] = field(default_factory=set)  # what a request's "model" may say

    @classmethod
    def create(cls, model: Model, scheduler: BatchScheduler, config: ServerConfig, created: int) -> ServerContext:
        metrics = ServerMetrics(scheduler.load, scheduler.cells_in_use, scheduler.n_slots * scheduler.slot_context)
        names = {config.model_id, str(model.path), Path(model.path).name, Path(model.path).stem}
        return cls(model, scheduler, config, metrics, EventPump(), created, names)

    # -- requests --------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        """One model is served, so any name reaches it (as llama-server and ollama answer), unless the
        server was started with ``--strict-model``."""
        if name is not None and self.config.strict_model and name not in self.names:
            raise ApiError(f"the model {name!r} does not exist (this server has {self.config.model_id!r})",
                           param="model", code="model_not_found")

    async def read_json(self, request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not valid JSON: {e}") from None

    def submit(self, prompts: Sequence[list[int]], params: GenerationParams, *, ignore_eos: bool = False,
               reuse_prefix: bool = True) -> Job:
        """Queue ``params.n`` sequences per prompt; the job's queue receives their events. ``ignore_eos``:
        end-of-generation tokens do not stop them; ``reuse_prefix=False``: no cached prefix is reused."""
        self.pump.loop = asyncio.get_running_loop()  # the loop exists only once the server runs
        job = Job(self.pump)
        model = self.model
        try:
            for p, ids in enumerate(prompts):
                for j in range(params.n):
                    index = len(job.choices)
                    seed = None if params.seed is None else params.seed + j
                    sampler = model.sampler(**params.sampling, seed=seed)
                    constraint = model.constraint(params.grammar, params.json_schema)
                    job.choices.append(Choice(index, p))
                    job.requests.append(GenerationRequest(ids, sampler, params.max_tokens, job.emitter(index),
                                                          stop=params.stop, logprobs=params.logprobs,
                                                          constraint=constraint,
                                                          stop_ids=frozenset() if ignore_eos else None,
                                                          reuse_prefix=reuse_prefix))
            self.scheduler.submit(job.requests)
        except QueueFullError as e:
            raise ApiError(str(e), status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_seconds)}) from None
        except MinferError as e:
            raise api_error(e) from None
        return job

    @property
    def pooling(self) -> Pooling:
        return self.config.pooling or self.model.pooling

    def submit_embeddings(self, prompts: Sequence[list[int]], pooling: Pooling, normalize: bool) -> Job:
        """Queue one embedding sequence per prompt (they share the scheduler's passes with generation)."""
        self.pump.loop = asyncio.get_running_loop()
        job = Job(self.pump)
        for p, ids in enumerate(prompts):
            job.choices.append(Choice(p, p))
            job.requests.append(EmbeddingRequest(ids, pooling, normalize, job.emitter(p)))
        try:
            self.scheduler.submit(job.requests)
        except QueueFullError as e:
            raise ApiError(str(e), status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_seconds)}) from None
        except MinferError as e:
            raise api_error(e) from None
        return job

    async def collect(self, job: Job, request: Request) -> None:
        """Wait until every sequence of ``job`` is done, or cancel them when the client goes away."""

        async def drain() -> None:
            while not job.done:
                job.apply(*await job.events.get())

        gone = asyncio.ensure_future(_wait_disconnect(request))
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
                raise api_error(c.error)
            if c.cancelled:
                raise cancelled_error()

    def stream(self, job: Job, chunk: Callable[[Choice, Event | None], dict[str, Any] | None],
               final_usage: Callable[[], dict[str, Any]] | None, done: bool = True) -> StreamingResponse:
        """Server-sent events: ``chunk`` turns each event into a body (or None to send nothing), then the
        usage chunk when asked, then ``[DONE]`` (unless ``done`` is False: llama-server's native streams
        end with their last chunk); an error ends the stream with an error event."""

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
                            e = api_error(event.error) if isinstance(event, Failed) else cancelled_error()
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
                if done:
                    yield b"data: [DONE]\n\n"
            finally:
                job.cancel()  # a no-op when every sequence finished; frees the slots when the client left

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- answers ---------------------------------------------------------------------------------

    def usage(self, job: Job, prompts: Sequence[list[int]]) -> dict[str, Any]:
        completion = sum(c.stats.generated_tokens for c in job.choices if c.stats is not None)
        prompt = sum(len(p) for p in prompts)
        cached = sum(next(c.cached_tokens for c in job.choices if c.prompt_index == i) for i in range(len(prompts)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def timings(self, job: Job, params: GenerationParams, choice: Choice | None = None) -> dict[str, Any]:
        """``{"timings": ...}``, llama-server's timings of ``choice`` (default: the job's first sequence),
        when the request asked for them (``timings_per_token``); else nothing."""
        c = choice or job.choices[0]
        if not params.timings or c.stats is None:
            return {}
        return {"timings": timings(c.stats, c.cached_tokens)}

    def token_text(self, token: int) -> str:
        return self.model.tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def finish_reason(c: Choice) -> str:
    assert c.stats is not None
    return c.stats.finish_reason


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
