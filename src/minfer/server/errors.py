"""How an error becomes an HTTP answer: every :class:`MinferError` a 4xx, anything else a 500."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from minfer.errors import BadRequestError, ContextOverflowError, MinferError
from minfer.runtime.scheduler import QueueFullError, ShuttingDownError
from minfer.server.protocol import ApiError

# the paths whose errors are Anthropic's {"type": "error", "error": {"type", "message"}} bodies
ANTHROPIC_PATHS = ("/v1/messages",)


def error_response(e: ApiError, path: str = "") -> JSONResponse:
    """The error as a JSON answer: OpenAI's body, or Anthropic's under the Anthropic routes."""
    body = anthropic_error_body(e) if path.startswith(ANTHROPIC_PATHS) else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


# Anthropic's error type for each HTTP status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(e: ApiError) -> dict[str, Any]:
    kind = ANTHROPIC_ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def cancelled_error() -> ApiError:
    return ApiError("the request was cancelled before it finished (server shutting down)", status=503,
                    type="server_error", code="cancelled")


def api_error(e: Exception) -> ApiError:
    """The HTTP answer to an engine error."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, QueueFullError):
        return ApiError(str(e), status=429, type="rate_limit_error", code="queue_full")
    if isinstance(e, ShuttingDownError):
        return ApiError(str(e), status=503, type="server_error", code="shutting_down")
    if isinstance(e, ContextOverflowError):
        return ApiError(str(e), code="context_length_exceeded", param="messages")
    if isinstance(e, BadRequestError | MinferError):
        return ApiError(str(e))
    return ApiError(f"internal error: {type(e).__name__}: {e}", status=500, type="server_error")
