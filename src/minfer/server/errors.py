"""How an error becomes an HTTP answer: an :class:`ApiError` says its own, every :class:`MinferError` is a
4xx, anything else a logged 500.

:func:`install_error_handlers` puts the conversion on the app itself, so every route (and every route
module added later) gets it without code of its own: a ``MinferError`` raised anywhere in a handler is a
4xx with an OpenAI error body, FastAPI's own validation errors are 400s, Starlette's HTTP errors keep
their headers (a 405 says ``Allow``), and anything else is a 500 whose body says only that it happened
(the traceback goes to the server's log, never to the client).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from minfer.errors import BadRequestError, ContextOverflowError, MinferError

# Light at import on purpose: the helper process that parses very large bodies imports json_body, and with
# it this module, alone; FastAPI and the engine (the engine loop's errors) are imported where they are used,
# so that process does not spend a second of the server's CPU loading them.
if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

log = logging.getLogger("minfer.server")


class ApiError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, message: str, status: int = 400, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: Mapping[str, str] | None = None, extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})  # more fields of the error object (a context overflow's token counts)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def __reduce__(self) -> Any:  # whole across a process boundary (bodies parsed in a helper process)
        return (ApiError, (self.message, self.status, self.type, self.param, self.code, self.headers, self.extra))


def context_overflow(message: str, n_prompt_tokens: int, n_ctx: int, param: str | None = "messages") -> ApiError:
    """A prompt longer than a sequence's context: llama-server's 400 of type ``exceed_context_size_error``,
    whose error object also carries ``n_prompt_tokens`` and ``n_ctx`` (clients read them to trim the prompt);
    ``code`` stays OpenAI's ``context_length_exceeded``."""
    return ApiError(message, type="exceed_context_size_error", param=param, code="context_length_exceeded",
                    extra={"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx})

# the paths whose errors are Anthropic's {"type": "error", "error": {"type", "message"}} bodies
ANTHROPIC_PATHS = ("/v1/messages",)
# the paths whose errors are ollama's {"error": "message"} bodies (its clients read the string)
OLLAMA_PATHS = ("/api/",)

HTTP_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_response(e: ApiError, path: str = "") -> JSONResponse:
    """The error as a JSON answer: OpenAI's body, Anthropic's under the Anthropic routes, ollama's under ``/api/``."""
    from fastapi.responses import JSONResponse

    if path.startswith(ANTHROPIC_PATHS):
        body = anthropic_error_body(e)
    elif path.startswith(OLLAMA_PATHS):
        body = {"error": e.message}
    else:
        body = e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


# Anthropic's error type for each HTTP status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(e: ApiError) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def internal_error() -> ApiError:
    return ApiError("internal server error (the details are in the server's log)", status=500, type="server_error",
                    code="internal_error")


def cancelled_error() -> ApiError:
    return ApiError("the request was cancelled before it finished (server shutting down)", status=503,
                    type="server_error", code="cancelled")


def api_error(e: BaseException) -> ApiError:
    """The HTTP answer to an engine error (a 500 for anything that is not a MinferError, logged here)."""
    from minfer.runtime.engine_loop import QueueFullError, ShuttingDownError

    if isinstance(e, ApiError):
        return e
    if isinstance(e, QueueFullError):
        return ApiError(str(e), status=429, type="rate_limit_error", code="queue_full")
    if isinstance(e, ShuttingDownError):
        return ApiError(str(e), status=503, type="server_error", code="shutting_down")
    if isinstance(e, ContextOverflowError):
        if e.n_prompt_tokens is not None and e.n_ctx is not None:
            return context_overflow(str(e), e.n_prompt_tokens, e.n_ctx)
        return ApiError(str(e), code="context_length_exceeded", param="messages")
    if isinstance(e, BadRequestError | MinferError):
        return ApiError(str(e))
    log.error("internal error: %s: %s", type(e).__name__, e, exc_info=e)
    return internal_error()


def install_error_handlers(app: FastAPI) -> None:
    """The one conversion of every exception a request raises into its answer."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e, request.url.path)

    @app.exception_handler(MinferError)
    async def on_minfer_error(request: Request, e: MinferError) -> JSONResponse:
        return error_response(api_error(e), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = HTTP_ERROR_TYPES.get(e.status_code, "invalid_request_error" if e.status_code < 500 else "server_error")
        return error_response(ApiError(str(e.detail), status=e.status_code, type=kind, headers=e.headers),
                              request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid request"))
        return error_response(ApiError(message, param=where), request.url.path)

    @app.exception_handler(Exception)
    async def on_anything_else(request: Request, _e: Exception) -> JSONResponse:
        # Starlette re-raises after answering; the outermost middleware logs it (once) and swallows it.
        return error_response(internal_error(), request.url.path)
