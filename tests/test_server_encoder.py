"""``minfer serve`` with an encoder: all-MiniLM-L6-v2 from its PyPI package behind the official ``openai`` client's
``embeddings.create``, the tiny BERT cross-encoder behind ``/v1/rerank`` (and its aliases and shapes) through
``httpx``, and every bad input a 400 naming the field. Real server processes on loopback ports."""

from __future__ import annotations

import base64
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI

import minfer
from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

RERANKER = Path(__file__).parent / "fixtures" / "bert_rerank"


@pytest.fixture(scope="module")
def local(all_minilm_path):
    return minfer.load(all_minilm_path)


@pytest.fixture(scope="module")
def server(all_minilm_path):
    with ServerProcess(all_minilm_path, ["--alias", "all-minilm"]) as s:
        yield s


@pytest.fixture(scope="module")
def reranker():
    with ServerProcess(RERANKER, ["--alias", "reranker", "--pooling", "rank"]) as s:
        yield s


def test_openai_client_embeddings_equal_the_api(server, local):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    texts = ["The cat sits on the mat.", "Un café, s'il vous plaît.", "量子コンピュータ", "x" * 40]
    got = client.embeddings.create(model="all-minilm", input=texts)
    assert [d.index for d in got.data] == [0, 1, 2, 3]
    vectors = np.array([d.embedding for d in got.data], np.float32)
    np.testing.assert_array_equal(vectors, local.embed(texts))  # the same kernels, the same bits
    assert got.usage.prompt_tokens == sum(len(local.tokenize(t)) for t in texts)
    b64 = client.embeddings.create(model="all-minilm", input="The cat sits on the mat.", encoding_format="base64")
    # asked for explicitly, base64 comes back as the string the server wrote: little-endian float32
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(b64.data[0].embedding), "<f4"), vectors[0])


def test_concurrent_clients_share_batches_and_get_their_own_vectors(server, local):
    texts = [f"request number {k} " + "word " * (k % 13) for k in range(24)]

    def one(text: str) -> np.ndarray:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": text}, timeout=120)
        r.raise_for_status()
        return np.array(r.json()["data"][0]["embedding"], np.float32)

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, texts))
    np.testing.assert_array_equal(np.stack(got), local.embed(texts))


def test_native_embedding_and_token_routes(server, local):
    r = httpx.post(server.url + "/embedding", json={"content": "hello world"}, timeout=60)
    assert r.status_code == 200
    np.testing.assert_array_equal(np.array(r.json()[0]["embedding"][0], np.float32), local.embed("hello world")[0])
    r = httpx.post(server.url + "/embedding", json={"content": "hello world", "embd_normalize": -1}, timeout=60)
    assert abs(np.linalg.norm(r.json()[0]["embedding"][0]) - 1.0) > 1e-3  # not normalised
    ids = httpx.post(server.url + "/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert ids == local.tokenize("hello world") and ids[0] == 101 and ids[-1] == 102
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["content"] == "hello world"
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["id"] == "all-minilm" and card["meta"]["n_embd"] == 384 and card["meta"]["kind"] == "encoder"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(server.url + "/metrics").text
    assert "minfer_requests_total" in metrics
    passes = [float(line.split()[1]) for line in metrics.splitlines() if line.startswith("minfer_encoder_passes ")]
    assert passes and passes[0] >= 1


@pytest.mark.parametrize("path,body,param,fragment", [
    ("/v1/embeddings", {"input": ""}, "input", "empty string"),
    ("/v1/embeddings", {"input": []}, "input", "empty"),
    ("/v1/embeddings", {"input": [1.5]}, "input", "must be a string"),
    ("/v1/embeddings", {"input": "word " * 300}, "input", "longer than the model's 256"),
    ("/v1/embeddings", {"input": "x", "truncate": "yes"}, "truncate", "true or false"),
    ("/v1/embeddings", {"input": [[5, 40000]]}, "input", "outside the vocabulary"),
    ("/v1/embeddings", {"input": "x", "dimensions": 10}, "dimensions", "384"),
    ("/v1/rerank", {"query": "q", "documents": ["a"]}, "model", "no classification head"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model", "is an encoder"),
    ("/completion", {"prompt": "hi"}, "model", "is an encoder"),
])
def test_bad_requests_are_400_naming_the_field(server, path, body, param, fragment):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err


def test_truncate_true_cuts_at_max_seq_length(server, local):
    long = "word " * 300
    r = httpx.post(server.url + "/v1/embeddings", json={"input": long, "truncate": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256
    np.testing.assert_array_equal(np.array(r.json()["data"][0]["embedding"], np.float32),
                                  local.embed(long, truncate=True)[0])


def test_rerank_shapes_and_aliases(reranker):
    local = minfer.load(RERANKER)
    docs = ["the cat sat on the mat", "stock markets fell today", "a cat is a small animal", "rain in spain"]
    want = local.rerank("what is a cat", docs)
    scores = [w["relevance_score"] for w in want]
    assert scores == sorted(scores, reverse=True)  # best first
    for path in ("/v1/rerank", "/rerank", "/reranking", "/v1/reranking"):
        r = httpx.post(reranker.url + path, json={"query": "what is a cat", "documents": docs, "top_n": 2,
                                                  "return_documents": True}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and len(body["results"]) == 2
        for got, exp in zip(body["results"], want[:2], strict=True):
            assert got["index"] == exp["index"] and got["relevance_score"] == pytest.approx(exp["relevance_score"],
                                                                                              abs=1e-6)
            assert got["document"] == {"text": docs[exp["index"]]}
    # Cohere's {"text": ...} documents; TEI's texts / score / return_text
    cohere = {"query": "what is a cat", "documents": [{"text": d} for d in docs]}
    r = httpx.post(reranker.url + "/v1/rerank", json=cohere)
    assert [x["index"] for x in r.json()["results"]] == [w["index"] for w in want]
    r = httpx.post(reranker.url + "/rerank", json={"query": "what is a cat", "texts": docs, "return_text": True})
    tei = r.json()
    assert isinstance(tei, list) and [x["index"] for x in tei] == [w["index"] for w in want]
    assert tei[0]["text"] == docs[want[0]["index"]] and "score" in tei[0]


@pytest.mark.parametrize("body,param", [
    ({"documents": ["a"]}, "query"),
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "q", "documents": ["a", 3]}, "documents"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ({"query": "q", "documents": ["a"], "top_n": "2"}, "top_n"),
    ({"query": 5, "documents": ["a"]}, "query"),
])
def test_bad_rerank_requests(reranker, body, param):
    r = httpx.post(reranker.url + "/v1/rerank", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_base64_is_little_endian_float32(server, local):
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "abc", "encoding_format": "base64"}, timeout=60)
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(vec, local.embed("abc")[0])


@pytest.mark.parametrize("model,fragment", [
    (Path(__file__).parent / "fixtures" / "bert", "has no classification head"),
    (Path(__file__).parent / "fixtures" / "llama" / "model-f32.gguf", "is a generating model"),
])
def test_pooling_rank_needs_a_reranker(model, fragment):
    r = subprocess.run([sys.executable, "-m", "minfer", "serve", str(model), "--port", "0", "--pooling", "rank"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and fragment in r.stderr, r.stderr
