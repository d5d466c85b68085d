"""A chat reply's text, split as it arrives into content, reasoning and tool calls.

:class:`ChatOutputParser` takes the generated text piece by piece (``feed``, then ``finish``) and
returns :data:`ChatDelta` events: :class:`ContentDelta`, :class:`ReasoningDelta`,
:class:`ToolCallStart` (index, id, name) and :class:`ToolCallDelta` (a fragment of that call's
arguments). The whole reply is the same events gathered (:class:`MessageBuilder`), so a streamed
reply assembles to exactly the one answered at once.

What is held back, and why:

* text that may be the start of a call marker (``<tool_`` at the end of what arrived) or of
  ``</think>``, until the next piece says;
* whitespace at the end of the content, dropped if a call follows (``"Sure.\\n\\n<tool_call>..."``
  gives the content ``"Sure."``);
* a call, until it is complete and valid (its name one of the tools, its arguments a JSON object),
  unless decoding was constrained to the call grammar (``incremental``: the output then cannot be
  malformed, so the name goes out as soon as it is read and the arguments as they are written).
  A malformed call, or one of an unknown function, is content: the reply's text from the call marker on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from minfer.runtime.chat.formats import RegionScan, ToolFormat
from minfer.runtime.chat.json_scan import Malformed, skip_ws
from minfer.runtime.chat.tools import ToolCall

__all__ = ["ContentDelta", "ReasoningDelta", "ToolCallStart", "ToolCallDelta", "ChatDelta", "ChatMessage",
           "MessageBuilder", "ToolCallParser", "ReasoningSplitter", "ChatOutputParser"]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """Call number ``index`` of the reply begins: its id and function name (arguments follow as deltas)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str


ChatDelta = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallDelta


@dataclass
class ChatMessage:
    """The whole reply: ``content`` is None when there is none (a reply of only tool calls)."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        """The assistant message as OpenAI's chat completion writes it."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return out


class MessageBuilder:
    """Gathers deltas into a :class:`ChatMessage`."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def add(self, deltas: Iterable[ChatDelta]) -> None:
        for d in deltas:
            if isinstance(d, ContentDelta):
                self.content.append(d.text)
            elif isinstance(d, ReasoningDelta):
                self.reasoning.append(d.text)
            elif isinstance(d, ToolCallStart):
                assert d.index == len(self.calls)
                self.calls.append(ToolCall(d.id, d.name, ""))
            else:
                self.calls[d.index].arguments += d.arguments

    def message(self) -> ChatMessage:
        content = "".join(self.content)
        reasoning = "".join(self.reasoning)
        return ChatMessage(content if content or not self.calls else None, reasoning or None, list(self.calls))


def _partial_suffix(text: str, markers: Iterable[str]) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of one of ``markers``."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


@dataclass
class _Call:
    id: str
    name: str
    sent: str = ""  # argument text already handed out


class ToolCallParser:
    """Finds the calls of one format in content text (see the module docstring).

    ``names``: the functions the reply may call (others are content); ``incremental``: decoding was
    constrained to the call grammar, so calls stream as they are written.
    """

    def __init__(self, fmt: ToolFormat, names: Iterable[str], incremental: bool = False) -> None:
        self.fmt = fmt
        self.names = frozenset(names)
        self.incremental = incremental
        self._buf = ""
        self._pos = 0  # text before this has been handed out (or dropped)
        self._mode = "text"  # "text", "call" (inside a call region) or "plain" (the rest is content)
        self._region = 0  # where the current region's calls begin (just after its marker)
        self._base = 0  # calls made by earlier regions
        self._ws = ""  # whitespace held at the end of the content
        self._seen_text = False
        self._calls: list[_Call] = []

    @property
    def made_calls(self) -> bool:
        return bool(self._calls)

    def feed(self, text: str) -> list[ChatDelta]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[ChatDelta]:
        out = self._drain(final=True)
        if self._ws and not self._calls:
            out.append(ContentDelta(self._ws))
        self._ws = ""
        return out

    def _content(self, text: str, out: list[ChatDelta], before_call: bool = False) -> None:
        text, self._ws = self._ws + text, ""
        body = text.rstrip()
        if not before_call:
            self._ws = text[len(body):]
        if body:
            out.append(ContentDelta(body))
            self._seen_text = True

    def _drain(self, final: bool) -> list[ChatDelta]:
        out: list[ChatDelta] = []
        while True:
            if self._mode == "plain":
                self._content(self._buf[self._pos:], out)
                self._pos = len(self._buf)
                return out
            if self._mode == "text":
                if not self._text(out, final):
                    return out
            elif not self._call(out, final):
                return out

    def _text(self, out: list[ChatDelta], final: bool) -> bool:
        """Content up to the next call marker; True when a call region begins."""
        seg = self._buf[self._pos:]
        found: tuple[int, int] | None = None
        for t in self.fmt.triggers:
            k = seg.find(t)
            if k >= 0 and (found is None or k < found[0]):
                found = (k, len(t))
        if self.fmt.at_start and not self._seen_text and not self._calls:
            k = skip_ws(seg, 0)
            if k < len(seg) and seg[k] == "{" and (found is None or k < found[0]):
                found = (k, 0)
            elif k == len(seg) and not final:
                return False  # only whitespace so far: it may still open with '{'
        if found is not None:
            k, n = found
            self._content(seg[:k], out, before_call=True)
            self._pos += k
            self._region = self._pos + n
            self._mode = "call"
            return True
        hold = 0 if final else _partial_suffix(seg, self.fmt.triggers)
        self._content(seg[:len(seg) - hold], out)
        self._pos += len(seg) - hold
        return False

    def _call(self, out: list[ChatDelta], final: bool) -> bool:
        """Read the open call region; True when it ended (the text after it is read next)."""
        try:
            scan = self.fmt.scan(self._buf[self._region:], final)
            if self.incremental:
                self._stream(scan, out)
        except Malformed:
            scan = None
        if scan is None:
            if self.incremental and len(self._calls) > self._base:
                # constrained output cut short (max_tokens): the calls stay as far as they were written
                self._pos = len(self._buf)
                return False
            self._mode = "plain"
            return True
        if scan.end is None:
            return False
        if not self.incremental:
            calls = self._validated(scan)
            if calls is None:
                self._mode = "plain"
                return True
            for rc in calls:
                assert rc.name is not None and rc.arguments is not None
                index = len(self._calls)
                self._calls.append(_Call(rc.id or self.fmt.new_id(), rc.name, rc.arguments))
                out.append(ToolCallStart(index, self._calls[-1].id, rc.name))
                out.append(ToolCallDelta(index, rc.arguments))
        self._base = len(self._calls)
        self._pos = self._region + scan.end
        self._mode = "text"
        return True

    def _validated(self, scan: RegionScan) -> list[Any] | None:
        for rc in scan.calls:
            if rc.name not in self.names or rc.arguments is None:
                return None
            try:
                if not isinstance(json.loads(rc.arguments), dict):
                    return None
            except json.JSONDecodeError:
                return None
        return scan.calls

    def _stream(self, scan: RegionScan, out: list[ChatDelta]) -> None:
        for k, rc in enumerate(scan.calls):
            index = self._base + k
            if index == len(self._calls):
                if rc.name is None:
                    return
                if rc.name not in self.names:
                    raise Malformed(f"a call of {rc.name!r}, which is not among the tools")
                self._calls.append(_Call(rc.id or self.fmt.new_id(), rc.name))
                out.append(ToolCallStart(index, self._calls[index].id, rc.name))
            call = self._calls[index]
            if rc.arguments is not None and len(rc.arguments) > len(call.sent) and rc.arguments.startswith(call.sent):
                out.append(ToolCallDelta(index, rc.arguments[len(call.sent):]))
                call.sent = rc.arguments


class ReasoningSplitter:
    """``<think>...</think>`` at the start of a reply (or after a prompt that opened ``<think>``) as
    reasoning; the rest as content. Whitespace around the reasoning is dropped."""

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, opened: bool = False) -> None:
        self._state = "reasoning_start" if opened else "start"
        self._buf = ""
        self._ws = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        """``(kind, text)`` pieces, kind "reasoning" or "content"."""
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            buf = self._buf
            if self._state == "start":
                s = buf.lstrip()
                if s.startswith(self.OPEN):
                    self._buf, self._state = s[len(self.OPEN):], "reasoning_start"
                elif self.OPEN.startswith(s) and not final:
                    return out
                else:
                    self._state = "content"
            elif self._state in ("reasoning_start", "content_start"):
                s = buf.lstrip()
                if not s and not final:
                    self._buf = ""
                    return out
                self._buf = s
                self._state = "reasoning" if self._state == "reasoning_start" else "content"
            elif self._state == "reasoning":
                k = buf.find(self.CLOSE)
                if k >= 0:
                    body = buf[:k].rstrip()
                    if body:
                        out.append(("reasoning", self._ws + body))
                    self._ws = ""
                    self._buf, self._state = buf[k + len(self.CLOSE):], "content_start"
                    continue
                hold = 0 if final else _partial_suffix(buf, (self.CLOSE,))
                text_ = buf[:len(buf) - hold]
                body = text_ if final else text_.rstrip()
                if body:
                    out.append(("reasoning", self._ws + body))
                    self._ws = ""
                self._ws += text_[len(body):]
                self._buf = buf[len(buf) - hold:]
                return out
            else:
                if buf:
                    out.append(("content", buf))
                self._buf = ""
                return out


class ChatOutputParser:
    """The reply's text -> :data:`ChatDelta` events: reasoning first (when ``reasoning``), then content
    with the tool calls of ``tools`` (a :class:`ToolCallParser`, or None when no calls are parsed)."""

    def __init__(self, tools: ToolCallParser | None = None, reasoning: ReasoningSplitter | None = None) -> None:
        self.tools = tools
        self.reasoning = reasoning

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.made_calls

    def feed(self, text: str) -> list[ChatDelta]:
        return self._route(self.reasoning.feed(text) if self.reasoning else [("content", text)], final=False)

    def finish(self) -> list[ChatDelta]:
        return self._route(self.reasoning.feed("", final=True) if self.reasoning else [], final=True)

    def _route(self, pieces: list[tuple[str, str]], final: bool) -> list[ChatDelta]:
        out: list[ChatDelta] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(ReasoningDelta(text))
            elif self.tools is not None:
                out.extend(self.tools.feed(text))
            elif text:
                out.append(ContentDelta(text))
        if final and self.tools is not None:
            out.extend(self.tools.finish())
        return out

    def parse(self, text: str) -> ChatMessage:
        """The whole reply at once (the same events as feeding it piece by piece)."""
        b = MessageBuilder()
        b.add(self.feed(text))
        b.add(self.finish())
        return b.message()
