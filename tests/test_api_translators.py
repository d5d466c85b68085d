"""The Responses and Messages translators without a server: request bodies to the chat request the engine
runs (and a 400 naming the field for bad ones), turn events to each API's stream events and final object,
every one validated against the official SDKs' own types (pydantic, required fields enforced)."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from minfer.server.errors import ApiError, anthropic_error_body
from minfer.server.protocols.anthropic import MessageBuilder, parse_messages
from minfer.server.protocols.responses import ResponseBuilder, parse_responses

RESPONSE_EVENT = TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


# -- Responses: requests -------------------------------------------------------------------------------


def test_responses_string_input_and_instructions():
    req = parse_responses({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.5})
    assert req.chat.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert req.chat.params.max_tokens == 7
    assert req.chat.params.sampling["temperature"] == 0.5


def test_responses_items_become_chat_messages():
    req = parse_responses({"input": [
        {"role": "developer", "content": "sys"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]})
    # the chat layer hands the template the arguments as an object
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert req.chat.messages[:3] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "ab"},
                                     {"role": "assistant", "content": "let me look", "tool_calls": [call]}]
    assert req.chat.messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_responses_text_format_json_schema():
    req = parse_responses({"input": "x", "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}})
    assert req.chat.params.json_schema == WEATHER
    assert req.text_format["format"]["name"] == "w"


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({}, "input", "required"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "'user'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url", "data: URL"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id", "nope"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments", "string"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "store"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "does not store"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "function"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools[0].parameters", "Schema"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name", "'g'"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "at least one tool"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]},
     "tools[0].parameters", "JSON Schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ">= 1"),
    ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens", "integer"),
    ({"input": "x", "temperature": 3}, "temperature", "between"),
    ({"input": "x", "stream": "yes"}, "stream", "true or false"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
])
def test_bad_responses_requests_name_the_field(body, param, fragment):
    with pytest.raises(ApiError) as e:
        parse_responses(body)
    assert e.value.status == 400 and e.value.param == param
    head, _, last = param.rpartition(".")  # "tools[0] 'f': parameters ..." names it too
    assert param in e.value.message or (head in e.value.message and f": {last} " in e.value.message)
    assert fragment in e.value.message


# -- Responses: events ---------------------------------------------------------------------------------


def _responses_run(tool: bool) -> tuple[ResponseBuilder, list[dict]]:
    req = parse_responses({"input": "x", "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]})
    b = ResponseBuilder(req, "m")
    events = b.start() + b.text("Let me ") + b.text("check.")
    if tool:
        events += b.tool_call("call_1", "get_weather") + b.arguments('{"city": ') + b.arguments('"Paris"}')
    events += b.finish("tool_calls" if tool else "stop", 10, 5, cached_tokens=3)
    return b, events


@pytest.mark.parametrize("tool", [False, True])
def test_response_events_validate_against_the_sdk_types(tool):
    b, events = _responses_run(tool)
    parsed = [RESPONSE_EVENT.validate_python(e) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(events)))
    kinds = [e.type for e in parsed]
    assert kinds[:6] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta", "response.output_text.delta"]
    assert kinds[6:9] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    if tool:
        assert kinds[9:] == ["response.output_item.added", "response.function_call_arguments.delta",
                             "response.function_call_arguments.delta", "response.function_call_arguments.done",
                             "response.output_item.done", "response.completed"]
    final = Response.model_validate(b.response)
    assert parsed[-1].response == final and final.status == "completed"
    assert final.output_text == "Let me check."
    assert final.usage.input_tokens == 10 and final.usage.output_tokens == 5 and final.usage.total_tokens == 15
    assert final.usage.input_tokens_details.cached_tokens == 3
    if tool:
        call = final.output[1]
        assert call.type == "function_call" and call.call_id == "call_1" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"}
        added = [e for e in parsed if e.type == "response.output_item.added"][1]
        assert added.item.id == call.id and added.output_index == 1


def test_a_truncated_response_is_incomplete():
    b = ResponseBuilder(parse_responses({"input": "x"}), "m")
    events = b.start() + b.text("abc") + b.finish("length", 3, 16)
    assert events[-1]["type"] == "response.incomplete"
    final = Response.model_validate(b.response)
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete"


# -- Messages: requests --------------------------------------------------------------------------------


def test_messages_blocks_become_chat_messages():
    req = parse_messages({"max_tokens": 20, "system": [{"type": "text", "text": "sys"}], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "checking"},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "thanks"}]},
    ], "stop_sequences": ["END"], "top_k": 5})
    m = req.chat.messages
    assert m[0] == {"role": "system", "content": "sys"}
    assert m[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert m[3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert m[4] == {"role": "user", "content": "thanks"}
    assert req.chat.params.stop == ["END"] and req.chat.params.sampling["top_k"] == 5
    assert req.prefill == ""


def test_messages_last_assistant_message_is_a_prefill():
    req = parse_messages({"max_tokens": 5, "messages": [{"role": "user", "content": "Count"},
                                                         {"role": "assistant", "content": "1, 2,"}]})
    assert req.prefill == "1, 2," and req.chat.messages == [{"role": "user", "content": "Count"}]


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens", "required"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens", ">= 1"),
    ({"max_tokens": 5}, "messages", "required"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "'user'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages[0].content[0]", "an image part needs"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"}]}]},
     "messages[0].content[0].tool_use_id", "t9"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature", "0 and 1"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
     "tools[0].input_schema", "required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f", "input_schema": {"type": "object", "required": 3}}]},
     "tools[0].input_schema", "JSON Schema"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f", "input_schema": WEATHER}], "tool_choice": {"type": "tool", "name": "g"}},
     "tool_choice.name", "'g'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}},
     "tool_choice.type", "'auto'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"},
     "stop_sequences", "list"),
])
def test_bad_messages_requests_name_the_field(body, param, fragment):
    with pytest.raises(ApiError) as e:
        parse_messages(body)
    assert e.value.status == 400 and e.value.param == param
    head, _, last = param.rpartition(".")  # "tools[0] 'f': parameters ..." names it too
    assert param in e.value.message or (head in e.value.message and f": {last} " in e.value.message)
    assert fragment in e.value.message
    body = anthropic_error_body(e.value)
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


def test_anthropic_error_types_follow_the_status():
    for status, kind in ((401, "authentication_error"), (404, "not_found_error"), (429, "rate_limit_error"),
                         (500, "api_error"), (503, "overloaded_error")):
        assert anthropic_error_body(ApiError("m", status=status))["error"]["type"] == kind


# -- Messages: events ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("tool", "finish", "stop", "reason"), [
    (False, "stop", None, "end_turn"), (False, "length", None, "max_tokens"),
    (False, "stop", "END", "stop_sequence"), (True, "tool_calls", None, "tool_use"),
])
def test_message_events_validate_against_the_sdk_types(tool, finish, stop, reason):
    b = MessageBuilder("m", input_tokens=12)
    events = b.start() + b.text("Let me ") + b.text("check.")
    if tool:
        events += b.tool_call("toolu_1", "get_weather") + b.arguments('{"city"') + b.arguments(': "Paris"}')
    events += b.finish(finish, stop, 7)
    parsed = [MESSAGE_EVENT.validate_python(e) for e in events if e["type"] != "ping"]
    kinds = [e.type for e in parsed]
    assert kinds[:4] == ["message_start", "content_block_start", "content_block_delta", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert parsed[0].message.stop_reason is None and parsed[0].message.usage.input_tokens == 12
    assert parsed[-2].delta.stop_reason == reason and parsed[-2].usage.output_tokens == 7
    final = Message.model_validate(b.message)
    assert final.stop_reason == reason and final.stop_sequence == stop
    assert final.content[0].type == "text" and final.content[0].text == "Let me check."
    if tool:
        use = final.content[1]
        assert use.type == "tool_use" and use.id == "toolu_1" and use.input == {"city": "Paris"}
        deltas = [e.delta.partial_json for e in parsed if e.type == "content_block_delta" and e.index == 1]
        assert "".join(deltas) == '{"city": "Paris"}'


def test_reasoning_is_a_reasoning_item_and_a_thinking_block():
    b = ResponseBuilder(parse_responses({"input": "x"}), "m")
    events = b.start() + b.reasoning("Hmm, ") + b.reasoning("easy.") + b.text("4") + b.finish("stop", 3, 4)
    parsed = [RESPONSE_EVENT.validate_python(e) for e in events]
    assert [e.type for e in parsed][2:6] == ["response.output_item.added", "response.content_part.added",
                                            "response.reasoning_text.delta", "response.reasoning_text.delta"]
    final = Response.model_validate(b.response)
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == "Hmm, easy."
    assert final.output_text == "4"

    m = MessageBuilder("m", input_tokens=3)
    events = m.start() + m.reasoning("Hmm, ") + m.reasoning("easy.") + m.text("4") + m.finish("stop", None, 4)
    parsed = [MESSAGE_EVENT.validate_python(e) for e in events if e["type"] != "ping"]
    assert parsed[2].delta.type == "thinking_delta"
    final = Message.model_validate(m.message)
    assert [blk.type for blk in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Hmm, easy." and final.content[1].text == "4"
