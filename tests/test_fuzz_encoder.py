"""Malformed and fuzzed requests against a real encoder server (the tiny BERT cross-encoder, which embeds and
reranks): every answer a 2xx, or a 4xx with an OpenAI error body; never a 500, never plain text, never a hang.
The corpus of ``test_fuzz_server.py`` (deep JSON, lone surrogates, integers beyond int64, NaN literals, wrong
types in every field, truncated and bit-flipped bodies, bodies past the cap, wrong methods), then hypothesis
bodies from the encoder endpoints' field names."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
from conftest import fixture_dir
from fuzz_support import SEED, Tally
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_server import JSON, judge, post

from minfer.testing.server_process import ServerProcess

MAX_BODY = 64 * 1024
ENDPOINTS = [
    ("/v1/embeddings", {"input": ["hello", "world"]}, ["input", "model", "encoding_format", "dimensions", "truncate"]),
    ("/embedding", {"content": "hello"}, ["content", "input", "embd_normalize", "truncate"]),
    ("/v1/rerank", {"query": "a cat", "documents": ["a cat sat", "rain"]},
     ["query", "documents", "texts", "top_n", "return_documents", "return_text", "truncate", "model"]),
    ("/tokenize", {"content": "hello"}, ["content"]),
    ("/detokenize", {"tokens": [5, 6]}, ["tokens"]),
]


@pytest.fixture(scope="module")
def server():
    args = ["--max-body-size", str(MAX_BODY), "--log-format", "off", "--pooling", "rank"]
    with ServerProcess(fixture_dir("bert_rerank"), args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tally(request):
    t = Tally("encoder server")
    yield t
    t.report(request.config)


def test_corpus(server, client, tally):
    rng = random.Random(SEED)
    for path, base, fields in ENDPOINTS:
        assert post(client, path, json.dumps(base).encode()).status_code == 200, path
        for depth in (65, 100_000):
            for body in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
                judge(tally, "deep_json", f"{path} depth {depth}", post(client, path, body))
        for field in fields:
            judge(tally, "surrogates", f"{path} {field}",
                  post(client, path, json.dumps({**base, field: "a\ud800b"}).encode()))
            judge(tally, "surrogates", f"{path} [{field}]",
                  post(client, path, json.dumps({**base, field: ["\udc00"]}).encode()))
            for value in (2**63, -(2**63) - 1, 10**400, [2**64], [[-1]], [10**6]):
                judge(tally, "huge_ints", f"{path} {field}={str(value)[:20]}",
                      post(client, path, json.dumps({**base, field: value}).encode()))
            for value in ("NaN", "Infinity", "1e999"):
                raw = json.dumps({**base, field: 0}).encode().replace(b": 0", b": " + value.encode(), 1)
                judge(tally, "nan_values", f"{path} {field}={value}", post(client, path, raw))
            for value in (None, "x", "", [], [1, "a"], [[]], {}, {"text": 3}, [{"text": None}], True, -1, 0.5,
                          "\u0000", "word " * 400):
                judge(tally, "wrong_types", f"{path} {field}={str(value)[:20]!r}",
                      post(client, path, json.dumps({**base, field: value}).encode()))
        valid = json.dumps(base).encode()
        for cut in range(0, len(valid), max(1, len(valid) // 10)):
            judge(tally, "truncation", f"{path} [:{cut}]", post(client, path, valid[:cut]))
        for i in range(25):
            blob = bytearray(valid)
            blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
            judge(tally, "flips", f"{path} flip #{i}", post(client, path, bytes(blob)))
        judge(tally, "oversized", f"{path} body past the cap", post(client, path, b" " * (MAX_BODY + 1)))
        for method in ("GET", "PUT", "DELETE"):
            r = client.request(method, path)
            judge(tally, "methods", f"{method} {path}", r)
            assert r.status_code == 405
    for path in ("/nope", "/v1/chat/completions", "/completion", "/v1/messages", "/v1/responses"):
        judge(tally, "routes", path, post(client, path, b'{"prompt": "x", "messages": []}'))
    assert client.get("/health").json()["status"] == "ok"
    tally.assert_clean()


@settings(max_examples=120, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(which=st.integers(0, len(ENDPOINTS) - 1), data=st.data())
def test_property_request_bodies(client, tally, which: int, data: Any):
    path, base, fields = ENDPOINTS[which]
    body = data.draw(st.dictionaries(st.sampled_from(fields), JSON | st.lists(st.text(max_size=8), max_size=3),
                                     max_size=4))
    if data.draw(st.booleans()):
        body = {**base, **body}
    judge(tally, "hypothesis_bodies", json.dumps(body)[:160], post(client, path, json.dumps(body).encode()))
    tally.assert_clean()
