"""``minfer serve`` as users meet it: a real server process on a loopback port, driven by the official
``openai`` client (streaming and not) and by raw HTTP for the error cases."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from conftest import fixture_dir
from openai import APIStatusError, AuthenticationError, BadRequestError, OpenAI

import minfer
from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write a haiku about rain.",
    "Who wrote Hamlet?",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def local(smollm2_path):
    """The same model in this process: the unbatched reference."""
    return minfer.load(smollm2_path, n_ctx=1024)


@pytest.fixture(scope="module")
def server(smollm2_path):
    with ServerProcess(smollm2_path, ["--parallel", "8", "--ctx-size", "8192", "--alias", "smollm2"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, question: str, **kw):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                          temperature=0, **kw)


# -- the openai client --------------------------------------------------------------------------------


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    assert client.models.retrieve("smollm2").id == "smollm2"
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"


def test_chat_answer_and_usage_match_the_engine(client, local):
    r = chat(client, QUESTIONS[0], max_tokens=40)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    expected = local.chat(messages, max_tokens=40, temperature=0)
    assert r.choices[0].message.content == expected
    assert "Paris" in expected
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.role == "assistant"
    n_prompt = len(local.tokenize(local.render_chat(messages), add_special=False))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == local.last_stats.generated_tokens
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    assert r.model == "smollm2" and r.object == "chat.completion"


def test_chat_stream_equals_the_whole_answer_and_reports_usage(client):
    whole = chat(client, QUESTIONS[2], max_tokens=30)
    stream = chat(client, QUESTIONS[2], max_tokens=30, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        if delta.content:
            pieces.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert roles[0] == "assistant"
    assert finish == whole.choices[0].finish_reason == "length"
    assert usage.completion_tokens == 30 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_eight_concurrent_requests_get_exactly_their_text_alone(server, client, local):
    """At temperature 0 batching changes nothing: each of 8 concurrent requests gets the text the
    unbatched engine gives it, and the text the server gives it alone."""
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda q: chat(client, q, max_tokens=48).choices[0].message.content, QUESTIONS))
    assert server.metric("minfer_batch_tokens_count") > 0
    for q, text in zip(QUESTIONS, together, strict=True):
        local.kv.clear()
        assert text == local.chat([{"role": "user", "content": q}], max_tokens=48, temperature=0)
        assert text == chat(client, q, max_tokens=48).choices[0].message.content
    # the batches really held several sequences: some forward passes evaluated 8 tokens or more
    text = httpx.get(server.url + "/metrics").text
    small = [ln for ln in text.splitlines() if ln.startswith('minfer_batch_tokens_bucket{le="4.0"}')][0]
    assert float(small.split()[-1]) < server.metric("minfer_batch_tokens_count")


def test_completions_prompts_n_echo_stop_and_logprobs(client, local):
    r = client.completions.create(model="smollm2", prompt=["The capital of France is", "1, 2, 3,"], max_tokens=8,
                                  temperature=0, logprobs=3, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, ["The capital of France is", "1, 2, 3,"], strict=True):
        local.kv.clear()
        expected = local.complete(p, 8, temperature=0, logprobs=3)
        assert c.text == p + expected.text
        assert c.logprobs.tokens == [local.tokenizer.token_bytes(t).decode("utf-8", "replace")
                                     for t in expected.tokens]
        assert c.logprobs.token_logprobs == pytest.approx([x.logprob for x in expected.logprobs], abs=1e-9)
        assert all(len(top) == 3 for top in c.logprobs.top_logprobs)
        assert c.logprobs.text_offset[0] == len(p)
    assert r.usage.prompt_tokens == sum(len(local.tokenize(p)) for p in ["The capital of France is", "1, 2, 3,"])

    ids = local.tokenize("1, 2, 3,")
    by_ids = client.completions.create(model="smollm2", prompt=ids, max_tokens=8, temperature=0, stop=[" 6"])
    assert by_ids.choices[0].text == " 4, 5,"
    assert by_ids.choices[0].finish_reason == "stop"

    seeded = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12, n=3, seed=11,
                                       temperature=1.0)
    again = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12, n=3, seed=11,
                                      temperature=1.0)
    texts = [c.text for c in seeded.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1  # each choice draws from its own seed


def local_token_id(item) -> int:
    """The id of a logprobs entry's token, from its bytes (SmolLM2's byte-level vocabulary is unambiguous)."""
    from minfer.pull import pull

    model = minfer.load(pull("smollm2", progress=False), n_ctx=16)
    ids = model.tokenize(bytes(item.bytes).decode("utf-8"), add_special=False)
    assert len(ids) == 1
    return ids[0]


def test_chat_logprobs_and_penalties(client):
    r = chat(client, QUESTIONS[4], max_tokens=6, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    assert "".join(i.token for i in content) == r.choices[0].message.content
    # a -100 bias on the chosen first token makes the runner-up come first
    first_id = local_token_id(r.choices[0].logprobs.content[0])
    biased = chat(client, QUESTIONS[4], max_tokens=6, logprobs=True, top_logprobs=2, logit_bias={str(first_id): -100})
    assert biased.choices[0].logprobs.content[0].token == content[0].top_logprobs[1].token
    r2 = chat(client, "Say the word 'apple' ten times.", max_tokens=30, presence_penalty=2.0, frequency_penalty=2.0,
              extra_body={"top_k": 1, "repeat_penalty": 1.5})
    plain = chat(client, "Say the word 'apple' ten times.", max_tokens=30)
    assert r2.choices[0].message.content != plain.choices[0].message.content


def test_response_format_json_schema(client, local):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=60,
        temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # SmolLM2-135M rambles on inside an unconstrained object, so compare with the engine's own constrained run
    messages = [{"role": "user", "content": "Give me a JSON object about cats."}]
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    local.kv.clear()
    expected = local.complete(local.render_chat(messages), 60, add_special=False, temperature=0, json_schema=True)
    assert r.choices[0].message.content == expected.text
    assert expected.text.startswith("{")


def test_prefix_reuse_reports_cached_tokens(server, client, local):
    system = " ".join(f"Rule {i}: answer politely and briefly." for i in range(30))
    n_system = len(local.tokenize(local.render_chat([{"role": "system", "content": system}], False), False))
    assert n_system >= 200
    before = server.metric("minfer_prompt_tokens_cached_total")

    def ask(q):
        return client.chat.completions.create(
            model="smollm2", messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
            max_tokens=16, temperature=0)

    first = ask("Who are you?")
    second = ask("What is the weather like?")
    assert second.usage.prompt_tokens_details.cached_tokens >= n_system - 1
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert server.metric("minfer_prompt_tokens_cached_total") - before >= n_system - 1
    local.kv.clear()
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the weather like?"}]
    assert second.choices[0].message.content == local.chat(messages, max_tokens=16, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < n_system  # nothing (or little) was cached yet


# -- errors over raw HTTP --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature", "between 0.0 and 2.0"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": -1}, "top_p", "between"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "max_tokens", ">= 0"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n", "between 1 and 16"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_k": -1}, None, "top_k"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"": 1}}, "logit_bias", "token ids"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}, None, "99999999"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs", "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
         "response_format.type", "json_schema"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "wizard"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
        ({"messages": "hi"}, "messages", "non-empty list"),
        ({"model": "smollm2"}, "messages", "'messages' is required"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": 4}, "model", "'model' must be a string"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream", "true or false"),
        ({"messages": [{"role": "user", "content": "hi"}], "grammar": "root ::= (("}, None, "grammar"),
    ],
)
def test_bad_chat_requests_get_400_naming_the_field(server, body, param, fragment):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_malformed_json_too_long_prompt_and_unknown_route(server, local):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi", ', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json=[1, 2], timeout=30)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    # 8 sequences share 8192 positions: any one prompt may take them all, and no more
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "word " * 8200}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "more than the context of 8192" in err["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 999999]}, timeout=30)
    assert r.status_code == 400
    assert "token id 999999 at index 2 is outside the vocabulary" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # the server is still fine
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_a_bad_request_does_not_disturb_a_running_stream(server, client):
    stream = chat(client, QUESTIONS[6], max_tokens=40, stream=True)
    pieces = []
    for i, chunk in enumerate(stream):
        if i == 2:
            bad = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 999999999]}, timeout=30)
            assert bad.status_code == 400
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == chat(client, QUESTIONS[6], max_tokens=40).choices[0].message.content


def test_client_disconnect_cancels_and_frees_the_sequence(server, local):
    cancelled_before = server.metric("minfer_sequences_finished_total", 'reason="cancelled"')
    no_end = {str(t): -100 for t in local.tokenizer.eog_ids}  # the story must not end by itself
    body = {"prompt": "Write a very long story about a dragon.", "max_tokens": 900, "temperature": 0.8,
            "stream": True, "logit_bias": no_end}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i > 6:
                break
    deadline = time.monotonic() + 20
    while server.metric("minfer_sequences_finished_total", 'reason="cancelled"') == cancelled_before:
        assert time.monotonic() < deadline, "the sequence was not cancelled"
        time.sleep(0.05)
    assert server.metric("minfer_requests_running") == 0
    assert server.metric("minfer_kv_cells_used") == 0

    # a non-streaming request whose client gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    deadline = time.monotonic() + 20
    while server.metric("minfer_sequences_finished_total", 'reason="cancelled"') < cancelled_before + 2:
        assert time.monotonic() < deadline, "the non-streaming sequence was not cancelled"
        time.sleep(0.05)


def test_metrics_in_prometheus_format(server, client):
    chat(client, QUESTIONS[1], max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    for name in ("minfer_requests_total", "minfer_prompt_tokens_total", "minfer_generated_tokens_total",
                 "minfer_queue_depth", "minfer_requests_running", "minfer_kv_cells_used", "minfer_kv_cells_total",
                 "minfer_time_to_first_token_seconds_bucket", "minfer_inter_token_latency_seconds_bucket",
                 "process_resident_memory_bytes"):
        assert f"\n{name}" in text, name
    assert server.metric("minfer_kv_cells_total") == 8192
    assert server.metric("minfer_requests_total", 'endpoint="/v1/chat/completions",status="200"') >= 1
    assert server.metric("minfer_time_to_first_token_seconds_count") >= 1


# -- a server with an API key, a small queue, shutdown ---------------------------------------------


@pytest.fixture(scope="module")
def keyed_server():
    model = fixture_dir("qwen2") / "model-f32.gguf"
    args = ["--api-key", "s3cret", "--parallel", "1", "--queue-size", "1", "--ctx-size", "256"]
    with ServerProcess(model, args) as s:
        s.auth_headers = {"Authorization": "Bearer s3cret"}
        yield s


def test_api_key_is_checked_everywhere_but_health(keyed_server):
    url = keyed_server.url
    assert httpx.get(url + "/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + path, headers=keyed_server.auth_headers).status_code == 200
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).completions.create(
            model="model-f32.gguf", prompt=[3, 4, 5], max_tokens=2)
    good = OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
    r = good.completions.create(model="model-f32.gguf", prompt=[3, 4, 5], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens <= 4 and r.usage.prompt_tokens == 3


def test_full_queue_answers_429_with_retry_after(keyed_server):
    url, headers = keyed_server.url, keyed_server.auth_headers
    body = {"prompt": [3, 4, 5], "max_tokens": 250, "stream": True, "temperature": 1.0, "seed": 1,
            "logit_bias": {"1": -100}}  # no end-of-sequence (id 1): each stream runs its whole length
    client = OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)

    def one_round() -> bool:
        """Two streams (one running, one waiting) fill the queue; two more requests are refused.

        False when the running stream ended before the checks were done (the tiny model's 250 tokens
        take a fraction of a second under load): then the queue may have had room, so the round proves
        nothing and runs again. The waiting stream still waiting after the checks means it waited all
        along, since nothing leaves the queue but to run."""
        done: list[int] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done.append(r.status_code)

        threads = [threading.Thread(target=stream) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 30
            while keyed_server.metric("minfer_queue_depth") < 1:  # one running, one waiting
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
            try:
                client.completions.create(model="model-f32.gguf", prompt=[3, 4], max_tokens=2)
                sdk_status = 200
            except APIStatusError as e:
                sdk_status = e.status_code
            if keyed_server.metric("minfer_queue_depth") < 1:
                return False
            assert r.status_code == 429
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert sdk_status == 429
        finally:
            for t in threads:
                t.join(60)
        assert done == [200, 200]
        return True

    assert any(one_round() for _ in range(5)), "the running stream ended before the checks, five times"


def test_sigterm_lets_open_streams_finish(smollm2_path):
    with ServerProcess(smollm2_path, ["--parallel", "2"]) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf",
                                           prompt="Once upon a time", max_tokens=60, temperature=0, stream=True,
                                           extra_body={"logit_bias": {"2": -100}})
        chunks = []
        for i, chunk in enumerate(stream):
            if i == 1:
                s.terminate()
            chunks.append(chunk)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert sum(1 for c in chunks if c.choices[0].text) >= 1
        assert s.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health", timeout=2)


def test_bad_request_bodies_on_the_tiny_model(keyed_server):
    """The chat endpoint on a model without a chat template says so."""
    r = httpx.post(keyed_server.url + "/v1/chat/completions", headers=keyed_server.auth_headers,
                   json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    with pytest.raises(BadRequestError):
        OpenAI(base_url=keyed_server.url + "/v1", api_key="s3cret", max_retries=0).completions.create(
            model="model-f32.gguf", prompt=[], max_tokens=2)
