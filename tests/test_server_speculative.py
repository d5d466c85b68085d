"""Speculative decoding in ``minfer serve``: concurrent speculative requests get their text alone (at
temperature 0 the text of plain decoding), the per-request ``speculative`` field, and the metrics."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import fixture_dir
from openai import OpenAI

import minfer
from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

PARAGRAPHS = [
    "The river runs past the mill, under the old stone bridge, and out into the wide green valley.",
    "Our team meets every Monday at nine to plan the week, review open tickets, and agree on priorities.",
    "To make tea, boil fresh water, warm the pot, add one spoon of leaves per cup, and steep for four minutes.",
    "The museum opens at ten, closes at six, and is free for children under twelve on weekends.",
    "Mercury is the smallest planet, Jupiter the largest, and Saturn has the most visible rings.",
    "Please send the signed contract by Friday so that the work can start on the first of next month.",
    "A good password is long, unique for every site, and stored in a password manager.",
    "The recipe needs two eggs, a cup of flour, half a cup of milk, and a pinch of salt.",
]
QUESTIONS = [f"Repeat this sentence exactly: {p}" for p in PARAGRAPHS]


@pytest.fixture(scope="module")
def local(smollm2_path):
    return minfer.load(smollm2_path, n_ctx=1024)


@pytest.fixture(scope="module")
def server(smollm2_path):
    with ServerProcess(smollm2_path, ["--parallel", "8", "--ctx-size", "8192", "--alias", "smollm2",
                                      "--lookup"]) as s:
        yield s


def chat(client, question: str, **kw):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                          temperature=0, max_tokens=64, **kw).choices[0].message.content


def test_eight_concurrent_lookup_requests_get_their_plain_text(server, local):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda q: chat(client, q), QUESTIONS))
    assert server.metric("minfer_speculative_drafted_tokens_total") > 0
    accepted = server.metric("minfer_speculative_accepted_tokens_total")
    generated = server.metric("minfer_generated_tokens_total")
    passes = server.metric("minfer_target_passes_total")
    assert accepted > 0 and 0 < passes < generated  # drafts kept: fewer passes than tokens
    assert server.metric("minfer_plans_built") >= 9  # at least the decode shapes of 1..8 sequences, at start
    for q, text in zip(QUESTIONS, together, strict=True):
        local.kv.clear()
        assert text == local.chat([{"role": "user", "content": q}], max_tokens=64, temperature=0)
        assert text == chat(client, q, extra_body={"speculative": "off"})
        assert text == chat(client, q, extra_body={"speculative": {"mode": "lookup", "draft_max": 3}})


@pytest.mark.parametrize("value, fragment", [
    ("draft", "needs a draft model"),
    ({"draft_max": 0}, "draft_max must be an integer >= 1"),
    ({"draft_max": 9000}, "does not fit in the context"),
    ({"mode": "sometimes"}, "mode must be one of"),
    ({"n": 3}, "unknown field 'n'"),
    (7, "must be a mode"),
])
def test_bad_speculative_fields_get_400_naming_the_field(server, value, fragment):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "speculative": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "speculative" and fragment in err["message"], err


def test_a_draft_model_server_batches_verifications():
    """A tiny fixture drafting for its own F32 weights in Q8_0: 4 concurrent completions equal the plain
    engine's text, and drafts were verified in shared passes."""
    target, draft = fixture_dir("llama") / "model-f32.gguf", fixture_dir("llama") / "model-q8_0.gguf"
    local = minfer.load(target)
    prompts = [[0, 5, 6, 7, 8, 9, 5, 6], [0, 100, 200, 300], [0, 11, 12, 13, 11, 12], [0, 40, 41, 42, 43, 44]]
    # the prior pass costs: drafts that do not depend on how busy the machine is (measured costs on a loaded
    # machine may price every draft out, and the test would see no verification)
    env = {**os.environ, "MINFER_PASS_COSTS": "prior"}
    with ServerProcess(target, ["--parallel", "4", "--ctx-size", "1024", "--draft", str(draft),
                                "--draft-p-min", "0", "--draft-max", "4"], env=env) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(ids, n):
            return client.completions.create(model="model-f32.gguf", prompt=ids, max_tokens=n,
                                             temperature=0).choices[0].text

        # lengths that differ: however the requests arrive, the pass ends with fewer sequences than four, where
        # a draft fills the padding of the pass's bucket (four decodes together may find no draft that pays)
        lengths = [40, 12, 24, 52]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(complete, prompts, lengths))
        assert s.metric("minfer_speculative_accepted_tokens_total") > 0
        for ids, n, text in zip(prompts, lengths, together, strict=True):
            local.kv.clear()
            assert text == local.generate(ids, n, temperature=0)
