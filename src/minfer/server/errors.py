"""How an error becomes an HTTP answer: every :class:`MinferError` a 4xx, anything else a 500."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from minfer.errors import BadRequestError, ContextOverflowError, MinferError
from minfer.runtime.scheduler import QueueFullError, ShuttingDownError
from minfer.server.protocol import ApiError


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


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
