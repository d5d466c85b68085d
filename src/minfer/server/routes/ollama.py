"""ollama's API on the same server and port: ``/api/chat``, ``/api/generate``, ``/api/embed``,
``/api/embeddings``, ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``, ``/api/pull``; ``/api/delete``,
``/api/copy``, ``/api/create`` and ``/api/push`` answer 501 saying what minfer does instead.

Streams are NDJSON (one JSON object a line; ``stream`` defaults to true, as ollama's), the last object
``done: true`` with ``done_reason`` and the counts and durations; an error after the stream began is a last
``{"error": ...}`` line, which ollama's clients raise. Errors before it are ollama's ``{"error": "..."}`` bodies
(:data:`minfer.server.errors.OLLAMA_PATHS`). The request side is :mod:`minfer.server.protocols.ollama`.

One model is served (``NAME`` and ``NAME:latest`` are its names); any name reaches it unless the server runs
with ``--strict-model``, where another name is a 404 as ollama's. Chat and generate go through the same chat
turn as OpenAI's endpoints, so the text at temperature 0 is theirs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minfer import __version__
from minfer.errors import MinferError
from minfer.formats.file_types import ollama_quantization
from minfer.pull import sha256_file
from minfer.runtime.chat import ContentDelta, ReasoningDelta
from minfer.runtime.requests import Failed, Token
from minfer.runtime.sampling import TokenLogprob
from minfer.server.chat_turn import ChatTurn, TurnDelta, TurnFinished
from minfer.server.context import ServerContext
from minfer.server.errors import ApiError, api_error, cancelled_error
from minfer.server.jobs import Job
from minfer.server.protocols.ollama import (
    OllamaRequest,
    durations,
    load_answer,
    load_request,
    now_rfc3339,
    ollama_message,
    parse_embed,
    parse_embeddings_prompt,
    parse_ollama_chat,
    parse_ollama_generate,
)

# the ollama API level these routes answer as (/api/version): tools, think, format schemas, /api/embed
OLLAMA_API_VERSION = "0.12.0"
NDJSON = "application/x-ndjson"
# what the routes ollama's model store has say minfer does instead
NOT_HERE = {
    "delete": "minfer does not keep a model store: delete the GGUF file or folder itself",
    "copy": "minfer does not keep a model store: copy the GGUF file, or serve it under another name with --alias",
    "create": "minfer does not build models from Modelfiles: serve a GGUF file or HF folder, with --chat-template "
              "and sampling flags for what a Modelfile would set",
    "push": "minfer does not push models to a registry",
}


def _ndjson(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def _stream(lines: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(lines, media_type=NDJSON, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def ollama_name(model_id: str) -> str:
    """A served model's ollama name: its id without ``.gguf``, tagged ``:latest`` as ollama's are."""
    model_id = model_id.removesuffix(".gguf")
    return model_id if ":" in model_id else f"{model_id}:latest"


def modified_at(path: Path) -> str:
    """A model file's or folder's modification time in RFC 3339 (ollama's ``modified_at``)."""
    return datetime.fromtimestamp(os.stat(path).st_mtime, UTC).isoformat().replace("+00:00", "Z")


class ModelFacts:
    """What ollama's listing says of the served model (a decoder's or an encoder's), computed once: details, size,
    the file's sha256."""

    def __init__(self, model_id: str, path: str | os.PathLike[str], arch: str, tensors: Iterable[Any],
                 metadata: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.name = ollama_name(model_id)
        by_type: Counter[str] = Counter()
        n_params = self.size = 0
        for t in tensors:
            n_params += int(math.prod(t.shape))
            self.size += int(t.nbytes)
            if len(t.shape) >= 2:
                by_type[t.ggml_type.name] += t.nbytes
        self._details = {"parent_model": "", "format": "gguf" if self.path.is_file() else "safetensors",
                         "family": arch, "families": [arch], "parameter_size": _parameter_size(n_params),
                         # the file's own type (a Q4_K_M file's biggest matrix, the embedding, may be Q8_0);
                         # without one, the type of most of its matrices' bytes
                         "quantization_level": ollama_quantization(metadata or {})
                         or (by_type.most_common(1)[0][0] if by_type else "")}
        self._digest: str | None = None
        self._lock = asyncio.Lock()

    def details(self) -> dict[str, Any]:
        return dict(self._details)

    def modified_at(self) -> str:
        return modified_at(self.path)

    async def digest(self) -> str:
        """The sha256 of the model file (of a folder: of its files' names and sha256s, sorted), computed on a
        worker thread the first time it is asked for."""
        async with self._lock:
            if self._digest is None:
                self._digest = await asyncio.to_thread(model_sha256, self.path)
        return self._digest

    async def listing(self) -> dict[str, Any]:
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at(), "size": self.size,
                "digest": await self.digest(), "details": self.details()}

    async def running(self, context_length: int) -> dict[str, Any]:
        """``/api/ps``'s entry: loaded for the server's life (ollama writes a far-off expiry for keep_alive -1)."""
        listing = await self.listing()
        del listing["modified_at"]
        return {**listing, "expires_at": "2318-01-01T00:00:00Z", "size_vram": 0, "context_length": context_length}


def model_name(body: Any) -> str:
    """The ``model`` (or older ``name``) of an ollama body."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise ApiError("model: is required (a model name)", param="model")
    return name


def model_sha256(path: Path) -> str:
    """ollama's ``digest`` of a model: its file's sha256 (of a folder: of its files' names and sha256s, sorted)."""
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(path)}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def _parameter_size(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}".replace(".0" + unit, unit)
    return str(n)


def model_info(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's metadata (a GGUF's keys, an HF folder's config.json) as ``/api/show``'s ``model_info``: long
    lists left out as ollama's leaves out the vocabulary (null), other values JSON's."""
    out: dict[str, Any] = {}
    for key, value in metadata.items():
        if isinstance(value, list | tuple) and len(value) > 64:
            value = None
        elif not isinstance(value, str | int | float | bool | list | tuple | dict | None):
            value = str(value)
        out[key] = value
    return out


def register(app: FastAPI, ctx: ServerContext) -> None:
    transformer = ctx.model.transformer
    facts = ModelFacts(ctx.config.model_id, ctx.model.path, ctx.model.hparams.arch, transformer.tensors.values(),
                       transformer.source.metadata)

    def check_model(name: str | None) -> None:
        if name is not None and name.endswith(":latest"):
            name = name.removesuffix(":latest")
        try:
            ctx.check_model(name)
        except ApiError as e:
            raise ApiError(f"model {name!r} not found (this server has {facts.name!r})", status=404,
                           param="model", code="model_not_found") from e

    def base(req: OllamaRequest) -> dict[str, Any]:
        return {"model": req.model, "created_at": now_rfc3339()}

    def logprobs(items: Iterable[TokenLogprob]) -> dict[str, Any]:
        """ollama's ``logprobs`` of the tokens ``items`` (none: nothing, the request did not ask)."""
        out = [{"token": ctx.token_text(x.token), "logprob": x.logprob,
                "top_logprobs": [{"token": ctx.token_text(t), "logprob": v} for t, v in x.top_logprobs]}
               for x in items]
        return {"logprobs": out} if out else {}

    def finished(req: OllamaRequest, job: Job, prompt_tokens: int) -> dict[str, Any]:
        stats = job.choices[0].stats
        assert stats is not None
        reason = "length" if stats.finish_reason == "length" else "stop"
        return {"done": True, "done_reason": reason,
                **durations(req.received, prompt_tokens, stats.prefill_seconds, stats.generated_tokens,
                            stats.decode_seconds)}

    async def errors_as_lines(lines: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for line in lines:
                yield line
        except ApiError as e:
            yield _ndjson({"error": e.message})
        except MinferError as e:
            yield _ndjson({"error": api_error(e).message})

    async def chat_answer(request: Request, req: OllamaRequest, generate: bool) -> Response:
        assert req.chat is not None
        check_model(req.model)
        turn = await ChatTurn.start(ctx, req.chat)
        n_prompt = len(turn.prompt_ids)

        def context() -> dict[str, Any]:  # /api/generate's token ids of the prompt and the reply
            stats = turn.job.choices[0].stats
            return {"context": turn.prompt_ids + list(stats.tokens if stats else [])} if req.want_context else {}

        if not req.stream:
            choice = (await turn.result(request))[0]
            message = ollama_message(choice.message)
            scores = logprobs(choice.logprobs)
            if generate:
                head: dict[str, Any] = {"response": message["content"]}
                if "thinking" in message:
                    head["thinking"] = message["thinking"]
            else:
                head = {"message": message}
            return JSONResponse({**base(req), **head, **finished(req, turn.job, n_prompt), **context(), **scores})

        def piece(text: str, thinking: bool, scores: dict[str, Any]) -> dict[str, Any]:
            if generate:
                return {**base(req), ("thinking" if thinking else "response"): text, "done": False, **scores}
            message = {"role": "assistant", "content": ""}
            message["thinking" if thinking else "content"] = text
            return {**base(req), "message": message, "done": False, **scores}

        async def lines() -> AsyncIterator[bytes]:
            async for batch in turn.batches():
                out = []
                for event in batch:
                    if isinstance(event, TurnDelta) and isinstance(event.delta, ContentDelta | ReasoningDelta):
                        if event.delta.text:
                            out.append(_ndjson(piece(event.delta.text, isinstance(event.delta, ReasoningDelta),
                                                     logprobs(event.logprobs))))
                    elif isinstance(event, TurnFinished):
                        message = ollama_message(event.message)
                        if "tool_calls" in message and not generate:  # a call is sent whole, as ollama's
                            out.append(_ndjson({**base(req), "message": {"role": "assistant", "content": "",
                                                                        "tool_calls": message["tool_calls"]},
                                                "done": False}))
                        last = {"response": ""} if generate else {"message": {"role": "assistant", "content": ""}}
                        out.append(_ndjson({**base(req), **last, **finished(req, turn.job, n_prompt), **context()}))
                if out:
                    yield b"".join(out)

        return _stream(errors_as_lines(lines()))

    async def raw_answer(request: Request, req: OllamaRequest) -> Response:
        """``/api/generate`` with ``raw``: the prompt as it is, no template."""
        assert req.completion is not None
        params = req.completion.params
        check_model(req.model)
        prompt = req.completion.prompts[0]
        ids = await ctx.tokenize(prompt, add_special=True) if isinstance(prompt, str) else prompt
        job = ctx.submit([ids], params)

        def last() -> dict[str, Any]:
            stats = job.choices[0].stats
            return {**finished(req, job, len(ids)), "context": ids + list(stats.tokens if stats else [])}

        if not req.stream:
            await ctx.collect(job, request)
            return JSONResponse({**base(req), "response": "".join(job.choices[0].text), **last(),
                                 **logprobs(job.choices[0].logprobs)})

        async def lines() -> AsyncIterator[bytes]:
            try:
                while not job.done:
                    index, event = await job.events.get()
                    c = job.apply(index, event)
                    if isinstance(event, Failed):
                        raise api_error(event.error)
                    if c.cancelled:
                        raise cancelled_error()
                    if isinstance(event, Token) and event.step.text:
                        scores = logprobs([event.step.logprob] if event.step.logprob is not None else [])
                        yield _ndjson({**base(req), "response": event.step.text, "done": False, **scores})
                yield _ndjson({**base(req), "response": "", **last()})
            finally:
                ctx.open_jobs.discard(job)
                job.cancel()

        return _stream(errors_as_lines(lines()))

    def load_or_unload(path: str, body: Any) -> Response | None:
        """ollama's load and unload requests (an empty prompt or no messages), answered at once: this server's one
        model is loaded for its life, so loading is done already and unloading cannot be (a front that can unload,
        --keep-alive or --sleep-idle-seconds, answers those itself and never sends them here)."""
        reason = load_request(path, body)
        if reason is None:
            return None
        name = body.get("model")
        if not isinstance(name, str) or not name:
            raise ApiError("model: is required (a model name)", param="model")
        check_model(name)
        if reason == "unload":
            raise ApiError("keep_alive: 0 asks to unload the model, and this server keeps its one model loaded for "
                           "its life: start it with --keep-alive or --sleep-idle-seconds to unload it on request",
                           param="keep_alive")
        return JSONResponse(load_answer(path, name, reason))

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        body = await ctx.read_json(request)
        answered = load_or_unload("/api/chat", body)
        if answered is not None:
            return answered
        return await chat_answer(request, parse_ollama_chat(body, ctx.engine_loop.slot_context), generate=False)

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        body = await ctx.read_json(request)
        answered = load_or_unload("/api/generate", body)
        if answered is not None:
            return answered
        req = parse_ollama_generate(body, ctx.engine_loop.slot_context)
        if req.completion is not None:
            return await raw_answer(request, req)
        return await chat_answer(request, req, generate=True)

    async def embed_texts(request: Request, texts: list[str], truncate: bool, field: str,
                          normalize: bool) -> tuple[list[list[float]], int]:
        if ctx.pooling == "none":
            raise ApiError("the server pools no vectors (--pooling none): start it with another --pooling",
                           param=field)
        context = ctx.engine_loop.slot_context
        prompts = []
        for i, text in enumerate(texts):
            where = f"{field}[{i}]" if len(texts) > 1 or field == "input" else field
            if truncate:
                ids = await ctx.off_loop(ctx.model.tokenize, text, True, size=len(text))
                ids = ids[:context]
            else:
                ids = await ctx.tokenize(text, True, param=where)
                if len(ids) > context:
                    raise ApiError(f"{where}: the input is {len(ids)} tokens, more than the context of {context} "
                                   "(send truncate: true to cut it)", param=where)
            prompts.append(ids)
        job = ctx.submit_embeddings(prompts, ctx.pooling, normalize)
        await ctx.collect(job, request)
        vectors = []
        for c in job.choices:
            assert c.embedding is not None
            vectors.append(c.embedding.astype("float32").tolist())
        return vectors, sum(len(p) for p in prompts)

    @app.post("/api/embed")
    async def embed(request: Request) -> Response:
        started = asyncio.get_running_loop().time()
        body = await ctx.read_json(request)
        check_model(model_name(body))
        texts, truncate = parse_embed(body, ctx.model.hparams.n_embd)
        vectors, n = await embed_texts(request, texts, truncate, "input", normalize=True)
        took = int((asyncio.get_running_loop().time() - started) * 1e9)
        return JSONResponse({"model": body["model"], "embeddings": vectors, "total_duration": took,
                             "load_duration": 0, "prompt_eval_count": n})

    @app.post("/api/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await ctx.read_json(request)
        check_model(model_name(body))
        prompt = parse_embeddings_prompt(body)
        if not prompt:  # ollama answers an empty prompt with an empty vector
            return JSONResponse({"embedding": []})
        # the older endpoint: the vector as pooled, not normalized (as ollama's)
        vectors, _ = await embed_texts(request, [prompt], False, "prompt", normalize=False)
        return JSONResponse({"embedding": vectors[0]})

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [await facts.listing()]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        return {"models": [await facts.running(ctx.engine_loop.slot_context)]}

    @app.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:
        body = await ctx.read_json(request)
        check_model(model_name(body))
        model = ctx.model
        defaults = model.generation_defaults
        parameters = "\n".join(f"{k:<15} {v}" for k, v in defaults.items() if isinstance(v, int | float | str))
        template = model.chat_template.source if model.chat_template is not None else ""
        capabilities = ["completion"]
        if model.chat_template is not None and "tools" in template:
            capabilities.append("tools")
        if "think" in template:
            capabilities.append("thinking")
        if ctx.pooling != "none":
            capabilities.append("embedding")
        if ctx.takes_images:
            capabilities.append("vision")
        return {"modelfile": f"# served by minfer {__version__}\nFROM {model.path}\n", "parameters": parameters,
                "template": template, "details": facts.details(),
                "model_info": model_info(ctx.model.transformer.source.metadata), "capabilities": capabilities,
                "modified_at": facts.modified_at()}

    @app.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION}

    @app.post("/api/pull")
    async def pull(request: Request) -> Response:
        from minfer import pull as pulling

        body = await ctx.read_json(request)
        name = model_name(body).removesuffix(":latest")
        stream = body.get("stream", True)
        try:
            known = pulling.known_model(name)
        except MinferError:
            raise ApiError(f"model {name!r} is not one minfer pull knows (it knows "
                           f"{', '.join(sorted(pulling.KNOWN_MODELS))})", status=404, param="model",
                           code="model_not_found") from None
        statuses = ["pulling manifest", f"pulling {known.name}", "verifying sha256 digest", "writing manifest",
                    "success"]

        async def fetch() -> None:
            await asyncio.to_thread(pulling.pull, name, False, False)

        if stream is False:
            await fetch()
            return JSONResponse({"status": "success"})

        async def lines() -> AsyncIterator[bytes]:
            yield _ndjson({"status": statuses[0]})
            yield _ndjson({"status": statuses[1]})
            await fetch()
            for status in statuses[2:]:
                yield _ndjson({"status": status})

        return _stream(errors_as_lines(lines()))

    def not_here(what: str) -> Callable[..., Any]:
        async def answer() -> Response:
            raise ApiError(f"/api/{what} is not available: {NOT_HERE[what]}", status=501, type="not_implemented")
        return answer

    app.add_api_route("/api/delete", not_here("delete"), methods=["DELETE"])
    for what in ("copy", "create", "push"):
        app.add_api_route(f"/api/{what}", not_here(what), methods=["POST"])


