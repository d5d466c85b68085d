"""A request body read as JSON, checked for values no field can take (a 400 naming the first).

Light on purpose: very large bodies are parsed in a helper process (``ServerContext.read_json``), and
that process imports this module alone (and :mod:`minfer.server.errors`, kept light for it); importing
the engine there would cost it a second of CPU on the machine the server's decode steps run on."""

from __future__ import annotations

import json
import math
from typing import Any

from minfer.server.errors import ApiError

MAX_JSON_DEPTH = 64  # deeper bodies are refused: no request needs them, and recursive code would overflow
INT64 = 1 << 63


def parse_body(raw: bytes) -> Any:
    """The request body as JSON, or an :class:`ApiError` (400) naming what is wrong with it: not JSON,
    ``NaN``/``Infinity`` (not JSON either), nested deeper than :data:`MAX_JSON_DEPTH`, a lone surrogate
    (``"\\ud800"``: no text can hold it), an integer beyond 64 bits or a number beyond a double."""

    def no_constants(name: str) -> Any:
        raise ApiError(f"the request body is not valid JSON: {name} is not a JSON number")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except RecursionError:
        raise ApiError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    check_json_values(body)
    return body


def check_json_values(body: Any) -> None:
    """Walk ``body`` without recursion; raise :class:`ApiError` at the first value no field can take.

    A path is built only for the value that fails (a 10 MB list of token ids is walked without making a
    string per item)."""
    if type(body) is not dict and type(body) is not list:
        _check_scalar(body, ())
        return
    stack: list[tuple[Any, tuple[Any, ...], int]] = [(body, (), 0)]
    while stack:
        value, at, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep "
                           f"(at {_path(at) or 'the top'})")
        if type(value) is list and _plain_list_ok(value):
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str):
                _check_text(k, at, f"a key of {_path(at) or 'the body'}")
            if type(v) is dict or type(v) is list:
                stack.append((v, (*at, k), depth + 1))
            elif type(v) is not bool and v is not None:
                _check_scalar(v, at, k)


def _plain_list_ok(items: list[Any]) -> bool:
    """Whether a list of only integers, or only strings, is fine, checked at C speed (token-id prompts)."""
    kinds = set(map(type, items))
    if kinds == {int}:
        return -INT64 <= min(items) and max(items) < INT64
    if kinds == {str}:
        try:
            "".join(items).encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    return False


def _check_scalar(v: Any, at: tuple[Any, ...], k: Any = None) -> None:
    t = type(v)
    if t is str:
        _check_text(v, (*at, k) if k is not None else at)
    elif t is int:
        if not -INT64 <= v < INT64:
            where = _path((*at, k) if k is not None else at) or "the body"
            raise ApiError(f"{where}: the integer {_short(v)} is out of range (64 bits)", param=where)
    elif t is float and not math.isfinite(v):
        where = _path((*at, k) if k is not None else at) or "the body"
        raise ApiError(f"{where}: the number is out of range", param=where)


def _path(at: tuple[Any, ...]) -> str:
    out = ""
    for part in at:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _check_text(text: str, at: tuple[Any, ...], what: str | None = None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = _path(at) or None
        raise ApiError(f"{what or where or 'the body'}: a lone surrogate ({text[e.start]!r}) at character "
                       f"{e.start} is not text (escape pairs must be whole)", param=where) from None


def _short(v: int) -> str:
    s = str(v)
    return s if len(s) <= 24 else f"{s[:10]}...({len(s)} digits)"
