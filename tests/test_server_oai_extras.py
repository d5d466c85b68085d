"""llama-server's extra fields on OpenAI answers, against a real ``minfer serve`` process (issue 39):
``timings`` on every whole ``/v1/chat/completions`` and ``/v1/completions`` answer and on the last event of a
stream (asked for or not), and the token ``id`` in chat ``logprobs``. The official ``openai`` client must still
parse every answer.

What llama-server (b1-0c1e570, the tiny llama, ``--chat-template chatml``) answered, for reference:

- whole chat / completion: ``{..., "usage": {...}, "id": ..., "timings": {"cache_n": 40, "prompt_n": 1,
  "prompt_ms": 0.435, "prompt_per_token_ms": 0.435, "prompt_per_second": 2298.8, "predicted_n": 2,
  "predicted_ms": 0.176, "predicted_per_token_ms": 0.176, "predicted_per_second": 5681.8}}``;
- streamed chat: ``timings`` on the ``finish_reason`` chunk only; with ``include_usage`` on the usage chunk
  (``"choices": []``) only; streamed ``/v1/completions``: on the ``finish_reason`` chunk only;
- chat ``logprobs.content[i]``: ``{"id": 438, "token": " Work", "bytes": [32, 87, 111, 114, 107], "logprob": ...,
  "top_logprobs": [{"id": 322, "token": " no", "bytes": [32, 110, 111], "logprob": ...}, ...]}``;
- the first streamed chat chunk: ``"delta": {"role": "assistant", "content": null}``. minfer keeps OpenAI's
  ``"content": ""`` there: both parse in the official client, and ``""`` is also safe for clients that
  concatenate ``delta.content`` without a None check.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import derive_gguf, fixture_dir

from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TIMINGS_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny llama with a chat template (it has none of its own)."""
    path = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path_factory.mktemp("chat") / "tiny.gguf",
                       {"tokenizer.chat_template": CHATML})
    with ServerProcess(path, ["--parallel", "2", "--ctx-size", "512", "--batch-size", "32"]) as s:
        yield s


def post(server, path, body) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path, body) -> list[dict]:
    """The ``data:`` chunks of a streamed answer, ``[DONE]`` left out."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x")


def check_timings(t: dict, predicted: int, prompt_tokens: int) -> None:
    assert set(t) == TIMINGS_KEYS
    assert t["predicted_n"] == predicted and t["prompt_n"] + t["cache_n"] == prompt_tokens
    assert t["prompt_ms"] >= 0 and t["predicted_ms"] >= 0


# -- 1. timings on whole and streamed answers, unasked -------------------------------------------------


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": USER}),
                                       ("/v1/completions", {"prompt": "The fox"})])
def test_whole_answers_carry_timings_unasked(tiny, path, body):
    r = post(tiny, path, {**body, "max_tokens": 3, "temperature": 0})
    check_timings(r["timings"], 3, r["usage"]["prompt_tokens"])


def test_the_official_client_parses_timings_as_an_extra_field(tiny):
    r = client(tiny).chat.completions.create(model="m", messages=USER, max_tokens=2, temperature=0)
    assert r.choices[0].message.role == "assistant"
    check_timings(r.model_extra["timings"], 2, r.usage.prompt_tokens)
    c = client(tiny).completions.create(model="m", prompt="The fox", max_tokens=2, temperature=0)
    check_timings(c.model_extra["timings"], 2, c.usage.prompt_tokens)


def test_streamed_chat_has_timings_on_its_finish_chunk_only(tiny):
    chunks = stream(tiny, "/v1/chat/completions", {"messages": USER, "max_tokens": 3, "temperature": 0})
    [finish] = [c for c in chunks if "timings" in c]
    assert finish is chunks[-1] and finish["choices"][0]["finish_reason"] == "length"
    prompt_tokens = post(tiny, "/v1/chat/completions/input_tokens", {"messages": USER})["input_tokens"]
    check_timings(finish["timings"], 3, prompt_tokens)


def test_streamed_chat_with_usage_has_timings_on_the_usage_chunk_only(tiny):
    chunks = stream(tiny, "/v1/chat/completions", {"messages": USER, "max_tokens": 3, "temperature": 0,
                                                   "stream_options": {"include_usage": True}})
    [last] = [c for c in chunks if "timings" in c]
    assert last is chunks[-1] and last["choices"] == []
    check_timings(last["timings"], 3, last["usage"]["prompt_tokens"])
    # the official client reads the same stream
    events = list(client(tiny).chat.completions.create(model="m", messages=USER, max_tokens=3, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
    assert events[-1].usage.completion_tokens == 3 and events[-1].model_extra["timings"]["predicted_n"] == 3


def test_streamed_chat_of_several_choices_has_each_ones_timings_on_its_finish_chunk(tiny):
    chunks = stream(tiny, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "n": 2, "seed": 1,
                                                   "stream_options": {"include_usage": True}})
    finished = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(c["choices"][0]["index"] for c in finished) == [0, 1]
    assert all(c["timings"]["predicted_n"] == 2 for c in finished)


def test_streamed_completion_has_timings_on_its_finish_chunk_only(tiny):
    chunks = stream(tiny, "/v1/completions", {"prompt": "The fox", "max_tokens": 3, "temperature": 0})
    [finish] = [c for c in chunks if "timings" in c]
    assert finish is chunks[-1] and finish["choices"][0]["finish_reason"] == "length"
    prompt_tokens = post(tiny, "/v1/completions", {"prompt": "The fox", "max_tokens": 1})["usage"]["prompt_tokens"]
    check_timings(finish["timings"], 3, prompt_tokens)


def test_timings_per_token_still_times_every_chunk(tiny):
    chunks = stream(tiny, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "temperature": 0,
                                                   "timings_per_token": True})
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert tokens and all(set(c["timings"]) == TIMINGS_KEYS for c in tokens)


# -- 2. the token id in chat logprobs -------------------------------------------------------------------


def test_chat_logprobs_carry_each_tokens_id_first(tiny):
    r = post(tiny, "/v1/chat/completions", {"messages": USER, "max_tokens": 3, "temperature": 0,
                                            "logprobs": True, "top_logprobs": 2})
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for x in content:
        assert list(x) == ["id", "token", "bytes", "logprob", "top_logprobs"]  # llama-server's order
        assert all(list(t) == ["id", "token", "bytes", "logprob"] for t in x["top_logprobs"])
        assert x["top_logprobs"][0]["id"] == x["id"]  # greedy: the chosen token is the likeliest
        assert x["id"] not in {t["id"] for t in x["top_logprobs"][1:]}
    ids = [x["id"] for x in content]
    text = post(tiny, "/detokenize", {"tokens": ids})["content"]
    assert text == r["choices"][0]["message"]["content"]


def test_chat_logprob_ids_in_streams_and_post_sampling_probs(tiny):
    chunks = stream(tiny, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "temperature": 0,
                                                   "logprobs": True, "top_logprobs": 1})
    entries = [x for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
               for x in c["choices"][0]["logprobs"]["content"]]
    assert len(entries) == 2 and all(isinstance(x["id"], int) and x["top_logprobs"][0]["id"] == x["id"]
                                     for x in entries)
    r = post(tiny, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "temperature": 0, "logprobs": True,
                                            "top_logprobs": 2, "post_sampling_probs": True})
    for x in r["choices"][0]["logprobs"]["content"]:
        assert list(x) == ["id", "token", "bytes", "prob", "top_probs"]
        assert all(list(t) == ["id", "token", "bytes", "prob"] for t in x["top_probs"])


def test_the_official_client_parses_logprobs_with_ids(tiny):
    r = client(tiny).chat.completions.create(model="m", messages=USER, max_tokens=2, temperature=0, logprobs=True,
                                             top_logprobs=2)
    [a, b] = r.choices[0].logprobs.content
    assert a.model_extra["id"] == a.top_logprobs[0].model_extra["id"] and isinstance(b.logprob, float)


# -- 3. the first streamed chat chunk ---------------------------------------------------------------------


def test_first_streamed_chat_chunk_opens_the_assistants_turn(tiny):
    """llama-server sends ``"content": null`` here; minfer keeps OpenAI's ``""`` (see the module's docstring)."""
    chunks = stream(tiny, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "temperature": 0})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    events = list(client(tiny).chat.completions.create(model="m", messages=USER, max_tokens=2, stream=True))
    assert events[0].choices[0].delta.role == "assistant"


# -- speculative decoding's counts ------------------------------------------------------------------------


def test_timings_add_draft_counts_when_tokens_were_drafted():
    """llama-server adds ``draft_n`` and ``draft_n_accepted`` to ``timings`` only when it drafted tokens."""
    from minfer.runtime.sequence import GenerationStats
    from minfer.server.timings import timings

    plain = timings(GenerationStats(prompt_tokens=4, generated_tokens=3, prefill_seconds=0.1, decode_seconds=0.2), 1)
    assert set(plain) == TIMINGS_KEYS
    drafted = timings(GenerationStats(prompt_tokens=4, generated_tokens=3, drafted_tokens=5, accepted_tokens=2), 0)
    assert set(drafted) == TIMINGS_KEYS | {"draft_n", "draft_n_accepted"}
    assert (drafted["draft_n"], drafted["draft_n_accepted"]) == (5, 2)
