"""``minfer trace --serve``: the trace explorer alone, for a model without the chat (or a hand-made example).

The same pages and ``/trace/api`` routes as ``minfer serve``; with no engine running, the traces run on
one worker thread. Listens on loopback by default and has no API key: it is a local tool.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minfer.errors import MinferError
from minfer.server import listening_socket
from minfer.server.errors import ApiError, api_error, error_response
from minfer.server.routes.page import register_pages
from minfer.server.routes.trace import TraceService, register_explorer
from minfer.trace.compare import DumpRun


def create_explorer_app(service: TraceService) -> FastAPI:
    app = FastAPI(title="minfer trace", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def on_api_error(_request: Request, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(MinferError)
    async def on_minfer_error(_request: Request, e: MinferError) -> JSONResponse:
        return error_response(api_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(str(e.detail), status=e.status_code, type=kind))

    async def read_json(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not valid JSON: {e}") from None

    register_pages(app, chat=False)
    register_explorer(app, service, read_json)
    return app


@dataclass(frozen=True)
class ExplorerOptions:
    host: str = "127.0.0.1"
    port: int = 8081
    log_level: str = "warning"


def serve_explorer(service: TraceService, rid: str | None, opts: ExplorerOptions,
                   dumps: dict[str, DumpRun] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; ``rid``, if given, is the run the printed address opens."""
    import uvicorn

    service.dumps.update(dumps or {})
    sock = listening_socket(opts.host, opts.port, backlog=64)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}/trace" + (f"?run={rid}" if rid else "")
    print(f"minfer: trace explorer on {url}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(create_explorer_app(service), log_level=opts.log_level, access_log=False))
    server.run(sockets=[sock])
