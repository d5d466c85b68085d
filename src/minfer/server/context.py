"""What every route shares: the model, the engine loop, and the steps of answering a generation request
(parse the body, submit sequences, wait for them or stream their events, count usage)."""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from minfer.api import Model
from minfer.errors import BadRequestError, MinferError
from minfer.runtime.engine_loop import EngineLoop, QueueFullError
from minfer.runtime.pooling import Pooling
from minfer.runtime.requests import EmbeddingRequest, Event, Failed, GenerationRequest
from minfer.runtime.speculative import resolve as resolve_speculative
from minfer.runtime.vision import ImageInput, PassImage
from minfer.server.access_log import note_job
from minfer.server.cors import CorsPolicy
from minfer.server.errors import ApiError, api_error, cancelled_error, context_overflow, internal_error
from minfer.server.image_urls import fetch_images
from minfer.server.jobs import Choice, EventPump, Job
from minfer.server.json_body import parse_body
from minfer.server.metrics import ServerMetrics
from minfer.server.protocols.images import image_error_param
from minfer.server.protocols.openai import GenerationParams

T = TypeVar("T")
DEFAULT_MAX_BODY_SIZE = 8 * 1024 * 1024
OFF_LOOP_BYTES = 16 * 1024  # bodies, texts and prompts beyond this are parsed/rendered/tokenized on a thread
OFF_PROCESS_BYTES = 1024 * 1024  # bodies beyond this are parsed in a helper process (see read_json)

log = logging.getLogger("minfer.server")


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    api_keys: tuple[str, ...] = ()  # a request may use any of them; empty: no key wanted
    retry_after_seconds: int = 1
    reasoning_format: str = "deepseek"  # how chat replies' <think> blocks are answered (--reasoning-format)
    strict_model: bool = False  # refuse a request's "model" unless it names this model (else any name is fine)
    pooling: Pooling | None = None  # embeddings' pooling; None: the model's own (GGUF pooling_type, else mean)
    normalize: bool = True  # L2-normalise pooled embeddings
    cors: CorsPolicy | None = None  # which browser pages may call the server; None: no CORS headers
    slots_endpoint: bool = False  # GET /slots (llama-server's --slots)
    max_body_size: int = DEFAULT_MAX_BODY_SIZE  # bytes; beyond them a request is a 413
    log_format: str = "text"  # the access log: text, json or off
    allow_image_urls: bool = False  # fetch http(s) image URLs (--allow-image-urls; see SECURITY.md)
    ollama_blobs: str | None = None  # --ollama-blobs: where /api/blobs keeps uploads (None: a temporary folder)
    metrics_endpoint: bool = True  # GET /metrics (--no-metrics: a 501, as llama-server without --metrics)
    # llama-server's server-wide settings: the defaults of requests that do not set them (--temp, --seed, -n)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)  # SamplingParams fields, the seed apart
    default_seed: int | None = None  # --seed: a request's sequences count up from it, as from a request's own
    default_n_predict: int | None = None  # -n: tokens at most when a request sets none (None: no limit)
    aliases: tuple[str, ...] = ()  # --alias's names (the first is model_id)
    tags: tuple[str, ...] = ()  # --tags
    ui: bool = True  # the chat page at /
    verbose: bool = False  # answers carry __verbose (-v)
    slot_save_path: str | None = None  # the folder of POST /slots/{id}?action=save|restore (None: those answer 501)
    # variables every chat template render gets unless the request's chat_template_kwargs sets them (llama-server's
    # --chat-template-kwargs, --reasoning on|off, --reasoning-effort, --reasoning-preserve)
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    media_path: str | None = None  # the folder file:// image URLs are read from (--media-path; None: refused)


@dataclass
class ServerContext:
    model: Model
    engine_loop: EngineLoop
    config: ServerConfig
    metrics: ServerMetrics
    pump: EventPump
    created: int
    names: set[str] = field(default_factory=set)  # what a request's "model" may say
    open_jobs: weakref.WeakSet[Job] = field(default_factory=weakref.WeakSet)  # what a late shutdown cancels
    loop: asyncio.AbstractEventLoop | None = None  # set at the app's startup
    parser_pool: Any = None  # the helper process of read_json, started by the first very large body
    _max_token_bytes: int = 0

    @classmethod
    def create(cls, model: Model, engine_loop: EngineLoop, config: ServerConfig, created: int) -> ServerContext:
        loop = engine_loop
        runner = model.engine.runner
        kv = loop.kv
        cells_total = kv.n_ctx if kv.unified else loop.n_slots * loop.slot_context
        cache = loop.engine.scheduler.slots.prompt_cache
        cached = (lambda: (cache.nbytes, len(cache), cache.restored)) if cache is not None else lambda: (0, 0, 0)
        metrics = ServerMetrics(loop.load, loop.cells_in_use, cells_total, lambda: runner.plans_built,
                                lambda: (kv.blocks_in_use, kv.blocks_shared), kv.n_blocks - 1, cached)
        names = {config.model_id, *config.aliases, str(model.path), Path(model.path).name, Path(model.path).stem}
        tok = model.tokenizer
        longest = max((len(tok.token_bytes(i)) for i in range(tok.vocab_size)), default=1)
        return cls(model, engine_loop, config, metrics, EventPump(), created, names, _max_token_bytes=max(longest, 1))

    # -- requests --------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        """One model is served, so any name reaches it (as llama-server and ollama answer), unless the
        server was started with ``--strict-model``."""
        if name is not None and self.config.strict_model and name not in self.names:
            raise ApiError(f"the model {name!r} does not exist (this server has {self.config.model_id!r})",
                           param="model", code="model_not_found")

    async def read_json(self, request: Request) -> Any:
        """The body as checked JSON (:func:`~minfer.server.json_body.parse_body`). A large one is parsed on a
        thread, a very large one in a helper process: ``json.loads`` holds the GIL for all of its run (0.1 s
        for 10 MB on a quiet core, seconds on a busy machine), which would stall the engine thread's
        decode steps and with them every stream."""
        raw = await request.body()
        if len(raw) > OFF_PROCESS_BYTES:
            if self.parser_pool is None:
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                self.parser_pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            return await asyncio.get_running_loop().run_in_executor(self.parser_pool, parse_body, raw)
        if len(raw) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(parse_body, raw)
        return parse_body(raw)

    async def off_loop(self, fn: Callable[..., T], *args: Any, size: int = OFF_LOOP_BYTES + 1) -> T:
        """``fn(*args)`` on a worker thread when its input is large (``size``), else here: the chat
        template and the tokenizer take seconds over megabytes, and the loop must not wait for them."""
        if size > OFF_LOOP_BYTES:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def check_text_fits(self, texts: Iterable[str], param: str = "messages") -> int:
        """Refuse text that cannot fit in a sequence's context before any of it is tokenized: no token
        is longer than the vocabulary's longest, so ``characters / longest`` is a lower bound of its tokens.
        Returns the characters counted."""
        chars = sum(len(t) for t in texts if isinstance(t, str))
        least = chars // self._max_token_bytes
        context = self.engine_loop.slot_context
        if least > context:
            raise context_overflow(f"the prompt has {chars} characters, at least {least} tokens: more than the "
                                   f"context of {context} tokens per sequence", least, context, param)
        return chars

    async def tokenize(self, text: str, add_special: bool, param: str = "prompt") -> list[int]:
        """``text``'s token ids, refused early when it cannot fit, tokenized off the loop when large."""
        self.check_text_fits([text], param)
        return await self.off_loop(self.model.tokenize, text, add_special, size=len(text))

    @property
    def takes_images(self) -> bool:
        """Whether the model has a vision model (an HF vision-language folder, or a GGUF with ``--mmproj``)."""
        return self.model.images is not None

    async def image_prompt(self, text: str, images: Sequence[ImageInput],
                           param: str = "messages") -> tuple[list[int], list[PassImage]]:
        """The prompt ids of ``text`` (a rendered prompt, one media marker per image, special tokens included)
        and where each image's tokens go (:meth:`minfer.api.Model.image_prompt`), on the engine's thread a layer of
        the vision tower at a time between two steps: the vision passes share the backend (its kernels' threads)
        with the engine's, so they never run beside one, and running sequences go on decoding while an image is
        encoded (llama-server encodes an image whole on its one loop, stalling them). A 400 naming
        the image's field for a bad image, or when the model takes no images; ``param``: the field named when no
        image is to blame (a marker count that does not match)."""
        if not self.takes_images:
            where = images[0].where if images else param
            raise ApiError(f"{where}: this model ({self.config.model_id}) takes no images: it has no vision model "
                           "(serve a vision-language model, or a GGUF with --mmproj FILE)", param=where,
                           code="images_not_supported")
        self.check_text_fits([text], param)
        images = await fetch_images(images, self.config.allow_image_urls, media_path=self.config.media_path)
        try:
            return await asyncio.wrap_future(self.engine_loop.call_in_slices(
                lambda: self.model.image_prompt_slices(text, images)))
        except BadRequestError as e:
            raise ApiError(str(e), param=image_error_param(str(e), images, param)) from None

    def submit(self, prompts: Sequence[list[int]], params: GenerationParams,
               constraint: Callable[[], Any] | None = None, *, ignore_eos: bool = False,
               reuse_prefix: bool = True, images: Sequence[PassImage] = ()) -> Job:
        """Queue ``params.n`` sequences per prompt; the job's queue receives their events. ``constraint``
        makes each sequence's constraint (default: from ``params.grammar`` / ``params.json_schema``);
        ``ignore_eos``: end-of-generation tokens do not stop them; ``reuse_prefix=False``: no cached prefix
        is reused; ``images``: where images' tokens go in the prompt (one prompt then: every sequence sees
        them)."""
        self.pump.loop = asyncio.get_running_loop()  # the loop exists only once the server runs
        job = Job(self.pump)
        note_job(job, sum(len(p) for p in prompts) * params.n)
        model = self.model
        try:
            speculative = None
            if params.speculative is not None:
                try:
                    speculative = resolve_speculative(params.speculative, model.engine.speculative, "'speculative'")
                    model.engine.check_speculative(speculative)
                except BadRequestError as e:
                    message = str(e) if str(e).startswith("'speculative'") else f"'speculative': {e}"
                    raise ApiError(message, param="speculative") from None
            try:
                lora = model.request_lora(params.lora)
            except BadRequestError as e:
                raise ApiError(str(e), param="lora") from None
            if images and len(prompts) != 1:
                raise ApiError("images go with one prompt, not several", param="prompt")
            for p, ids in enumerate(prompts):
                for j in range(params.n):
                    index = len(job.choices)
                    first = params.seed if params.seed is not None else self.config.default_seed
                    seed = None if first is None else first + j
                    sampler = model.sampler(**{**self.config.sampling_defaults, **params.sampling}, seed=seed)
                    sampler.reports_chain = params.post_sampling_probs  # logprobs of the chain's distribution
                    c = constraint() if constraint is not None else model.constraint(params.grammar,
                                                                                      params.json_schema)
                    job.choices.append(Choice(index, p))
                    max_tokens = params.max_tokens if params.max_tokens is not None else self.config.default_n_predict
                    job.requests.append(GenerationRequest(ids, sampler, max_tokens, job.emitter(index),
                                                          stop=params.stop, logprobs=params.logprobs,
                                                          constraint=c,
                                                          stop_ids=frozenset() if ignore_eos else None,
                                                          reuse_prefix=reuse_prefix, speculative=speculative,
                                                          lora=lora, images=images))
            self.engine_loop.submit(job.requests)
        except QueueFullError as e:
            raise ApiError(str(e), status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_seconds)}) from None
        except MinferError as e:  # callers handle one type, ApiError (the error handlers would answer the same)
            raise api_error(e) from None
        self.open_jobs.add(job)  # what a shutdown past its timeout cancels
        return job

    @property
    def pooling(self) -> Pooling:
        return self.config.pooling or self.model.pooling

    def submit_embeddings(self, prompts: Sequence[list[int]], pooling: Pooling, normalize: bool) -> Job:
        """Queue one embedding sequence per prompt (they share the engine's passes with generation)."""
        self.pump.loop = asyncio.get_running_loop()
        job = Job(self.pump)
        for p, ids in enumerate(prompts):
            job.choices.append(Choice(p, p))
            job.requests.append(EmbeddingRequest(ids, pooling, normalize, job.emitter(p)))
        try:
            self.engine_loop.submit(job.requests)
        except QueueFullError as e:
            raise ApiError(str(e), status=429, type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_seconds)}) from None
        except MinferError as e:  # as ApiError: routes/embeddings names its own field on a 400
            raise api_error(e) from None
        self.open_jobs.add(job)
        return job

    def begin_shutdown(self, timeout: float) -> None:
        """On the loop: the server stops; what is still open after ``timeout`` seconds is cancelled, so its
        answer ends cleanly (a 503, or a stream's error event and ``[DONE]``) before uvicorn cuts it."""
        assert self.loop is not None

        def cancel_open() -> None:
            for job in list(self.open_jobs):
                if not job.done:
                    job.cancel()

        self.loop.call_later(max(timeout, 0.0), cancel_open)

    def begin_shutdown_threadsafe(self, timeout: float) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.begin_shutdown, timeout)

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
            self.open_jobs.discard(job)
            if not work.done():
                work.cancel()
                job.cancel()
        for c in job.choices:
            if c.error is not None:
                raise api_error(c.error)
            if c.cancelled:
                raise cancelled_error()

    def stream(self, job: Job, chunk: Callable[[Choice, Event | None], dict[str, Any] | list[dict[str, Any]] | None],
               final_usage: Callable[[], dict[str, Any]] | None, done: bool = True) -> StreamingResponse:
        """Server-sent events: ``chunk`` turns each event into a body (or None to send nothing), then the
        usage chunk when asked, then ``[DONE]`` (unless ``done`` is False: llama-server's native streams
        end with their last chunk); an error ends the stream with an error event (then ``[DONE]`` where the
        stream has one): an engine error, a shutdown past its timeout, or a bug in ``chunk`` - a client
        always sees the end."""

        async def events() -> AsyncIterator[bytes]:
            out: list[bytes] = []
            try:
                while not job.done:
                    # every event already queued goes out in one write (a client that fell behind, n > 1)
                    item = await job.events.get()
                    while True:
                        index, event = item
                        c = job.apply(index, event)
                        if isinstance(event, Failed) or c.cancelled:
                            e = api_error(event.error) if isinstance(event, Failed) else cancelled_error()
                            job.cancel()
                            yield b"".join(out) + sse(e.body()) + (b"data: [DONE]\n\n" if done else b"")
                            return
                        body = chunk(c, event)
                        # a list: several chunks for one event (llama-server's prompt progress before a token)
                        out.extend(sse(b) for b in (body if isinstance(body, list) else [body]) if b is not None)
                        if job.done or job.events.empty():
                            break
                        item = job.events.get_nowait()
                    if out:
                        yield b"".join(out)
                        out = []
                if final_usage is not None:
                    yield sse(final_usage())
                if done:
                    yield b"data: [DONE]\n\n"
            except Exception:
                log.exception("internal error while streaming")
                yield b"".join(out) + sse(internal_error().body()) + (b"data: [DONE]\n\n" if done else b"")
            finally:
                self.open_jobs.discard(job)
                job.cancel()  # a no-op when every sequence finished; frees the slots when the client left

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def event_stream(self, chunks: AsyncIterator[bytes]) -> StreamingResponse:
        """Server-sent events from ready-made ``chunks`` (an endpoint's formatted events)."""
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- answers ---------------------------------------------------------------------------------

    def usage(self, job: Job, prompts: Sequence[list[int]]) -> dict[str, Any]:
        completion = sum(c.stats.generated_tokens for c in job.choices if c.stats is not None)
        prompt = sum(len(p) for p in prompts)
        cached = sum(next(c.cached_tokens for c in job.choices if c.prompt_index == i) for i in range(len(prompts)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

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
