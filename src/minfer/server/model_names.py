"""Which model a request names, for the fronts that serve several: the several-model router
(:mod:`minfer.server.model_router`) and the Ray front (:mod:`minfer.server.cluster.front`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any, TypeVar
from urllib.parse import parse_qs

from starlette.types import Scope

from minfer.server.errors import ApiError

T = TypeVar("T")


def find_model(models: Mapping[str, T], name: str) -> T:
    """``models[name]``, where ``NAME:latest`` and ``NAME.gguf`` are ``NAME``; else a 404 listing the names."""
    for candidate in (name, name.removesuffix(":latest"), name.removesuffix(".gguf")):
        if candidate in models:
            return models[candidate]
    raise ApiError(f"model {name!r} not found (this server has {', '.join(sorted(models))})",
                   status=404, type="not_found_error", param="model", code="model_not_found")


def json_object(body: bytes) -> dict[str, Any] | None:
    """A request body that is a JSON object, else None (the model's server answers what is wrong with it)."""
    if body[:1] != b"{":
        return None
    with contextlib.suppress(ValueError):
        parsed = json.loads(body)
        return parsed if isinstance(parsed, dict) else None
    return None


def model_of(scope: Scope, body: Mapping[str, Any] | None) -> str | None:
    """The model a request names: its JSON body's ``model`` (ollama's older ``name``; ``body`` as
    :func:`json_object` reads it), else ``?model=``."""
    if body is not None:
        name = body.get("model", body.get("name"))
        if isinstance(name, str) and name:
            return name
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model")
    return values[0] if values else None
