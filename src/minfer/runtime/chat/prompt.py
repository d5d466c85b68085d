"""A chat request made ready to generate: its prompt, the constraint a forced call needs, and the parser
that reads the reply.

:func:`plan_chat` is the one place a chat turn is prepared, for ``Model.chat`` and for every HTTP
endpoint alike:

* **tools through the template.** When the chat template takes ``tools`` (its source uses the
  variable), the tool definitions go to it as transformers' ``apply_chat_template(tools=...)`` passes
  them (OpenAI's ``{"type": "function", "function": {...}}`` items), and assistant ``tool_calls`` in the
  history reach it with their arguments as a dict. The call format is the template's
  (:func:`~minfer.runtime.chat.formats.detect_format`).
* **tools in the system prompt.** Otherwise minfer describes the tools itself
  (:func:`generic_tools_prompt`, appended to the system message or written as one) and the reply is
  read in the ``generic`` format. Assistant calls in the history are written in that format, and
  ``tool`` results become user turns (``get_weather returned: <content>``), which any template can render.
* **tool_choice.** ``auto``: the model decides, its calls are parsed. ``none``: the tools are not shown
  and nothing is parsed. ``required`` / a named function: decoding is constrained (llguidance) to the
  call grammar of the format, every tool's arguments to its schema; one call, or one or more with
  ``parallel_tool_calls`` (a named function: exactly one).
* **reasoning.** With ``reasoning_format="deepseek"`` a ``<think>...</think>`` at the start of the reply
  (or after a prompt that already opened ``<think>``) is the reasoning, split from the content;
  ``"none"`` leaves it in the content. ``template_kwargs`` (``enable_thinking=False``...) reach the template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from minfer.errors import BadRequestError
from minfer.formats.chat_template import ChatTemplate
from minfer.formats.tokenizer import Tokenizer
from minfer.runtime.chat.formats import GENERIC, Generic, ToolFormat, detect_format
from minfer.runtime.chat.output import ChatOutputParser, ReasoningSplitter, ToolCallParser
from minfer.runtime.chat.tools import ToolChoice, ToolSpec
from minfer.runtime.constraints import Constraint

__all__ = ["ChatOptions", "ChatPlan", "plan_chat", "check_messages", "generic_tools_prompt", "REASONING_FORMATS"]

REASONING_FORMATS = ("none", "deepseek")
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatOptions:
    """What a chat request asks beyond its messages and sampling."""

    tools: Sequence[ToolSpec] = ()
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    reasoning_format: str | None = None  # None: "deepseek"

    @property
    def choice(self) -> ToolChoice:
        return self.tool_choice or ToolChoice("auto" if self.tools else "none")


@dataclass
class ChatPlan:
    """One prepared chat turn. ``fmt`` is None when no calls are parsed; ``grammar`` (llguidance Lark)
    is set when a call is forced."""

    prompt: str
    fmt: ToolFormat | None = None
    names: frozenset[str] = frozenset()
    grammar: str | None = None
    reasoning: bool = False
    think_opened: bool = False

    def parser(self) -> ChatOutputParser:
        """A fresh parser for one reply (one per generated sequence)."""
        tools = None
        if self.fmt is not None:
            tools = ToolCallParser(self.fmt, self.names, incremental=self.grammar is not None)
        return ChatOutputParser(tools, ReasoningSplitter(self.think_opened) if self.reasoning else None)

    def constraint(self, tokenizer: Tokenizer) -> Constraint | None:
        """The decoding constraint of a forced call (one per sequence), or None."""
        if self.grammar is None:
            return None
        return Constraint.from_grammar(self.grammar, tokenizer, param="tools")


def generic_tools_prompt(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """The system-prompt text that offers ``tools`` to a model whose template takes none."""
    listing = json.dumps([t.to_openai()["function"] for t in tools], ensure_ascii=False, indent=1)
    many = " (several calls go in the one list)" if parallel else " (one call at a time)"
    return (
        "You can call functions. These are the functions, with their parameters as JSON Schema:\n"
        f"{listing}\n"
        "To call functions, reply with only this JSON object, nothing before or after it"
        f"{many}:\n"
        '{"tool_calls": [{"name": "<function name>", "arguments": {<the arguments>}}]}\n'
        "Otherwise, answer the user in plain text."
    )


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages in OpenAI's shape, checked: a role, string content (or null for an assistant
    message with ``tool_calls``), calls as ``{"id", "type": "function", "function": {"name",
    "arguments"}}`` with arguments a JSON object (text or dict), ``tool`` messages with their content.
    ``developer`` becomes ``system``. Returns plain dicts; errors name the field (``messages[2].tool_calls[0]...``)."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise BadRequestError("messages must be a non-empty list of messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise BadRequestError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in _ROLES:
            raise BadRequestError(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content")
        if content is None and not calls:
            raise BadRequestError(f"{where}.content is required")
        msg["content"] = _content_text(content, where) if content is not None else ""
        if calls:
            msg["tool_calls"] = _check_calls(calls, where)
        if role == "tool":
            cid = m.get("tool_call_id")
            if cid is not None and not isinstance(cid, str):
                raise BadRequestError(f"{where}.tool_call_id must be a string")
            if cid:
                msg["tool_call_id"] = cid
        name = m.get("name")
        if isinstance(name, str) and name:
            msg["name"] = name
        out.append(msg)
    return out


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequestError(f"{where}.content: only text parts are supported, got {part!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequestError(f"{where}.content must be a string or a list of text parts")


def _check_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise BadRequestError(f"{where}.tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise BadRequestError(f"{w} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise BadRequestError(f"{w}.function.arguments is not valid JSON: {e}") from None
        if not isinstance(args, Mapping):
            raise BadRequestError(f"{w}.function.arguments must be a JSON object")
        cid = c.get("id")
        out.append({"id": cid if isinstance(cid, str) else f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": dict(args)}})
    return out


def _with_tool_names(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tool`` messages get the ``name`` of the call they answer (templates that print it need it)."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        for c in m.get("tool_calls", ()):
            names[c["id"]] = c["function"]["name"]
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m = {**m, "name": names[m["tool_call_id"]]}
        out.append(m)
    return out


def _generic_history(messages: list[dict[str, Any]], tools_text: str | None) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = Generic.render_calls([(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]])
            text = m["content"]
            m = {"role": "assistant", "content": f"{text}\n{calls}" if text else calls}
        elif m["role"] == "tool":
            name = m.get("name") or "the function"
            m = {"role": "user", "content": f"{name} returned: {m['content']}"}
        out.append(m)
    if tools_text is not None:
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{tools_text}" if out[0]["content"] else tools_text}
        else:
            out.insert(0, {"role": "system", "content": tools_text})
    return out


def plan_chat(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
              options: ChatOptions | None = None) -> ChatPlan:
    """Render ``messages`` (see :func:`check_messages`) with ``options`` into a :class:`ChatPlan`."""
    options = options or ChatOptions()
    reasoning_format = options.reasoning_format or "deepseek"
    if reasoning_format not in REASONING_FORMATS:
        raise BadRequestError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, "
                              f"got {reasoning_format!r}")
    msgs = _with_tool_names(check_messages(messages))
    choice = options.choice
    offered = list(options.tools) if choice.mode != "none" else []
    if choice.forced and not options.tools:
        raise BadRequestError(f"tool_choice {choice.mode!r} needs tools")
    has_history_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in msgs)
    kwargs = dict(options.template_kwargs)
    for reserved in ("messages", "add_generation_prompt", "tools"):
        kwargs.pop(reserved, None)
    fmt: ToolFormat | None
    if template.takes_tools:
        fmt = detect_format(template.source, lambda text: _single_token(tokenizer, text) is not None)
        tools_arg = [t.to_openai() for t in offered] or None
        prompt = template.render(msgs, add_generation_prompt=True, tools=tools_arg, **kwargs)
    else:
        fmt = GENERIC
        if offered or has_history_calls:
            tools_text = generic_tools_prompt(offered, options.parallel_tool_calls) if offered else None
            msgs = _generic_history(msgs, tools_text)
        prompt = template.render(msgs, add_generation_prompt=True, **kwargs)
    plan = ChatPlan(prompt, reasoning=reasoning_format == "deepseek",
                    think_opened=prompt.rstrip().endswith(ReasoningSplitter.OPEN))
    if offered:
        forced = [t for t in offered if t.name == choice.name] if choice.mode == "function" else offered
        plan.fmt, plan.names = fmt, frozenset(t.name for t in forced)
        if choice.forced:
            def ref(text: str) -> str:
                token = _single_token(tokenizer, text)
                return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)

            plan.grammar = fmt.grammar(forced, options.parallel_tool_calls and choice.mode == "required", ref)
    return plan


def _single_token(tokenizer: Tokenizer, text: str) -> int | None:
    """The id of ``text`` when the vocabulary has it as one token of its own (a marker like ``<tool_call>``)."""
    ids = tokenizer.encode(text, add_special=False)
    return ids[0] if len(ids) == 1 and tokenizer.token_text(ids[0]) == text else None
