"""``chat_template_caps`` (``/props``) against llama-server's for the same templates: eight of llama.cpp's copies of
models' templates, each capability set on some and unset on others (tests/data/chat_template_caps: what
llama-server 0.5.0-dev answered for each, started with ``--chat-template-file``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minfer.formats.chat_template import ChatTemplate
from minfer.formats.chat_template_caps import template_caps

DATA = Path(__file__).parent / "data" / "chat_template_caps"
REFS = json.loads((DATA / "llama_server_caps.json").read_text())["caps"]


@pytest.mark.parametrize("name", sorted(REFS))
def test_caps_equal_llama_servers(name):
    template = ChatTemplate((DATA / f"{name}.jinja").read_text(), bos_token="<s>", eos_token="</s>")
    assert template_caps(template) == REFS[name]


def test_every_capability_is_seen_both_ways():
    """The references hold each capability true on some template and false on another, so each probe is tested
    both ways; but string content, which every template of llama.cpp's collection takes (the next test has one
    that does not)."""
    for key in set(next(iter(REFS.values()))) - {"supports_string_content"}:
        assert {caps[key] for caps in REFS.values()} == {True, False}, key


def test_a_template_that_prints_a_list_of_parts_as_it_is_has_no_typed_content():
    printed = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert template_caps(printed)["supports_string_content"] is True
    assert template_caps(printed)["supports_typed_content"] is False
    typed = ChatTemplate("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}")
    assert template_caps(typed)["supports_typed_content"] is True
    assert template_caps(typed)["supports_string_content"] is False
