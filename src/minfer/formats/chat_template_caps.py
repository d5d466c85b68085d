"""What a chat template can render, as llama.cpp reports it (``/props``' ``chat_template_caps``): each capability
is probed on llama.cpp's probe conversations (``common/jinja/caps.cpp``), by rendering and looking for a marker in
the text. llama.cpp's own Jinja engine watches which values the template reads; seeing what it writes is what a
Python template engine observes, and agrees wherever the template shows what it reads. A template that fails on
a probe (minfer's sandbox refuses some that llama.cpp's engine runs) lacks what it probes: the caps say what
minfer can render."""

from __future__ import annotations

from typing import Any

from minfer.formats.chat_template import ChatTemplate

_MARK = "\u2063minfer-cap\u2063"  # an invisible separator no real conversation holds
_TOOL, _FIRST, _SECOND, _ARG = (f"{_MARK}{w}" for w in ("tool", "first", "second", "arg"))


def _user(content: Any = "User message") -> dict[str, Any]:
    return {"role": "user", "content": content}


def _call(name: str, arguments: Any, call_id: str = "call00001") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_turn(*calls: dict[str, Any]) -> list[dict[str, Any]]:
    """llama.cpp's probe: a user turn, the assistant's calls, the tool's answer, the assistant's reply, a user turn."""
    return [_user(), {"role": "assistant", "content": "", "tool_calls": list(calls)},
            {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "The tool response was 'tool response'"}, _user()]


_TOOLS = [{"name": "tool", "type": "function", "function": {
    "name": _TOOL, "description": "Tool description",
    "parameters": {"type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
                   "required": ["arg"]}}}]


def _renders(template: ChatTemplate, messages: list[dict[str, Any]], **variables: Any) -> str:
    return template.probe(messages, **variables) or ""


def template_caps(template: ChatTemplate) -> dict[str, bool]:
    """llama.cpp's ``chat_template_caps`` of ``template``: the same keys, each probed by rendering."""
    string = _renders(template, [_user(_MARK)])
    typed = _renders(template, [_user([{"type": "text", "text": _MARK}])])
    # a template that prints a list of parts as it is shows the marker inside the list's text: not typed content
    typed_ok = _MARK in typed and "'text':" not in typed and '"text":' not in typed
    system = _renders(template, [{"role": "system", "content": _MARK}, _user()])
    with_object = _renders(template, _tool_turn(_call(_FIRST, {"arg": _ARG})), tools=_TOOLS)
    object_arguments = _FIRST in with_object and _ARG in with_object
    calls = with_object if object_arguments else _renders(template, _tool_turn(_call(_FIRST, '{"arg": "value"}')),
                                                          tools=_TOOLS)
    arguments: Any = {"arg": "value"} if object_arguments else '{"arg": "value"}'
    parallel = _renders(template, _tool_turn(_call(_FIRST, arguments), _call(_SECOND, arguments, "call00002")),
                        tools=_TOOLS)
    reasoning = [_user(), {"role": "assistant", "content": "Assistant message", "reasoning_content": _MARK}, _user(),
                 {"role": "assistant", "content": "Assistant message", "reasoning_content": "Reasoning content"},
                 _user()]
    kept = _renders(template, reasoning, enable_thinking=True, preserve_thinking=True, clear_thinking=False,
                    truncate_history_thinking=False, drop_thinking=False)
    return {
        "supports_string_content": _MARK in string,
        "supports_typed_content": typed_ok,
        "supports_system_role": _MARK in system,
        "supports_tools": _TOOL in calls,
        "supports_tool_calls": _FIRST in calls,
        "supports_object_arguments": object_arguments,
        "supports_parallel_tool_calls": _FIRST in parallel and _SECOND in parallel,
        "supports_preserve_reasoning": _MARK in kept,
        "supports_reasoning_effort": bool({"reasoning_effort", "reasoning_strength"} & template.variables),
    }
