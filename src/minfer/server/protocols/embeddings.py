"""The embeddings request bodies: OpenAI's ``/v1/embeddings`` and llama-server's native ``/embedding``,
checked field by field (an :class:`~minfer.server.errors.ApiError` naming the field)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from minfer.server.errors import ApiError

ENCODINGS = ("float", "base64")


@dataclass
class EmbeddingsRequest:
    inputs: list[str | list[int]]  # one string or one list of token ids per vector
    model: str | None
    encoding_format: str
    dimensions: int | None
    normalize: bool | None  # None: the server's setting


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def embedding_inputs(value: Any, field: str) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists (an item may also be
    ``{"content": [content parts]}``); never empty."""
    if value is None:
        raise ApiError(f"'{field}' is required", param=field)
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_token(t) for t in value):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise ApiError(f"'{field}' must be a string, a list of strings, a list of token ids or a list of such lists, "
                       f"got {type(value).__name__}", param=field)
    if not items:
        raise ApiError(f"'{field}' is empty: give a string, token ids, or a list of them", param=field)
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise ApiError(f"'{field}[{i}]' is an empty string (nothing to embed)", param=field)
            out.append(item)
        elif isinstance(item, Mapping) and "content" in item:
            out.append(_content_parts(item["content"], f"{field}[{i}].content"))
        elif isinstance(item, list) and all(_is_token(t) for t in item):
            if not item:
                raise ApiError(f"'{field}[{i}]' is an empty list of token ids", param=field)
            out.append(list(item))
        else:
            raise ApiError(f"'{field}[{i}]' must be a string, a list of token ids or {{\"content\": [parts]}}, got "
                           f"{item!r:.60}", param=field)
    return out


def _content_parts(parts: Any, where: str) -> str:
    """An input item given as OpenAI content parts (``{"content": [{"type": "text", "text": ...}, ...]}``, as
    llama-server also takes it): their texts joined, embedded as that one string. Only text parts: this
    server embeds no images."""
    if isinstance(parts, str):
        parts = [{"type": "text", "text": parts}]
    if not isinstance(parts, list) or not parts:
        raise ApiError(f"'{where}' must be a non-empty list of content parts", param=where)
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            raise ApiError(f"'{where}[{j}]' must be a text part ({{\"type\": \"text\", \"text\": ...}}): "
                           f"embeddings take text only, got type {kind!r}", param=f"{where}[{j}]")
        if not isinstance(part.get("text"), str):
            raise ApiError(f"'{where}[{j}].text' must be a string", param=f"{where}[{j}].text")
        texts.append(part["text"])
    text = "".join(texts)
    if not text:
        raise ApiError(f"'{where}' has no text (nothing to embed)", param=where)
    return text


def parse_embeddings(body: Any, native: bool = False) -> EmbeddingsRequest:
    """OpenAI's body (``input``, ``model``, ``encoding_format``, ``dimensions``) or, with ``native``,
    llama-server's (``content`` or ``input``, ``embd_normalize``: -1 none, 2 Euclidean)."""
    if not isinstance(body, Mapping):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    field = "content" if native and "content" in body else "input"
    inputs = embedding_inputs(body.get(field), field)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(f"'model' must be a string, got {model!r}", param="model")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODINGS:
        raise ApiError(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", param="encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not _is_token(dims) or dims < 1):
        raise ApiError(f"'dimensions' must be a positive integer, got {dims!r}", param="dimensions")
    normalize = None
    if native and body.get("embd_normalize") is not None:
        v = body["embd_normalize"]
        if v not in (-1, 2) or isinstance(v, bool):
            raise ApiError(f"'embd_normalize' must be -1 (none) or 2 (Euclidean), got {v!r}", param="embd_normalize")
        normalize = v == 2
    return EmbeddingsRequest(inputs, model, fmt, dims, normalize)
