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
import pytest
from conftest import derive_gguf, fixture_dir

from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TIMINGS_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny llama with a chat template, four slots, ``/slots`` on."""
    path = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path_factory.mktemp("stream") / "tiny.gguf",
                       {"tokenizer.chat_template": CHATML})
    with ServerProcess(path, ["--parallel", "4", "--ctx-size", "1024", "--batch-size", "32", "--slots"]) as s:
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
