"""ollama's API on the same server and port: ``/api/chat``, ``/api/generate``, ``/api/embed``,
``/api/embeddings``, ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``, ``/api/pull``; ``/api/copy`` and
``/api/push`` answer 501 saying what minfer does instead.

LoRA adapters are model variants (:mod:`minfer.server.ollama_variants`): those loaded with ``--lora`` are listed as
``<base>:<adapter stem>`` and run with that adapter alone; ``/api/blobs`` (:mod:`minfer.server.ollama_blobs`) and
``/api/create`` (``from`` the served model, one GGUF ``adapters`` blob, ``system``, ``parameters``, ``license``)
load one more between two engine steps, and ``/api/delete`` removes such a variant. ``/api/create`` of a model
of its own (no ``from`` and ``adapters``, or ``files``, ``quantize``, ``template``, ``messages``) and
``/api/delete`` of the served model answer 501.

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
from minfer.runtime.chat import ContentDelta, ReasoningDelta
from minfer.runtime.requests import Failed, Token
from minfer.runtime.sampling import TokenLogprob
from minfer.server.chat_turn import ChatTurn, TurnDelta, TurnFinished
from minfer.server.context import ServerContext
from minfer.server.errors import ApiError, api_error, cancelled_error
from minfer.server.jobs import Job
from minfer.server.ollama_blobs import BlobStore, blob_hex, model_sha256, model_size
from minfer.server.ollama_variants import Variant, Variants, tagged
from minfer.server.protocols.ollama import (
    OllamaRequest,
    check_parameters,
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
              "and sampling flags for what a Modelfile would set (/api/create makes a LoRA adapter's variant "
              "of the served model: from and adapters)",
    "push": "minfer does not push models to a registry",
}
# /api/create's fields that would build a model minfer cannot make here, and what to do instead
CREATE_UNSUPPORTED = {
    "files": "minfer serves the one model it was started with: start it on the GGUF file or HF folder",
    "quantize": "minfer quantizes at load: start the server with --quantize",
    "template": "the base's chat template is used: start the server with --chat-template-file",
    "messages": "a variant cannot carry a conversation: send the messages with each /api/chat request",
    "modelfile": "send the Modelfile's FROM as from and its ADAPTER as adapters (the client's create does)",
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

    async def listing(self, variant: Variant | None = None) -> dict[str, Any]:
        """``/api/tags``' entry of the model or of one of its adapters' ``variant``s (the base's size with the
        adapter's, the base as its ``parent_model``)."""
        if variant is None:
            return {"name": self.name, "model": self.name, "modified_at": self.modified_at(), "size": self.size,
                    "digest": await self.digest(), "details": self.details()}
        return {"name": variant.name, "model": variant.name,
                "modified_at": variant.modified_at or modified_at(variant.path),
                "size": self.size + model_size(variant.path), "digest": await variant.digest(await self.digest()),
                "details": {**self.details(), "parent_model": self.name}}

    async def running(self, context_length: int, variant: Variant | None = None) -> dict[str, Any]:
        """``/api/ps``'s entry: loaded for the server's life (ollama writes a far-off expiry for keep_alive -1)."""
        listing = await self.listing(variant)
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
    variants = Variants.of_startup_adapters(facts.name, ctx.model.lora_adapters)
    blobs = BlobStore(ctx.config.ollama_blobs)

    def check_model(name: str | None, field: str = "model") -> Variant | None:
        """The variant ``name`` names, or None for the served model; a 404 for a name neither (under
        --strict-model: any other name reaches the served model)."""
        if not isinstance(name, str):
            return None  # (the body's parser names the field)
        variant = variants.get(name)
        if variant is not None:
            return variant
        if name is not None and name.endswith(":latest"):
            name = name.removesuffix(":latest")
        try:
            ctx.check_model(name)
        except ApiError as e:
            raise ApiError(f"{'model' if field == 'model' else field}: model {name!r} not found (this server has "
                           f"{', '.join(repr(n) for n in [facts.name, *(v.name for v in variants)])})",
                           status=404, param=field, code="model_not_found") from e
        return None

    def is_served(name: str) -> bool:
        """Whether ``name`` is one of the served model's own names (whatever --strict-model says)."""
        return tagged(name) == facts.name or name.removesuffix(":latest") in ctx.names

    def with_variant(body: dict[str, Any], variant: Variant | None, generate: bool) -> dict[str, Any]:
        """A chat or generate body with the variant's defaults: its options under the request's own, its system
        prompt where the request sends none."""
        if variant is None:
            return body
        body = dict(body)
        if variant.parameters:
            options = body.get("options")
            body["options"] = {**variant.parameters, **options} if isinstance(options, dict) else \
                (variant.parameters if options is None else options)
        if variant.system is not None:
            messages = body.get("messages")
            if generate and not body.get("system") and not body.get("raw"):
                body["system"] = variant.system
            elif not generate and isinstance(messages, list) and not any(
                    isinstance(m, dict) and m.get("role") == "system" for m in messages):
                body["messages"] = [{"role": "system", "content": variant.system}, *messages]
        return body

    def run_variant(req: OllamaRequest, variant: Variant | None) -> OllamaRequest:
        """The request runs the variant's adapter alone (the served model's name is checked for it: a variant's
        is not among the OpenAI side's names)."""
        if variant is not None:
            params = req.chat.params if req.chat is not None else req.completion.params if req.completion else None
            assert params is not None
            params.lora, params.model = variant.lora, None
        return req

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
        variant = check_model(body.get("model") if isinstance(body, dict) else None)
        req = parse_ollama_chat(with_variant(body, variant, generate=False), ctx.engine_loop.slot_context)
        return await chat_answer(request, run_variant(req, variant), generate=False)

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        body = await ctx.read_json(request)
        answered = load_or_unload("/api/generate", body)
        if answered is not None:
            return answered
        variant = check_model(body.get("model") if isinstance(body, dict) else None)
        req = run_variant(parse_ollama_generate(with_variant(body, variant, generate=True),
                                                ctx.engine_loop.slot_context), variant)
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
        return {"models": [await facts.listing(v) for v in (None, *variants)]}

    @app.get("/api/ps")
    async def ps() -> dict[str, Any]:
        return {"models": [await facts.running(ctx.engine_loop.slot_context, v) for v in (None, *variants)]}

    @app.post("/api/show")
    async def show(request: Request) -> dict[str, Any]:
        body = await ctx.read_json(request)
        variant = check_model(model_name(body))
        model = ctx.model
        defaults = {**model.generation_defaults, **(variant.parameters if variant is not None else {})}
        parameters = "\n".join(f"{k:<15} {x}" for k, v in defaults.items() for x in (v if isinstance(v, list) else [v])
                               if isinstance(x, int | float | str))
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
        shown = {"modelfile": f"# served by minfer {__version__}\nFROM {model.path}\n", "parameters": parameters,
                 "template": template, "details": facts.details(),
                 "model_info": model_info(ctx.model.transformer.source.metadata), "capabilities": capabilities,
                 "modified_at": facts.modified_at()}
        if variant is not None:  # a LoRA adapter's variant: its Modelfile, the base as its parent
            listing = await facts.listing(variant)
            shown.update(modelfile=f"# served by minfer {__version__}\n" + variant.modelfile(model.path),
                         details=listing["details"], modified_at=listing["modified_at"])
            if variant.system is not None:
                shown["system"] = variant.system
            if variant.license is not None:
                shown["license"] = variant.license
        return shown

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

    for what in ("copy", "push"):
        app.add_api_route(f"/api/{what}", not_here(what), methods=["POST"])

    @app.head("/api/blobs/{digest}")
    async def blob_exists(digest: str) -> Response:
        return Response(status_code=200 if blobs.has(digest) else 404)

    @app.post("/api/blobs/{digest}")
    async def blob_upload(digest: str, request: Request) -> Response:
        blob_hex(digest)  # a bad digest is refused before the body is read
        return Response(status_code=201 if await blobs.write(digest, request.stream()) else 200)

    def create_adapter(adapters: Any) -> tuple[str, str]:
        """``/api/create``'s ``adapters``: the (name, digest) of its one adapter blob, which must be held."""
        if not isinstance(adapters, dict) or len(adapters) != 1:
            raise ApiError("adapters: must be an object naming one adapter blob, {\"NAME.gguf\": \"sha256:...\"} "
                           f"(minfer runs one adapter a variant), got {adapters!r:.80}", param="adapters")
        [(file, digest)] = adapters.items()
        where = f"adapters[{file!r}]"
        if not isinstance(digest, str):
            raise ApiError(f"{where}: must be a blob digest, got {digest!r:.60}", param="adapters")
        if not blobs.has(digest, where):
            raise ApiError(f"{where}: blob {digest} is not on this server: upload it first (POST /api/blobs/"
                           f"{digest}; the client's create_blob)", param="adapters")
        return file, digest

    @app.post("/api/create")
    async def create(request: Request) -> Response:
        body = await ctx.read_json(request)
        name = tagged(model_name(body))
        for field, instead in CREATE_UNSUPPORTED.items():
            if body.get(field):
                raise ApiError(f"{field}: not supported by minfer's /api/create: {instead}", status=501,
                               param=field, type="not_implemented")
        stream = body.get("stream", True)
        if not isinstance(stream, bool | None):
            raise ApiError(f"stream: must be true or false, got {stream!r}", param="stream")
        base_name = body.get("from")
        if base_name is None and body.get("adapters") is None:  # a model of its own, not a variant
            raise ApiError(f"/api/create is not available: {NOT_HERE['create']}", status=501, type="not_implemented")
        if not isinstance(base_name, str) or not base_name:
            raise ApiError(f"from: is required, the served model ({facts.name!r}) that the adapter adapts",
                           param="from")
        if variants.get(base_name) is not None:
            raise ApiError(f"from: {base_name!r} is a variant of {facts.name!r}: make a variant from "
                           f"{facts.name!r} itself", param="from")
        if not is_served(base_name):
            raise ApiError(f"from: model {base_name!r} not found (this server serves {facts.name!r}, the only "
                           "model a variant can adapt)", status=404, param="from", code="model_not_found")
        if body.get("adapters") is None:
            raise ApiError("adapters: is required (one LoRA adapter blob: minfer can only make a variant of the "
                           f"served model {facts.name!r})", param="adapters", status=501, type="not_implemented")
        file, digest = create_adapter(body["adapters"])
        system = body.get("system")
        if system is not None and not isinstance(system, str):
            raise ApiError(f"system: must be a string, got {system!r:.60}", param="system")
        parameters = check_parameters(body.get("parameters"), ctx.engine_loop.slot_context)
        license_text = body.get("license")
        if isinstance(license_text, list) and all(isinstance(x, str) for x in license_text):
            license_text = "\n".join(license_text)
        if license_text is not None and not isinstance(license_text, str):
            raise ApiError(f"license: must be a string or a list of strings, got {license_text!r:.60}",
                           param="license")
        existing = variants.get(name)
        if is_served(name) or (
                existing is not None and not existing.created):
            raise ApiError(f"model: {name!r} is the name of a model this server was started with: choose another",
                           param="model")
        path = blobs.path(digest)
        adapter = variants.adapter_of_blob(digest)
        if adapter is None:
            try:  # between two engine steps: the plans are rebuilt for the new adapter set
                adapter = await asyncio.wrap_future(ctx.engine_loop.call(lambda: ctx.model.add_lora_adapter(path)))
            except MinferError as e:
                raise ApiError(f"adapters[{file!r}]: {e}", param="adapters") from None
        variants.add(Variant(name, adapter, 1.0, path, created=True, system=system, parameters=parameters,
                             license=license_text, modified_at=now_rfc3339()), blob=digest)
        if stream is False:
            return JSONResponse({"status": "success"})
        statuses = [f"using existing layer {digest}", "creating new layer", "writing manifest", "success"]
        return _stream(_lines(statuses))

    @app.delete("/api/delete")
    async def delete(request: Request) -> Response:
        body = await ctx.read_json(request)
        name = model_name(body)
        variant = check_model(name)
        if variant is None and not is_served(name):
            raise ApiError(f"model: model {name!r} not found", status=404, param="model", code="model_not_found")
        if variant is None:  # (not implemented, as for any other model store)
            raise ApiError(f"/api/delete is not available for {name!r}, the served model: {NOT_HERE['delete']} "
                           "(only a variant /api/create made can be deleted)", status=501, type="not_implemented")
        if not variant.created:
            raise ApiError(f"model: {variant.name!r} is an adapter the server was started with (--lora): start it "
                           "without that adapter", param="model")
        variants.remove(variant.name)
        return Response(status_code=200)


async def _lines(statuses: Iterable[str]) -> AsyncIterator[bytes]:
    for status in statuses:
        yield _ndjson({"status": status})


