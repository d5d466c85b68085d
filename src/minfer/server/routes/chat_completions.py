"""OpenAI's ``POST /v1/chat/completions``, whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minfer.errors import MinferError
from minfer.runtime.engine import Event, Finished, Started, Token
from minfer.runtime.sampling import TokenLogprob
from minfer.server.context import ServerContext, finish_reason
from minfer.server.errors import api_error
from minfer.server.jobs import Choice
from minfer.server.protocol import parse_chat


def chat_logprobs(ctx: ServerContext, items: Sequence[TokenLogprob]) -> dict[str, Any]:
    tokenizer = ctx.model.tokenizer

    def entry(token: int, lp: float) -> dict[str, Any]:
        return {"token": ctx.token_text(token), "logprob": lp, "bytes": list(tokenizer.token_bytes(token))}

    return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top_logprobs]}
                        for x in items]}


def register(app: FastAPI, ctx: ServerContext) -> None:
    model = ctx.model

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_chat(await ctx.read_json(request))
        params = req.params
        ctx.check_model(params.model)
        try:
            prompt = model.render_chat(req.messages)
        except MinferError as e:
            raise api_error(e) from None
        ids = model.tokenize(prompt, add_special=False)
        job = ctx.submit([ids], params)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": now, "model": ctx.config.model_id, "system_fingerprint": "minfer"}
        if not params.stream:
            await ctx.collect(job, request)
            return JSONResponse({
                **base, "object": "chat.completion",
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
                             "logprobs": chat_logprobs(ctx, c.logprobs) if params.logprobs is not None else None,
                             "finish_reason": finish_reason(c)} for c in job.choices],
                "usage": ctx.usage(job, [ids]), **ctx.timings(job, params),
            })
        extra = {"usage": None} if params.include_usage else {}

        def chunk(c: Choice, event: Event | None) -> dict[str, Any] | None:
            if isinstance(event, Started):
                delta: dict[str, Any] = {"role": "assistant", "content": ""}
                choice = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}
            elif isinstance(event, Token):
                if not event.step.text and event.step.logprob is None:
                    return None
                lp = chat_logprobs(ctx, [event.step.logprob]) if event.step.logprob is not None else None
                choice = {"index": c.index, "delta": {"content": event.step.text}, "logprobs": lp,
                          "finish_reason": None}
            elif isinstance(event, Finished):
                choice = {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish_reason(c)}
                return {**base, "object": "chat.completion.chunk", "choices": [choice], **extra,
                        **ctx.timings(job, params, c)}
            else:
                return None
            return {**base, "object": "chat.completion.chunk", "choices": [choice], **extra}

        def final() -> dict[str, Any]:
            return {**base, "object": "chat.completion.chunk", "choices": [], "usage": ctx.usage(job, [ids])}

        return ctx.stream(job, chunk, final if params.include_usage else None)
