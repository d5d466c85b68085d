"""OpenAI's ``POST /v1/chat/completions``, whole or streamed: a formatter of :mod:`minfer.server.chat_turn`;
``POST /v1/chat/completions/input_tokens``: the prompt's token count, nothing generated.

A reply's tool calls are ``message.tool_calls`` (streamed as ``delta.tool_calls[i]``: the id, type and
name first, then fragments of ``function.arguments``), its reasoning ``message.reasoning_content``
(``delta.reasoning_content``), as llama-server and vLLM write them.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minfer.runtime.chat import ContentDelta, ReasoningDelta, ToolCallDelta, ToolCallStart
from minfer.runtime.sampling import TokenLogprob
from minfer.server.chat_turn import ChatTurn, TurnDelta, TurnEvent, TurnFinished, TurnStarted
from minfer.server.context import ServerContext, sse
from minfer.server.errors import ApiError
from minfer.server.protocols.openai import parse_chat
from minfer.server.routes.llama_native import verbose_fields
from minfer.server.stream_extras import StreamExtras
from minfer.server.timings import answer_timings


def chat_logprobs(ctx: ServerContext, items: Sequence[TokenLogprob], post_sampling: bool = False) -> dict[str, Any]:
    """``logprobs.content``: each token's ``logprob`` and ``top_logprobs``; with ``post_sampling`` (llama-server's
    ``post_sampling_probs``: the items hold the sampler chain's log-probabilities) ``prob`` and ``top_probs``.
    Each entry, and each of its alternatives, also has the token's ``id``, as llama-server's do."""
    tokenizer = ctx.model.tokenizer
    value, top = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def entry(token: int, lp: float) -> dict[str, Any]:
        # llama-server's order: its "id" (the token id, beyond OpenAI's fields) first, then token, bytes, value
        return {"id": token, "token": ctx.token_text(token), "bytes": list(tokenizer.token_bytes(token)),
                value: math.exp(lp) if post_sampling else lp}

    return {"content": [{**entry(x.token, x.logprob), top: [entry(t, v) for t, v in x.top_logprobs]}
                        for x in items]}


def delta_body(event: TurnDelta) -> dict[str, Any]:
    """The ``delta`` of one streamed chunk."""
    d = event.delta
    if isinstance(d, ContentDelta):
        return {"content": d.text}
    if isinstance(d, ReasoningDelta):
        return {"reasoning_content": d.text}
    if isinstance(d, ToolCallStart):
        return {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                "function": {"name": d.name, "arguments": ""}}]}
    if isinstance(d, ToolCallDelta):
        return {"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments}}]}
    return {}


def register(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/chat/completions/input_tokens")
    async def input_tokens(request: Request) -> Response:
        """llama-server's count of a chat request's prompt tokens: ``{"input_tokens": N, "object":
        "response.input_tokens"}``, nothing generated (also ``/chat/completions/input_tokens``, the alias)."""
        req = parse_chat(await ctx.read_json(request))
        ctx.check_model(req.params.model)
        return JSONResponse({"input_tokens": await ChatTurn.count_prompt(ctx, req), "object": "response.input_tokens"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_chat(await ctx.read_json(request))
        params = req.params
        turn = await ChatTurn.start(ctx, req)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": now, "model": ctx.config.model_id, "system_fingerprint": "minfer"}
        want_logprobs = params.logprobs is not None
        post_sampling = params.post_sampling_probs
        if not params.stream:
            choices = await turn.result(request)
            return JSONResponse({
                **base, "object": "chat.completion",
                "choices": [{"index": c.index, "message": c.message.to_openai(),
                             "logprobs": chat_logprobs(ctx, c.logprobs, post_sampling) if want_logprobs else None,
                             "finish_reason": c.finish_reason} for c in choices],
                "usage": turn.usage(), **answer_timings(turn.job.choices[0]),
                **verbose_fields(ctx, turn.job, params, turn.prompt_ids),
            })
        extra = {"usage": None} if params.include_usage else {}
        # llama-server puts the finished choice's timings on its last event: the usage chunk when there is one
        # (one choice: one usage chunk), else the finish chunk
        timings_on_usage = params.include_usage and len(turn.job.choices) == 1

        extras = StreamExtras(turn.job, params, lambda c: len(turn.prompt_ids))

        def body_of(choice: dict[str, Any], **fields: Any) -> dict[str, Any]:
            return {**base, "object": "chat.completion.chunk", "choices": [choice], **extra, **fields}

        def role(index: int, content: str | None) -> dict[str, Any]:
            return {"index": index, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                    "finish_reason": None}

        def chunks(event: TurnEvent) -> list[dict[str, Any]]:
            c = turn.job.choices[event.index]
            if isinstance(event, TurnStarted):
                # with return_progress the role chunk waits for the prompt's progress (llama-server's order)
                progress = extras.on_start(c)
                return [body_of(role(event.index, ""))] if progress is None else [
                    body_of(role(event.index, None), **progress)]
            if isinstance(event, TurnDelta):
                out = [] if (progress := extras.before_token(c)) is None else [
                    body_of(role(event.index, None), **progress), body_of(role(event.index, ""))]
                lp = chat_logprobs(ctx, event.logprobs, post_sampling) if want_logprobs and event.logprobs else None
                choice = {"index": event.index, "delta": delta_body(event), "logprobs": lp, "finish_reason": None}
                return [*out, body_of(choice, **extras.timings(c))]
            assert isinstance(event, TurnFinished)
            choice = {"index": event.index, "delta": {}, "logprobs": None, "finish_reason": event.finish_reason}
            return [body_of(choice, **({} if timings_on_usage else answer_timings(c)))]

        async def body() -> AsyncIterator[bytes]:
            try:
                async for batch in turn.batches():
                    yield b"".join(sse(b) for e in batch for b in chunks(e))
            except ApiError as e:
                yield sse(e.body())
                return
            if params.include_usage:
                last = answer_timings(turn.job.choices[0]) if timings_on_usage else {}
                yield sse({**base, "object": "chat.completion.chunk", "choices": [], "usage": turn.usage(), **last})
            yield b"data: [DONE]\n\n"

        return ctx.event_stream(body())
