"""llama-server's token endpoints: ``POST /tokenize``, ``POST /detokenize``, ``POST /apply-template``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request

from minfer.server.chat_turn import ChatTurn
from minfer.server.context import ServerContext
from minfer.server.errors import ApiError
from minfer.server.protocols.openai import parse_chat


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{name}' must be true or false, got {v!r}", param=name)
    return v


def register(app: FastAPI, ctx: ServerContext) -> None:
    tokenizer = ctx.model.tokenizer
    # ids that have text: a model may have more embedding rows than its tokenizer has tokens
    n_text = min(ctx.model.hparams.n_vocab, tokenizer.vocab_size)

    def piece(token: int) -> str | list[int]:
        """The token's text, or its bytes where they are not valid UTF-8 on their own (llama-server's rule)."""
        raw = tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return list(raw)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = _object(await ctx.read_json(request))
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(f"'content' must be a string, got {content!r:.60}", param="content")
        add_special, parse_special = _flag(body, "add_special", False), _flag(body, "parse_special", True)
        ids = await ctx.off_loop(tokenizer.encode, content, add_special, parse_special, size=len(content))
        if _flag(body, "with_pieces", False):
            return {"tokens": [{"id": t, "piece": piece(t)} for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = _object(await ctx.read_json(request))
        ids = body.get("tokens", [])
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ApiError("'tokens' must be a list of token ids", param="tokens")
        for i, t in enumerate(ids):
            if not 0 <= t < n_text:
                raise ApiError(f"token id {t} at index {i} is outside the vocabulary (0..{n_text - 1})",
                               param="tokens")
        return {"content": tokenizer.decode(ids)}

    @app.post("/apply-template")
    async def apply_template(request: Request) -> dict[str, Any]:
        req = parse_chat(await ctx.read_json(request))
        # the prompt a chat request renders: its tools and chat_template_kwargs over the server's defaults;
        # continue_final_message: the last assistant message's text after the opened turn, as the reply sees it
        return {"prompt": ChatTurn.plan(ctx, req).prompt + req.prefill}
