"""Chat templates rendered as transformers' ``apply_chat_template(..., tokenize=False)`` renders them.

References (tests/data/tokenizer_refs/smollm2.json "chat", and chat_templates.json) come from
scripts/make_tokenizer_refs.py, run with transformers 5.24.0.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from minfer.errors import BadRequestError, FormatError
from minfer.formats.chat_template import ChatTemplate
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.tokenizer import Tokenizer

TESTS = Path(__file__).resolve().parent
REFS = TESTS / "data" / "tokenizer_refs"
FIXTURES = TESTS / "fixtures"


@cache
def refs(name: str) -> dict[str, Any]:
    return json.loads((REFS / f"{name}.json").read_text(encoding="utf-8"))


@cache
def read_metadata(path: str) -> dict[str, Any]:
    return GGUFFile(path).metadata


def smollm2_template() -> ChatTemplate:
    chat = refs("smollm2")["chat"]
    return ChatTemplate(chat["template"], bos_token=chat["bos_token"], eos_token=chat["eos_token"])


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --- against transformers -------------------------------------------------------------------------------
@pytest.mark.parametrize("index", range(len(refs("smollm2")["chat"]["conversations"])))
def test_smollm2_template_matches_transformers(index: int) -> None:
    conversation = refs("smollm2")["chat"]["conversations"][index]
    rendered = smollm2_template().render(
        conversation["messages"], add_generation_prompt=conversation["add_generation_prompt"]
    )
    assert rendered == conversation["rendered"]


@pytest.mark.parametrize("name", [t["name"] for t in refs("chat_templates")["templates"]])
def test_template_features_match_transformers(name: str) -> None:
    # tojson (no HTML escaping, indent, separators), loop controls, namespace, trim/lstrip blocks,
    # {% generation %}, dict(), tools/documents defaults and extra variables.
    data = refs("chat_templates")
    spec = next(t for t in data["templates"] if t["name"] == name)
    template = ChatTemplate(spec["template"], bos_token=data["bos_token"], eos_token=data["eos_token"])
    rendered = template.render(spec["messages"], add_generation_prompt=spec["add_generation_prompt"], **spec["kwargs"])
    assert rendered == spec["rendered"]


@pytest.mark.slow
def test_smollm2_from_gguf_metadata(smollm2_path: Path) -> None:
    metadata = GGUFFile(smollm2_path).metadata
    template = ChatTemplate.from_gguf_metadata(metadata, Tokenizer.from_gguf_metadata(metadata))
    assert template is not None
    chat = refs("smollm2")["chat"]
    assert (template.source, template.bos_token, template.eos_token) == (
        chat["template"],
        chat["bos_token"],
        chat["eos_token"],
    )
    for conversation in chat["conversations"]:
        rendered = template.render(conversation["messages"], conversation["add_generation_prompt"])
        assert rendered == conversation["rendered"]


def test_no_template_in_file() -> None:
    metadata = read_metadata(str(FIXTURES / "llama" / "model-f32.gguf"))
    assert "tokenizer.chat_template" not in metadata
    assert ChatTemplate.from_gguf_metadata(metadata, Tokenizer.from_gguf_metadata(metadata)) is None
    with_template = {**metadata, "tokenizer.chat_template": "{{ bos_token }}|{{ eos_token }}"}
    template = ChatTemplate.from_gguf_metadata(with_template, Tokenizer.from_gguf_metadata(metadata))
    assert template is not None
    assert template.render([{"role": "user", "content": "x"}]) == "<|bos|>|<|eos|>"


# --- behaviour ------------------------------------------------------------------------------------------
def test_add_generation_prompt_defaults_to_true() -> None:
    template = ChatTemplate(CHATML)
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert template.render(messages, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"


def test_messages_are_not_modified_and_extra_keys_pass_through() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.name }}:{{ m.content }};{% endfor %}{{ flag }}")
    messages = [{"role": "user", "content": "a", "name": "bob", "tool_calls": None}]
    before = copy.deepcopy(messages)
    assert template.render(messages, flag=True) == "bob:a;True"
    assert messages == before


def test_missing_bos_token_is_undefined() -> None:
    template = ChatTemplate("{% if bos_token is defined %}B{% else %}none{% endif %}{{ eos_token }}")
    assert template.render([{"role": "user", "content": "x"}]) == "none"
    assert (
        ChatTemplate(template.source, bos_token="<s>", eos_token="</s>").render([{"role": "user", "content": "x"}])
        == "B</s>"
    )


def test_strftime_now() -> None:
    rendered = ChatTemplate("{{ strftime_now('%Y') }}").render([{"role": "user", "content": "x"}])
    assert rendered == str(datetime.now().year)


# --- errors -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hello", r"messages must be a list"),
        ({"role": "user", "content": "x"}, r"messages must be a list"),
        ([], r"messages is empty"),
        ([{"role": "user", "content": "x"}, "oops"], r"messages\[1\] must be an object"),
        ([{"content": "x"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        (
            [{"role": "user", "content": "x"}, {"role": "user", "content": 3}],
            r"messages\[1\]\.content must be a string",
        ),
        ([{"role": None, "content": "x"}], r"messages\[0\]\.role must be a string, got NoneType"),
    ],
)
def test_invalid_messages(messages: Any, message: str) -> None:
    with pytest.raises(BadRequestError, match=message):
        ChatTemplate(CHATML).render(messages)


def test_raise_exception_becomes_bad_request() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}ok"
    )
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(BadRequestError, match="Only user and assistant roles are supported!"):
        template.render([{"role": "system", "content": "x"}])


def test_template_bugs_become_bad_request() -> None:
    with pytest.raises(BadRequestError, match="chat template"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(BadRequestError, match="chat template"):
        ChatTemplate("{{ nothing.there }}").render([{"role": "user", "content": "x"}])


def test_syntax_error_is_a_format_error() -> None:
    with pytest.raises(FormatError, match="not valid jinja"):
        ChatTemplate("{% for m in messages %}{{ m.content }}")


def test_sandbox() -> None:
    messages = [{"role": "user", "content": "x"}]
    # Immutable: no in-place list changes; namespaces refuse underscore names; no dunder access.
    with pytest.raises(BadRequestError):
        ChatTemplate("{% set l = [1] %}{{ l.append(2) }}").render(messages)
    with pytest.raises(BadRequestError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(messages)
    with pytest.raises(BadRequestError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(messages)


# --- Gemma 3 --------------------------------------------------------------------------------------------
def gemma3_metadata() -> dict[str, Any]:
    return read_metadata(str(FIXTURES / "gemma3" / "model-f32.gguf"))


def test_gemma3_template_matches_transformers() -> None:
    """The gemma3 fixture's GGUF carries Gemma 3's template; chat.json holds transformers' renderings."""
    metadata = gemma3_metadata()
    template = ChatTemplate.from_gguf_metadata(metadata, Tokenizer.from_gguf_metadata(metadata))
    assert template is not None and not template.builtin
    assert (template.bos_token, template.eos_token) == ("<bos>", "<eos>")
    ref = json.loads((FIXTURES / "gemma3" / "chat.json").read_text(encoding="utf-8"))
    for conv in ref["conversations"]:
        assert template.render(conv["messages"], conv["add_generation_prompt"]) == conv["rendered"]
    with pytest.raises(BadRequestError, match="Conversation roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_gemma3_file_without_template_gets_the_builtin_one() -> None:
    # Gemma 3 270M's GGUF has no tokenizer.chat_template: Gemma 3's own is used, the same text the fixture's
    # file (and google/gemma-3-*-it) carries; other architectures get none
    metadata = dict(gemma3_metadata())
    source = metadata.pop("tokenizer.chat_template")
    tok = Tokenizer.from_gguf_metadata(metadata)
    template = ChatTemplate.from_gguf_metadata(metadata, tok)
    assert template is not None and template.builtin and template.source == source
    rendered = template.render([{"role": "user", "content": "Hi"}])
    assert rendered == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert "built-in" in repr(template)
    assert ChatTemplate.from_gguf_metadata({**metadata, "general.architecture": "llama"}, tok) is None


# modelled on SmolVLM's published template (HuggingFaceTB/SmolVLM-256M-Instruct), which walks a message's content
# as a list of typed parts only: a string content would render as nothing
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_a_template_that_reads_only_typed_parts_gets_string_content_as_one_text_part():
    t = ChatTemplate(SMOLVLM_TEMPLATE)
    assert t.typed_content
    assert t.render([{"role": "user", "content": "Hi <__media__> there"}]) == \
        "<|im_start|>User: Hi <__media__> there<end_of_utterance>\nAssistant:"
    assert not ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}").typed_content
