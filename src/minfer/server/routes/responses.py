"""OpenAI's ``POST /v1/responses``: one chat turn on the engine, answered as a response object or as its
typed stream events (:mod:`minfer.server.protocols.responses` translates both ways)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minfer.server.chat_turn import ChatTurn
from minfer.server.context import ServerContext
from minfer.server.protocols.responses import ResponseBuilder, parse_responses
from minfer.server.typed_stream import Events, feed_message, turn_events, typed_stream


def register(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req = parse_responses(await ctx.read_json(request))
        turn = await ChatTurn.start(ctx, req.chat)
        builder = ResponseBuilder(req, ctx.config.model_id)

        def finish(reason: str) -> Events:
            usage = turn.usage()
            cached = usage["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
            return builder.finish(reason, usage["prompt_tokens"], usage["completion_tokens"], cached)  # type: ignore[arg-type]

        if not req.chat.params.stream:
            choice = (await turn.result(request))[0]
            feed_message(builder, choice.message)
            finish(choice.finish_reason)
            return JSONResponse(builder.response)

        return typed_stream(turn.job, turn_events(turn, builder, finish), builder.error)
