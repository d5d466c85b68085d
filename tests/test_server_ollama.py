"""ollama's API (``/api/*``) through ``minfer serve`` with the official ``ollama`` client, on SmolLM2: every stream
object goes through the client's own pydantic types, and each answer is checked against the OpenAI endpoints of
the same server (the same turn at temperature 0), the file's known sha256 and the tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import numpy as np
import ollama
import pytest
from openai import OpenAI

from minfer.pull import KNOWN_MODELS
from minfer.runtime.chat import ChatMessage, ToolCall
from minfer.server.protocols.ollama import ollama_message
from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow
DATA = Path(__file__).parent / "data"

# the key order ollama's client sends (its pydantic Tool writes "required" before "properties"), so that the OpenAI
# request renders the very same tool description into the prompt
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def server(smollm2_path):
    # --strict-model: a name the server does not have is a 404, as ollama's
    with ServerProcess(smollm2_path, ["--parallel", "2", "--strict-model"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=300)


@pytest.fixture(scope="module")
def openai_client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def name(client):
    return client.list().models[0].model


def test_tags_and_ps_describe_the_file(client, smollm2_path, name):
    listed = client.list().models
    assert len(listed) == 1 and name == f"{smollm2_path.stem}:latest"
    m = listed[0]
    assert m.digest == KNOWN_MODELS["smollm2"].sha256  # the file's own sha256, as minfer pull verified it
    assert m.size > 0.9 * smollm2_path.stat().st_size
    assert (m.details.format, m.details.family, m.details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert m.details.parameter_size.endswith("M")
    running = client.ps().models
    assert [r.model for r in running] == [name] and running[0].context_length > 0


def test_show_gives_the_gguf_metadata_and_template(client, name, server):
    shown = client.show(name)
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["tokenizer.ggml.tokens"] is None  # the vocabulary left out, as ollama's
    assert shown.modelinfo["llama.block_count"] == 30
    props = httpx.get(server.url + "/props").json()
    assert shown.template == props["chat_template"]
    assert "completion" in shown.capabilities


def test_chat_equals_openai_s_turn_whole_and_streamed(client, openai_client, name):
    whole = client.chat(model=name, messages=ASK, options=GREEDY, stream=False)
    ref = openai_client.chat.completions.create(model=name.removesuffix(":latest"), messages=ASK, temperature=0,
                                                max_tokens=24)
    assert whole.message.role == "assistant" and whole.message.content == ref.choices[0].message.content
    assert whole.prompt_eval_count == ref.usage.prompt_tokens and whole.eval_count == ref.usage.completion_tokens
    assert whole.done and whole.done_reason == {"length": "length", "stop": "stop"}[ref.choices[0].finish_reason]
    assert whole.total_duration >= whole.eval_duration > 0 and whole.load_duration == 0
    parts = list(client.chat(model=name, messages=ASK, options=GREEDY, stream=True))  # each part: ChatResponse
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].prompt_eval_count == whole.prompt_eval_count


def test_chat_with_a_tool_answers_as_openai_s(client, openai_client, name):
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    got = client.chat(model=name, messages=ask, tools=[WEATHER], options={"temperature": 0, "num_predict": 60})
    ref = openai_client.chat.completions.create(model=name.removesuffix(":latest"), messages=ask, tools=[WEATHER],
                                                temperature=0, max_tokens=60).choices[0].message
    calls = [(c.function.name, dict(c.function.arguments)) for c in got.message.tool_calls or []]
    assert calls == [(c.function.name, json.loads(c.function.arguments)) for c in ref.tool_calls or []]
    assert got.message.content == (ref.content or "")
    streamed = list(client.chat(model=name, messages=ask, tools=[WEATHER], stream=True,
                                options={"temperature": 0, "num_predict": 60}))
    assert [(c.function.name, dict(c.function.arguments)) for p in streamed for c in p.message.tool_calls or []] \
        == calls


def test_a_forced_call_comes_as_ollama_s_objects_whole_and_streamed(server, openai_client, name):
    """SmolLM2 answers in text unless asked for a call: minfer's own ``tool_choice`` asks, as on OpenAI's route."""
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    body = {"model": name, "messages": ask, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "options": {"temperature": 0, "num_predict": 60}}
    whole = ollama.ChatResponse(**httpx.post(server.url + "/api/chat", json={**body, "stream": False},
                                             timeout=300).json())
    ref = openai_client.chat.completions.create(model=name.removesuffix(":latest"), messages=ask, tools=[WEATHER],
                                                tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                max_tokens=60)
    assert ref.choices[0].finish_reason == "tool_calls"
    want = [(c.function.name, json.loads(c.function.arguments)) for c in ref.choices[0].message.tool_calls]
    assert want and [(c.function.name, dict(c.function.arguments)) for c in whole.message.tool_calls] == want
    with httpx.stream("POST", server.url + "/api/chat", json=body, timeout=300) as r:
        parts = [ollama.ChatResponse(**json.loads(line)) for line in r.iter_lines() if line]
    assert [(c.function.name, dict(c.function.arguments)) for p in parts for c in p.message.tool_calls or []] == want
    assert parts[-1].done and parts[-1].done_reason == "stop"


def test_a_tool_round_trip_in_the_history_is_read(client, name):
    """An assistant turn with ollama's tool_calls (arguments as an object) and the tool's answer (tool_name)."""
    history = [{"role": "user", "content": "What is the weather like in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny, 24 degrees", "tool_name": "get_weather"}]
    r = client.chat(model=name, messages=history, tools=[WEATHER], options={"temperature": 0, "num_predict": 30})
    assert r.done and r.prompt_eval_count > 40


def test_the_answer_side_writes_calls_as_objects():
    m = ChatMessage(None, "let me look", [ToolCall("call_0", "get_weather", '{"city": "Paris"}')])
    assert ollama_message(m) == {"role": "assistant", "content": "", "thinking": "let me look",
                                 "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}


def test_generate_raw_equals_a_completion_and_gives_the_context(client, openai_client, name, server):
    prompt = "The capital of France is"
    got = client.generate(model=name, prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 12})
    ref = openai_client.completions.create(model=name.removesuffix(":latest"), prompt=prompt, temperature=0,
                                           max_tokens=12)
    assert got.response == ref.choices[0].text
    ids = httpx.post(server.url + "/tokenize", json={"content": prompt + got.response, "add_special": True}).json()
    assert list(got.context) == ids["tokens"][:len(got.context)] and len(got.context) >= got.prompt_eval_count
    parts = list(client.generate(model=name, prompt=prompt, raw=True, stream=True,
                                 options={"temperature": 0, "num_predict": 12}))
    assert "".join(p.response for p in parts) == got.response and list(parts[-1].context) == list(got.context)


def test_generate_runs_the_template_with_the_system_prompt(client, openai_client, name):
    got = client.generate(model=name, prompt="Name a colour.", system="You answer in one word.", options=GREEDY)
    ref = openai_client.chat.completions.create(
        model=name.removesuffix(":latest"), temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "You answer in one word."},
                  {"role": "user", "content": "Name a colour."}])
    assert got.response == ref.choices[0].message.content and got.done


def test_an_empty_generate_loads_the_model(client, name):
    r = client.generate(model=name)
    assert r.done and r.done_reason == "load" and r.response == ""
    r = client.chat(model=name, messages=[])  # ollama's other load request: no messages
    assert r.done and r.done_reason == "load" and r.message.role == "assistant" and not r.message.content


def test_an_unload_request_says_this_server_keeps_its_model(client, name):
    """ollama's unload request (no prompt or no messages, keep_alive 0) on a one-model server started without
    --keep-alive or --sleep-idle-seconds: it cannot unload, and says how to start one that can."""
    for call in (lambda: client.generate(model=name, keep_alive=0), lambda: client.chat(model=name, keep_alive=0)):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 400 and "--keep-alive" in e.value.error
    assert client.generate(model=name, keep_alive="5m").done_reason == "load"


def test_format_json_gives_json(client, name):
    r = client.chat(model=name, messages=[{"role": "user", "content": "Describe a cat as JSON."}], format="json",
                    options={"temperature": 0, "num_predict": 60})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    r = client.chat(model=name, messages=[{"role": "user", "content": "Name a cat."}], format=schema,
                    options={"temperature": 0, "num_predict": 60})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content)["name"], str)


def test_embed_is_openai_s_vectors_normalized(client, openai_client, name):
    texts = ["hello there", "the cat sat on the mat"]
    got = client.embed(model=name, input=texts)
    ref = openai_client.embeddings.create(model=name.removesuffix(":latest"), input=texts)
    a = np.array(got.embeddings)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(a, np.array([d.embedding for d in ref.data]), atol=1e-6)
    assert got.prompt_eval_count > 0
    old = np.array(client.embeddings(model=name, prompt=texts[0]).embedding)  # the older endpoint: not normalized
    np.testing.assert_allclose(old / np.linalg.norm(old), a[0], atol=1e-5)


def test_pull_streams_ollama_s_statuses(client):
    statuses = [p.status for p in client.pull("smollm2", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("no-such-model")
    assert err.value.status_code == 404 and "minfer pull knows" in err.value.error


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="llama3:8b", messages=ASK)
    assert err.value.status_code == 404 and "llama3:8b" in err.value.error


@pytest.mark.parametrize("extra,needle", [
    ({"options": {"bogus": 1}}, "options.bogus: is not an option"),
    ({"options": {"temperature": "hot"}}, "options.temperature: must be a number"),
    ({"options": {"temperature": -1}}, "options.temperature"),
    ({"options": {"num_ctx": 10 ** 7}}, "options.num_ctx"),
    ({"format": "xml"}, "format: must be"),
    ({"keep_alive": "soon"}, "keep_alive: must be"),
    ({"think": "very"}, "think: must be"),
    ({"messages": [{"role": "user", "content": "x", "images": ["aGVsbG8="]}]}, "no vision"),
    ({"messages": "hi"}, "messages: must be a non-empty list"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_chat_bodies_are_400s_naming_the_field(server, name, extra, needle):
    r = httpx.post(server.url + "/api/chat", json={"model": name, "messages": ASK, "stream": False, **extra})
    assert r.status_code == 400 and isinstance(r.json()["error"], str) and needle in r.json()["error"]


@pytest.mark.parametrize("method,path", [("DELETE", "/api/delete"), ("POST", "/api/copy"), ("POST", "/api/create"),
                                         ("POST", "/api/push")])
def test_the_model_store_routes_say_what_to_do_instead(server, name, method, path):
    r = httpx.request(method, server.url + path, json={"model": name})
    assert r.status_code == 501 and "minfer" in r.json()["error"]


def test_version_and_ndjson(server, name):
    assert httpx.get(server.url + "/api/version").json()["version"].count(".") == 2
    with httpx.stream("POST", server.url + "/api/chat", json={"model": name, "messages": ASK,
                                                             "options": {"num_predict": 4}}, timeout=300) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])


def test_the_digest_is_the_file_s_sha256(client, smollm2_path):
    h = hashlib.sha256(smollm2_path.read_bytes()).hexdigest()
    assert client.list().models[0].digest == h


def test_the_api_key_and_the_body_cap_hold_on_ollama_s_routes(smollm2_path):
    with ServerProcess(smollm2_path, ["--api-key", "s3cret", "--max-body-size", "2048"]) as s:
        with pytest.raises(ollama.ResponseError) as err:
            ollama.Client(host=s.url).list()
        assert err.value.status_code == 401 and isinstance(err.value.error, str)
        keyed = ollama.Client(host=s.url, headers={"Authorization": "Bearer s3cret"})
        assert keyed.list().models
        with pytest.raises(ollama.ResponseError) as err:
            keyed.chat(model="m", messages=[{"role": "user", "content": "x" * 4096}])
        assert err.value.status_code == 413 and isinstance(err.value.error, str)


def test_langchain_s_chat_ollama_invokes_and_streams(server, client, name):
    """LangChain's ``ChatOllama`` and ``OllamaEmbeddings`` (PyPI ``langchain-ollama``) against minfer's server."""
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    llm = ChatOllama(model=name, base_url=server.url, temperature=0, num_predict=20)
    answer = llm.invoke("What is the capital of France?")
    ref = client.chat(model=name, messages=ASK, options={"temperature": 0, "num_predict": 20})
    assert answer.content == ref.message.content and answer.usage_metadata["output_tokens"] == ref.eval_count
    assert "".join(chunk.content for chunk in llm.stream("What is the capital of France?")) == answer.content
    vector = OllamaEmbeddings(model=name, base_url=server.url).embed_query("hello there")
    np.testing.assert_allclose(vector, client.embed(model=name, input="hello there").embeddings[0], atol=1e-6)


# --- an encoder's server: ollama's embedding routes ---------------------------------------------------------


@pytest.fixture(scope="module")
def encoder_server(all_minilm_path):
    with ServerProcess(all_minilm_path, ["--alias", "all-minilm"]) as s:
        yield s


def test_an_encoder_embeds_through_ollama_s_client_as_sentence_transformers(encoder_server):
    """all-MiniLM-L6-v2 (ollama's ``all-minilm``): /api/embed's vectors are sentence-transformers' own."""
    client = ollama.Client(host=encoder_server.url, timeout=300)
    sentences = json.loads((DATA / "minilm_sentences.json").read_text())[:8]
    ref = np.load(DATA / "minilm_reference.npz")["embeddings"][:8]
    got = np.array(client.embed(model="all-minilm:latest", input=sentences).embeddings)
    assert (got * ref).sum(axis=1).min() >= 0.99999
    old = np.array(client.embeddings(model="all-minilm", prompt=sentences[0]).embedding)
    np.testing.assert_allclose(old / np.linalg.norm(old), ref[0], atol=1e-5)
    assert [m.model for m in client.list().models] == ["all-minilm:latest"]
    assert client.show("all-minilm").capabilities == ["embedding"]
    assert client.ps().models[0].details.format == "safetensors"
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="all-minilm", messages=ASK)
    assert err.value.status_code == 400 and "is an encoder" in err.value.error


def test_logprobs_are_openai_s(client, openai_client, name):
    got = client.chat(model=name, messages=ASK, options={"temperature": 0, "num_predict": 6}, logprobs=True,
                      top_logprobs=2)
    ref = openai_client.chat.completions.create(model=name.removesuffix(":latest"), messages=ASK, temperature=0,
                                                max_tokens=6, logprobs=True, top_logprobs=2)
    want = ref.choices[0].logprobs.content
    assert [(x.token, round(x.logprob, 5)) for x in got.logprobs] == [(x.token, round(x.logprob, 5)) for x in want]
    assert [[t.token for t in x.top_logprobs] for x in got.logprobs] == [[t.token for t in x.top_logprobs]
                                                                          for x in want]
    parts = list(client.generate(model=name, prompt="The capital of France is", raw=True, stream=True, logprobs=True,
                                 options={"temperature": 0, "num_predict": 4}))
    assert sum(len(p.logprobs or []) for p in parts) == 4
