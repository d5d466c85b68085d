"""Rendering a GGUF's chat template (``tokenizer.chat_template``) into a prompt.

The template is the jinja2 source from the model's ``tokenizer_config.json``, written for
transformers, so it is rendered the way transformers' ``apply_chat_template(..., tokenize=False)``
does (``transformers.utils.chat_template_utils``): a sandboxed, immutable environment with
``trim_blocks`` and ``lstrip_blocks``, loop controls, transformers' ``tojson`` filter, and the
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` globals. The template sees
``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` (None unless given),
``bos_token`` and ``eos_token``, and any extra keyword the caller passes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minfer.errors import BadRequestError, FormatError

if TYPE_CHECKING:
    from minfer.formats.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "BUILTIN_TEMPLATES"]

# Gemma 3's chat template as published with google/gemma-3-*-it (tokenizer_config.json). Some Gemma 3 GGUFs
# carry no tokenizer.chat_template (the 270M base file among them: converted from a folder whose template
# lived in chat_template.jinja, which older converters did not read); for text-only messages this renders
# what llama.cpp's built-in "gemma" format writes.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)
# general.architecture -> the template used when the file has none
BUILTIN_TEMPLATES: dict[str, str] = {"gemma3": GEMMA3_TEMPLATE}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML and has no ensure_ascii; templates are
    # written against transformers' version, which is plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    # `dict(...)` for templates without handing them the real type (whose attributes a sandbox
    # escape could start from).
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # As in transformers: a namespace refuses underscore names, which lead to CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick: self is args[0]
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})"
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it (to build
    training masks). Without the tag such templates would not even parse; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """A copy built from plain JSON-like types, so the template cannot reach (or mutate) caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    # Anything else becomes an inert placeholder naming its type, as transformers does.
    return f"<{type(value).__name__}>"


def _validate(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise BadRequestError(f"messages must be a list of messages, got {type(messages).__name__}")
    if not messages:
        # transformers refuses an empty conversation too.
        raise BadRequestError("messages is empty: a conversation needs at least one message")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise BadRequestError(
                f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}"
            )
        for field in ("role", "content"):
            if field not in message:
                raise BadRequestError(f"messages[{i}] has no '{field}'")
            if not isinstance(message[field], str):
                kind = type(message[field]).__name__
                raise BadRequestError(f"messages[{i}].{field} must be a string, got {kind}")
        # transformers drops None-valued keys: templates test for a key's presence, not for None.
        checked.append({k: _plain(v) for k, v in message.items() if v is not None})
    return checked


class ChatTemplate:
    """A compiled chat template; :meth:`render` turns a message list into the prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", builtin: bool = False) -> None:
        """Compile ``source``; a template that is not valid jinja raises :class:`FormatError`.

        ``bos_token`` and ``eos_token`` are the texts the template may write as ``{{ bos_token }}``;
        an empty one is left undefined, as transformers leaves a tokenizer's missing token. ``builtin``:
        the template is the architecture's own (``BUILTIN_TEMPLATES``), the file having none.
        """
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.builtin = builtin
        self._typed: bool | None = None  # typed_content, once probed
        env = _environment()
        try:
            self._template = env.from_string(source)
            self.variables: frozenset[str] = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except jinja2.exceptions.TemplateSyntaxError as err:
            raise FormatError(f"chat template is not valid jinja (line {err.lineno}): {err.message}") from None

    @property
    def typed_content(self) -> bool:
        """Whether the template renders only content given as a list of typed parts (``[{"type": "text", "text":
        ...}]``, as SmolVLM's does): string contents are then handed to it as one text part, as minja's polyfill does
        for llama.cpp. Decided once, by rendering a probe both ways."""
        if self._typed is None:
            probe = "\u2063minfer-probe\u2063"

            def shows(content: Any) -> bool:
                try:
                    return probe in self._template.render(messages=[{"role": "user", "content": content}],
                                                          add_generation_prompt=False, tools=None, documents=None,
                                                          bos_token=self.bos_token, eos_token=self.eos_token)
                except Exception:  # noqa: BLE001 - a template that fails on the probe is not this kind
                    return False

            self._typed = not shows(probe) and shows([{"type": "text", "text": probe}])
        return self._typed

    def probe(self, messages: list[dict[str, Any]], **variables: Any) -> str | None:
        """The template rendered on ``messages`` as they are (unvalidated, no generation prompt), or None when it
        fails on them: what capability probes (:mod:`minfer.formats.chat_template_caps`) read."""
        # tools and documents stay undefined unless given, as llama.cpp's probes leave them
        base = {"bos_token": self.bos_token, "eos_token": self.eos_token, "add_generation_prompt": False}
        try:
            return self._template.render(**{**base, **variables, "messages": messages})
        except Exception:  # noqa: BLE001 - a template that fails on a probe lacks what it probes
            return None

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders tool definitions (its source reads the ``tools`` variable)."""
        return "tools" in self.variables

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], tokenizer: Tokenizer) -> ChatTemplate | None:
        """The file's ``tokenizer.chat_template``, with its BOS/EOS texts; when it has none, the
        architecture's built-in template (``BUILTIN_TEMPLATES``: Gemma 3), else None."""
        source = metadata.get("tokenizer.chat_template")
        builtin = False
        if source is None or source == "":
            source = BUILTIN_TEMPLATES.get(metadata.get("general.architecture"))  # type: ignore[arg-type]
            if source is None:
                return None
            builtin = True
        if not isinstance(source, str):
            raise FormatError(f"tokenizer.chat_template has type {type(source).__name__}, expected str")
        bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        return cls(source, bos_token=bos, eos_token=eos, builtin=builtin)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages`` (each with a string ``role`` and ``content``).

        ``add_generation_prompt`` appends the opening of an assistant turn. ``extra`` reaches the
        template as variables (``tools=...``, ``enable_thinking=...``) and overrides the defaults.
        Invalid messages, and templates that reject them (``raise_exception``), raise
        :class:`BadRequestError`.
        """
        variables: dict[str, Any] = {"tools": None, "documents": None}
        if self.bos_token:
            variables["bos_token"] = self.bos_token
        if self.eos_token:
            variables["eos_token"] = self.eos_token
        variables.update(_plain(extra))
        checked = _validate(messages)
        if self.typed_content:
            checked = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in checked]
        variables["messages"] = checked
        variables["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as err:
            # raise_exception's message is written for the user ("Conversation roles must
            # alternate..."); undefined names and sandbox refusals land here too.
            raise BadRequestError(f"chat template: {err.message or type(err).__name__}") from None
        except (TypeError, ValueError, ArithmeticError, LookupError) as err:
            # A template bug that these messages or variables trigger ("'str' + 'int'"): the template is
            # data from the model file, so this is reported, not crashed on.
            raise BadRequestError(f"chat template failed: {type(err).__name__}: {err}") from None

    def __repr__(self) -> str:
        size = len(self.source)
        kind = ", built-in" if self.builtin else ""
        return f"ChatTemplate({size} chars{kind}, bos_token={self.bos_token!r}, eos_token={self.eos_token!r})"
