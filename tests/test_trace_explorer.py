"""The trace explorer's model of a forward pass (minfer.trace.explorer) and its HTTP routes, on the fixtures."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from conftest import fixture_dir
from explorer_process import explorer_process

import minfer
from minfer.testing.server_process import ServerProcess
from minfer.trace.compare import DumpRun, compare

PROMPT = "The capital of France is Paris. The capital of Italy is"


def f32(o: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(o["b64"]), "<f4").reshape(o["shape"])


@pytest.fixture(scope="module")
def qwen3() -> minfer.Model:
    return minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=64)


def test_attention_panel_is_the_engines_attention(qwen3):
    trace = qwen3.trace_forward(qwen3.tokenize(PROMPT))
    hp = qwen3.hparams
    n = len(trace.tokens)
    for layer in range(hp.n_layer):
        attn = trace.attention_nodes(layer)["attn"]
        engine = trace.tensor(attn).reshape(n, hp.n_head, hp.head_dim_v)
        for head in range(hp.n_head):
            a = trace.attention(layer, head)
            weights, v = f32(a["weights"]).astype(np.float64), f32(a["v"]).astype(np.float64)
            assert a["check"]["equal"] and a["qk_norm"]  # Qwen3 normalizes q and k before RoPE
            np.testing.assert_allclose(weights.sum(axis=1), 1, atol=1e-6)
            assert np.all(np.triu(weights, 1) == 0)
            np.testing.assert_allclose(weights @ v, engine[:, head], atol=1e-5)
            np.testing.assert_array_equal(f32(a["output"]), engine[:, head])


def test_a_small_budget_captures_layers_again_with_the_same_values(qwen3):
    ids = qwen3.tokenize(PROMPT)
    full = qwen3.trace_forward(ids)
    tight = qwen3.trace_forward(ids, budget=0)
    assert tight.memory()["held_layers"] == [] and full.memory()["held_layers"] == [0, 1, 2]
    for layer in range(3):
        for name in ("q_rope", "attn", "ffn_residual"):
            node = full.by_name[f"blk.{layer}.{name}"]
            np.testing.assert_array_equal(tight.tensor(node), full.tensor(node))  # bit-identical rerun
    assert tight.recaptures >= 3 and tight.memory()["held_bytes"] <= tight.fixed_bytes() + tight.layer_bytes(2)


def test_logit_lens_last_layer_is_the_models_prediction(qwen3):
    ids = qwen3.tokenize(PROMPT)
    trace = qwen3.trace_forward(ids)
    lens = trace.lens(range(len(ids)))
    assert len(lens["layers"]) == 3 and len(lens["layers"][0]) == len(ids)
    assert [cell[0][0] for cell in lens["layers"][-1]] == lens["model_top"]
    logits = qwen3.logits(ids)
    assert lens["model_top"] == [int(np.argmax(row)) for row in logits]
    np.testing.assert_allclose([cell[0][2] for cell in lens["layers"][-1]], logits.max(axis=1), rtol=1e-4, atol=1e-4)


def test_compare_names_where_a_q8_0_cache_parts_and_a_dump_agrees(qwen3, tmp_path):
    ids = qwen3.tokenize(PROMPT)
    a, b = qwen3.trace_forward(ids), qwen3.trace_forward(ids, cache_type="q8_0")
    c = compare(a, b)
    assert c["first"]["name"] == "blk.0.attn" and 0 < c["first"]["max_abs"] and c["first"]["cosine"] < 1
    assert all(not r["parts"] for r in c["rows"][:-1])
    dumped = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=64, dump_dir=tmp_path / "d")
    dumped.logits(ids)
    same = compare(a, DumpRun(tmp_path / "d"), all_nodes=True)
    assert same["first"] is None and len(same["rows"]) > 30


@pytest.fixture(scope="module")
def explorer() -> str:
    """`minfer trace MODEL PROMPT --serve` on a free port: the explorer alone."""
    args = [str(fixture_dir("qwen3") / "model-f32.gguf"), PROMPT, "--compare-cache-type", "q8_0"]
    with explorer_process(args) as url:
        yield url.split("/trace")[0]


def test_explorer_routes_serve_tensors_on_demand(explorer):
    with httpx.Client(base_url=explorer, timeout=60) as c:
        runs = c.get("/trace/api/runs").json()["runs"]
        assert [r["cache_type"] for r in runs] == ["f32", "q8_0"]
        rid = runs[0]["id"]
        summary = c.get(f"/trace/api/runs/{rid}").json()
        assert summary["n_layer"] == 3 and summary["memory"]["held_bytes"] <= summary["memory"]["budget_bytes"]
        graph = c.get(f"/trace/api/runs/{rid}/layers/1/graph").json()
        ids = {n["id"] for n in graph["nodes"]}
        inside = [n for n in graph["nodes"] if not n["outside"]]
        assert all(i in ids for n in inside for i in n["inputs"])  # every edge of the layer's nodes drawn
        assert any(n["op"] == "weight" and n["name"] == "blk.1.attn_q.weight" for n in graph["nodes"])
        assert all(i < n["id"] for n in inside for i in n["inputs"])  # numbered by id: inputs come first
        q = next(n for n in graph["nodes"] if n["name"] == "blk.1.q")
        view = c.get(f"/trace/api/runs/{rid}/nodes/{q['id']}", params={"max_cols": 16}).json()
        assert view["shape"] == q["shape"] and view["cols"] == [0, 128, 8] and f32(view["values"]).shape[1] == 16
        assert view["axes"] == {"rows": "token", "cols": "query head x dim", "heads": 4, "head_dim": 32}
        assert sum(view["histogram"]["counts"]) == q["shape"][0] * q["shape"][1]
        window = c.get(f"/trace/api/runs/{rid}/nodes/{q['id']}", params={"rows": "2:4", "cols": "32:64"}).json()
        whole = c.get(f"/trace/api/runs/{rid}/nodes/{q['id']}").json()
        assert whole["cols"] == [0, 128, 1]
        np.testing.assert_array_equal(f32(window["values"]), f32(whole["values"])[2:4, 32:64])
        np.testing.assert_array_equal(f32(view["values"]), f32(whole["values"])[:, ::8])
        att = c.get(f"/trace/api/runs/{rid}/layers/2/attention/3").json()
        assert att["check"]["equal"] and att["kv_head"] == 1 and att["cache_type"] == "f32"
        lens = c.get(f"/trace/api/runs/{rid}/lens", params={"positions": "0:4"}).json()
        assert lens["positions"] == [0, 1, 2, 3]
        cmp = c.get("/trace/api/compare", params={"a": rid, "b": runs[1]["id"]}).json()
        assert cmp["first"]["name"] == "blk.0.attn"
        for url, status, words in [(f"/trace/api/runs/{rid}/layers/9/graph", 400, "layer 9"),
                                   (f"/trace/api/runs/{rid}/nodes/{q['id']}?rows=5", 400, "START:STOP"),
                                   (f"/trace/api/runs/{rid}/layers/0/attention/7", 400, "head 7"),
                                   ("/trace/api/runs/r99", 404, "r99")]:
            r = c.get(url)
            assert r.status_code == status and words in r.json()["error"]["message"], r.text
        r = c.post("/trace/api/runs", json={"prompt": "hi", "tokens": [1]})
        assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
        page = c.get("/trace")
        assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
        assert "https://" not in page.text and "http://" not in page.text


def test_pages_load_without_the_key_and_the_api_wants_it(qwen3):
    with ServerProcess(fixture_dir("qwen3") / "model-f32.gguf", ["--api-key", "k", "-np", "1", "-c", "64"]) as s:
        for path in ("/", "/trace", "/static/chat.js", "/static/vendor/marked.umd.js", "/favicon.ico"):
            assert httpx.get(s.url + path).status_code == 200, path
        assert 'content="required"' in httpx.get(s.url + "/").text
        assert httpx.get(s.url + "/static/../v1/models").status_code != 200
        r = httpx.post(s.url + "/trace/api/runs", json={"prompt": "hello"})
        assert r.status_code == 401
        r = httpx.post(s.url + "/trace/api/runs", json={"prompt": "hello"}, headers={"Authorization": "Bearer k"},
                       timeout=120)
        assert r.status_code == 200 and r.json()["cache_type"] == "f32"
        r = httpx.post(s.url + "/trace/api/runs", json={"messages": [{"role": "user", "content": "hi"}]},
                       headers={"Authorization": "Bearer k"}, timeout=120)
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]  # the fixture has none
