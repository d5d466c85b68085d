"""Tool calls and reasoning, below the server: each call format on real model outputs (streamed piece by
piece and whole, which must agree), malformed calls answered as text, the grammars that force a call,
tool/schema validation, and the prompt a chat turn renders."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from minfer.errors import BadRequestError
from minfer.formats.chat_template import ChatTemplate
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.tokenizer import Tokenizer
from minfer.runtime.chat import (
    ChatOptions,
    ContentDelta,
    MessageBuilder,
    ToolCallDelta,
    ToolCallStart,
    check_messages,
    parse_tool_choice,
    parse_tools,
    plan_chat,
)
from minfer.runtime.chat.formats import FORMATS, closed, detect_format
from minfer.runtime.chat.json_scan import Malformed, read_object, value_end
from minfer.runtime.chat.output import ChatOutputParser, ReasoningSplitter, ToolCallParser
from minfer.runtime.constraints import Constraint

WEATHER = {"type": "function", "function": {
    "name": "get_current_temperature", "description": "Get current temperature at a location.",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location"]}}}
DATED = {"type": "function", "function": {
    "name": "get_temperature_date", "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}, "date": {"type": "string"}}, "required": ["location", "date"]}}}

# Real outputs, as the models' documentation shows them:
# Qwen2.5 (https://qwen.readthedocs.io/en/v2.5/framework/function_call.html, the Hermes-style template)
QWEN25 = ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, '
          'USA", "date": "2024-10-01"}}\n</tool_call>')
# Hermes 2 Pro (NousResearch/Hermes-2-Pro-Llama-3-8B model card): arguments before the name
HERMES2PRO = '<tool_call>\n{"arguments": {"location": "Paris"}, "name": "get_current_temperature"}\n</tool_call>'
# Qwen3 thinking, then a call (the reasoning split off first)
QWEN3 = ('<think>\nThe user wants the temperature in Paris. I should call get_current_temperature.\n</think>\n\n'
         '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "Paris", "unit": "celsius"}}\n'
         '</tool_call>')
# Llama 3.1 JSON tool calling (llama.com prompt-format docs: "JSON based tool calling")
LLAMA31 = '{"name": "get_current_temperature", "parameters": {"location": "San Francisco, CA", "unit": "fahrenheit"}}'
LLAMA31_TAG = '<|python_tag|>{"name": "get_current_temperature", "parameters": {"location": "Menlo Park"}}'
# Mistral 7B Instruct v0.3 (mistral-inference README; the decoded text has a space after the marker)
MISTRAL03 = '[TOOL_CALLS] [{"name": "get_current_temperature", "arguments": {"location": "Paris, France", ' \
            '"unit": "celsius"}, "id": "G6tqZbJf2"}]'
# Mistral Small 3.2 / Magistral / Devstral (mistral-common tokenizer v11+)
MISTRAL32 = '[TOOL_CALLS]get_current_temperature[ARGS]{"location": "Paris"}' \
            '[TOOL_CALLS]get_temperature_date[ARGS]{"location": "Rome", "date": "2025-06-01"}'
GENERIC = '{"tool_calls": [{"name": "get_current_temperature", "arguments": {"location": "Paris"}}]}'

NAMES = ("get_current_temperature", "get_temperature_date")


def parse(fmt: str, text: str, step: int | None = None, incremental: bool = False, think: bool = False):
    """The message from ``text`` fed in pieces of ``step`` characters (None: whole)."""
    parser = ChatOutputParser(ToolCallParser(FORMATS[fmt], NAMES, incremental), ReasoningSplitter() if think else None)
    if step is None:
        return parser.parse(text), []
    b, events = MessageBuilder(), []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.finish()
    b.add(events)
    return b.message(), events


def calls(message):
    return [(c.name, json.loads(c.arguments)) for c in message.tool_calls]


def same_at_every_split(fmt: str, text: str, **kw):
    whole, _ = parse(fmt, text, **kw)
    for step in (1, 2, 3, 7, 50):
        m, _ = parse(fmt, text, step, **kw)
        assert (m.content, m.reasoning_content, [(c.name, c.arguments) for c in m.tool_calls]) == \
               (whole.content, whole.reasoning_content, [(c.name, c.arguments) for c in whole.tool_calls]), step
    return whole


@pytest.mark.parametrize("fmt, text, expected", [
    ("hermes", QWEN25, [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
                        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]),
    ("hermes", HERMES2PRO, [("get_current_temperature", {"location": "Paris"})]),
    ("llama3", LLAMA31, [("get_current_temperature", {"location": "San Francisco, CA", "unit": "fahrenheit"})]),
    ("llama3", LLAMA31_TAG, [("get_current_temperature", {"location": "Menlo Park"})]),
    ("mistral", MISTRAL03, [("get_current_temperature", {"location": "Paris, France", "unit": "celsius"})]),
    ("mistral-args", MISTRAL32, [("get_current_temperature", {"location": "Paris"}),
                                 ("get_temperature_date", {"location": "Rome", "date": "2025-06-01"})]),
    ("mistral-args", MISTRAL03, [("get_current_temperature", {"location": "Paris, France", "unit": "celsius"})]),
    ("generic", GENERIC, [("get_current_temperature", {"location": "Paris"})]),
    ("generic", '{"tool_call": {"name": "get_temperature_date", "arguments": {"location": "Oslo", "date": "today"}}}',
     [("get_temperature_date", {"location": "Oslo", "date": "today"})]),
])
def test_real_outputs_parse_to_calls(fmt, text, expected):
    m = same_at_every_split(fmt, text)
    assert calls(m) == expected
    assert m.content is None
    assert all(c.id for c in m.tool_calls) and len({c.id for c in m.tool_calls}) == len(m.tool_calls)


def test_mistral_keeps_the_models_call_id_and_makes_nine_character_ones():
    m, _ = parse("mistral", MISTRAL03)
    assert m.tool_calls[0].id == "G6tqZbJf2"
    m, _ = parse("mistral-args", MISTRAL32)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in m.tool_calls)


def test_arguments_are_the_models_own_text():
    text = '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location":"Paris",  "unit": "celsius"}}\n' \
           '</tool_call>'
    m, _ = parse("hermes", text)
    assert m.tool_calls[0].arguments == '{"location":"Paris",  "unit": "celsius"}'


def test_content_before_a_call_and_reasoning():
    m = same_at_every_split("hermes", "Let me look that up.\n\n" + HERMES2PRO)
    assert m.content == "Let me look that up."
    assert calls(m) == [("get_current_temperature", {"location": "Paris"})]
    m = same_at_every_split("hermes", QWEN3, think=True)
    assert m.reasoning_content == "The user wants the temperature in Paris. I should call get_current_temperature."
    assert m.content is None and calls(m) == [("get_current_temperature", {"location": "Paris", "unit": "celsius"})]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "Paris"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'),  # unknown function
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": "Paris"}\n</tool_call>'),  # not an object
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "Par'),  # cut short
    ("hermes", "<tool_call> I think I should call a tool"),
    ("llama3", '{"answer": 42, "name": "get_current_temperature"}'),  # a JSON answer, not a call
    ("llama3", '{"name": "get_current_temperature", "parameters": {"location": "Paris"'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_temperature", "arguments": {"location": }}]'),
    ("mistral-args", "[TOOL_CALLS]get current temperature"),
    ("mistral-args", '[TOOL_CALLS]get_current_temperature[ARGS]{"location": Paris}'),
    ("generic", '{"tool_calls": [{"name": "rm -rf", "arguments": {}}]}'),
    ("generic", '{"city": "Paris"}'),
])
def test_malformed_calls_are_content(fmt, text):
    m = same_at_every_split(fmt, text)
    assert m.tool_calls == []
    assert m.content == text


def test_text_that_only_looks_like_a_marker_is_content():
    for fmt, text in [("hermes", "a < b and <tool is not a tag"), ("mistral", "[TOOL] [CALLS]"),
                      ("generic", "Use {braces} later"), ("llama3", "  Hello {x}")]:
        m = same_at_every_split(fmt, text)
        assert m.content == text and m.tool_calls == []


def test_streaming_sends_the_name_first_then_argument_fragments():
    """Held (auto): start and arguments once the call is whole; incremental (forced): as written."""
    _, events = parse("hermes", QWEN25, step=1)
    kinds = [type(e) for e in events]
    assert kinds == [ToolCallStart, ToolCallDelta, ToolCallStart, ToolCallDelta]
    _, events = parse("hermes", QWEN25, step=1, incremental=True)
    starts = [i for i, e in enumerate(events) if isinstance(e, ToolCallStart)]
    assert len(starts) == 2 and starts[0] == 0
    frags = [e for e in events if isinstance(e, ToolCallDelta) and e.index == 0]
    assert len(frags) > 10 and "".join(f.arguments for f in frags) == '{"location": "San Francisco, CA, USA"}'
    assert not any(isinstance(e, ContentDelta) for e in events)


def test_reasoning_splitter():
    def split(text, opened=False, step=1):
        r, out = ReasoningSplitter(opened), []
        for i in range(0, len(text), step):
            out += r.feed(text[i:i + step])
        out += r.feed("", final=True)
        kinds = {}
        for k, t in out:
            kinds[k] = kinds.get(k, "") + t
        return kinds

    assert split("<think>\nhmm, 2+2\n</think>\n\n4") == {"reasoning": "hmm, 2+2", "content": "4"}
    assert split("hmm, 2+2\n</think>\n\n4", opened=True) == {"reasoning": "hmm, 2+2", "content": "4"}  # R1 distills
    assert split("4, no thinking") == {"content": "4, no thinking"}
    assert split("<think>never closed") == {"reasoning": "never closed"}
    assert split("<thinking is a word") == {"content": "<thinking is a word"}
    assert split("<think>\n\n</think>\n\nHi") == {"content": "Hi"}  # Qwen3 with enable_thinking off


def test_json_scan_partial_and_malformed():
    obj = read_object('{"name": "f", "arguments": {"a": [1, "}"', 0)
    assert [m.key for m in obj.members] == ["name", "arguments"] and obj.members[1].end is None and obj.end is None
    assert value_end('{"a": "}"} tail', 0) == 10
    assert value_end("12", 0) is None and value_end("12,", 0) == 2
    with pytest.raises(Malformed):
        read_object('{"a" 1}', 0)
    with pytest.raises(Malformed):
        value_end("nope", 0)


# -- tools, tool_choice, schemas ---------------------------------------------------------------------


def test_tool_validation_names_the_tool():
    assert [t.name for t in parse_tools([WEATHER, DATED])] == list(NAMES)
    bad = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object",
                                                                             "properties": {"x": {"type": "strng"}}}}}
    with pytest.raises(BadRequestError, match=r"tools\[1\] 'broken': parameters is not a valid JSON Schema"):
        parse_tools([WEATHER, bad])
    with pytest.raises(BadRequestError, match=r"tools\[0\]\.function\.name"):
        parse_tools([{"type": "function", "function": {"name": "has spaces"}}])
    with pytest.raises(BadRequestError, match="second tool"):
        parse_tools([WEATHER, WEATHER])
    tools = parse_tools([WEATHER])
    assert parse_tool_choice(None, tools).mode == "auto" and parse_tool_choice(None, []).mode == "none"
    assert parse_tool_choice({"type": "function", "function": {"name": "get_current_temperature"}}, tools).forced
    with pytest.raises(BadRequestError, match="'nope', which is not among the tools"):
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)
    with pytest.raises(BadRequestError, match="tool_choice must be"):
        parse_tool_choice("sometimes", tools)


def test_history_messages_are_checked():
    msgs = check_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_current_temperature", "arguments": '{"location": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}])
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"location": "Paris"}  # a dict, as transformers passes
    with pytest.raises(BadRequestError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"):
        check_messages([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])


def test_closed_schema():
    s = closed({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
                "additionalProperties": True})
    assert s["additionalProperties"] is True and s["properties"]["a"]["additionalProperties"] is False


# -- templates and prompts ---------------------------------------------------------------------------

# The tool parts of Qwen2.5's chat template (tokenizer_config.json of Qwen/Qwen2.5-7B-Instruct), shortened to
# what these tests exercise: tools in the system turn, calls and tool results in the history.
QWEN_STYLE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_current_temperature", "arguments": '{"location": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path).metadata)


def test_template_that_takes_tools_renders_them_and_the_history(smollm2_tokenizer):
    template = ChatTemplate(QWEN_STYLE)
    assert template.takes_tools
    plan = plan_chat(template, smollm2_tokenizer, HISTORY, ChatOptions(parse_tools([WEATHER])))
    assert plan.fmt is FORMATS["hermes"] and plan.grammar is None
    assert '"name": "get_current_temperature"' in plan.prompt.split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "Paris"}}\n</tool_call>' \
        in plan.prompt
    assert "<tool_response>\n21 C\n</tool_response>" in plan.prompt


def test_template_without_tools_gets_the_generic_prompt(smollm2_path, smollm2_tokenizer):
    template = ChatTemplate.from_gguf_metadata(GGUFFile(smollm2_path).metadata, smollm2_tokenizer)
    assert template is not None and not template.takes_tools
    plan = plan_chat(template, smollm2_tokenizer, HISTORY, ChatOptions(parse_tools([WEATHER])))
    assert plan.fmt is FORMATS["generic"]
    system = plan.prompt.split("<|im_end|>")[0]
    assert "You can call functions" in system and '"get_current_temperature"' in system
    assert '{"tool_calls": [{"name": "get_current_temperature", "arguments": {"location": "Paris"}}]}' in plan.prompt
    assert "get_current_temperature returned: 21 C" in plan.prompt
    none = plan_chat(template, smollm2_tokenizer, HISTORY, ChatOptions(parse_tools([WEATHER]),
                                                                      parse_tool_choice("none", [])))
    assert none.fmt is None and "You can call functions" not in none.prompt


def test_format_detection_from_template_and_vocabulary():
    def never(text):
        return False

    assert detect_format("... <tool_call> ...", never).name == "hermes"
    assert detect_format("[AVAILABLE_TOOLS] [TOOL_CALLS]", never).name == "mistral"
    assert detect_format("[TOOL_CALLS]{{ name }}[ARGS]{{ args }}", never).name == "mistral-args"
    assert detect_format("<|start_header_id|>ipython<|end_header_id|>", never).name == "llama3"
    assert detect_format("{{ tools }}", lambda t: t == "[TOOL_CALLS]").name == "mistral"
    assert detect_format("{{ tools }}", never).name == "hermes"


def test_think_opened_by_the_template(smollm2_tokenizer):
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}<|Assistant|><think>\n")
    plan = plan_chat(template, smollm2_tokenizer, [{"role": "user", "content": "hi"}])
    assert plan.think_opened and plan.parser().parse("thinking\n</think>\n\nHello").reasoning_content == "thinking"
    off = plan_chat(template, smollm2_tokenizer, [{"role": "user", "content": "hi"}],
                    ChatOptions(reasoning_format="none"))
    assert off.parser().parse("a</think>b").content == "a</think>b"
    kw = ChatTemplate("{{ 'T' if enable_thinking is not defined or enable_thinking else 'F' }}")
    assert plan_chat(kw, smollm2_tokenizer, [{"role": "user", "content": "x"}],
                     ChatOptions(template_kwargs={"enable_thinking": False})).prompt == "F"


# -- forced calls: the grammars ----------------------------------------------------------------------


def walk(constraint: Constraint, tokenizer: Tokenizer, text: str) -> bool:
    """Whether the constraint accepts ``text`` (in its canonical tokens) and may end after it."""
    logits = np.zeros(tokenizer.vocab_size, dtype=np.float32)
    for token in tokenizer.encode(text, add_special=False):
        row = logits.copy()
        constraint.mask_logits(row)
        if not np.isfinite(row[token]):
            return False
        constraint.accept(token)
    return constraint.is_accepting()


@pytest.mark.parametrize("fmt, good", [
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "Paris"}}\n</tool_call>'),
    ("llama3", '{"name": "get_current_temperature", "parameters": {"location": "Paris"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_current_temperature", "arguments": {"location": "Paris"}}]'),
    ("mistral-args", '[TOOL_CALLS]get_current_temperature[ARGS]{"location": "Paris"}'),
    ("generic", GENERIC),
])
def test_forced_call_grammars(fmt, good, smollm2_tokenizer):
    tools = parse_tools([WEATHER, DATED])
    grammar = FORMATS[fmt].grammar(tools, False, lambda t: json.dumps(t))
    assert walk(Constraint.from_grammar(grammar, smollm2_tokenizer, param="tools"), smollm2_tokenizer, good)
    bad_args = good.replace('"location": "Paris"', '"place": "Paris"')
    assert not walk(Constraint.from_grammar(grammar, smollm2_tokenizer, param="tools"), smollm2_tokenizer, bad_args)
    other = good.replace("get_current_temperature", "get_humidity")
    assert not walk(Constraint.from_grammar(grammar, smollm2_tokenizer, param="tools"), smollm2_tokenizer, other)
    # what the grammar allows, the parser reads as the call
    m, _ = parse(fmt, good, step=1, incremental=True)
    assert calls(m) == [("get_current_temperature", {"location": "Paris"})]
    jsonschema.validate(json.loads(m.tool_calls[0].arguments), WEATHER["function"]["parameters"])


def test_serve_reasoning_format_flag():
    from minfer.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "smollm2"]).reasoning_format == "deepseek"
    assert parser.parse_args(["serve", "smollm2", "--reasoning-format", "none"]).reasoning_format == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "smollm2", "--reasoning-format", "loud"])
