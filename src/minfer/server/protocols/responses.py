"""OpenAI's Responses API (``POST /v1/responses``) translated to and from the chat request the engine runs.

The request side turns ``input`` (a string, or a list of message / ``function_call`` /
``function_call_output`` items), ``instructions``, the flat function ``tools`` and ``tool_choice`` into an
OpenAI chat-completions body, which :func:`minfer.server.protocols.openai.parse_chat` then checks like any chat
request; every field of the Responses body is checked here first so that a 400 names the field as the
caller wrote it (``input[2].call_id``, ``tools[0].parameters``).

The answer side is :class:`ResponseBuilder`: fed the turn's events (text deltas, a tool call's start and
argument fragments, the finish), it yields the typed stream events (``response.created`` ...
``response.completed``, each with its ``sequence_number``) and holds the final ``response`` object, so
a streamed answer and a whole one are the same object by construction.

Nothing is stored: ``previous_response_id`` and ``item_reference`` inputs are refused with a 400 (send
the whole conversation in ``input``), and every response says ``"store": false``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from minfer.runtime.sampling.params import PARAMS
from minfer.runtime.vision import ImageInput
from minfer.server.errors import ApiError
from minfer.server.protocols.images import MEDIA_MARKER, image_from_part
from minfer.server.protocols.openai import ChatRequest
from minfer.server.translated_chat import parse_translated_chat

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
# the fields of the body that are accepted and only echoed (or have no meaning for a local server)
ECHOED = ("metadata", "user", "store", "truncation", "service_tier", "include", "reasoning", "safety_identifier",
          "prompt_cache_key", "background")


@dataclass
class ResponsesRequest:
    chat: ChatRequest  # what the engine runs
    body: Mapping[str, Any]  # the request as sent (echoed in the response object)
    tools: list[dict[str, Any]]  # the Responses tools, as the response object lists them
    tool_choice: Any
    parallel_tool_calls: bool
    text_format: dict[str, Any]


def _err(message: str, param: str) -> ApiError:
    return ApiError(f"{param}: {message}", param=param)


def _text_parts(content: Any, where: str, kinds: tuple[str, ...], images: list[ImageInput] | None = None) -> str:
    """A message's content: a string, or a list of text parts of the given ``kinds``; with ``images``, also
    ``input_image`` parts (a data: URL), added there in order, each one's place in the text a media marker."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _err("must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        p = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise _err("must be an object with a 'type'", p)
        kind = part.get("type")
        if kind == "input_image" and images is not None:
            images.append(image_from_part(part, p))
            out.append(MEDIA_MARKER)
            continue
        if kind not in kinds:
            unsupported = kind in ("input_image", "input_file", "input_audio")
            raise _err(f"content parts of type {kind!r} are not supported by this server" if unsupported
                       else f"'type' must be one of {', '.join(map(repr, kinds))}, got {kind!r}", f"{p}.type")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise _err("'text' must be a string", f"{p}.text")
        out.append(text)
    return "".join(out)


def _input_messages(value: Any, images: list[ImageInput]) -> list[tuple[dict[str, Any], str]]:
    """``input`` as chat messages, each with the path of the item it came from (the user messages' images added
    to ``images``)."""
    if isinstance(value, str):
        return [({"role": "user", "content": value}, "input")]
    if not isinstance(value, list) or not value:
        raise _err("must be a string or a non-empty list of input items", "input")
    out: list[tuple[dict[str, Any], str]] = []
    calls: set[str] = set()
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _err("must be an object (a message or a function_call / function_call_output item)", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise _err(f"'role' must be one of {', '.join(map(repr, MESSAGE_ROLES))}, got {role!r}",
                           f"{where}.role")
            if item.get("content") is None:
                raise _err("'content' is required", f"{where}.content")
            kinds = ("output_text", "refusal", "input_text") if role == "assistant" else ("input_text",)
            text = _text_parts(item["content"], f"{where}.content", kinds, images if role == "user" else None)
            out.append(({"role": "system" if role == "developer" else role, "content": text}, where))
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            for key, v in (("call_id", call_id), ("name", name), ("arguments", arguments)):
                if not isinstance(v, str) or (key != "arguments" and not v):
                    raise _err(f"'{key}' must be a{' non-empty' if key != 'arguments' else ''} string",
                               f"{where}.{key}")
            assert isinstance(call_id, str)
            calls.add(call_id)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1][0] if out else None
            if last is not None and last["role"] == "assistant":  # the same turn: text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append(({"role": "assistant", "content": "", "tool_calls": [call]}, where))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _err("'call_id' must be a non-empty string", f"{where}.call_id")
            if call_id not in calls:
                raise _err(f"no function_call item before it has call_id {call_id!r}", f"{where}.call_id")
            if item.get("output") is None:
                raise _err("'output' is required", f"{where}.output")
            output = _text_parts(item["output"], f"{where}.output", ("input_text",))
            out.append(({"role": "tool", "tool_call_id": call_id, "content": output}, where))
        elif kind == "reasoning":
            continue  # a previous turn's reasoning, passed back: templates drop it from history anyway
        elif kind == "item_reference":
            raise _err("item references need stored responses, which this server does not keep; send the "
                       "items themselves", f"{where}.type")
        else:
            raise _err(f"input items of type {kind!r} are not supported (message, function_call, "
                       "function_call_output)", f"{where}.type")
    return out


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _err("must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise _err("must be an object", where)
        if tool.get("type") != "function":
            raise _err(f"only 'function' tools are supported by this server, got {tool.get('type')!r}",
                       f"{where}.type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _err("'name' must be a non-empty string", f"{where}.name")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise _err("'parameters' must be a JSON Schema object", f"{where}.parameters")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _err("'description' must be a string", f"{where}.description")
        out.append({"type": "function", "name": tool["name"], "description": description,
                    "parameters": dict(params) if params is not None else {"type": "object", "properties": {}},
                    "strict": bool(tool.get("strict", False))})
    return out


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[Any, Any]:
    """(the Responses tool_choice to echo, the chat one)."""
    if value is None:
        return "auto", None
    if value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise _err("'required' needs at least one tool in 'tools'", "tool_choice")
        return value, value
    if isinstance(value, Mapping) and value.get("type") == "function":
        name = value.get("name")
        if name not in {t["name"] for t in tools}:
            raise _err(f"names no function in 'tools': {name!r}", "tool_choice.name")
        return {"type": "function", "name": name}, {"type": "function", "function": {"name": name}}
    raise _err("must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}", "tool_choice")


def _text_format(value: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(``text`` to echo, the chat ``response_format``)."""
    if value is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(value, Mapping):
        raise _err("must be an object", "text")
    fmt = value.get("format")
    if fmt is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(fmt, Mapping):
        raise _err("must be an object with a 'type'", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return {"format": {"type": "text"}}, None
    if kind == "json_object":
        return {"format": {"type": "json_object"}}, {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, Mapping):
            raise _err("'schema' must be a JSON Schema object", "text.format.schema")
        name = fmt.get("name", "response")
        if not isinstance(name, str):
            raise _err("'name' must be a string", "text.format.name")
        echo = {"type": "json_schema", "name": name, "schema": dict(schema), "strict": bool(fmt.get("strict"))}
        return {"format": echo}, {"type": "json_schema", "json_schema": {"name": name, "schema": dict(schema)}}
    raise _err(f"'type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", "text.format.type")


def parse_responses(body: Any) -> ResponsesRequest:
    if not isinstance(body, Mapping):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    if body.get("previous_response_id") is not None:
        raise _err("this server does not store responses; send the whole conversation in 'input'",
                   "previous_response_id")
    if body.get("conversation") is not None:
        raise _err("this server does not store conversations; send the whole conversation in 'input'",
                   "conversation")
    if body.get("input") is None:
        raise _err("is required", "input")
    images: list[ImageInput] = []
    messages = _input_messages(body["input"], images)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _err("must be a string", "instructions")
        messages.insert(0, ({"role": "system", "content": instructions}, "instructions"))
    tools = _tools(body.get("tools"))
    choice_echo, choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _err("must be true or false", "parallel_tool_calls")
    text, response_format = _text_format(body.get("text"))

    chat: dict[str, Any] = {"messages": [m for m, _ in messages], "stream": body.get("stream", False)}
    if tools:
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if t[k] is not None}} for t in tools]
        chat["parallel_tool_calls"] = parallel
    if choice is not None:
        chat["tool_choice"] = choice
    if response_format is not None:
        chat["response_format"] = response_format
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("model", "model")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    # the sampling fields (temperature, top_p, and llama.cpp's extras under their own names)
    chat.update({k: body[k] for k in PARAMS if k in body and PARAMS[k].request})
    if "max_tokens" in chat and isinstance(chat["max_tokens"], int) and chat["max_tokens"] < 1:
        raise _err(f"must be >= 1, got {chat['max_tokens']}", "max_output_tokens")
    origins = [where for _, where in messages]
    chat_request = parse_translated_chat(chat, origins, schema_field="parameters", messages_field="input",
                                         renames={"max_tokens": "max_output_tokens", "response_format": "text.format"})
    chat_request.images = images
    return ResponsesRequest(chat_request, body, tools, choice_echo, parallel, text)


# -- the answer ------------------------------------------------------------------------------------------


@dataclass
class _Item:
    """One output item being built: a message with one output_text part, a reasoning item with one
    reasoning_text part, or a function call."""

    kind: str  # "message" | "reasoning" | "function_call"
    id: str
    text: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""

    def body(self, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self.part()]
        if self.kind == "message":
            return {"id": self.id, "type": "message", "status": status, "role": "assistant", "content": content}
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "status": status, "summary": [], "content": content}
        return {"id": self.id, "type": "function_call", "status": status, "call_id": self.call_id,
                "name": self.name, "arguments": "".join(self.text)}

    def part(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": "".join(self.text)}
        return {"type": "output_text", "text": "".join(self.text), "annotations": [], "logprobs": []}


class ResponseBuilder:
    """The response object and its typed stream events, built from the turn's events.

    Each method returns the events it causes (a streaming route sends them, a whole one ignores them);
    :attr:`response` is the object as it stands, complete after :meth:`finish`.
    """

    def __init__(self, request: ResponsesRequest, model_id: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.sequence = 0
        self.items: list[_Item] = []
        self.open: _Item | None = None
        body = request.body
        self.response: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": model_id, "output": [],
            "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": body.get("temperature", 1.0), "text": request.text_format,
            "tool_choice": request.tool_choice, "tools": request.tools, "top_p": body.get("top_p", 1.0),
            "truncation": "disabled", "usage": None, "user": body.get("user"), "metadata": body.get("metadata") or {},
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.response))  # events carry the object as it was then

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def _add(self, item: _Item) -> list[dict[str, Any]]:
        events = self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=item.body("in_progress")))
        if item.kind != "function_call":
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=index,
                                      content_index=0, part={**item.part(), "text": ""}))
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        events = []
        if item.kind != "function_call":
            text = "".join(item.text)
            if item.kind == "message":
                events.append(self._event("response.output_text.done", item_id=item.id, output_index=index,
                                          content_index=0, text=text, logprobs=[]))
            else:
                events.append(self._event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                          content_index=0, text=text))
            events.append(self._event("response.content_part.done", item_id=item.id, output_index=index,
                                      content_index=0, part=item.part()))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                      output_index=index, name=item.name, arguments="".join(item.text)))
        done = item.body(status)
        self.response["output"].append(done)
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        return events

    def _append(self, kind: str, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        events = [] if self.open is not None and self.open.kind == kind else \
            self._add(_Item(kind, f"{'msg' if kind == 'message' else 'rs'}_{uuid.uuid4().hex}"))
        assert self.open is not None
        self.open.text.append(delta)
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(event, item_id=self.open.id, output_index=len(self.items) - 1, content_index=0,
                                  delta=delta, **extra))
        return events

    def text(self, delta: str) -> list[dict[str, Any]]:
        return self._append("message", delta)

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        return self._append("reasoning", delta)

    def tool_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        return self._add(_Item("function_call", f"fc_{uuid.uuid4().hex}", call_id=call_id, name=name))

    def arguments(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        item = self.open
        assert item is not None and item.kind == "function_call", "argument fragments outside a tool call"
        item.text.append(delta)
        return [self._event("response.function_call_arguments.delta", item_id=item.id,
                            output_index=len(self.items) - 1, delta=delta)]

    def finish(self, finish_reason: str, input_tokens: int, output_tokens: int,
               cached_tokens: int = 0) -> list[dict[str, Any]]:
        """``finish_reason`` as chat says it: ``length`` makes the response incomplete."""
        incomplete = finish_reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        self.response["status"] = "incomplete" if incomplete else "completed"
        if incomplete:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.response["usage"] = {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        }
        events.append(self._event("response.incomplete" if incomplete else "response.completed",
                                  response=self._snapshot()))
        return events

    def error(self, e: ApiError) -> dict[str, Any]:
        """The stream's last event when generation fails."""
        return self._event("error", code=e.code or e.type, message=e.message, param=e.param)


