"""llama-server's ``POST /slots/{id_slot}?action=save|restore|erase``: a free slot's cached tokens and KV cells
written to a file under ``--slot-save-path``, read back into a slot (a later prompt that starts with them
reuses them), or forgotten.

Answers as llama-server's: ``{"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}``,
``{..., "n_restored", "n_read", "timings": {"restore_ms"}}``, ``{"id_slot", "n_erased"}``; without
``--slot-save-path`` a 501 ``not_supported_error``; a bad slot id, action or file name a 400. A slot that is
processing a request is acted on once it is done (llama-server defers the task the same way). The file is a
checksummed session file naming the model (:mod:`minfer.runtime.slot_file`): one of another model or cell
type, a damaged one, or one that is not a saved slot is refused by name (400), never loaded.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minfer.errors import BadRequestError, ContextOverflowError, FormatError, MinferError
from minfer.runtime.slot_file import SlotBusyError
from minfer.server.context import ServerContext
from minfer.server.errors import ApiError

ACTIONS = ("save", "restore", "erase")
BUSY_POLL_SECONDS = 0.02  # how often a request for a busy slot looks again
_MAX_NAME_BYTES = 255  # the longest file name common file systems take
# characters no file name here may hold: path separators (and their look-alikes), characters Windows refuses,
# the replacement character and the byte-order mark (a name that was not text)
_FORBIDDEN = set('/\\:*?"<>|') | {"\u2215", "\u2216", "\uff0e", "\ufffd", "\ufeff"}


def not_supported() -> Response:
    """llama-server's answer to a slot action when it was started without ``--slot-save-path``."""
    return JSONResponse({"error": {"code": 501, "message": "This server does not support slots action. Start it "
                                   "with `--slot-save-path`", "type": "not_supported_error"}}, status_code=501)


def check_filename(value: Any) -> str:
    """``value`` as a file name directly under the slot folder, or a 400 naming ``filename``: a non-empty
    string of at most 255 bytes, no path separator, no ``.``/``..``, no control or Windows-reserved character,
    no leading or trailing space nor trailing dot (Windows would strip them: another file)."""
    if not isinstance(value, str):
        raise ApiError(f"'filename' must be a string, got {'nothing' if value is None else type(value).__name__}",
                       param="filename")
    problem = None
    if not value:
        problem = "it is empty"
    elif len(value.encode("utf-8", errors="surrogatepass")) > _MAX_NAME_BYTES:
        problem = f"it is longer than {_MAX_NAME_BYTES} bytes"
    elif value in (".", ".."):
        problem = "it names a folder"
    elif any(c in _FORBIDDEN or ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or 0xD800 <= ord(c) <= 0xDFFF
             for c in value):
        problem = "it holds a path separator or a control or reserved character"
    elif value[0] == " " or value[-1] in " .":
        problem = "it starts or ends with a space or ends with a dot"
    if problem is not None:
        raise ApiError(f"Invalid filename {value!r}: {problem} (a file name directly under --slot-save-path)",
                       param="filename")
    return value


def slot_id(ctx: ServerContext, text: str) -> int:
    """The slot a path names, or a 400 naming ``id_slot``."""
    n = ctx.engine_loop.n_slots
    slot = int(text) if re.fullmatch(r"-?[0-9]{1,9}", text) else -1
    if not 0 <= slot < n:
        raise ApiError(f"Invalid slot ID {text!r}: this server has slots 0..{n - 1}", param="id_slot")
    return slot


async def slot_action(ctx: ServerContext, request: Request, id_slot: str, action: str) -> Response:
    """Run ``action`` (save, restore or erase) on slot ``id_slot`` as its path gave them."""
    folder = ctx.config.slot_save_path
    if folder is None:
        return not_supported()
    slot = slot_id(ctx, id_slot)
    if action not in ACTIONS:
        raise ApiError(f"Invalid action {action!r}: one of {', '.join(ACTIONS)}", param="action")
    engine = ctx.engine_loop.engine
    if action == "erase":
        n, _ = await _on_engine(ctx, request, lambda: engine.erase_slot(slot), action, None)
        return JSONResponse({"id_slot": slot, "n_erased": n})
    body = await ctx.read_json(request)
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object with 'filename'", param="filename")
    filename = check_filename(body.get("filename"))
    path = os.path.join(folder, filename)
    if action == "save":
        (n, nbytes), ms = await _on_engine(ctx, request, lambda: engine.save_slot(slot, path), action,
                                           (path, filename))
        return JSONResponse({"id_slot": slot, "filename": filename, "n_saved": n, "n_written": nbytes,
                             "timings": {"save_ms": ms}})
    (n, nbytes), ms = await _on_engine(ctx, request, lambda: engine.restore_slot(slot, path), action,
                                       (path, filename))
    return JSONResponse({"id_slot": slot, "filename": filename, "n_restored": n, "n_read": nbytes,
                         "timings": {"restore_ms": ms}})


def _timed(fn: Callable[[], Any]) -> Callable[[], tuple[Any, float]]:
    def run() -> tuple[Any, float]:
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1000.0

    return run


async def _on_engine(ctx: ServerContext, request: Request, fn: Callable[[], Any], action: str,
                     shown: tuple[str, str] | None) -> tuple[Any, float]:
    """``fn()`` on the engine's thread between two steps, once its slot is free (a busy slot: looked at again
    every few ms while the client waits), and the milliseconds it took (not the wait). A file's error names
    the file as the client gave it (``shown``: the path and its name), never the server's folder."""
    while True:
        try:
            return await asyncio.wrap_future(ctx.engine_loop.call(_timed(fn)))
        except SlotBusyError:
            if await request.is_disconnected():
                raise ApiError("the client went away while the slot was busy", status=408) from None
            await asyncio.sleep(BUSY_POLL_SECONDS)
        except (FormatError, BadRequestError, ContextOverflowError) as e:  # the file, or no room for it
            message = str(e) if shown is None else str(e).replace(shown[0], shown[1])
            raise ApiError(message, param=None if shown is None else "filename") from None
        except MinferError as e:
            if type(e) is not MinferError:  # (shutting down: answered as such)
                raise
            message = str(e) if shown is None else str(e).replace(shown[0], shown[1])
            # the file could not be written or read (a full disk, permissions), as llama-server's 500
            raise ApiError(f"Unable to {action} the slot: {message}", status=500, type="server_error") from None
