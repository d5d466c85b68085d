"""CORS for browser clients (``--cors-origin``): Starlette's CORSMiddleware, placed outside the API key
check so that a preflight ``OPTIONS`` (which browsers send without credentials) is answered before it."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp


def with_cors(app: ASGIApp, origins: Sequence[str]) -> ASGIApp:
    """``app`` answering cross-origin requests from ``origins`` (``"*"``: any); unchanged when empty."""
    if not origins:
        return app
    any_origin = "*" in origins
    return CORSMiddleware(app, allow_origins=["*"] if any_origin else list(origins), allow_methods=["*"],
                          allow_headers=["*"], allow_credentials=not any_origin, expose_headers=["Retry-After"],
                          max_age=600)


def parse_origins(values: Sequence[str] | None) -> tuple[str, ...]:
    """``--cors-origin`` values: repeatable, each may be a comma-separated list; trailing slashes dropped."""
    out: list[str] = []
    for v in values or ():
        out += [o.strip().rstrip("/") for o in v.split(",") if o.strip()]
    return tuple(dict.fromkeys(out))
