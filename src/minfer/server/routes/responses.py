"""OpenAI's ``POST /v1/responses``: one chat turn on the engine, answered as a response object or as its
typed stream events (:mod:`minfer.server.responses_protocol` translates both ways)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minfer.server.context import ServerContext
from minfer.server.responses_protocol import ResponseBuilder, parse_responses
from minfer.server.turns import TextDelta, ToolArguments, ToolCallStart, TurnFinished, start_turn
from minfer.server.typed_stream import typed_stream


def register(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req = parse_responses(await ctx.read_json(request))
        ctx.check_model(req.chat.params.model)
        turn = start_turn(ctx, req.chat)
        builder = ResponseBuilder(req, ctx.config.model_id)

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
                    yield builder.finish(ev.finish_reason, ev.prompt_tokens, ev.completion_tokens,
                                         ev.cached_tokens)

        if req.chat.params.stream:
            return typed_stream(turn.job, events(), builder.error)
        async for _ in events():
            pass
        return JSONResponse(builder.response)


