"""Tool calls and reasoning through ``minfer serve`` with the official ``openai`` client, on SmolLM2 (whose
template takes no tools: the generic format, tools described in the system prompt)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(smollm2_path):
    with ServerProcess(smollm2_path, ["--parallel", "4", "--ctx-size", "8192", "--alias", "smollm2"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def create(client, **kw):
    return client.chat.completions.create(model="smollm2", **{"messages": ASK, "max_tokens": 80, **kw})


def test_named_tool_choice_validates_for_ten_seeds(client):
    def one(seed):
        return create(client, tools=[WEATHER, TIME], tool_choice=NAMED, temperature=0.8, seed=seed)

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(one, range(10)))
    for r in replies:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert len({c.choices[0].message.tool_calls[0].id for c in replies}) == 10


def test_streamed_call_assembles_to_the_whole_one(client):
    kw = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    whole = create(client, **kw).choices[0]
    chunks = list(create(client, stream=True, stream_options={"include_usage": True}, **kw))
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 3  # the arguments arrive in fragments
    streamed = []
    for piece in pieces:
        if piece.index == len(streamed):  # a new call: its id, type and name come first
            assert piece.id and piece.type == "function" and piece.function.name
            streamed.append([piece.function.name, piece.function.arguments or ""])
        else:
            assert piece.index == len(streamed) - 1 and piece.id is None and piece.function.name is None
            streamed[-1][1] += piece.function.arguments
    assert streamed == [[c.function.name, c.function.arguments] for c in whole.message.tool_calls]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"] == [whole.finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


@pytest.mark.parametrize("question, parallel", [("Tell me a joke.", False), ("What time is it in Tokyo?", False),
                                                ("Hi!", True)])
def test_required_always_gives_a_call(client, question, parallel):
    r = create(client, messages=[{"role": "user", "content": question}], tools=[WEATHER, TIME],
               tool_choice="required", parallel_tool_calls=parallel, temperature=0.8, seed=7, max_tokens=100)
    choice = r.choices[0]
    calls = choice.message.tool_calls
    assert calls
    if not parallel:
        assert choice.finish_reason == "tool_calls" and len(calls) == 1
    else:
        # SmolLM2 may go on adding calls until max_tokens; the calls before the cut are whole
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "length":
            calls = calls[:-1]
    for call in calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_round_trip(client):
    first = create(client, tools=[WEATHER], tool_choice=NAMED, temperature=0).choices[0].message
    [call] = first.tool_calls
    history = ASK + [
        {"role": "assistant", "content": first.content, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})},
    ]
    answer = create(client, messages=history, tools=[WEATHER], tool_choice="none", temperature=0,
                    max_tokens=30).choices[0]
    assert answer.message.tool_calls is None
    assert isinstance(answer.message.content, str) and answer.message.content.strip()
    assert answer.finish_reason in ("stop", "length")
    # under "auto" the model may call again or answer: either way a well-formed reply
    again = create(client, messages=history, tools=[WEATHER], temperature=0, max_tokens=40).choices[0]
    assert again.message.tool_calls or again.message.content
    assert again.finish_reason == ("tool_calls" if again.message.tool_calls else again.finish_reason)


def test_auto_answers_text_or_a_valid_call(client):
    for question in ("What is the weather like in Paris?", "Write one sentence about cats."):
        r = create(client, messages=[{"role": "user", "content": question}], tools=[WEATHER], temperature=0,
                   max_tokens=40)
        m = r.choices[0].message
        if m.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls"
            for call in m.tool_calls:
                assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
        else:
            assert m.content


def test_reasoning_is_split_whole_and_streamed(server, client):
    # SmolLM2 does not think; a grammar makes it write a <think> block, which the server must split off
    grammar = 'root ::= "<think>" [a-z ]{3,20} "</think>" [a-z ]{3,20}'
    kw = {"temperature": 0, "extra_body": {"grammar": grammar}, "max_tokens": 60}
    whole = create(client, **kw).choices[0].message
    assert whole.reasoning_content and whole.content and "<think>" not in whole.content + whole.reasoning_content
    stream = list(create(client, stream=True, **kw))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in stream if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert (reasoning, content) == (whole.reasoning_content, whole.content)
    raw = create(client, **{**kw, "extra_body": {"grammar": grammar, "reasoning_format": "none"}}).choices[0].message
    assert raw.content.startswith("<think>") and "</think>" in raw.content


def test_json_object_with_schema_is_applied(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    r = create(client, temperature=0.8, seed=3, response_format={"type": "json_object", "schema": schema})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.parametrize("extra, param, needle", [
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"x": {"type": "strng"}}}}}]}, "tools", "tools[1] 'broken': parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"required": "city"}}}]},
     "tools", "tools[0] 'bad'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "'get_time', which is not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "always"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "not a valid JSON Schema"),
    ({"response_format": {"type": "json_object", "schema": {"type": "object", "minProperties": -1}}},
     "response_format.schema", "not a valid JSON Schema"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{city: Paris"}}]}]}, "messages[1].tool_calls[0].function.arguments",
     "not valid JSON"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"reasoning_format": "loud"}, "reasoning_format", "loud"),
])
def test_bad_tool_requests_are_400s(server, client, extra, param, needle):
    with pytest.raises(BadRequestError) as e:
        create(client, **{k: v for k, v in extra.items() if k in ("messages", "tools", "tool_choice",
                                                                  "response_format")},
               extra_body={k: v for k, v in extra.items() if k == "reasoning_format"} or None)
    assert e.value.status_code == 400
    body = e.value.body
    assert body["param"] == param and needle in body["message"]
    raw = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == param
