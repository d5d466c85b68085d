"""llama-server's ``GET /lora-adapters`` (the loaded adapters and the scales requests run with by default) and
``POST /lora-adapters`` (new defaults: ``[{"id": 0, "scale": 0.5}]``, an adapter not named is off). A request
chooses its own with a ``lora`` field of the same shape (:mod:`minfer.server.protocols.openai`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from minfer.errors import BadRequestError
from minfer.server.context import ServerContext
from minfer.server.errors import ApiError


def register(app: FastAPI, ctx: ServerContext) -> None:
    model = ctx.model

    @app.get("/lora-adapters")
    async def list_adapters() -> list[dict[str, Any]]:
        return model.lora_adapters

    @app.post("/lora-adapters")
    async def set_adapters(request: Request) -> dict[str, Any]:
        body = await ctx.read_json(request)
        if not isinstance(body, list):
            raise ApiError(f"the request body must be an array of {{\"id\": ..., \"scale\": ...}}, got "
                           f"{type(body).__name__}")
        try:
            # the defaults of sequences that start from now on; running ones keep theirs, and cached prefixes
            # computed under other scales are not reused (slots compare the scales)
            model.set_lora(body)
        except BadRequestError as e:
            raise ApiError(str(e), param="lora") from None
        return {"success": True}
