"""Reading JSON text that may still be arriving: where a value ends, and an object's members with their spans.

The tool-call parsers read a model's output a few characters at a time. They need to know, before the
text is complete, whether it can still be a call (a ``{`` whose first key is ``"name"``), the function's
name as soon as its string closes, and the exact text of the arguments value (streamed as it grows, and
handed to the client verbatim). ``json.loads`` gives none of that on a prefix; these functions do, and
leave the final word on validity to ``json.loads`` on the completed text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

__all__ = ["Malformed", "Member", "ObjectScan", "skip_ws", "value_end", "read_object", "read_array"]

_WS = " \t\n\r"
_LITERAL = re.compile(r"-?[0-9][0-9.eE+\-]*|true|false|null")
_LITERAL_CHARS = set("0123456789.eE+-truefalsn")


class Malformed(ValueError):
    """The text cannot be (the beginning of) the JSON the reader expects."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The index after the string opening at ``text[i]`` (a ``"``), or None if the text ends inside it."""
    j = i + 1
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == '"':
            return j + 1
        if ch < " ":
            raise Malformed(f"a raw control character in a JSON string at offset {j}")
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at ``text[i]``, or None when the text ends before it does.

    Containers are matched by depth outside strings (a mismatched bracket is left to ``json.loads``);
    a number at the very end of the text is incomplete, since more digits may follow.
    """
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] in _LITERAL_CHARS:
        j += 1
    if j == i:
        raise Malformed(f"no JSON value at offset {i}: {text[i:i + 20]!r}")
    if j == len(text):
        if not any(w.startswith(text[i:j]) for w in ("true", "false", "null")) and not _LITERAL.fullmatch(text[i:j]):
            raise Malformed(f"not a JSON value at offset {i}: {text[i:j]!r}")
        return None
    if not _LITERAL.fullmatch(text[i:j]):
        raise Malformed(f"not a JSON value at offset {i}: {text[i:j]!r}")
    return j


@dataclass
class Member:
    """One ``"key": value`` of an object: the value spans ``text[start:end]`` (``end`` None: still arriving)."""

    key: str
    start: int
    end: int | None


@dataclass
class ObjectScan:
    members: list[Member] = field(default_factory=list)
    end: int | None = None  # the index after the closing brace; None: the object is still open

    def get(self, *keys: str) -> Member | None:
        for m in self.members:
            if m.key in keys:
                return m
        return None


def read_object(text: str, i: int) -> ObjectScan:
    """The members of the object opening at ``text[i]`` as far as the text goes.

    Raises :class:`Malformed` as soon as the text cannot be a JSON object.
    """
    if i >= len(text) or text[i] != "{":
        raise Malformed(f"expected '{{' at offset {i}")
    scan = ObjectScan()
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        scan.end = j + 1
        return scan
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return scan
        if text[j] != '"':
            raise Malformed(f"expected a key at offset {j}")
        kend = _string_end(text, j)
        if kend is None:
            return scan
        key = json.loads(text[j:kend])
        j = skip_ws(text, kend)
        if j >= len(text):
            return scan
        if text[j] != ":":
            raise Malformed(f"expected ':' at offset {j}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return scan
        end = value_end(text, j)
        scan.members.append(Member(key, j, end))
        if end is None:
            return scan
        j = skip_ws(text, end)
        if j >= len(text):
            return scan
        if text[j] == ",":
            j += 1
        elif text[j] == "}":
            scan.end = j + 1
            return scan
        else:
            raise Malformed(f"expected ',' or '}}' at offset {j}")


def read_array(text: str, i: int) -> tuple[list[int], int | None]:
    """The start offsets of the items of the array opening at ``text[i]``, and the index after its
    closing bracket (None while it is open). Items are skipped with :func:`value_end`."""
    if i >= len(text) or text[i] != "[":
        raise Malformed(f"expected '[' at offset {i}")
    starts: list[int] = []
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "]":
        return starts, j + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return starts, None
        starts.append(j)
        end = value_end(text, j)
        if end is None:
            return starts, None
        j = skip_ws(text, end)
        if j >= len(text):
            return starts, None
        if text[j] == ",":
            j += 1
        elif text[j] == "]":
            return starts, j + 1
        else:
            raise Malformed(f"expected ',' or ']' at offset {j}")
