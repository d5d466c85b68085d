"""OpenAI's legacy ``POST /v1/completions`` (raw prompts, several per request, ``echo``), whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minfer.runtime.requests import Event, Finished, Started, Token
from minfer.runtime.sampling import TokenLogprob
from minfer.server.chat_turn import bias_tokens
from minfer.server.context import ServerContext, finish_reason
from minfer.server.jobs import Choice
from minfer.server.protocols.openai import parse_completion
from minfer.server.routes.llama_native import verbose_fields
from minfer.server.stream_extras import StreamExtras
from minfer.server.timings import answer_timings


def completion_logprobs(ctx: ServerContext, items: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for x in items:
        offsets.append(offset)
        offset += len(ctx.token_text(x.token))
    return {"tokens": [ctx.token_text(x.token) for x in items], "token_logprobs": [x.logprob for x in items],
            "top_logprobs": [{ctx.token_text(t): v for t, v in x.top_logprobs} for x in items],
            "text_offset": offsets}


def register(app: FastAPI, ctx: ServerContext) -> None:
    model = ctx.model

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_completion(await ctx.read_json(request))
        params = req.params
        ctx.check_model(params.model)
        params.resolve_text_bias(partial(bias_tokens, ctx))
        prompts = [await ctx.tokenize(p, add_special=True) if isinstance(p, str) else p for p in req.prompts]
        echo = [(p if isinstance(p, str) else model.detokenize(p)) if req.echo else "" for p in req.prompts]
        job = ctx.submit(prompts, params)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": now, "model": ctx.config.model_id, "system_fingerprint": "minfer"}
        if not params.stream:
            await ctx.collect(job, request)
            choices = []
            for c in job.choices:
                head = echo[c.prompt_index]
                lp = completion_logprobs(ctx, c.logprobs, len(head)) if params.logprobs is not None else None
                choices.append({"index": c.index, "text": head + "".join(c.text), "logprobs": lp,
                                "finish_reason": finish_reason(c)})
            return JSONResponse({**base, "object": "text_completion", "choices": choices,
                                 "usage": ctx.usage(job, prompts), **answer_timings(job.choices[0]),
                                 **verbose_fields(ctx, job, params, prompts[0])})
        extra = {"usage": None} if params.include_usage else {}
        offsets = [len(echo[c.prompt_index]) for c in job.choices]

        extras = StreamExtras(job, params, lambda c: len(prompts[c.prompt_index]))

        def body(choice: dict[str, Any], **fields: Any) -> dict[str, Any]:
            return {**base, "object": "text_completion", "choices": [choice], **extra, **fields}

        def empty(c: Choice) -> dict[str, Any]:
            return {"index": c.index, "text": "", "logprobs": None, "finish_reason": None}

        def chunk(c: Choice, event: Event | None) -> list[dict[str, Any]] | dict[str, Any] | None:
            if isinstance(event, Started):
                out = [] if (progress := extras.on_start(c)) is None else [body(empty(c), **progress)]
                if echo[c.prompt_index]:
                    out.append(body({**empty(c), "text": echo[c.prompt_index]}))
                return out
            if isinstance(event, Token):
                step = event.step
                if not step.text and step.logprob is None:
                    return None
                out = [] if (progress := extras.before_token(c)) is None else [body(empty(c), **progress)]
                lp = None
                if step.logprob is not None:
                    lp = completion_logprobs(ctx, [step.logprob], offsets[c.index])
                offsets[c.index] += len(step.text)
                choice = {"index": c.index, "text": step.text, "logprobs": lp, "finish_reason": None}
                return [*out, body(choice, **extras.timings(c))]
            if isinstance(event, Finished):
                choice = {"index": c.index, "text": "", "logprobs": None, "finish_reason": finish_reason(c)}
                return body(choice, **answer_timings(c))  # llama-server's last event carries them
            return None

        def final() -> dict[str, Any]:
            return {**base, "object": "text_completion", "choices": [], "usage": ctx.usage(job, prompts)}

        return ctx.stream(job, chunk, final if params.include_usage else None)
