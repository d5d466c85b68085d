"""OpenAI's ``/v1/responses`` and Anthropic's ``/v1/messages`` on a real ``minfer serve`` process, driven by
the official ``openai`` and ``anthropic`` clients: text whole and streamed (every event checked against the
SDK's own types), tool calls forced and answered, the error bodies, and the key in ``x-api-key``."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from anthropic.types import RawMessageStreamEvent
from conftest import fixture_dir
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one sentence."
WEATHER_TOOL = {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False},
}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2_path):
    with ServerProcess(smollm2_path, ["--parallel", "2", "--ctx-size", "4096", "--alias", "smollm2"]) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=600)


def chat_answer(oai, messages, max_tokens):
    r = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


# -- Responses -------------------------------------------------------------------------------------------


TERSE = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": QUESTION}]
FUNCTION = {"type": "function", **WEATHER_TOOL}
FORCED = {"type": "function", "name": "get_weather"}
WEATHER_Q = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def whole_response(oai):
    return oai.responses.create(model="smollm2", instructions="You are terse.", input=QUESTION,
                                max_output_tokens=24, temperature=0)


def test_responses_create_is_the_chat_answer(oai, whole_response):
    r = whole_response
    text, finish, usage = chat_answer(oai, TERSE, 24)
    assert r.output_text == text and "Paris" in text
    assert r.object == "response" and r.model == "smollm2" and r.id.startswith("resp_")
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == usage.prompt_tokens and r.usage.output_tokens == usage.completion_tokens
    assert r.instructions == "You are terse." and r.store is False


def test_responses_stream_assembles_to_the_whole_response(oai, whole_response):
    events = list(oai.responses.create(model="smollm2", input=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=24, temperature=0, stream=True))
    strict = TypeAdapter(ResponseStreamEvent)
    for e in events:  # the SDK parses leniently; the SDK's types, enforced, are the check
        strict.validate_python(e.model_dump(exclude_unset=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.incomplete" if whole_response.status == "incomplete" else "response.completed")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole_response.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole_response.usage.output_tokens


def test_responses_stream_helper_gives_the_final_response(oai):
    with oai.responses.stream(model="smollm2", input="Say hello.", max_output_tokens=60, temperature=0) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text == text and text


@pytest.fixture(scope="module")
def forced_response(oai):
    return oai.responses.create(model="smollm2", input=WEATHER_Q, tools=[FUNCTION], tool_choice=FORCED,
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)


def test_responses_forced_function_call_validates(oai, forced_response):
    hot = oai.responses.create(model="smollm2", input=WEATHER_Q, tools=[FUNCTION], tool_choice=FORCED,
                               parallel_tool_calls=False, max_output_tokens=60, temperature=0.8)
    for r in (forced_response, hot):
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER_TOOL["parameters"])
        assert r.status == "completed" and r.tools[0].name == "get_weather"


def test_responses_streamed_function_call_assembles_to_the_whole_one(oai, forced_response):
    events = list(oai.responses.create(model="smollm2", input=WEATHER_Q, tools=[FUNCTION], tool_choice=FORCED,
                                       parallel_tool_calls=False, max_output_tokens=60, temperature=0,
                                       stream=True))
    strict = TypeAdapter(ResponseStreamEvent)
    for e in events:
        strict.validate_python(e.model_dump(exclude_unset=True))
    call = next(o for o in forced_response.output if o.type == "function_call")
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    assert added.item.name == call.name
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                   and e.item_id == added.item.id)
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert args == done.arguments == call.arguments
    assert events[-1].type == "response.completed"


def test_responses_function_call_output_round_trip_gets_text(oai, forced_response):
    call = next(o for o in forced_response.output if o.type == "function_call")
    history = [{"role": "user", "content": WEATHER_Q},
               *[o.model_dump(exclude_none=True) for o in forced_response.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}]
    second = oai.responses.create(model="smollm2", input=history, tools=[FUNCTION], tool_choice="none",
                                  max_output_tokens=30, temperature=0)
    assert [o.type for o in second.output] == ["message"]
    assert second.output_text.strip()


def test_bad_responses_requests_get_a_400_naming_the_field(server, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="smollm2", input=[{"type": "function_call_output", "call_id": "c9", "output": "x"}])
    assert e.value.body["param"] == "input[0].call_id" and "c9" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="smollm2", input="x", previous_response_id="resp_abc")
    assert e.value.body["param"] == "previous_response_id"
    r = httpx.post(server.url + "/v1/responses", json={"input": "x", "tools": [{"type": "function", "name": "f",
                                                                              "parameters": {"type": 5}}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools[0]"), r.text
    r = httpx.post(server.url + "/v1/responses", content=b"{oops")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


# -- Messages --------------------------------------------------------------------------------------------


def test_messages_create_is_the_chat_answer(oai, claude):
    m = claude.messages.create(model="smollm2", max_tokens=24, system="You are terse.",
                               messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY)
    text, finish, usage = chat_answer(oai, TERSE, 24)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish]
    # as Anthropic and llama-server count: input_tokens the prompt tokens not read from the prefix cache (the
    # chat answer just before shares this prompt), cache_read_input_tokens the rest
    prompt_tokens = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert prompt_tokens == usage.prompt_tokens and m.usage.output_tokens == usage.completion_tokens
    assert m.role == "assistant" and m.type == "message" and m.model == "smollm2"
    counted = claude.messages.count_tokens(model="smollm2", system="You are terse.",
                                           messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == prompt_tokens


def test_messages_stream_events_and_the_stream_helper(claude):
    kw = {"model": "smollm2", "max_tokens": 24, "messages": [{"role": "user", "content": QUESTION}],
          "extra_body": GREEDY}
    events = list(claude.messages.create(**kw, stream=True))
    strict = TypeAdapter(RawMessageStreamEvent)
    for e in events:
        strict.validate_python(e.model_dump(exclude_unset=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    with claude.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == final.content[0].text == text and "Paris" in text
    assert final.stop_reason == events[-2].delta.stop_reason
    assert final.usage.output_tokens == events[-2].usage.output_tokens
    # (the second request reads from the cache what the first left there: the split differs, the sum does not)
    start = events[0].message.usage
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        start.input_tokens + start.cache_read_input_tokens


def test_messages_stop_sequence_and_prefill(claude):
    m = claude.messages.create(model="smollm2", max_tokens=30, stop_sequences=[" 6"], extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."},
                                         {"role": "assistant", "content": "1, 2, 3,"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " 6"
    assert m.content[0].text == " 4, 5,"  # the continuation of the prefill, without it


def test_messages_forced_tool_use_validates_and_round_trips(claude):
    tool = {"name": WEATHER_TOOL["name"], "description": WEATHER_TOOL["description"],
            "input_schema": WEATHER_TOOL["parameters"]}
    question = {"role": "user", "content": WEATHER_Q}
    m = claude.messages.create(model="smollm2", max_tokens=60, tools=[tool], messages=[question],
                               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                               extra_body={"temperature": 0.8})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, WEATHER_TOOL["parameters"])
    with claude.messages.stream(model="smollm2", max_tokens=60, tools=[tool], messages=[question],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                extra_body=GREEDY) as s:
        streamed = s.get_final_message()
    use = next(b for b in streamed.content if b.type == "tool_use")
    assert streamed.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER_TOOL["parameters"])  # assembled from the input_json_delta fragments
    answer = claude.messages.create(model="smollm2", max_tokens=30, tools=[tool], extra_body=GREEDY, messages=[
        question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in streamed.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "18 degrees and sunny"}]}], tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text.strip()


def test_bad_messages_requests_get_anthropic_errors_naming_the_field(server, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="smollm2", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: is required"}}
    r = httpx.post(server.url + "/v1/messages", json={"max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]})
    assert r.status_code == 400 and "messages[0].content[0].tool_use_id" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", content=b"[1, 2")
    assert r.status_code == 400 and r.json()["type"] == "error"


# -- the key in x-api-key --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server():
    with ServerProcess(fixture_dir("gemma3") / "model-f32.gguf", ["--api-key", "s3cret", "--ctx-size", "256"]) as s:
        yield s


def test_x_api_key_is_accepted_and_a_wrong_key_is_an_anthropic_401(keyed_server):
    url = keyed_server.url
    good = anthropic.Anthropic(base_url=url, api_key="s3cret", max_retries=0, timeout=60)
    m = good.messages.create(model="model-f32.gguf", max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                             extra_body=GREEDY)  # the SDK sends x-api-key and anthropic-version
    assert m.usage.output_tokens <= 3
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    # either header works on every route; the OpenAI ones keep OpenAI's error body
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
    r = httpx.get(url + "/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0).responses.create(
        model="model-f32.gguf", input="hi", max_output_tokens=3)
    assert r.usage.output_tokens <= 3
