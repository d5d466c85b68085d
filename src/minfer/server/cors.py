"""CORS for browser clients, as llama-server answers it (``--cors-origins``, ``--cors-methods``,
``--cors-headers``, ``--cors-credentials``).

Every ``OPTIONS`` request is a preflight, answered 200 here, outside the API key check and the routes:
browsers send it without credentials, and on any path (``/completions`` as well as ``/v1/...``). Every
other response gets ``Access-Control-Allow-Origin`` when the request's origin is allowed:

- ``*`` (the default) with credentials on: the request's ``Origin`` is echoed (any page may call), with
  credentials off: ``*`` itself;
- ``localhost``: only loopback origins (``http://localhost:8080``, ``http://127.0.0.1``, ``http://[::1]:3000``)
  are echoed, judged by the origin's parsed host (``http://localhost.evil.com`` is not one);
- listed origins: the request's origin when it is one of them (llama-server sends the configured text as it
  is, which a browser accepts only for a single origin; echoing the matching one works for a list too).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minfer.errors import BadRequestError

ANY_ORIGIN = "*"
LOOPBACK_ORIGINS = "localhost"  # llama-server's special value: loopback origins only
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
DEFAULT_METHODS = "GET, POST, DELETE, OPTIONS"
DEFAULT_HEADERS = "*"
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110): a method or header name


@dataclass(frozen=True)
class CorsPolicy:
    """Which origins may call the server from a browser, and what a preflight allows them."""

    origins: tuple[str, ...] = (ANY_ORIGIN,)  # "*", "localhost" and/or origins; empty: no CORS at all
    methods: str = DEFAULT_METHODS
    headers: str = DEFAULT_HEADERS
    credentials: bool = True

    def allow_origin(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for a request from ``origin``; None: no header."""
        if ANY_ORIGIN in self.origins and not self.credentials:
            return ANY_ORIGIN
        if not origin:
            return None
        if ANY_ORIGIN in self.origins or origin.rstrip("/") in self.origins:
            return origin
        if LOOPBACK_ORIGINS in self.origins and is_loopback_origin(origin):
            return origin
        return None

    def allow_headers(self, requested: str | None) -> str:
        """``Access-Control-Allow-Headers`` for a preflight that asks for ``requested`` headers.

        ``*`` does not cover ``Authorization`` in browsers (the Fetch standard), nor anything for a request
        with credentials: with ``*`` configured the requested names are listed after it, so a page that sends
        the API key passes its preflight (llama-server answers a bare ``*``, and such a page fails there)."""
        if self.headers != ANY_ORIGIN or not requested or not requested.strip():
            return self.headers
        return ", ".join([ANY_ORIGIN, *(h.strip() for h in requested.split(",") if h.strip())])


def is_loopback_origin(origin: str) -> bool:
    """Whether ``origin``'s host (parsed, any port) is localhost, 127.0.0.1 or ::1."""
    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host in LOOPBACK_HOSTS


class Cors:
    """Pure ASGI middleware (streams pass untouched): the preflight answer and the origin headers."""

    def __init__(self, app: ASGIApp, policy: CorsPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        allowed = self.policy.allow_origin(request_headers.get(b"origin"))
        extra: list[tuple[bytes, bytes]] = []
        if allowed is not None:
            extra.append((b"access-control-allow-origin", allowed.encode("latin-1")))
            if allowed != ANY_ORIGIN:
                extra.append((b"vary", b"Origin"))  # the answer depends on the Origin: caches must know
        if scope["method"] == "OPTIONS":
            await self._preflight(send, extra, request_headers.get(b"access-control-request-headers"))
            return
        if allowed is not None:
            # No Access-Control-Allow-Credentials here, as llama-server: the preflight says it, but without it
            # on the answer a browser keeps a credentialed (cookie) answer from the page. With any origin echoed,
            # that is what stops a page reading what a cookie-authenticating proxy in front would let through.
            extra.append((b"access-control-expose-headers", b"Retry-After"))  # a 429's wait, readable by pages

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                # this policy is the answer's: a proxied model server's own CORS headers (the several-model
                # router's, the sleeping server's) give way to it rather than doubling it
                own = [(k, v) for k, v in message.get("headers", []) if not _cors_header(k, v)]
                message = {**message, "headers": [*own, *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _preflight(self, send: Send, extra: list[tuple[bytes, bytes]], requested: str | None) -> None:
        p = self.policy
        headers = [*extra,
                   (b"access-control-allow-credentials", b"true" if p.credentials else b"false"),
                   (b"access-control-allow-methods", p.methods.encode("latin-1")),
                   (b"access-control-allow-headers", p.allow_headers(requested).encode("latin-1")),
                   (b"content-type", b"text/html"), (b"content-length", b"0")]  # llama-server's blank answer
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


def with_cors(app: ASGIApp, policy: CorsPolicy | None) -> ASGIApp:
    """``app`` answering preflights and cross-origin requests by ``policy``; unchanged without one."""
    if policy is None or not policy.origins:
        return app
    return Cors(app, policy)


def parse_origins(values: Sequence[str] | None) -> tuple[str, ...]:
    """``--cors-origins`` values (repeatable, each a comma-separated list): ``*``, ``localhost`` or origins
    (``scheme://host[:port]``, a trailing slash dropped); anything else is a one-line error."""
    out: list[str] = []
    for value in values or ():
        for item in (o.strip() for o in value.split(",")):
            if not item:
                continue
            origin = item.rstrip("/") if item not in (ANY_ORIGIN, LOOPBACK_ORIGINS) else item
            if origin not in (ANY_ORIGIN, LOOPBACK_ORIGINS) and not _is_origin(origin):
                raise BadRequestError(f"--cors-origins: {item!r} is not an origin (scheme://host[:port], "
                                      f"'{ANY_ORIGIN}' for any or '{LOOPBACK_ORIGINS}' for loopback pages)")
            out.append(origin)
    if values and not out:
        raise BadRequestError("--cors-origins: no origin given (use '*', 'localhost' or scheme://host[:port])")
    return tuple(dict.fromkeys(out))


def parse_token_list(flag: str, value: str, what: str) -> str:
    """A ``--cors-methods`` / ``--cors-headers`` value: comma-separated HTTP tokens (or ``*``), normalised
    to ``A, B``; an empty list or a name that is not a token is a one-line error naming ``flag``."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise BadRequestError(f"{flag}: no {what} given")
    for item in items:
        if not _TOKEN.match(item):
            raise BadRequestError(f"{flag}: {item!r} is not an HTTP {what} name")
    return ", ".join(items)


def _cors_header(name: bytes, value: bytes) -> bool:
    name = name.lower()
    return name.startswith(b"access-control-") or (name == b"vary" and value == b"Origin")


def _is_origin(text: str) -> bool:
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        return False
    return bool(parts.scheme and parts.netloc and not parts.path and not parts.query and not parts.fragment)
