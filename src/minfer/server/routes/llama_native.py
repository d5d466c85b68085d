"""llama-server's native endpoints: ``POST /completion``, ``POST /infill``, ``GET /props``, ``GET /slots``,
``POST /slots/{id}?action=...`` (:mod:`~minfer.server.routes.slot_actions`).

Shapes as llama.cpp's ``tools/server`` answers them: a completion's ``content``, ``tokens``, ``stop``,
``id_slot``, ``stop_type`` / ``stopping_word``, ``tokens_predicted`` / ``tokens_evaluated`` /
``tokens_cached``, ``truncated``, ``timings``, ``generation_settings`` and (with ``n_probs``)
``completion_probabilities``; streamed as ``data: {...}`` chunks, the last one with ``stop: true`` and
no ``[DONE]`` after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import minfer
from minfer.formats.chat_template_caps import template_caps
from minfer.runtime.requests import Event, Finished, Started, Token
from minfer.runtime.sampling import SamplingParams, TokenLogprob
from minfer.runtime.vision import MEDIA_MARKER, PassImage
from minfer.server.context import ServerContext
from minfer.server.errors import ApiError
from minfer.server.jobs import Choice, Job
from minfer.server.protocols.images import image_from_base64
from minfer.server.protocols.llama import NativeRequest, parse_infill, parse_native_completion
from minfer.server.protocols.openai import GenerationParams
from minfer.server.routes.service import model_ftype
from minfer.server.routes.slot_actions import slot_action
from minfer.server.stream_extras import StreamExtras
from minfer.server.timings import timings


def register(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/completion")
    async def completion(request: Request) -> Response:
        return await native_completion(ctx, request)

    @app.post("/infill")
    async def infill(request: Request) -> Response:
        return await infill_completion(ctx, request)

    @app.get("/props")
    async def props() -> dict[str, Any]:
        return server_props(ctx)

    @app.get("/slots")
    async def slots() -> Response:
        return slots_answer(ctx)

    @app.post("/slots/{id_slot}")
    async def slots_action(id_slot: str, request: Request, action: str = "") -> Response:
        return await slot_action(ctx, request, id_slot, action)


def tokenizer_of(ctx: ServerContext) -> Callable[[str, bool], list[int]]:
    """The tokenizer a native body's prompt is read with; called on a worker thread (``ctx.off_loop``)."""
    return partial(_tokenize, ctx)


def _tokenize(ctx: ServerContext, text: str, add_special: bool) -> list[int]:
    ctx.check_text_fits([text], "prompt")
    return ctx.model.tokenize(text, add_special=add_special)


async def native_completion(ctx: ServerContext, request: Request) -> Response:
    """``/completion``: a native body, its prompt tokenized here (or given as ids), completed; with
    ``multimodal_data`` (base64 images), the prompt text holds one media marker per image."""
    body = await ctx.read_json(request)
    # the images' branch only with images: a prompt object without them ({"prompt_string": ...}) is a text prompt
    prompt = body.get("prompt") if isinstance(body, Mapping) else None
    if isinstance(body, Mapping) and (body.get("multimodal_data") is not None or (
            isinstance(prompt, Mapping) and prompt.get("multimodal_data") is not None)):
        ids, placed = await multimodal_prompt(ctx, body)
        rest = {k: v for k, v in body.items() if k not in ("multimodal_data", "prompt")}
        req = await ctx.off_loop(parse_native_completion, rest, tokenizer_of(ctx), [ids])
        req.images = placed
        return await complete(ctx, request, req)
    return await complete(ctx, request, await ctx.off_loop(parse_native_completion, body, tokenizer_of(ctx)))


async def multimodal_prompt(ctx: ServerContext, body: Mapping[str, Any]) -> tuple[list[int], list[PassImage]]:
    """llama-server's prompt with images: ``prompt`` a string holding one ``<__media__>`` per image of
    ``multimodal_data`` (or ``prompt`` an object ``{"prompt_string", "multimodal_data"}``); BOS before it as
    before a text prompt."""
    prompt, data, where = body.get("prompt"), body.get("multimodal_data"), "multimodal_data"
    if isinstance(prompt, Mapping):
        if prompt.get("multimodal_data") is not None:
            data, where = prompt["multimodal_data"], "prompt.multimodal_data"
        prompt = prompt.get("prompt_string")
    if not isinstance(prompt, str):
        raise ApiError(f"'prompt' must be a string (with one {MEDIA_MARKER} per image) when it has images",
                       param="prompt")
    if not isinstance(data, list) or not data:
        raise ApiError(f"'{where}' must be a non-empty list of base64-encoded images", param=where)
    images = [image_from_base64(d, f"{where}[{k}]") for k, d in enumerate(data)]
    markers = prompt.count(MEDIA_MARKER)
    if markers != len(images):
        raise ApiError(f"'prompt' holds {markers} {MEDIA_MARKER} markers for the {len(images)} images of '{where}' "
                       "(one per image, where it goes)", param=where)
    ids, placed = await ctx.image_prompt(prompt, images, param=where)
    tokenizer = ctx.model.tokenizer
    if tokenizer.add_bos and tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids = [tokenizer.bos_id, *ids]
        placed = [PassImage(p.first + 1, p.vectors) for p in placed]
    return ids, placed


async def infill_completion(ctx: ServerContext, request: Request) -> Response:
    """``/infill``: the fill-in-the-middle prompt the model's FIM tokens make, completed as ``/completion``."""
    model = ctx.model
    body = await ctx.read_json(request)
    fill = parse_infill(body)
    if model.fim_tokens is None:
        raise ApiError(f"this model ({ctx.config.model_id}) has no fill-in-the-middle tokens (prefix, suffix, "
                       "middle), so it cannot infill", param="input_prefix", code="fim_not_supported")
    ids = await ctx.off_loop(model.infill_prompt, fill.prefix, fill.suffix, fill.prompt, fill.extra)
    return await complete(ctx, request, await ctx.off_loop(parse_native_completion, body, tokenizer_of(ctx), [ids]))


def sampling_defaults(ctx: ServerContext) -> dict[str, Any]:
    """The sampling a request gets for what it does not set: the server's flags (--temp, --seed, ...) over the
    model's own defaults; the seed as given (llama-server's 4294967295 without one)."""
    config = ctx.config
    params = asdict(SamplingParams(**{**ctx.model.generation_defaults, **config.sampling_defaults}))
    params.pop("logit_bias", None)
    seed = config.default_seed if config.default_seed is not None else params.get("seed")
    params["seed"] = 0xFFFFFFFF if seed is None else seed
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


def settings(ctx: ServerContext, req: NativeRequest | None) -> dict[str, Any]:
    """llama-server's ``generation_settings`` (and ``/props``' ``default_generation_settings.params``)."""
    params = sampling_defaults(ctx)
    if req is not None:
        params.update({k: list(v) if isinstance(v, tuple) else v for k, v in req.params.sampling.items()
                       if k != "logit_bias"})
    p = req.params if req is not None else None
    params.update({
        "n_predict": (p.max_tokens if p is not None and p.max_tokens is not None
                      else -1 if ctx.config.default_n_predict is None else ctx.config.default_n_predict),
        "stop": [] if p is None else p.stop, "stream": False if p is None else p.stream,
        "n_probs": 0 if p is None or p.logprobs is None else p.logprobs,
        "ignore_eos": False if req is None else req.ignore_eos, "n_keep": 0,
        "grammar": "" if p is None or p.grammar is None else p.grammar,
        "timings_per_token": False if req is None else req.timings_per_token, "n_ctx": ctx.engine_loop.slot_context,
        "model": ctx.config.model_id, "lora": _lora_settings(ctx, p),
    })
    params["logit_bias"] = _logit_bias_settings(ctx, req)
    params["max_tokens"] = params["n_predict"]
    params.update(_LLAMA_SETTINGS)
    params["post_sampling_probs"] = False if p is None else p.post_sampling_probs
    params["reasoning_format"] = ctx.config.reasoning_format
    params["speculative.types"] = _SPECULATIVE_TYPES[ctx.model.engine.speculative.mode]
    return params


def _logit_bias_settings(ctx: ServerContext, req: NativeRequest | None) -> list[dict[str, Any]]:
    """The request's biases as llama-server lists them, ``[{"bias", "token"}]``, with ``ignore_eos``'s ban of the
    end-of-generation tokens among them (as llama-server adds it); a ban's -inf is JSON's null, as there."""
    if req is None:
        return []
    bias = {int(t): float(b) for t, b in (req.params.sampling.get("logit_bias") or {}).items()}
    if req.ignore_eos:
        bias.update(dict.fromkeys(sorted(ctx.model.tokenizer.eog_ids), -math.inf))
    return [{"bias": None if math.isinf(b) and b < 0 else b, "token": t} for t, b in bias.items()]


# minfer's speculative modes by llama-server's names for them
_SPECULATIVE_TYPES = {"off": "none", "draft": "draft-simple", "lookup": "ngram-simple"}


# llama-server's generation settings that are fixed in minfer: off (adaptive-p, dynamic temperature, backend
# sampling, discarding), or its only behaviour (the content as answered, no generation prompt of the server's own)
_LLAMA_SETTINGS: dict[str, Any] = {
    "adaptive_target": -1.0, "adaptive_decay": 0.9, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
    "backend_sampling": False, "n_discard": 0, "chat_format": "Content-only",
    "generation_prompt": "", "reasoning_in_content": False, "grammar_lazy": False, "grammar_triggers": [],
    "preserved_tokens": [],
}


def _lora_settings(ctx: ServerContext, p: Any) -> list[dict[str, Any]]:
    """Each loaded adapter's scale for this request (its ``lora``, else the server's defaults), as llama-server
    lists them."""
    adapters = ctx.model.lora_adapters
    if p is None or p.lora is None:
        return [{"id": a["id"], "scale": a["scale"]} for a in adapters]
    return [{"id": k, "scale": v} for k, v in enumerate(ctx.model.request_lora(p.lora) or [])]


def probs(ctx: ServerContext, items: Sequence[TokenLogprob], post_sampling: bool = False) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities``: each token's ``logprob`` and ``top_logprobs``; with
    ``post_sampling`` (its ``post_sampling_probs``: the items hold the sampler chain's log-probabilities)
    plain probabilities, ``prob`` and ``top_probs``."""
    tokenizer = ctx.model.tokenizer
    value, top = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def entry(token: int, lp: float) -> dict[str, Any]:
        return {"id": token, "token": ctx.token_text(token), "bytes": list(tokenizer.token_bytes(token)),
                value: math.exp(lp) if post_sampling else lp}

    return [{**entry(x.token, x.logprob), top: [entry(t, v) for t, v in x.top_logprobs]} for x in items]


def stop_type(c: Choice) -> str:
    assert c.stats is not None
    if c.stats.stop:
        return "word"
    return "limit" if c.stats.finish_reason == "length" else "eos"


def result(ctx: ServerContext, c: Choice, req: NativeRequest, prompt: list[int], content: str,
           final: bool) -> dict[str, Any]:
    stats = c.stats
    assert stats is not None
    out: dict[str, Any] = {
        "index": c.index, "content": content,
        "tokens": list(stats.tokens) if req.return_tokens and not req.params.stream else [],
        "id_slot": c.slot, "stop": True, "model": ctx.config.model_id,
        "tokens_predicted": stats.generated_tokens, "tokens_evaluated": len(prompt),
        "generation_settings": settings(ctx, req),
        "prompt": ctx.model.detokenize([t for t in prompt if t >= 0]),  # (an image's rows have ids of their own)
        "has_new_line": "\n" in "".join(c.text), "truncated": len(prompt) + stats.generated_tokens
        >= ctx.engine_loop.slot_context, "stop_type": stop_type(c), "stopping_word": stats.stop or "",
        "tokens_cached": c.cached_tokens, "timings": timings(stats, c.cached_tokens),
    }
    if req.params.logprobs is not None and not final:
        out["completion_probabilities"] = probs(ctx, c.logprobs, req.params.post_sampling_probs)
    return out


def verbose_fields(ctx: ServerContext, job: Job, params: GenerationParams, prompt: list[int]) -> dict[str, Any]:
    """``--verbose``: an OpenAI-style answer's ``__verbose``, llama-server's native answer for its first choice
    (the rendered prompt, the whole content, the settings, timings); nothing without the flag."""
    if not ctx.config.verbose or not job.choices:
        return {}
    c = job.choices[0]
    req = NativeRequest([prompt], params, ignore_eos=False, cache_prompt=True, return_tokens=False,
                        timings_per_token=params.timings, id_slot=-1)
    return {"__verbose": result(ctx, c, req, prompt, "".join(c.text), final=False)}


async def complete(ctx: ServerContext, request: Request, req: NativeRequest) -> Response:
    """Run a parsed native body: one answer (a list of them for several prompts), or its ``data:`` chunks."""
    ctx.check_model(req.params.model)
    job: Job = ctx.submit(req.prompts, req.params, ignore_eos=req.ignore_eos, reuse_prefix=req.cache_prompt,
                          images=req.images)
    prompts = req.prompts
    if not req.params.stream:
        await ctx.collect(job, request)
        results = [result(ctx, c, req, prompts[c.prompt_index], "".join(c.text), final=False) for c in job.choices]
        return JSONResponse(results[0] if len(results) == 1 else results)

    extras = StreamExtras(job, req.params, lambda c: len(prompts[c.prompt_index]))

    def head(c: Choice, content: str, tokens: list[int]) -> dict[str, Any]:
        return {"index": c.index, "content": content, "tokens": tokens, "stop": False, "id_slot": c.slot,
                "tokens_predicted": len(c.text), "tokens_evaluated": len(prompts[c.prompt_index])}

    def chunk(c: Choice, event: Event | None) -> list[dict[str, Any]] | dict[str, Any] | None:
        if isinstance(event, Started):
            progress = extras.on_start(c)
            return None if progress is None else {**head(c, "", []), **progress}
        if isinstance(event, Token):
            step = event.step
            if not step.text and step.token is None:
                return None
            out = [] if (progress := extras.before_token(c)) is None else [
                {**head(c, "", []), "tokens_predicted": len(c.text) - 1, **progress}]
            body = {**head(c, step.text, [] if step.token is None else [step.token]), **extras.timings(c)}
            if step.logprob is not None:
                body["completion_probabilities"] = probs(ctx, [step.logprob], req.params.post_sampling_probs)
            return [*out, body]
        if isinstance(event, Finished):
            return result(ctx, c, req, prompts[c.prompt_index], "", final=True)
        return None

    return ctx.stream(job, chunk, None, done=False)


def server_props(ctx: ServerContext) -> dict[str, Any]:
    """``/props``: llama-server's description of the server, its model and its default settings."""
    model = ctx.model
    tokenizer = model.tokenizer
    template = model.chat_template
    n_ctx = ctx.engine_loop.slot_context
    return {
        "default_generation_settings": {
            "id": 0, "id_task": -1, "n_ctx": n_ctx, "speculative": False, "is_processing": False,
            "params": settings(ctx, None), "prompt": "",
            "next_token": {"has_next_token": True, "has_new_line": False, "n_remain": -1, "n_decoded": 0,
                           "stopping_word": ""},
        },
        "total_slots": ctx.engine_loop.n_slots, "n_ctx": n_ctx, "model_path": str(model.path),
        "model_alias": ctx.config.model_id, "chat_template": template.source if template is not None else "",
        "chat_template_caps": template_caps(template) if template is not None else {},
        "model_ftype": model_ftype(ctx), "endpoint_metrics": ctx.config.metrics_endpoint,
        "modalities": {"vision": ctx.takes_images, "video": False, "audio": False},
        "media_marker": MEDIA_MARKER, "endpoint_props": False, "ui_settings": {}, "cors_proxy_enabled": False,
        "bos_token": _token(tokenizer, tokenizer.bos_id), "eos_token": _token(tokenizer, tokenizer.eos_id),
        "build_info": f"minfer {minfer.__version__}", "is_sleeping": False,
        "endpoint_slots": ctx.config.slots_endpoint, "ui": ctx.config.ui,
        "pooling": ctx.pooling, "fim": model.fim_tokens is not None,
    }


def slots_answer(ctx: ServerContext) -> Response:
    """``/slots``: each sequence slot, busy or not (a 501, as llama-server answers, without ``--slots``)."""
    if not ctx.config.slots_endpoint:
        # llama-server's answer when its slots endpoint is off
        return JSONResponse({"error": {"code": 501, "message": "This server does not support slots endpoint "
                                       "(start it with --slots).", "type": "not_supported_error"}},
                            status_code=501)
    engine_loop = ctx.engine_loop
    running = {r.slot: r for r in engine_loop.engine.running}
    n_ctx = engine_loop.slot_context
    out = []
    for s in range(engine_loop.n_slots):
        run = running.get(s)
        stats = run.request.stats if run is not None else None
        n_prompt = len(run.request.prompt_ids) if run is not None else 0
        processed = stats.prompt_tokens if stats is not None else 0
        out.append({
            "id": s, "id_task": -1, "n_ctx": n_ctx, "speculative": False, "is_processing": run is not None,
            "n_prompt_tokens": n_prompt, "n_prompt_tokens_processed": processed,
            "n_prompt_tokens_cache": max(n_prompt - processed, 0),
            "params": settings(ctx, None), "n_cached": len(engine_loop.kv.tokens(s)),
            "kv_blocks": engine_loop.kv.n_blocks_held(s),
            "preempted": stats.preempted if stats is not None else 0,
            # llama-server's list: one entry per sequence the slot decodes
            "next_token": [{"has_next_token": run is not None, "has_new_line": False, "n_remain": -1,
                            "n_decoded": stats.generated_tokens if stats is not None else 0}],
        })
    return JSONResponse(out)


def _token(tokenizer: Any, token: int | None) -> str:
    return "" if token is None else tokenizer.token_bytes(token).decode("utf-8", errors="replace")
