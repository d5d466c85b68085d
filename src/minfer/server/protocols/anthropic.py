"""Anthropic's Messages API (``POST /v1/messages``) translated to and from the chat request the engine runs.

The request side turns ``system`` (a string or text blocks), ``messages`` (text, ``image`` (base64 sources),
``tool_use`` and ``tool_result`` blocks), ``tools`` (``input_schema``) and ``tool_choice`` (``auto`` / ``any`` /
``tool`` / ``none``) into an OpenAI chat-completions body for :func:`minfer.server.protocols.openai.parse_chat`;
every field is checked here first so a 400 names it as the caller wrote it (``messages[1].content[0].tool_use_id``).
A ``tool_result`` block becomes a ``tool`` message, a ``tool_use`` block an assistant ``tool_calls``
entry. A last ``assistant`` message is a prefill: the reply continues it (and does not repeat it).

The answer side is :class:`MessageBuilder`: fed the turn's events it yields Anthropic's stream events
(``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``) and holds the final message, so streamed and whole answers agree by construction.
Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}`` bodies
(:func:`minfer.server.errors.anthropic_error_body`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from minfer.runtime.vision import ImageInput
from minfer.server.errors import ApiError
from minfer.server.protocols.images import MEDIA_MARKER, image_from_part
from minfer.server.protocols.openai import ChatRequest
from minfer.server.translated_chat import parse_translated_chat

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


@dataclass
class MessagesRequest:
    chat: ChatRequest  # what the engine runs
    prefill: str  # the text of a last assistant message, which the reply continues


def _err(message: str, param: str) -> ApiError:
    return ApiError(f"{param}: {message}", param=param)


def _text_blocks(content: Any, where: str) -> str:
    """A string, or a list of text blocks (``system``, a ``tool_result``'s content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _err("must be a string or a list of text blocks", where)
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, Mapping) else None
            raise _err(f"only text blocks are supported here, got {kind!r}", f"{where}[{j}]")
        if not isinstance(block.get("text"), str):
            raise _err("'text' must be a string", f"{where}[{j}].text")
        parts.append(block["text"])
    return "".join(parts)


def _tool_result_content(content: Any, where: str, images: list[ImageInput]) -> str:
    """A ``tool_result``'s content: a string, or text and ``image`` blocks (a screenshot tool's answer); each
    image's place in the text is a media marker, its image added to ``images`` (a model without vision
    answers a 400 naming the block when the prompt is made)."""
    if not isinstance(content, list):
        return _text_blocks(content, where)
    parts = []
    for j, block in enumerate(content):
        if isinstance(block, Mapping) and block.get("type") == "image":
            images.append(image_from_part(block, f"{where}[{j}]"))
            parts.append(MEDIA_MARKER)
        else:
            parts.append(_text_block(block, f"{where}[{j}]"))
    return "".join(parts)


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, Mapping) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, Mapping) else None
        raise _err(f"only text and image blocks are supported here, got {kind!r}", where)
    if not isinstance(block.get("text"), str):
        raise _err("'text' must be a string", f"{where}.text")
    return block["text"]


def _messages(value: Any, images: list[ImageInput]) -> tuple[list[tuple[dict[str, Any], str]], str]:
    """The chat messages (each with the path it came from) and the assistant prefill, if any; the image blocks'
    images are added to ``images`` in order, each one's place in its message's text a media marker."""
    if not isinstance(value, list) or not value:
        raise _err("must be a non-empty list of messages", "messages")
    out: list[tuple[dict[str, Any], str]] = []
    tool_uses: set[str] = set()
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise _err("must be an object with 'role' and 'content'", where)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise _err(f"'role' must be 'user' or 'assistant', got {role!r}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append(({"role": role, "content": content}, where))
            continue
        if not isinstance(content, list):
            raise _err("must be a string or a list of content blocks", f"{where}.content")
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[tuple[dict[str, Any], str]] = []
        # the tool results come before the message's own text once translated: their images first too
        result_images: list[ImageInput] = []
        text_images: list[ImageInput] = []
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(block, Mapping):
                raise _err("must be an object with a 'type'", at)
            kind = block.get("type")
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise _err("'text' must be a string", f"{at}.text")
                text.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                tid, name, args = block.get("id"), block.get("name"), block.get("input")
                if not isinstance(tid, str) or not tid:
                    raise _err("'id' must be a non-empty string", f"{at}.id")
                if not isinstance(name, str) or not name:
                    raise _err("'name' must be a non-empty string", f"{at}.name")
                if not isinstance(args, Mapping):
                    raise _err("'input' must be an object", f"{at}.input")
                tool_uses.add(tid)
                calls.append({"id": tid, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                tid = block.get("tool_use_id")
                if not isinstance(tid, str) or tid not in tool_uses:
                    raise _err(f"names no tool_use block of an earlier assistant message: {tid!r}",
                               f"{at}.tool_use_id")
                result = _tool_result_content(block.get("content", ""), f"{at}.content", result_images)
                if block.get("is_error"):
                    result = f"Error: {result}"
                results.append(({"role": "tool", "tool_call_id": tid, "content": result}, at))
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning, passed back: templates drop it from the history
            elif kind in ("tool_use", "tool_result"):
                raise _err(f"{kind} blocks belong in {'assistant' if kind == 'tool_use' else 'user'} messages",
                           f"{at}.type")
            elif kind == "image" and role == "user":
                text_images.append(image_from_part(block, at))  # (a "url" source: refused, never fetched)
                text.append(MEDIA_MARKER)
            elif kind == "image":
                raise _err("image blocks belong in user messages", f"{at}.type")
            elif kind in ("document", "search_result"):
                raise _err(f"content blocks of type {kind!r} are not supported by this server", f"{at}.type")
            else:
                raise _err(f"'type' must be 'text', 'tool_use' or 'tool_result', got {kind!r}", f"{at}.type")
        out.extend(results)  # the tool results answer the previous turn's calls, before any new text
        images += result_images + text_images
        if calls:
            out.append(({"role": "assistant", "content": "".join(text), "tool_calls": calls}, where))
        elif text or not results:
            out.append(({"role": role, "content": "".join(text)}, where))
    prefill = ""
    last = out[-1][0]
    if last["role"] == "assistant":
        if last.get("tool_calls"):
            raise _err("the last message may not be an assistant's tool_use; answer it with a tool_result",
                       out[-1][1])
        prefill = last["content"]
        out.pop()
        if not out:
            raise _err("needs a user message before the assistant's", "messages")
    return out, prefill


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _err("must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise _err("must be an object", where)
        if tool.get("type") not in (None, "custom"):
            raise _err(f"only client tools (with an 'input_schema') are supported, got type {tool.get('type')!r}",
                       f"{where}.type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _err("'name' must be a non-empty string", f"{where}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise _err("'input_schema' is required: a JSON Schema object", f"{where}.input_schema")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _err("'description' must be a string", f"{where}.description")
        fn = {"name": tool["name"], "parameters": dict(schema)}
        if description:
            fn["description"] = description
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[Any, bool]:
    """(the chat tool_choice, whether parallel calls are allowed)."""
    if value is None:
        return None, True
    if not isinstance(value, Mapping):
        raise _err("must be an object with a 'type'", "tool_choice")
    parallel = not value.get("disable_parallel_tool_use", False)
    kind = value.get("type")
    if kind in ("auto", "any", "tool") and not tools:
        raise _err(f"{kind!r} needs at least one tool in 'tools'", "tool_choice")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        name = value.get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise _err(f"names no tool in 'tools': {name!r}", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise _err(f"'type' must be 'auto', 'any', 'tool' or 'none', got {kind!r}", "tool_choice.type")


def _output_format(config: Any) -> dict[str, Any] | None:
    """``output_config.format`` (structured outputs) as the chat ``response_format``."""
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise _err("must be an object", "output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        raise _err("must be {'type': 'json_schema', 'schema': {...}}", "output_config.format")
    if not isinstance(fmt.get("schema"), Mapping):
        raise _err("'schema' must be a JSON Schema object", "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": dict(fmt["schema"])}}


def parse_messages(body: Any, count_only: bool = False) -> MessagesRequest:
    """``count_only``: the body of ``/v1/messages/count_tokens``, which has no ``max_tokens``."""
    if not isinstance(body, Mapping):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    max_tokens = body.get("max_tokens", 1 if count_only else None)
    if max_tokens is None:
        raise _err("is required", "max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _err(f"must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    if body.get("messages") is None:
        raise _err("is required", "messages")
    images: list[ImageInput] = []
    messages, prefill = _messages(body["messages"], images)
    if body.get("system") is not None:
        messages.insert(0, ({"role": "system", "content": _text_blocks(body["system"], "system")}, "system"))
    stop = body.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise _err("must be a list of non-empty strings", "stop_sequences")
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, int | float)
                                    or not 0 <= temperature <= 1):
        raise _err(f"must be a number between 0 and 1, got {temperature!r}", "temperature")
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)

    chat: dict[str, Any] = {"messages": [m for m, _ in messages], "max_tokens": max_tokens,
                            "stream": body.get("stream", False)}
    if tools:
        chat["tools"] = tools
        chat["parallel_tool_calls"] = parallel
    if choice is not None:
        chat["tool_choice"] = choice
    if stop:
        chat["stop"] = stop
    response_format = _output_format(body.get("output_config"))
    if response_format is not None:
        chat["response_format"] = response_format
    for key in ("model", "temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    chat_request = parse_translated_chat(chat, [where for _, where in messages], schema_field="input_schema",
                                         messages_field="messages",
                                         renames={"stop": "stop_sequences", "response_format": "output_config.format"})
    chat_request.images = images
    return MessagesRequest(chat_request, prefill)


# -- the answer ------------------------------------------------------------------------------------------


class MessageBuilder:
    """The message and its stream events, built from the turn's events.

    Each method returns the events it causes (a streaming route sends them, a whole one ignores them);
    :attr:`message` is the message as it stands, complete after :meth:`finish`.
    """

    def __init__(self, model_id: str, input_tokens: int, cached_tokens: Callable[[], int] = lambda: 0) -> None:
        """``cached_tokens``: how many of the prompt's tokens the prefix cache served, asked when the message
        starts and when it finishes (known once the sequence has its slot): Anthropic's
        ``cache_read_input_tokens``, and ``input_tokens`` counts the rest, as Anthropic and llama-server do."""
        self.prompt_tokens = input_tokens
        self.cached_tokens = cached_tokens
        self.message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model_id,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "cache_read_input_tokens": 0, "output_tokens": 0},
        }
        self.open: dict[str, Any] | None = None  # the block being streamed
        self.json: list[str] = []  # the open tool_use block's input, as its fragments came

    def _count_cache(self) -> None:
        cached = self.cached_tokens()
        self.message["usage"].update(input_tokens=self.prompt_tokens - cached, cache_read_input_tokens=cached)

    def start(self) -> list[dict[str, Any]]:
        self._count_cache()
        return [{"type": "message_start", "message": json.loads(json.dumps(self.message))}, {"type": "ping"}]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.open = block
        self.message["content"].append(block)
        index = len(self.message["content"]) - 1
        start = {"type": "content_block_start", "index": index, "content_block": json.loads(json.dumps(block))}
        return [*events, start]

    def _close(self) -> list[dict[str, Any]]:
        block, self.open = self.open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            raw = "".join(self.json)
            self.json = []
            try:
                block["input"] = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError:
                block["input"] = {}  # the turn layer hands over only calls it could parse; belt and braces
        return [{"type": "content_block_stop", "index": len(self.message["content"]) - 1}]

    def _append(self, kind: str, field: str, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        events = [] if self.open is not None and self.open["type"] == kind else \
            self._open({"type": kind, field: "", **({"signature": ""} if kind == "thinking" else {})})
        assert self.open is not None
        self.open[field] += delta
        events.append({"type": "content_block_delta", "index": len(self.message["content"]) - 1,
                       "delta": {"type": f"{field}_delta", field: delta}})
        return events

    def text(self, delta: str) -> list[dict[str, Any]]:
        return self._append("text", "text", delta)

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        """The model's thinking, as a ``thinking`` block (unsigned: a local model has nothing to sign)."""
        return self._append("thinking", "thinking", delta)

    def tool_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        return self._open({"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def arguments(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        assert self.open is not None and self.open["type"] == "tool_use", "argument fragments outside a tool call"
        self.json.append(delta)
        return [{"type": "content_block_delta", "index": len(self.message["content"]) - 1,
                 "delta": {"type": "input_json_delta", "partial_json": delta}}]

    def finish(self, finish_reason: str, stop: str | None, output_tokens: int) -> list[dict[str, Any]]:
        """``finish_reason`` as chat says it; ``stop`` the stop sequence that ended the reply, if one did."""
        events = self._close()
        reason = "stop_sequence" if stop is not None and finish_reason == "stop" else \
            STOP_REASONS.get(finish_reason, "end_turn")
        self.message["stop_reason"] = reason
        self.message["stop_sequence"] = stop if reason == "stop_sequence" else None
        self._count_cache()
        usage = self.message["usage"]
        usage["output_tokens"] = output_tokens
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": reason, "stop_sequence": self.message["stop_sequence"]},
                       "usage": dict(usage)})
        events.append({"type": "message_stop"})
        return events


