"""``Model.chat(..., tools=...)`` in the Python API, on SmolLM2: a forced call validates, the streamed
deltas assemble to the whole message, and plain chat is unchanged."""

from __future__ import annotations

import json

import jsonschema
import pytest

import minfer
from minfer.errors import BadRequestError
from minfer.runtime.chat import ChatMessage, MessageBuilder, ToolCallStart

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def model(smollm2_path):
    return minfer.load(smollm2_path, n_ctx=1024)


def test_forced_call_and_stream(model):
    whole = model.chat(ASK, 60, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert isinstance(whole, ChatMessage) and whole.content is None
    [call] = whole.tool_calls
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    deltas = list(model.chat(ASK, 60, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                             temperature=0, stream=True))
    assert isinstance(deltas[0], ToolCallStart) and deltas[0].name == "get_weather"
    b = MessageBuilder()
    b.add(deltas)
    assert [(c.name, c.arguments) for c in b.message().tool_calls] == [(call.name, call.arguments)]
    assert model.chat(ASK, 8, temperature=0) == model.generate(model.render_chat(ASK), 8, temperature=0,
                                                               add_special=False)
    with pytest.raises(BadRequestError, match="not among the tools"):
        model.chat(ASK, 8, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
