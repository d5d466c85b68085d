"""Anthropic's ``POST /v1/messages``: one chat turn on the engine, answered as a message or as its
stream events (:mod:`minfer.server.protocols.anthropic` translates both ways); errors in Anthropic's
body shape (``errors.error_response`` answers every error under ``/v1/messages`` so).
``POST /v1/messages/count_tokens``: the prompt's token count, nothing generated."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minfer.server.chat_turn import ChatTurn
from minfer.server.context import ServerContext
from minfer.server.errors import anthropic_error_body
from minfer.server.protocols.anthropic import MessageBuilder, parse_messages
from minfer.server.typed_stream import Events, feed_message, turn_events, typed_stream


def register(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        req = parse_messages(await ctx.read_json(request), count_only=True)
        return JSONResponse({"input_tokens": await ChatTurn.count_prompt(ctx, req.chat, req.prefill)})

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        req = parse_messages(await ctx.read_json(request))
        turn = await ChatTurn.start(ctx, req.chat, prefill=req.prefill)
        builder = MessageBuilder(ctx.config.model_id, len(turn.prompt_ids), lambda: turn.job.choices[0].cached_tokens)

        def finish(reason: str) -> Events:
            stats = turn.job.choices[0].stats
            assert stats is not None
            return builder.finish(reason, stats.stop, stats.generated_tokens)

        if not req.chat.params.stream:
            choice = (await turn.result(request))[0]
            feed_message(builder, choice.message)
            finish(choice.finish_reason)
            return JSONResponse(builder.message)

        return typed_stream(turn.job, turn_events(turn, builder, finish), anthropic_error_body)
