"""The ways models write tool calls: how to find a call in a reply, and the grammar that forces one.

Each :class:`ToolFormat` knows the text that opens a call (its *triggers*, or a ``{`` as the first
thing in the reply), how to read the calls from the text after it while it is still arriving
(:meth:`ToolFormat.scan`), and the llguidance Lark grammar that allows exactly a call of the offered
tools, arguments valid under each tool's JSON Schema (:meth:`ToolFormat.grammar`).

The formats:

* ``hermes`` (Hermes 2 Pro, Qwen 2.5/3, and most templates derived from them):
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call, text before;
* ``llama3`` (Llama 3.1-3.3's JSON tool calling): the reply is ``{"name": "f", "parameters": {...}}``,
  possibly after ``<|python_tag|>``, several separated by ``;``;
* ``mistral`` (Mistral 7B v0.3, Mistral Small 3.1, Mixtral): ``[TOOL_CALLS][{"name": "f", "arguments": {...}}]``;
* ``mistral-args`` (Mistral Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]f[ARGS]{...}``, repeated for more calls
  (the list form is read too);
* ``generic`` (models whose template takes no tools; minfer describes the tools in the system prompt,
  see :func:`minfer.runtime.chat.prompt.generic_tools_prompt`): the reply is only
  ``{"tool_calls": [{"name": "f", "arguments": {...}}]}`` (``{"tool_call": {...}}`` is read too).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from minfer.runtime.chat.json_scan import Malformed, ObjectScan, read_array, read_object, skip_ws, value_end
from minfer.runtime.chat.tools import ToolSpec, new_call_id

__all__ = ["RawCall", "RegionScan", "ToolFormat", "FORMATS", "detect_format", "JSON_WS"]

# JSON whitespace inside forced calls: as the constraints module bounds it for response_format
JSON_WS = r"(?: |\n{1,2}[ \t]{0,20})"

TokenRef = Callable[[str], str]  # marker text -> a Lark atom (the single special token where there is one)


@dataclass
class RawCall:
    """A call as read so far: ``name`` once its string has closed, ``arguments`` the raw text of the
    arguments value (all of it once ``complete``)."""

    name: str | None
    arguments: str | None
    complete: bool
    id: str | None = None


@dataclass
class RegionScan:
    """The calls read from a call region; ``end``: the offset where the region ends (None: still open)."""

    calls: list[RawCall] = field(default_factory=list)
    end: int | None = None


def _call_from(text: str, obj: ObjectScan, arg_keys: tuple[str, ...]) -> RawCall:
    name = None
    m = obj.get("name")
    if m is not None and m.end is not None:
        name = json.loads(text[m.start:m.end])
        if not isinstance(name, str):
            raise Malformed("the function name is not a string")
    a = obj.get(*arg_keys)
    args = None if a is None else text[a.start:a.end] if a.end is not None else text[a.start:]
    complete = obj.end is not None
    if complete:
        if name is None:
            raise Malformed("a call without a name")
        if args is None:
            args = "{}"
    cid = None
    i = obj.get("id")
    if complete and i is not None and i.end is not None:
        value = json.loads(text[i.start:i.end])
        cid = value if isinstance(value, str) and value else None
    return RawCall(name, args, complete, cid)


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _schema(properties: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object that lists ``properties`` and says
    nothing of others: a forced call writes the declared arguments only (as llama.cpp's grammars and
    OpenAI's strict mode do). Left open, small models keep inventing properties until ``max_tokens``."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties"):
            out[key] = {k: closed(v) for k, v in value.items()} if isinstance(value, dict) else value
        elif key in ("items", "anyOf", "oneOf", "allOf", "prefixItems", "additionalProperties", "not"):
            out[key] = closed(value)
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json_rule(schema: Any) -> str:
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {"whitespace_pattern": JSON_WS, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


class ToolFormat:
    """One way of writing tool calls (see the module docstring)."""

    name = ""
    triggers: tuple[str, ...] = ()
    at_start = False  # a '{' as the first thing in the reply opens a call region

    def scan(self, text: str, final: bool) -> RegionScan:
        """The calls in ``text`` (from just after the trigger; from the ``{`` for ``at_start``).
        ``final``: no more text comes. Raises :class:`Malformed` when the text is no call."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool, ref: TokenRef) -> str:
        """An llguidance Lark grammar for a reply that is one call of ``tools`` (one or more with ``parallel``)."""
        raise NotImplementedError

    def new_id(self) -> str:
        return new_call_id()

    def __repr__(self) -> str:
        return f"ToolFormat({self.name!r})"


def _call_rules(tools: Sequence[ToolSpec], args_key: str) -> tuple[str, list[str]]:
    rules = []
    for i, t in enumerate(tools):
        schema = _schema({"name": {"const": t.name}, args_key: closed(dict(t.parameters))}, ["name", args_key])
        rules.append(f"call_{i}: {_json_rule(schema)}")
    return " | ".join(f"call_{i}" for i in range(len(tools))), rules


class Hermes(ToolFormat):
    name = "hermes"
    triggers = ("<tool_call>",)
    close = "</tool_call>"

    def scan(self, text: str, final: bool) -> RegionScan:
        i = skip_ws(text, 0)
        if i >= len(text):
            if final:
                raise Malformed("an empty <tool_call>")
            return RegionScan()
        obj = read_object(text, i)
        call = _call_from(text, obj, ("arguments", "parameters"))
        if obj.end is None:
            if final:
                raise Malformed("the call's JSON is incomplete")
            return RegionScan([call])
        j = skip_ws(text, obj.end)
        rest = text[j:]
        if rest.startswith(self.close):
            return RegionScan([call], j + len(self.close))
        if not rest and final:  # the reply ended before the closing tag: the call itself is whole
            return RegionScan([call], j)
        if self.close.startswith(rest) and not final:
            return RegionScan([call])
        raise Malformed(f"text after the call where {self.close} belongs")

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool, ref: TokenRef) -> str:
        alts, rules = _call_rules(tools, "arguments")
        block = f'{ref("<tool_call>")} "\\n" call "\\n" {ref("</tool_call>")}'
        start = 'block ("\\n" block)*' if parallel else "block"
        return "\n".join(["%llguidance {}", f"start: {start}", f"block: {block}", f"call: {alts}", *rules]) + "\n"


class Llama3(ToolFormat):
    name = "llama3"
    triggers = ("<|python_tag|>",)
    at_start = True
    _first_keys = ("name", "type", "function", "parameters", "arguments")

    def scan(self, text: str, final: bool) -> RegionScan:
        out = RegionScan()
        j = skip_ws(text, 0)
        while True:
            if j >= len(text):
                if final:
                    if not out.calls:
                        raise Malformed("no call")
                    out.end = j
                return out
            obj = read_object(text, j)
            if obj.members and obj.members[0].key not in self._first_keys:
                raise Malformed("a JSON object that is not a call")
            # {"type": "function", "function": {"name", "parameters"}}, as some fine-tunes write it
            f = obj.get("function")
            if f is not None:
                if text[f.start] != "{":
                    raise Malformed("'function' is not an object")
                call = _call_from(text, read_object(text, f.start), ("parameters", "arguments"))
                call.complete = call.complete and obj.end is not None
            else:
                call = _call_from(text, obj, ("parameters", "arguments"))
            out.calls.append(call)
            if obj.end is None:
                if final:
                    raise Malformed("the call's JSON is incomplete")
                return out
            j = skip_ws(text, obj.end)
            if j < len(text) and text[j] == ";":
                j = skip_ws(text, j + 1)
            elif j < len(text) and text[j] != "{":
                out.end = j
                return out

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool, ref: TokenRef) -> str:
        alts, rules = _call_rules(tools, "parameters")
        start = 'call ("; " call)*' if parallel else "call"
        return "\n".join(["%llguidance {}", f"start: {start}", f"call: {alts}", *rules]) + "\n"


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class Mistral(ToolFormat):
    """``[TOOL_CALLS]`` followed by a JSON list of calls, or (``args_form``) by ``name[ARGS]{...}``."""

    triggers = ("[TOOL_CALLS]",)

    def __init__(self, args_form: bool) -> None:
        self.args_form = args_form
        self.name = "mistral-args" if args_form else "mistral"

    def new_id(self) -> str:
        # Mistral's templates refuse other ids in the history: nine letters and digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def scan(self, text: str, final: bool) -> RegionScan:
        i = skip_ws(text, 0)
        if i >= len(text):
            if final:
                raise Malformed("nothing after [TOOL_CALLS]")
            return RegionScan()
        if text[i] == "[" and not text.startswith("[ARGS]", i) and not text.startswith("[CALL_ID]", i):
            return self._scan_list(text, i, final)
        return self._scan_args(text, i, final)

    def _scan_list(self, text: str, i: int, final: bool) -> RegionScan:
        starts, end = read_array(text, i)
        out = RegionScan(end=end)
        for s in starts:
            obj = read_object(text, s)
            out.calls.append(_call_from(text, obj, ("arguments", "parameters")))
        if end is None and final:
            raise Malformed("the call list is incomplete")
        return out

    def _scan_args(self, text: str, i: int, final: bool) -> RegionScan:
        m = _MISTRAL_NAME.match(text, i)
        assert m is not None
        name, j = m.group(), m.end()
        cid = None
        rest = text[j:]
        if rest.startswith("[CALL_ID]"):
            k = text.find("[ARGS]", j)
            if k < 0:
                if final:
                    raise Malformed("[CALL_ID] without [ARGS]")
                return RegionScan([RawCall(None, None, False)])
            cid, j = text[j + len("[CALL_ID]"):k].strip() or None, k
            rest = text[j:]
        if not rest.startswith("[ARGS]"):
            if final or not ("[ARGS]".startswith(rest) or "[CALL_ID]".startswith(rest)):
                raise Malformed("a function name not followed by [ARGS]")
            return RegionScan([RawCall(None, None, False)])
        if not name:
            raise Malformed("[ARGS] without a function name")
        s = skip_ws(text, j + len("[ARGS]"))
        if s >= len(text):
            if final:
                raise Malformed("no arguments after [ARGS]")
            return RegionScan([RawCall(name, None, False, cid)])
        end = value_end(text, s)
        if end is None:
            if final:
                raise Malformed("the arguments are incomplete")
            return RegionScan([RawCall(name, text[s:], False, cid)])
        return RegionScan([RawCall(name, text[s:end], True, cid)], end)

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool, ref: TokenRef) -> str:
        tc = ref("[TOOL_CALLS]")
        if self.args_form:
            args = ref("[ARGS]")
            rules = [f"call_{i}: {_lark_str(t.name)} {args} args_{i}\n"
                     f"args_{i}: {_json_rule(closed(dict(t.parameters)))}" for i, t in enumerate(tools)]
            alts = " | ".join(f"call_{i}" for i in range(len(tools)))
            start = "block+" if parallel else "block"
            return "\n".join(["%llguidance {}", f"start: {start}", f"block: {tc} call", f"call: {alts}", *rules]) + "\n"
        items = [_schema({"name": {"const": t.name}, "arguments": closed(dict(t.parameters))}, ["name", "arguments"])
                 for t in tools]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        return "\n".join(["%llguidance {}", f"start: {tc} calls", f"calls: {_json_rule(array)}"]) + "\n"


class Generic(ToolFormat):
    name = "generic"
    at_start = True

    def scan(self, text: str, final: bool) -> RegionScan:
        obj = read_object(text, 0)
        out = RegionScan(end=obj.end)
        if obj.members:
            first = obj.members[0]
            if first.key not in ("tool_calls", "tool_call"):
                raise Malformed("a JSON object that is not a call")
            if first.start < len(text):
                if first.key == "tool_call":
                    out.calls.append(_call_from(text, read_object(text, first.start), ("arguments", "parameters")))
                else:
                    starts, _ = read_array(text, first.start)
                    for s in starts:
                        out.calls.append(_call_from(text, read_object(text, s), ("arguments", "parameters")))
            if len(obj.members) > 1:
                raise Malformed("more than the tool calls in the reply object")
        if obj.end is not None and not out.calls:
            raise Malformed("no call in the reply object")
        if obj.end is None and final:
            raise Malformed("the reply object is incomplete")
        return out

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool, ref: TokenRef) -> str:
        items = [_schema({"name": {"const": t.name}, "arguments": closed(dict(t.parameters))}, ["name", "arguments"])
                 for t in tools]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        reply = _schema({"tool_calls": array}, ["tool_calls"])
        return f"%llguidance {{}}\nstart: {_json_rule(reply)}\n"

    @staticmethod
    def render_calls(calls: Sequence[tuple[str, Any]]) -> str:
        """An assistant turn's calls as this format writes them (for the history of a template without tools)."""
        return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]}, ensure_ascii=False)


HERMES = Hermes()
LLAMA3 = Llama3()
MISTRAL = Mistral(args_form=False)
MISTRAL_ARGS = Mistral(args_form=True)
GENERIC = Generic()
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS, GENERIC)}


def detect_format(template_source: str | None, has_token: Callable[[str], bool]) -> ToolFormat:
    """The format of a model whose chat template takes ``tools``: from the markers the template writes
    (``<tool_call>``, ``[TOOL_CALLS]`` with or without ``[ARGS]``, ``<|python_tag|>`` or Llama 3's
    header tokens), else from the vocabulary's tokens, else ``hermes`` (the most common)."""
    src = template_source or ""
    if "<tool_call>" in src:
        return HERMES
    if "[TOOL_CALLS]" in src:
        return MISTRAL_ARGS if "[ARGS]" in src else MISTRAL
    if "<|python_tag|>" in src or "<|start_header_id|>" in src:
        return LLAMA3
    if has_token("<tool_call>"):
        return HERMES
    if has_token("[TOOL_CALLS]"):
        return MISTRAL_ARGS if has_token("[ARGS]") else MISTRAL
    if has_token("<|python_tag|>"):
        return LLAMA3
    return HERMES
