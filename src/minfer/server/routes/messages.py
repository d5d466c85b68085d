"""Anthropic's ``POST /v1/messages``: one chat turn on the engine, answered as a message or as its
stream events (:mod:`minfer.server.anthropic_protocol` translates both ways); errors in Anthropic's
body shape (``app.py`` answers every error under ``/v1/messages`` so)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minfer.server.anthropic_protocol import MessageBuilder, parse_messages
from minfer.server.context import ServerContext
from minfer.server.errors import anthropic_error_body
from minfer.server.turns import TextDelta, ToolArguments, ToolCallStart, TurnFinished, start_turn
from minfer.server.typed_stream import typed_stream


def register(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        req = parse_messages(await ctx.read_json(request))
        ctx.check_model(req.chat.params.model)
        turn = start_turn(ctx, req.chat, prefill=req.prefill)
        builder = MessageBuilder(ctx.config.model_id, turn.prompt_tokens)

        async def events() -> AsyncIterator[list[dict[str, Any]]]:
            yield builder.start()
            async for ev in turn.events(request):
                if isinstance(ev, TextDelta):
                    yield builder.text(ev.text)
                elif isinstance(ev, ToolCallStart):
                    yield builder.tool_call(ev.id, ev.name)
                elif isinstance(ev, ToolArguments):
                    yield builder.arguments(ev.delta)
                elif isinstance(ev, TurnFinished):
                    yield builder.finish(ev.finish_reason, ev.stop, ev.completion_tokens)

        if req.chat.params.stream:
            return typed_stream(turn.job, events(), anthropic_error_body)
        async for _ in events():
            pass
        return JSONResponse(builder.message)
