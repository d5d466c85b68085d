"""What the translated APIs (OpenAI Responses, Anthropic Messages) share on the way in: their request is
rewritten as a chat request and checked by :func:`~minfer.server.protocols.openai.parse_chat`, and an error found
there is renamed to the caller's own field, so the 400 names what the client sent."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from minfer.server.errors import ApiError
from minfer.server.protocols.openai import ChatRequest, parse_chat


def parse_translated_chat(
    chat: dict[str, Any], origins: Sequence[str], *, schema_field: str, messages_field: str,
    renames: Mapping[str, str],
) -> ChatRequest:
    """``parse_chat(chat)``; on an error, ``messages[i]`` becomes ``origins[i]`` (the item message i was
    made of), ``tools[i].function.parameters`` becomes ``tools[i].<schema_field>``, and each chat field in
    ``renames`` its API's name (e.g. ``stop`` -> ``stop_sequences``)."""
    try:
        return parse_chat(chat)
    except ApiError as e:
        message, param = e.message, e.param or ""
        if param in ("tools", "tool_choice"):  # the turn layer names the tool at the message's start
            head = message.split(" ", 1)[0].rstrip(":")
            param = head if head.startswith(param) else param
            if param.startswith("tools[") and ": parameters is not a valid JSON Schema" in message:
                message = message.replace(": parameters is not", f": {schema_field} is not")
                param += f".{schema_field}"
        pairs = [(".function.parameters", f".{schema_field}"), (".function.", ".")]
        m = re.match(r"messages\[(\d+)\]", param)
        if m:
            i = int(m.group(1))
            pairs.append((m.group(0), origins[i] if i < len(origins) else messages_field))
        pairs += [(theirs, ours) for theirs, ours in renames.items() if param.startswith(theirs)]
        for theirs, ours in pairs:
            message, param = message.replace(theirs, ours), param.replace(theirs, ours)
        raise ApiError(message, status=e.status, type=e.type, param=param or None, code=e.code) from None
