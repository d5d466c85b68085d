"""The pages: the chat at ``/``, the trace explorer at ``/trace``, their scripts and styles under ``/static/``.

Everything is served from the package (``minfer/server/page/``; the three browser libraries in ``vendor/``
are copied in by ``scripts/vendor_page_libs.sh`` at pinned versions): the pages load nothing from
elsewhere, and their Content-Security-Policy lets them talk to this server only. They load without the API
key (the middleware leaves these paths open) and ask for it once when the API answers 401.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from minfer.server.context import ServerContext

PAGE_DIR = Path(__file__).resolve().parent.parent / "page"
# no request leaves the machine: scripts, styles, images and fetches from this origin only
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def register_pages(app: FastAPI, chat: bool = True, key_required: bool = False) -> None:
    """``/`` (the chat, or the explorer where ``chat`` is False), ``/trace`` and ``/static/``. With
    ``key_required`` the pages ask for the key before their first API call (not after a 401 the browser
    would log as an error); a refused key still brings the question back."""

    def page(name: str) -> HTMLResponse:
        text = (PAGE_DIR / name).read_text(encoding="utf-8")
        text = text.replace('<meta name="minfer-key" content="">',
                            f'<meta name="minfer-key" content="{"required" if key_required else ""}">')
        return HTMLResponse(text, headers=HEADERS)

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return page("chat.html" if chat else "trace.html")

    @app.get("/trace", include_in_schema=False)
    async def explorer() -> HTMLResponse:
        return page("trace.html")

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:
        return FileResponse(PAGE_DIR / "favicon.svg", media_type="image/svg+xml")

    app.mount("/static", StaticFiles(directory=PAGE_DIR), name="static")


def register(app: FastAPI, ctx: ServerContext) -> None:
    if ctx.config.ui:  # --no-ui: no chat page (llama-server then answers / with 404)
        register_pages(app, chat=True, key_required=bool(ctx.config.api_keys))


def register_encoder_page(app: FastAPI, key_required: bool = False) -> None:
    """An encoder server's ``/``: a page that says chat is not available and offers an embeddings and rerank
    playground (``encoder.html``), with ``/favicon.ico`` and ``/static/`` as :func:`register_pages` serves them."""

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        text = (PAGE_DIR / "encoder.html").read_text(encoding="utf-8")
        text = text.replace('<meta name="minfer-key" content="">',
                            f'<meta name="minfer-key" content="{"required" if key_required else ""}">')
        return HTMLResponse(text, headers=HEADERS)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:
        return FileResponse(PAGE_DIR / "favicon.svg", media_type="image/svg+xml")

    app.mount("/static", StaticFiles(directory=PAGE_DIR), name="static")
