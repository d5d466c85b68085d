"""Request fields llama-server takes on its chat, completion, Anthropic and embeddings endpoints, against a real
``minfer serve`` process (issue 39): context-overflow errors with their token counts, the chat prompt's token
count, ``continue_final_message``, ``response_format`` with the schema directly under it, ``logit_bias`` by
text and as pairs, prompt objects, Anthropic's cache usage and images in tool results, and embedding inputs
given as content parts."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import anthropic
import httpx
import numpy as np
import openai
import pytest
from conftest import derive_gguf, fixture_dir

import minfer
from minfer.server.protocols.llama import native_prompts
from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

N_CTX = 256  # one sequence: the slot's context is the whole --ctx-size
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VISION = Path(__file__).parent / "fixtures" / "gemma3_vision"
PNG = (VISION / "images" / "rgb_64x64.png").read_bytes()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny llama with a chat template (it has none of its own)."""
    path = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path_factory.mktemp("chat") / "tiny.gguf",
                       {"tokenizer.chat_template": CHATML})
    with ServerProcess(path, ["--parallel", "1", "--ctx-size", str(N_CTX), "--batch-size", "32"]) as s:
        yield s


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x")


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- 1. context overflow ------------------------------------------------------------------------------


def test_context_overflow_is_exceed_context_size_error_with_its_counts(tiny):
    """llama-server: 400, ``{"error": {"code": 400, "type": "exceed_context_size_error", "message": ...,
    "n_prompt_tokens": N, "n_ctx": C}}``; minfer's code stays OpenAI's ``context_length_exceeded``."""
    r = post(tiny, "/v1/completions", {"prompt": [5] * 300, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["code"] == "context_length_exceeded"
    assert err["n_prompt_tokens"] == 300 and err["n_ctx"] == N_CTX
    with pytest.raises(openai.BadRequestError) as e:  # a chat prompt the template makes too long
        client(tiny).chat.completions.create(model="m", messages=user("hi " * 300), max_tokens=2)
    err = e.value.body
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == N_CTX and err["n_prompt_tokens"] > N_CTX


# -- 2. the chat prompt's token count -------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"])
def test_chat_input_tokens_counts_the_rendered_prompt(tiny, path):
    """llama-server: ``{"input_tokens": N, "object": "response.input_tokens"}``."""
    messages = [{"role": "system", "content": "Be brief."}, *user("How far is the moon?")]
    r = post(tiny, path, {"model": "m", "messages": messages})
    assert r.status_code == 200, r.text
    prompt = post(tiny, "/apply-template", {"messages": messages}).json()["prompt"]
    ids = post(tiny, "/tokenize", {"content": prompt, "add_special": False}).json()["tokens"]
    assert r.json() == {"input_tokens": len(ids), "object": "response.input_tokens"}
    done = client(tiny).chat.completions.create(model="m", messages=messages, max_tokens=1)
    assert done.usage.prompt_tokens == len(ids)
    assert post(tiny, path, {"messages": []}).status_code == 400


# -- 3. continue_final_message -----------------------------------------------------------------------


def test_continue_final_message(tiny):
    """llama-server: both true is a 400 "Cannot set both add_generation_prompt and continue_final_message to
    true."; continuing renders the messages before the last with the assistant's turn opened, its text after."""
    messages = [*user("Name a colour."), {"role": "assistant", "content": "The colour is"}]
    r = post(tiny, "/v1/chat/completions", {"messages": messages, "continue_final_message": True,
                                            "add_generation_prompt": True, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    assert "add_generation_prompt" in r.json()["error"]["message"]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 4,
            "temperature": 0}
    r = post(tiny, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    prompt = post(tiny, "/apply-template", {"messages": messages[:1]}).json()["prompt"] + "The colour is"
    ids = post(tiny, "/tokenize", {"content": prompt, "add_special": False}).json()["tokens"]
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    plain = post(tiny, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0}).json()
    assert r.json()["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    counted = post(tiny, "/v1/chat/completions/input_tokens", body).json()["input_tokens"]
    assert counted == len(ids)
    assert post(tiny, "/apply-template", body).json()["prompt"] == prompt
    # a last message that is not the assistant's has nothing to continue; false alone is not honoured here
    r = post(tiny, "/v1/chat/completions", {**body, "messages": messages[:1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    r = post(tiny, "/v1/chat/completions", {"messages": messages[:1], "add_generation_prompt": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_generation_prompt"


# -- 4. response_format with the schema directly under it ----------------------------------------------


@pytest.mark.parametrize("schema, kind", [
    ({"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 2}, list),
    ({"type": "number", "minimum": 0, "maximum": 9}, (int, float)),
])
def test_response_format_json_schema_with_schema_directly(tiny, schema, kind):
    """``{"type": "json_schema", "schema": {...}}``: the schema is used, not ignored for any object."""
    r = client(tiny).chat.completions.create(
        model="m", messages=user("Give numbers."), max_tokens=48, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "schema": schema}})
    text = r.choices[0].message.content
    assert not text.lstrip().startswith("{"), text
    if r.choices[0].finish_reason == "stop":
        value = json.loads(text)
        assert isinstance(value, kind) and not isinstance(value, bool), text
        if isinstance(value, list):
            assert 1 <= len(value) <= 2 and all(isinstance(x, int | float) for x in value)
    else:  # cut off: still the start of the schema's JSON
        assert text.lstrip()[:1] in ("[",) if kind is list else text.lstrip()[:1] in "-0123456789", text
    bad = post(tiny, "/v1/chat/completions", {"messages": user("x"), "response_format": {"type": "json_schema",
                                                                                        "schema": "nope"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.schema"


# -- 5. logit_bias by text, as pairs, false ------------------------------------------------------------


def greedy_token(server, prompt: list[int]) -> int:
    r = post(server, "/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0, "return_tokens": True})
    return r.json()["tokens"][0]


def test_logit_bias_by_text_and_as_pairs(tiny):
    """llama-server: an object key that is not a number is text (each of its tokens biased), a list of
    ``[token id or text, bias]`` pairs, and ``false`` bans the token."""
    prompt = post(tiny, "/tokenize", {"content": "The fox", "add_special": True}).json()["tokens"]
    first = greedy_token(tiny, prompt)
    text = post(tiny, "/detokenize", {"tokens": [first]}).json()["content"]
    assert post(tiny, "/tokenize", {"content": text, "parse_special": False}).json()["tokens"] == [first]

    def first_of(bias) -> int:
        r = post(tiny, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 0,
                                           "logit_bias": bias})
        assert r.status_code == 200, r.text
        tok = r.json()["choices"][0]["logprobs"]["tokens"][0]
        return post(tiny, "/tokenize", {"content": tok, "parse_special": False}).json()["tokens"][0]

    assert first_of({}) == first
    for bias in ({text: -100}, [[text, -100]], [[first, False]], {str(first): False}, [[text, False]]):
        assert first_of(bias) != first, bias
    other = (first + 7) % 200 + 10
    assert first_of([[other, 100]]) == other and first_of({str(other): 100}) == other
    # the chat endpoint through the official client (it sends the object as given)
    chat = client(tiny).chat.completions.create(model="m", messages=user("hi"), max_tokens=1, temperature=0,
                                                logprobs=True, logit_bias={str(other): 100})
    assert chat.choices[0].logprobs.content[0].token == post(tiny, "/detokenize", {"tokens": [other]}).json()["content"]
    for bad in ([[1]], [["x", "high"]], {"": 1}, {"x": 101}, 5):
        r = post(tiny, "/v1/chat/completions", {"messages": user("hi"), "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (bad, r.text)


# -- 8. prompt objects ------------------------------------------------------------------------------------


def test_prompt_object_is_its_prompt_string():
    """llama-server's ``{"prompt_string": ...}`` (no images) is the string's prompt, alone or in a list."""
    def tokenize(text: str, add_special: bool) -> list[int]:
        return ([1] if add_special else []) + [ord(c) for c in text]

    assert native_prompts({"prompt_string": "ab"}, tokenize) == [[1, 97, 98]]
    assert native_prompts([{"prompt_string": "a"}, "b", [5, "c"]], tokenize) == [[1, 97], [1, 98], [5, 99]]
    assert native_prompts({"prompt_string": "ab", "multimodal_data": []}, tokenize) == [[1, 97, 98]]
    with pytest.raises(Exception, match="prompt_string"):
        native_prompts({"prompt_string": 3}, tokenize)


def test_prompt_objects_in_a_list_on_completion(tiny):
    """Through the server: a list of ``{"prompt_string"}`` objects is one prompt each, as their strings are."""
    body = {"n_predict": 3, "temperature": 0}
    plain = post(tiny, "/completion", {**body, "prompt": "The fox"}).json()
    objects = post(tiny, "/completion", {**body, "prompt": [{"prompt_string": "The fox"}]})
    assert objects.status_code == 200, objects.text
    assert objects.json()["content"] == plain["content"]
    bad = post(tiny, "/completion", {**body, "prompt": [{"prompt_string": 5}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    alone = post(tiny, "/completion", {**body, "prompt": {"prompt_string": "The fox"}})  # not in a list
    assert alone.status_code == 200, alone.text
    assert alone.json()["content"] == plain["content"]


def test_ignore_eos_shows_its_ban_in_generation_settings(tiny):
    """llama-server adds the end-of-generation tokens at -inf to the request's ``logit_bias`` under ``ignore_eos``
    and lists them in ``generation_settings.logit_bias`` as ``{"bias": null, "token": id}`` (-inf is JSON's
    null), after the request's own biases."""
    body = {"prompt": "The fox", "n_predict": 2, "temperature": 0, "logit_bias": [[7, 1.5]]}
    plain = post(tiny, "/completion", body).json()["generation_settings"]
    assert plain["ignore_eos"] is False and plain["logit_bias"] == [{"bias": 1.5, "token": 7}]
    banned = post(tiny, "/completion", {**body, "ignore_eos": True}).json()["generation_settings"]
    eog = minfer.load(fixture_dir("llama") / "model-f32.gguf").tokenizer.eog_ids
    assert banned["ignore_eos"] is True and banned["logit_bias"][0] == {"bias": 1.5, "token": 7}
    bans = banned["logit_bias"][1:]
    assert bans and all(b["bias"] is None for b in bans)
    assert {b["token"] for b in bans} == set(eog)


# -- 9. Anthropic ----------------------------------------------------------------------------------------


def tool_turn(*result_blocks: dict) -> list[dict]:
    return [{"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": list(result_blocks)}]}]


IMAGE_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(PNG).decode()}}


def test_anthropic_cache_usage_empty_messages_and_tool_result_images_on_a_text_model(tiny):
    """llama-server: ``usage.cache_read_input_tokens`` the prompt tokens served from the cache,
    ``input_tokens`` the rest; an empty ``messages`` is a 400."""
    c = anthropic.Anthropic(base_url=tiny.url, api_key="x")
    messages = [{"role": "user", "content": "Tell me about the long history of the moon " * 4}]
    count = c.messages.count_tokens(model="m", messages=messages).input_tokens
    c.messages.create(model="m", max_tokens=2, messages=messages)
    again = c.messages.create(model="m", max_tokens=2, messages=messages)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == count
    with c.messages.stream(model="m", max_tokens=2, messages=messages) as s:
        final = s.get_final_message()
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count
    with pytest.raises(anthropic.BadRequestError, match="messages"):
        c.messages.create(model="m", max_tokens=2, messages=[])
    # an image in a tool result: a model without vision says so, naming the block (it was a 500)
    r = post(tiny, "/v1/messages", {"model": "m", "max_tokens": 2,
                                    "messages": tool_turn({"type": "text", "text": "here:"}, IMAGE_BLOCK)})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "messages[2].content[0].content[1]" in message and "takes no images" in message
    r = post(tiny, "/v1/messages", {"model": "m", "max_tokens": 2,
                                    "messages": tool_turn({"type": "document", "source": {}})})
    assert r.status_code == 400 and "messages[2].content[0].content[0]" in r.json()["error"]["message"]


def test_anthropic_tool_result_image_on_a_vision_model():
    """A vision model takes an image returned by a tool: it counts the image's tokens and answers."""
    with ServerProcess(VISION / "hf", ["--ctx-size", "1024", "--batch-size", "64"]) as s:
        c = anthropic.Anthropic(base_url=s.url, api_key="x")
        with_image = tool_turn({"type": "text", "text": "here:"}, IMAGE_BLOCK)
        text_only = tool_turn({"type": "text", "text": "here:"})
        n_image = c.messages.count_tokens(model="m", messages=with_image).input_tokens
        n_text = c.messages.count_tokens(model="m", messages=text_only).input_tokens
        assert n_image > n_text + 16  # the image's tokens, not a marker's few
        r = c.messages.create(model="m", max_tokens=3, messages=with_image)
        assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == n_image


# -- 10. embeddings --------------------------------------------------------------------------------------


def test_embedding_input_as_content_parts_is_the_joined_text(tiny):
    """llama-server: an input item ``{"content": [{"type": "text", ...}, ...]}`` is tokenized as its parts' text."""
    parts = {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
    r = client(tiny).embeddings.create(model="m", input=[parts, "hello world"])  # type: ignore[list-item]
    a, b = (np.asarray(d.embedding) for d in r.data)
    assert np.allclose(a, b, atol=1e-6)
    assert r.usage.prompt_tokens == 2 * len(post(tiny, "/tokenize", {"content": "hello world",
                                                                     "add_special": True}).json()["tokens"])
    bad = post(tiny, "/v1/embeddings", {"input": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0].content[0]"


# -- /props and /v1/models: what llama-server says of the model --------------------------------------------


def test_props_and_models_describe_the_file_as_llama_server_does(tiny):
    """llama-server on this file: ``/props`` ``model_ftype`` "all F32" (``general.file_type`` 0), ``endpoint_metrics``
    and ``chat_template_caps`` (ChatML: string content and a system role, no tools); ``/v1/models`` has a
    ``models`` list (ollama's listing shape) beside ``data``, whose ``meta`` has ``vocab_type`` 2 (byte-level BPE)
    and ``ftype``."""
    props = httpx.get(tiny.url + "/props", timeout=30).json()
    assert props["model_ftype"] == "all F32" and props["endpoint_metrics"] is True
    caps = props["chat_template_caps"]
    assert caps["supports_string_content"] and caps["supports_system_role"]
    assert not caps["supports_tools"] and not caps["supports_tool_calls"] and not caps["supports_typed_content"]
    for path in ("/v1/models", "/models"):
        listing = httpx.get(tiny.url + path, timeout=30).json()
        card = listing["data"][0]
        assert card["meta"]["vocab_type"] == 2 and card["meta"]["ftype"] == "all F32"
        (entry,) = listing["models"]
        assert entry["name"] == entry["model"] == card["id"] and entry["capabilities"] == ["completion"]
        assert entry["details"]["format"] == "gguf" and entry["details"]["quantization_level"] == "all F32"
