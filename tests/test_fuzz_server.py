"""Malformed and fuzzed requests against a real server (the gemma3 fixture, which has a chat template):
every answer a 2xx, or a 4xx with an OpenAI error body; never a 500, never plain text, never a hang.

The corpus: the probe's kinds (JSON nested deep, lone surrogates in every text field, integers beyond
int64 in every integer field, NaN/Infinity literals, truncated and bit-flipped bodies, wrong types in every
field, an out-of-vocabulary token id with ``echo``, protocol garbage on a raw socket, wrong methods, bodies
past ``--max-body-size``). Then hypothesis builds bodies from the endpoints' field names.
"""

from __future__ import annotations

import json
import random
import socket
from typing import Any

import httpx
import pytest
from conftest import fixture_dir
from fuzz_support import SEED, Tally
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minfer.testing.server_process import ServerProcess

MAX_BODY = 64 * 1024
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hello", "max_tokens": 2}
FIELDS = ["model", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "stop", "seed",
          "temperature", "top_p", "top_k", "min_p", "typical_p", "repeat_penalty", "repeat_last_n",
          "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "response_format",
          "grammar", "mirostat", "dry_multiplier", "dry_penalty_last_n", "xtc_probability", "samplers",
          "top_n_sigma", "echo", "best_of", "suffix", "tools", "min_keep", "dry_sequence_breakers"]


@pytest.fixture(scope="module")
def server():
    model = fixture_dir("gemma3") / "model-f32.gguf"
    args = ["--parallel", "2", "--ctx-size", "256", "--max-body-size", str(MAX_BODY), "--log-format", "off"]
    with ServerProcess(model, args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tally(request):
    t = Tally("server")
    yield t
    t.report(request.config)


def judge(tally: Tally, kind: str, case: str, r: httpx.Response) -> None:
    """Count one answer: a 2xx, or a 4xx whose body is an OpenAI error; anything else is a failure."""
    if r.status_code >= 500:
        tally.count(kind, "status_500")
        tally.failures.append(f"{kind} {case}: {r.status_code} {r.text[:200]}")
        return
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
            ok = isinstance(err["message"], str) and isinstance(err["type"], str) and "Traceback" not in r.text
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            tally.count(kind, "bad_error_body")
            tally.failures.append(f"{kind} {case}: {r.status_code} without an error body: {r.text[:200]}")
            return
        tally.count(kind, "clean_error")
        return
    tally.count(kind, "accepted")


def post(client: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return client.post(path, content=content, headers={"content-type": "application/json"})


ENDPOINTS = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]


def test_corpus(server, client, tally):
    rng = random.Random(SEED)
    for path, base in ENDPOINTS:
        for depth in (65, 1000, 100_000):
            for body in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
                judge(tally, "deep_json", f"{path} depth {depth}", post(client, path, body))
        texts = [("messages", 0, "content")] if "chat" in path else [("prompt",)]
        for where in [*texts, ("model",), ("stop",), ("grammar",), ("logit_bias", "\ud800")]:
            body = json.loads(json.dumps(base))
            if where[0] == "logit_bias":
                body["logit_bias"] = {"\ud800": 1}
            elif len(where) == 3:
                body["messages"][0]["content"] = "a\ud800b"
            else:
                body[where[0]] = "\udc00"
            judge(tally, "surrogates", f"{path} {where}", post(client, path, json.dumps(body).encode()))
        for field in FIELDS:
            for value in (2**63, 2**64 + 1, -(2**63) - 1, 10**400):
                judge(tally, "huge_ints", f"{path} {field}={value}",
                      post(client, path, json.dumps({**base, field: value}).encode()))
            for value in ("NaN", "Infinity", "-Infinity", "1e999"):
                raw = json.dumps({**base, field: 0}).encode().replace(b": 0", b": " + value.encode(), 1)
                judge(tally, "nan_values", f"{path} {field}={value}", post(client, path, raw))
            for value in (None, "x", [], [1, "a"], {}, {"a": [1]}, True, -1, 0.5, "\u0000"):
                judge(tally, "wrong_types", f"{path} {field}={value!r}",
                      post(client, path, json.dumps({**base, field: value}).encode()))
        judge(tally, "huge_ints", f"{path} logit_bias key 2^70",
              post(client, path, json.dumps({**base, "logit_bias": {str(2**70): 1}}).encode()))
        valid = json.dumps(base).encode()
        for cut in range(0, len(valid), max(1, len(valid) // 12)):
            judge(tally, "truncation", f"{path} [:{cut}]", post(client, path, valid[:cut]))
        for i in range(40):
            blob = bytearray(valid)
            blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
            judge(tally, "flips", f"{path} flip #{i}", post(client, path, bytes(blob)))
        judge(tally, "oversized", f"{path} body past the cap", post(client, path, b" " * (MAX_BODY + 1)))

        def chunked():
            yield b'{"prompt": "'
            for _ in range(MAX_BODY // 4096 + 2):
                yield b"x" * 4096
            yield b'"}'

        judge(tally, "oversized", f"{path} chunked past the cap",
              client.post(path, content=chunked(), headers={"content-type": "application/json"}))
        for method in ("GET", "PUT", "DELETE", "PATCH"):
            r = client.request(method, path)
            judge(tally, "methods", f"{method} {path}", r)
            assert r.status_code == 405 and "POST" in r.headers["allow"]
    judge(tally, "bad_values", "echo with a token outside the vocabulary",
          post(client, "/v1/completions", json.dumps({"prompt": [1, 2, 10**6], "echo": True}).encode()))
    judge(tally, "bad_values", "echo with a negative token id",
          post(client, "/v1/completions", json.dumps({"prompt": [[-5]], "echo": True}).encode()))
    for path in ("/nope", "/v1/nope", "/v1/models/nope", "/v1/chat/completions/x"):
        judge(tally, "routes", path, client.get(path))
    tally.assert_clean()


GARBAGE = [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", b"GET / HTTP/9.9\r\n\r\n", b"GARBAGE\r\n\r\n",
           b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
           b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nContent-Length: 20\r\n\r\n",
           b"GET /health HTTP/1.1\r\n" + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n",
           b"GET /\x00\x01 HTTP/1.1\r\n\r\n", b"\r\n\r\n\r\n"]


def test_protocol_garbage_gets_json_400s(server, tally):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    for i, blob in enumerate(GARBAGE):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(blob)
            try:
                answer = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                answer = b""
        head, _, body = answer.partition(b"\r\n\r\n")
        case = f"garbage #{i} {blob[:24]!r}"
        if not answer:
            tally.count("protocol_garbage", "closed")
            continue
        status = int(head.split()[1])
        if status >= 500 or (status >= 400 and b"application/json" not in head.lower()):
            tally.count("protocol_garbage", "status_500" if status >= 500 else "bad_error_body")
            tally.failures.append(f"{case}: {head[:100]!r} {body[:100]!r}")
        else:
            tally.count("protocol_garbage", "clean_error" if status >= 400 else "accepted")
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    tally.assert_clean()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=5,
)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 1]),
                                           "content": st.text(max_size=8) | JSON}), max_size=3)


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(path=st.sampled_from([p for p, _ in ENDPOINTS]), fields=st.dictionaries(st.sampled_from(FIELDS), JSON,
                                                                                   max_size=4),
       messages=MESSAGES, prompt=st.text(max_size=12) | st.lists(st.integers(-3, 10**6), max_size=4) | JSON)
def test_property_request_bodies(client, tally, path: str, fields: dict[str, Any], messages, prompt):
    body: dict[str, Any] = {"max_tokens": 2, **fields}
    if "chat" in path:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
        body["max_tokens"] = 4  # keep generations short; the huge values are the corpus's job
    judge(tally, "hypothesis_bodies", json.dumps(body)[:160], post(client, path, json.dumps(body).encode()))
    tally.assert_clean()
