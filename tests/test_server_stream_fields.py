"""What llama-server's streams carry on request, against a real ``minfer serve`` process (issue 39):
``return_progress`` (prompt progress chunks before the tokens), ``timings_per_token`` (each chunk's
``timings``), streamed log-probabilities as fields, ``post_sampling_probs`` (the sampler chain's
probabilities), and the guards: a cancelled stream frees its slot, streamed and whole answers agree at
temperature 0, per-request ``n_predict`` in a shared batch."""

from __future__ import annotations

import json
import math
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import derive_gguf, fixture_dir
from fastapi import FastAPI

from minfer.runtime.sampling import Sampler, SamplingParams
from minfer.server.routes.vertex import register as register_vertex
from minfer.server.routes.vertex import request_format
from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TIMINGS_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny llama with a chat template, four slots, ``/slots`` on, Vertex AI's prediction route on (at
    ``/vertex/predict``, its health route at ``/vertex/health``)."""
    path = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path_factory.mktemp("stream") / "tiny.gguf",
                       {"tokenizer.chat_template": CHATML})
    env = {"AIP_MODE": "PREDICTION", "AIP_PREDICT_ROUTE": "vertex/predict", "AIP_HEALTH_ROUTE": "/vertex/health"}
    with ServerProcess(path, ["--parallel", "4", "--ctx-size", "16384", "--batch-size", "32", "--slots"],
                       env=env) as s:
        yield s


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def stream(server, path, body) -> list[dict]:
    """The ``data:`` chunks of a streamed answer, ``[DONE]`` left out."""
    out = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


# -- return_progress ---------------------------------------------------------------------------------


def test_return_progress_sends_prompt_progress_chunks_before_the_tokens(tiny):
    """llama-server (``/completion``, ``return_progress: true``, stream): a chunk with ``content: ""``,
    ``prompt_progress: {total, cache, processed: cache, time_ms}`` when the slot starts, another with
    ``processed: total`` once the prompt is evaluated, then the token chunks (without ``prompt_progress``)."""
    prompt = "progress of a prompt with several tokens in it"
    chunks = stream(tiny, "/completion", {"prompt": prompt, "n_predict": 3, "temperature": 0, "cache_prompt": False,
                                          "return_progress": True})
    progress = [c for c in chunks if "prompt_progress" in c]
    assert len(progress) == 2
    assert chunks[:2] == progress  # before any token
    total = chunks[-1]["tokens_evaluated"]
    first, done = (p["prompt_progress"] for p in progress)
    assert set(first) == {"total", "cache", "processed", "time_ms"}
    assert first["total"] == done["total"] == total
    assert first["processed"] == first["cache"] == 0
    assert done["processed"] == total
    assert all(isinstance(p["prompt_progress"]["time_ms"], int) for p in progress)
    assert all(p["content"] == "" and p["tokens"] == [] and p["stop"] is False for p in progress)
    tokens = [c for c in chunks[2:] if not c["stop"]]
    assert len(tokens) == 3 and not any("prompt_progress" in c for c in tokens)


def test_without_return_progress_no_progress_chunks(tiny):
    chunks = stream(tiny, "/completion", {"prompt": "no progress", "n_predict": 2, "temperature": 0})
    assert not any("prompt_progress" in c for c in chunks)
    assert chunks[0]["content"] or chunks[0]["tokens"]


def test_return_progress_counts_the_cached_prefix(tiny):
    """A prompt whose prefix is cached: the first progress has ``cache`` and ``processed`` at the cached count."""
    prompt = "a cached prefix that is long enough to be reused by the second request"
    post(tiny, "/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0})
    chunks = stream(tiny, "/completion", {"prompt": prompt + " and more", "n_predict": 1, "temperature": 0,
                                          "return_progress": True})
    first = chunks[0]["prompt_progress"]
    assert first["cache"] > 0 and first["processed"] == first["cache"] < first["total"]


def test_return_progress_on_openai_streams(tiny):
    """llama-server: ``/v1/completions`` progress chunks are empty choices (``text: ""``) with
    ``prompt_progress``; chat's carry ``delta: {role: assistant, content: null}``."""
    chunks = stream(tiny, "/v1/completions", {"prompt": "openai progress", "max_tokens": 2, "temperature": 0,
                                              "return_progress": True})
    progress = [c for c in chunks if "prompt_progress" in c]
    assert len(progress) == 2 and chunks[:2] == progress
    assert all(c["choices"][0]["text"] == "" for c in progress)
    assert progress[1]["prompt_progress"]["processed"] == progress[1]["prompt_progress"]["total"]
    chat = stream(tiny, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "temperature": 0, "return_progress": True})
    progress = [c for c in chat if "prompt_progress" in c]
    assert len(progress) == 2
    assert progress[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert progress[1]["prompt_progress"]["processed"] == progress[1]["prompt_progress"]["total"]


def test_return_progress_must_be_a_boolean(tiny):
    r = post(tiny, "/completion", {"prompt": "x", "n_predict": 1, "return_progress": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_progress"


# -- timings_per_token and streamed probabilities ----------------------------------------------------


def test_timings_per_token_puts_a_timings_object_on_every_token_chunk(tiny):
    """llama-server: each chunk has ``timings``, its whole object (the nine fields), ``predicted_n`` counting
    the tokens so far."""
    chunks = stream(tiny, "/completion", {"prompt": "timings", "n_predict": 3, "temperature": 0,
                                          "timings_per_token": True})
    tokens = [c for c in chunks if not c["stop"]]
    assert len(tokens) == 3
    for n, c in enumerate(tokens, 1):
        assert set(c["timings"]) == TIMINGS_KEYS
        assert c["timings"]["predicted_n"] == n
        assert c["timings"]["prompt_n"] == c["tokens_evaluated"] - c["timings"]["cache_n"]
    assert set(chunks[-1]["timings"]) == TIMINGS_KEYS
    for path, body in (("/v1/completions", {"prompt": "timings"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        chunks = stream(tiny, path, {**body, "max_tokens": 2, "temperature": 0, "timings_per_token": True})
        generated = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason") is None
                     and (c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content"))]
        assert generated and all(set(c["timings"]) == TIMINGS_KEYS for c in generated), path
        assert set(chunks[-1]["timings"]) == TIMINGS_KEYS


def test_streamed_probabilities_are_lists_of_objects(tiny):
    """llama-server: a ``/completion`` chunk's ``completion_probabilities`` is a list of one object (``id``,
    ``token``, ``bytes``, ``logprob``, ``top_logprobs``: a list of such objects); a chat chunk's
    ``logprobs.content`` likewise."""
    chunks = stream(tiny, "/completion", {"prompt": "probs", "n_predict": 2, "temperature": 0, "n_probs": 3})
    tokens = [c for c in chunks if not c["stop"]]
    for c in tokens:
        [p] = c["completion_probabilities"]
        assert p["id"] == c["tokens"][0] and set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"}
        assert len(p["top_logprobs"]) == 3
        assert all(set(t) == {"id", "token", "bytes", "logprob"} for t in p["top_logprobs"])
    assert "completion_probabilities" not in chunks[-1]  # the last chunk has none, as llama-server's
    chat = stream(tiny, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "temperature": 0, "logprobs": True, "top_logprobs": 2})
    content = [c["choices"][0]["logprobs"]["content"] for c in chat
               if c["choices"] and c["choices"][0].get("logprobs")]
    assert content and all(isinstance(x, list) and set(x[0]) >= {"token", "logprob", "bytes", "top_logprobs"}
                           and len(x[0]["top_logprobs"]) == 2 for x in content)


# -- post_sampling_probs -----------------------------------------------------------------------------


def test_post_sampling_probs_are_the_chains_probabilities(tiny):
    """llama-server (``n_probs: 3, post_sampling_probs: true, top_k: 2``): ``prob`` and ``top_probs`` in place of
    ``logprob``/``top_logprobs``, the two tokens top_k keeps with probabilities renormalised over them (they
    sum to 1), e.g. ``{"prob": 0.594, "top_probs": [{..., "prob": 0.594}, {..., "prob": 0.406}]}``."""
    r = post(tiny, "/completion", {"prompt": "hello world", "n_predict": 3, "n_probs": 3, "top_k": 2,
                                   "post_sampling_probs": True, "seed": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["generation_settings"]["post_sampling_probs"] is True
    for p in body["completion_probabilities"]:
        assert set(p) == {"id", "token", "bytes", "prob", "top_probs"}
        assert len(p["top_probs"]) == 2  # what top_k kept, fewer than n_probs
        assert math.isclose(sum(t["prob"] for t in p["top_probs"]), 1.0, rel_tol=1e-6)
        assert p["top_probs"][0]["prob"] >= p["top_probs"][1]["prob"]
        assert p["prob"] == next(t["prob"] for t in p["top_probs"] if t["id"] == p["id"])
    # the model's raw distribution is another: its top two do not sum to 1
    raw = post(tiny, "/completion", {"prompt": "hello world", "n_predict": 1, "n_probs": 2, "top_k": 2,
                                     "seed": 7}).json()["completion_probabilities"][0]
    assert sum(math.exp(t["logprob"]) for t in raw["top_logprobs"]) < 0.99


def test_post_sampling_probs_greedy_is_certain(tiny):
    """llama-server at temperature 0: ``prob: 1.0`` and ``top_probs`` the one token; streamed chunks too."""
    body = post(tiny, "/completion", {"prompt": "hello world", "n_predict": 2, "n_probs": 3, "temperature": 0,
                                      "post_sampling_probs": True}).json()
    for p in body["completion_probabilities"]:
        assert p["prob"] == 1.0 and [t["id"] for t in p["top_probs"]] == [p["id"]]
    chunks = stream(tiny, "/completion", {"prompt": "hello world", "n_predict": 2, "n_probs": 3, "temperature": 0,
                                          "post_sampling_probs": True})
    for c in chunks[:-1]:
        [p] = c["completion_probabilities"]
        assert p["prob"] == 1.0 and len(p["top_probs"]) == 1


def test_post_sampling_probs_leaves_the_sampled_tokens_as_they_were(tiny):
    """Asking for the chain's probabilities does not change what a seeded request samples."""
    body = {"prompt": "same tokens", "n_predict": 6, "n_probs": 2, "seed": 11, "temperature": 1.0}
    plain = post(tiny, "/completion", body).json()
    post_sampled = post(tiny, "/completion", {**body, "post_sampling_probs": True}).json()
    assert [p["id"] for p in plain["completion_probabilities"]] == \
        [p["id"] for p in post_sampled["completion_probabilities"]]


def test_post_sampling_probs_must_be_a_boolean(tiny):
    r = post(tiny, "/completion", {"prompt": "x", "n_predict": 1, "n_probs": 1, "post_sampling_probs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "post_sampling_probs"


def test_chain_logprobs_are_the_kept_candidates_renormalised():
    """The sampler's report of the draw's distribution: top_k 2 of four tokens keeps two, their probabilities
    the softmax over those two (temperature 1); the model's report is over the whole vocabulary."""
    logits = np.array([0.0, 2.0, 1.0, -1.0], dtype=np.float32)
    s = Sampler(SamplingParams(top_k=2, top_p=1.0, min_p=0.0, temperature=1.0, seed=1))
    kept = np.exp([2.0, 1.0]) / np.exp([2.0, 1.0]).sum()
    lp = s.chain_logprobs(logits, 2, n_top=3)
    assert [t for t, _ in lp.top_logprobs] == [1, 2]  # fewer than n_top: what the chain kept
    assert np.allclose([np.exp(v) for _, v in lp.top_logprobs], kept)
    assert np.isclose(np.exp(lp.logprob), kept[1])
    assert s.token_logprobs(logits, 2, 3).logprob < lp.logprob  # reports_chain off: the model's
    s.reports_chain = True
    assert s.token_logprobs(logits, 2, 3) == lp
    assert s.chain_logprobs(logits, 0, 2).logprob == -np.inf  # a token the chain dropped


def test_chain_logprobs_leave_xtc_draws_as_they_were():
    """Asking for the chain's distribution does not move XTC's random stream: the tokens drawn are the same."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(30, 50)).astype(np.float32)
    params = SamplingParams(xtc_probability=0.5, xtc_threshold=0.05, seed=3)
    plain, asked = Sampler(params), Sampler(params)
    a, b = [], []
    for row in rows:
        a.append(plain.sample(row))
        b.append(asked.sample(row))
        asked.chain_logprobs(row, b[-1], 3)
    assert a == b


def test_post_sampling_probs_on_chat(tiny):
    """llama-server: chat's ``logprobs.content`` items have ``prob`` and ``top_probs`` with
    ``post_sampling_probs`` (and each token's ``id``)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 3,
            "top_k": 2, "post_sampling_probs": True, "seed": 5}
    content = post(tiny, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    for x in content:
        assert set(x) == {"id", "token", "prob", "bytes", "top_probs"} and len(x["top_probs"]) <= 2
        assert math.isclose(sum(t["prob"] for t in x["top_probs"]), 1.0, rel_tol=1e-6)


# -- Vertex AI's /predict ----------------------------------------------------------------------------


def test_request_format_is_the_camel_case_path():
    """llama-server's names: the path without ``/v1``, ``/``, ``-`` and ``_`` starting a capital."""
    assert request_format("/v1/chat/completions") == "chatCompletions"
    assert request_format("/apply-template") == "applyTemplate"
    assert request_format("/completion") == "completion"
    assert request_format("/v1/models/{model}") == "models"
    assert request_format("/health") == "health"


def test_predict_route_only_in_prediction_mode():
    """llama-server registers it only with ``AIP_MODE=PREDICTION``; one of its own routes as
    ``AIP_PREDICT_ROUTE`` stops it."""
    app = FastAPI()
    app.add_api_route("/health", lambda: {"status": "ok"})
    register_vertex(app, None, {})  # type: ignore[arg-type]
    assert "/predict" not in {r.path for r in app.routes}
    with pytest.raises(ValueError, match="AIP_PREDICT_ROUTE"):
        register_vertex(app, None, {"AIP_MODE": "PREDICTION", "AIP_PREDICT_ROUTE": "health"})  # type: ignore[arg-type]


def test_predict_dispatches_each_instance_to_its_endpoint(tiny):
    """llama-server (``AIP_MODE=PREDICTION``): ``{"predictions": [...]}``, one per instance in order, each the
    endpoint's own answer (``completions``: ``/v1/completions``'s ``text_completion``; ``/completion``: the
    native answer, not streamed though the instance asked; ``health``: ``{"status": "ok"}``); an instance's
    error in its place: ``{"error": {"code": 400, "message": "no handler registered for @requestFormat: nope",
    "type": "invalid_request_error"}}``, "each instance must include a string @requestFormat", "each instance
    must be a JSON object"."""
    instances = [
        {"@requestFormat": "completions", "prompt": "hello", "max_tokens": 2, "temperature": 0},
        {"@requestFormat": "/completion", "prompt": "hello", "n_predict": 2, "temperature": 0, "stream": True},
        {"@requestFormat": "chatCompletions", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {"@requestFormat": "health"},
        {"@requestFormat": "nope"},
        {"prompt": "x"},
        5,
        {"@requestFormat": "completion", "prompt": "x", "n_predict": "many"},
    ]
    r = post(tiny, "/vertex/predict", {"instances": instances, "parameters": {}})
    assert r.status_code == 200, r.text
    p = r.json()["predictions"]
    assert len(p) == len(instances)
    assert p[0]["object"] == "text_completion"
    assert p[1]["stop"] is True and p[1]["content"] == p[0]["choices"][0]["text"]
    assert p[2]["object"] == "chat.completion"
    assert p[3]["status"] == "ok"  # (minfer's /health says more than llama-server's)
    assert p[4]["error"]["message"] == "no handler registered for @requestFormat: nope"
    assert p[4]["error"]["type"] == "invalid_request_error"
    assert "@requestFormat" in p[5]["error"]["message"]
    assert p[6]["error"]["message"] == "each instance must be a JSON object"
    assert p[7]["error"]["param"] == "n_predict"
    assert httpx.get(tiny.url + "/vertex/health").json()["status"] == "ok"


def test_predict_refuses_a_body_without_instances(tiny):
    """llama-server: 400 "request body must include an array field named instances"; over 128 instances, 400."""
    r = post(tiny, "/vertex/predict", {"inputs": []})
    assert r.status_code == 400 and "instances" in r.json()["error"]["message"]
    r = post(tiny, "/vertex/predict", {"instances": [{}] * 129})
    assert r.status_code == 400 and "128" in r.json()["error"]["message"]
    r = post(tiny, "/vertex/predict", [1])
    assert r.status_code == 400


# -- guards ------------------------------------------------------------------------------------------


def idle(server) -> bool:
    return not any(s["is_processing"] for s in httpx.get(server.url + "/slots", timeout=10).json())


def test_a_stream_cancelled_midway_frees_its_slot(tiny):
    """The client leaves after two chunks of a long generation (4000 tokens, seconds of the tiny model): its slot
    is idle soon after (``/slots``)."""
    with httpx.stream("POST", tiny.url + "/completion", json={"prompt": "cancel me", "n_predict": 4000,
                                                             "ignore_eos": True, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()  # kept: the iterator, once dropped, closes the response
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 2:
                break
        assert not idle(tiny)  # still generating when the client leaves
    deadline = time.monotonic() + 20
    while not idle(tiny):
        assert time.monotonic() < deadline, "the cancelled stream still holds its slot"
        time.sleep(0.1)


@pytest.mark.parametrize("path,body", [
    ("/completion", {"prompt": "same answer", "n_predict": 8}),
    ("/v1/completions", {"prompt": "same answer", "max_tokens": 8}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "same answer"}], "max_tokens": 8}),
])
def test_streamed_and_whole_answers_agree_at_temperature_0(tiny, path, body):
    """Content and (``/completion``'s ``tokens``, the others' logprob tokens) the same, whole or streamed."""
    body = {**body, "temperature": 0}
    if path == "/completion":
        whole = post(tiny, path, {**body, "return_tokens": True}).json()
        chunks = stream(tiny, path, body)
        assert "".join(c["content"] for c in chunks) == whole["content"]
        assert [t for c in chunks if not c["stop"] for t in c["tokens"]] == whole["tokens"]
        return
    chat = path.endswith("chat/completions")
    extra = {"logprobs": True} if chat else {"logprobs": 0}
    whole = post(tiny, path, {**body, **extra}).json()["choices"][0]
    chunks = [c["choices"][0] for c in stream(tiny, path, {**body, **extra}) if c["choices"]]
    if chat:
        text = "".join(c["delta"].get("content") or "" for c in chunks)
        assert text == whole["message"]["content"]
        streamed = [x["token"] for c in chunks if c["logprobs"] for x in c["logprobs"]["content"]]
        assert streamed == [x["token"] for x in whole["logprobs"]["content"]]
    else:
        assert "".join(c["text"] for c in chunks) == whole["text"]
        streamed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert streamed == whole["logprobs"]["tokens"]


def test_each_request_keeps_its_own_n_predict_in_a_shared_batch(tiny):
    """Four requests sent at once (``--parallel 4``) with limits 1, 3, 6 and 10: each generates its own."""
    limits = [1, 3, 6, 10]
    results: dict[int, dict] = {}
    barrier = threading.Barrier(len(limits))

    def run(n: int) -> None:
        barrier.wait()
        results[n] = post(tiny, "/completion", {"prompt": f"request {n}", "n_predict": n, "ignore_eos": True,
                                                "temperature": 0}).json()

    threads = [threading.Thread(target=run, args=(n,)) for n in limits]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for n in limits:
        assert results[n]["tokens_predicted"] == n and results[n]["stop_type"] == "limit", n
