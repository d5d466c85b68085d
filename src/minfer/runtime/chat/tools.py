"""Tool definitions and the tool choice of a chat request, checked; the calls a reply makes.

The shapes are OpenAI's: a tool is ``{"type": "function", "function": {"name", "description",
"parameters"}}`` (``parameters`` a JSON Schema), ``tool_choice`` is ``"auto"``, ``"none"``,
``"required"`` or ``{"type": "function", "function": {"name": ...}}``. Every mistake is a
:class:`~minfer.errors.BadRequestError` whose message starts with the field it is about
(``tools[1] 'get_weather': parameters is not a valid JSON Schema: ...``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema
import jsonschema.exceptions

from minfer.errors import BadRequestError

__all__ = ["ToolSpec", "ToolChoice", "ToolCall", "parse_tools", "parse_tool_choice", "check_json_schema",
           "new_call_id"]

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_openai(self) -> dict[str, Any]:
        """The definition as OpenAI writes it (and as chat templates expect ``tools`` items)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters)
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: "auto" (the model decides), "none" (no calls), "required" (at least one call) or
    "function" (a call of ``name``)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        """Whether the reply must be a call (decoding is then constrained to the tools' schemas)."""
        return self.mode in ("required", "function")


@dataclass
class ToolCall:
    """A call the model made: ``arguments`` is the JSON text of the arguments object, as the model wrote it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def check_json_schema(schema: Any, where: str) -> None:
    """Raise BadRequestError ("<where> is not a valid JSON Schema: ...") unless ``schema`` passes its
    metaschema (the draft its ``$schema`` names, else 2020-12)."""
    if not isinstance(schema, Mapping):
        raise BadRequestError(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        raise BadRequestError(f"{where} is not a valid JSON Schema: {e.message}" + (f" (at {path})" if path else "")) \
            from None


def parse_tools(tools: Any, param: str = "tools") -> list[ToolSpec]:
    """The ``tools`` of a request (OpenAI's list of function tools), each checked."""
    if tools is None:
        return []
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise BadRequestError(f"{param} must be a list of tools")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, Mapping):
            raise BadRequestError(f"{where} must be an object")
        if tool.get("type", "function") != "function":
            raise BadRequestError(f"{where}.type must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise BadRequestError(f"{where}.function must be an object with a 'name'")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BadRequestError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
        where = f"{where} {name!r}"
        if any(s.name == name for s in specs):
            raise BadRequestError(f"{where}: a second tool of this name")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise BadRequestError(f"{where}: description must be a string")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        check_json_schema(parameters, f"{where}: parameters")
        specs.append(ToolSpec(name, description, dict(parameters)))
    return specs


def parse_tool_choice(choice: Any, tools: Sequence[ToolSpec], param: str = "tool_choice") -> ToolChoice:
    """``tool_choice`` against the tools offered (default: "auto" with tools, "none" without)."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise BadRequestError(f"{param} must be 'auto', 'none', 'required' or a function, got {choice!r}")
        if choice == "required" and not tools:
            raise BadRequestError(f"{param} is 'required' but no tools are given")
        return ToolChoice(choice)  # type: ignore[arg-type]
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise BadRequestError(f"{param} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if not any(t.name == name for t in tools):
            known = ", ".join(repr(t.name) for t in tools) or "none"
            raise BadRequestError(f"{param} names the function {name!r}, which is not among the tools ({known})")
        return ToolChoice("function", name)
    raise BadRequestError(f"{param} must be a string or an object, got {type(choice).__name__}")
