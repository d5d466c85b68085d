"""What llama.cpp's clients expect of a local server, against a real ``minfer serve`` process: embeddings
(the openai client, transformers' vectors), the routes without ``/v1``, any model name, CORS before the
key check, the native ``/completion`` and ``/infill``, and the endpoints clients probe."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import derive_gguf, fixture_dir
from openai import BadRequestError, OpenAI

from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

REFS = json.loads((Path(__file__).parent / "data" / "embedding_refs.json").read_text())["models"]["llama"]
KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://editor.example"
FIM = {"tokenizer.ggml.fim_pre_token_id": 3, "tokenizer.ggml.fim_suf_token_id": 4,
       "tokenizer.ggml.fim_mid_token_id": 5}


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


class Keyed(ServerProcess):
    auth_headers = AUTH


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    """The llama fixture with fill-in-the-middle token ids in its metadata."""
    return derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path_factory.mktemp("fim") / "tiny.gguf", FIM)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    args = ["--parallel", "3", "--ctx-size", "384", "--batch-size", "32", "--alias", "tiny", "--api-key", KEY,
            "--cors-origin", f"{ORIGIN},http://other.example", "--slots"]
    with Keyed(tiny_path, args) as s:
        yield s


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=60, **kw)


# -- embeddings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("base", ["/v1", ""])
def test_openai_client_embeddings_match_transformers(tiny, base):
    client = OpenAI(base_url=tiny.url + base, api_key=KEY, max_retries=0, timeout=60)
    texts = [c["text"] for c in REFS]
    r = client.embeddings.create(model="text-embedding-3-small", input=texts)  # any model name is served
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, case in zip(r.data, REFS, strict=True):
        assert cosine(d.embedding, case["mean"]) > 1 - 1e-5
    assert r.usage.prompt_tokens == sum(len(c["ids"]) for c in REFS) == r.usage.total_tokens
    assert r.model == "tiny"
    # base64: little-endian float32, the same numbers
    b = client.embeddings.create(model="tiny", input=texts[0], encoding_format="base64")
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(b.data[0].embedding), "<f4"),
                                  np.asarray(r.data[0].embedding, np.float32))


def test_embeddings_of_token_ids_base64_and_batched_equal_one_by_one(tiny):
    ids = [c["ids"] for c in REFS]
    many = post(tiny, "/v1/embeddings", {"input": ids}).json()["data"]
    for i, x in enumerate(ids):
        one = post(tiny, "/v1/embeddings", {"input": x, "encoding_format": "base64"}).json()
        vec = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(vec, many[i]["embedding"], atol=1e-6)
        assert one["usage"]["prompt_tokens"] == len(x)


def test_native_embedding_shape(tiny):
    r = post(tiny, "/embedding", {"content": REFS[0]["text"]}).json()
    assert len(r) == 1 and r[0]["index"] == 0 and len(r[0]["embedding"]) == 1
    assert cosine(r[0]["embedding"][0], REFS[0]["mean"]) > 1 - 1e-5
    # /embeddings answers natively to a native body, in OpenAI's shape to an OpenAI one
    assert post(tiny, "/embeddings", {"content": "hello"}).json()[0]["index"] == 0
    assert post(tiny, "/embeddings", {"input": "hello"}).json()["object"] == "list"
    raw = post(tiny, "/embedding", {"content": REFS[2]["ids"], "embd_normalize": -1}).json()
    assert abs(np.linalg.norm(raw[0]["embedding"][0]) - 1) > 1e-3  # not normalised


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"input": []}, "input", "is empty"),
        ({"input": ""}, "input", "empty string"),
        ({}, "input", "'input' is required"),
        ({"input": [[1, 2], []]}, "input", "empty list"),
        ({"input": [1, 2, 99999]}, "input", "token id 99999 at index 2 is outside the vocabulary"),
        ({"input": [[1, 2], [3, -1]]}, "input", "token id -1"),
        ({"input": {"text": "x"}}, "input", "must be a string"),
        ({"input": [1.5]}, "input", "must be a string, a list of token ids"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "x", "dimensions": 16}, "dimensions", "must be 64"),
        ({"input": [0] * 400}, "input", "more than the context"),
    ],
)
def test_bad_embeddings_get_400_naming_the_field(tiny, body, param, fragment):
    r = post(tiny, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # a prompt too long is llama-server's exceed_context_size_error (with its counts), the others plain 400s
    kind = "exceed_context_size_error" if "context" in fragment else "invalid_request_error"
    assert fragment in err["message"] and err["param"] == param and err["type"] == kind


def test_openai_client_sees_a_bad_embedding_as_bad_request(tiny):
    client = OpenAI(base_url=tiny.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(BadRequestError, match="is empty"):
        client.embeddings.create(model="tiny", input=[])


# -- routes, model names, CORS ------------------------------------------------------------------------


def test_routes_without_v1_and_any_model_name(tiny):
    for path in ("/completions", "/v1/completions"):
        r = post(tiny, path, {"model": "gpt-4o", "prompt": "abc", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny"
    r = post(tiny, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code in (200, 400)  # the fixture has no chat template: a 400 from the chat route itself
    assert "chat template" in r.text or r.json()["object"] == "chat.completion"
    models = httpx.get(tiny.url + "/models", headers=AUTH).json()
    assert models["data"][0]["id"] == "tiny"
    meta = models["data"][0]["meta"]
    assert meta["n_vocab"] == 512 and meta["n_embd"] == 64 and meta["n_params"] > 0 and meta["size"] > 0
    assert httpx.get(tiny.url + "/models/tiny", headers=AUTH).json()["id"] == "tiny"
    assert httpx.get(tiny.url + "/nothing", headers=AUTH).status_code == 404


def test_cors_preflight_before_the_key_check(tiny):
    pre = httpx.options(tiny.url + "/v1/embeddings", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"]  # "*" alone does not cover it
    r = httpx.post(tiny.url + "/embeddings", json={"input": "x"}, headers={**AUTH, "Origin": "http://other.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://other.example"
    # the key is still required for the request itself, and its error carries the CORS header
    r = httpx.post(tiny.url + "/v1/embeddings", json={"input": "x"}, headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    # an origin not allowed gets no CORS header: its preflight is answered 200 (as llama-server answers every
    # OPTIONS), and the browser refuses the page for the missing header
    bad = httpx.options(tiny.url + "/v1/embeddings", headers={"Origin": "http://evil.example",
                                                              "Access-Control-Request-Method": "POST"})
    assert bad.status_code == 200 and "access-control-allow-origin" not in bad.headers


# -- the native API -----------------------------------------------------------------------------------


def test_native_completion_matches_v1_completions(tiny):
    body = {"prompt": "The fox", "n_predict": 8, "temperature": 0, "n_probs": 3, "return_tokens": True}
    r = post(tiny, "/completion", body).json()
    ref = post(tiny, "/v1/completions", {"prompt": "The fox", "max_tokens": 8, "temperature": 0, "logprobs": 3}).json()
    assert r["content"] == ref["choices"][0]["text"]
    assert r["stop"] is True and r["tokens_predicted"] == 8 and r["stop_type"] == "limit"
    assert r["tokens_evaluated"] == len(REFS[0]["ids"][:1]) + len(httpx.post(
        tiny.url + "/tokenize", json={"content": "The fox"}, headers=AUTH).json()["tokens"])
    assert len(r["tokens"]) == 8 and r["truncated"] is False and 0 <= r["id_slot"] < 3
    probs = r["completion_probabilities"]
    assert len(probs) == 8 and all(len(p["top_logprobs"]) == 3 for p in probs)
    assert [p["id"] for p in probs] == r["tokens"]
    assert probs[0]["logprob"] == pytest.approx(ref["choices"][0]["logprobs"]["token_logprobs"][0], abs=1e-6)
    assert probs[0]["top_logprobs"][0]["logprob"] >= probs[0]["top_logprobs"][1]["logprob"]
    t = r["timings"]
    assert t["predicted_n"] == 8 and t["prompt_n"] + t["cache_n"] == r["tokens_evaluated"]
    assert t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    assert r["generation_settings"]["n_predict"] == 8 and r["generation_settings"]["temperature"] == 0


def test_native_completion_streams_data_chunks(tiny):
    body = {"prompt": "The fox", "n_predict": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", tiny.url + "/completion", json=body, headers=AUTH, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: {") for line in lines)  # no [DONE]
    chunks = [json.loads(line[6:]) for line in lines]
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    text = "".join(c["content"] for c in chunks)
    whole = post(tiny, "/completion", {**body, "stream": False}).json()
    assert text == whole["content"]
    assert chunks[-1]["timings"]["predicted_n"] == 6 and chunks[-1]["stop_type"] == "limit"


def test_native_completion_stop_words_tokens_prompts_and_sampling_names(tiny):
    first = post(tiny, "/completion", {"prompt": "The fox", "n_predict": 8, "temperature": 0}).json()
    word = first["content"][2:5]
    r = post(tiny, "/completion", {"prompt": "The fox", "n_predict": 8, "temperature": 0, "stop": [word]}).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == word and word not in r["content"]
    ids = httpx.post(tiny.url + "/tokenize", json={"content": "The fox", "add_special": True}, headers=AUTH).json()
    by_ids = post(tiny, "/completion", {"prompt": ids["tokens"], "n_predict": 8, "temperature": 0}).json()
    assert by_ids["content"] == first["content"]
    mixed = post(tiny, "/completion", {"prompt": [ids["tokens"][0], "The fox"], "n_predict": 8, "temperature": 0})
    assert mixed.json()["content"] == first["content"]
    two = post(tiny, "/completion", {"prompt": ["The fox", "A dog"], "n_predict": 4, "temperature": 0}).json()
    assert isinstance(two, list) and [x["index"] for x in two] == [0, 1]
    sampled = post(tiny, "/completion", {"prompt": "The fox", "n_predict": 8, "temperature": 0.9, "top_k": 5,
                                         "min_p": 0.1, "repeat_penalty": 1.2, "seed": 7, "mirostat": 0}).json()
    again = post(tiny, "/completion", {"prompt": "The fox", "n_predict": 8, "temperature": 0.9, "top_k": 5,
                                       "min_p": 0.1, "repeat_penalty": 1.2, "seed": 7, "mirostat": 0}).json()
    assert sampled["content"] == again["content"]
    assert sampled["generation_settings"]["top_k"] == 5


def test_native_logit_bias_false_bans_the_token(tiny):
    greedy = post(tiny, "/completion", {"prompt": "The fox", "n_predict": 1, "temperature": 0,
                                        "return_tokens": True}).json()["tokens"][0]
    other = post(tiny, "/completion", {"prompt": "The fox", "n_predict": 1, "temperature": 0, "return_tokens": True,
                                       "logit_bias": [[greedy, False]]}).json()["tokens"][0]
    assert other != greedy


def test_cache_prompt_false_evaluates_the_whole_prompt(tiny):
    body = {"prompt": "The fox jumps", "n_predict": 2, "temperature": 0}
    post(tiny, "/completion", body)
    warm = post(tiny, "/completion", body).json()
    cold = post(tiny, "/completion", {**body, "cache_prompt": False}).json()
    assert warm["tokens_cached"] > 0 and cold["tokens_cached"] == 0
    assert cold["timings"]["prompt_n"] == cold["tokens_evaluated"]
    assert cold["content"] == warm["content"]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"prompt": 5}, "prompt", "'prompt' must be"),
        ({"prompt": {"text": "x"}}, "prompt", "'prompt' must be"),
        ({"n_predict": 3}, "prompt", "'prompt' is required"),
        ({"prompt": [1, 2, 99999]}, None, "token id 99999 at index 2"),
        ({"prompt": "x", "n_predict": -5}, "n_predict", "'n_predict' must be >= 0"),
        ({"prompt": "x", "n_probs": 100}, "n_probs", "'n_probs' must be between 0 and 20"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "finite number"),
        ({"prompt": "x", "id_slot": 1}, "id_slot", "send -1"),
        ({"prompt": "x", "t_max_predict_ms": 100}, "t_max_predict_ms", "not supported"),
        ({"prompt": "x", "logit_bias": [[1]]}, "logit_bias", "[token, bias] pairs"),
        ({"prompt": "x", "json_schema": "object"}, "json_schema", "JSON Schema object"),
        ({"prompt": []}, "prompt", "'prompt' must be"),
    ],
)
def test_bad_native_completions_get_400(tiny, body, param, fragment):
    r = post(tiny, "/completion", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"], err
    if param is not None:
        assert err["param"] == param


def test_infill_uses_the_fim_tokens(tiny):
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    r = post(tiny, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "prompt": "c =", "n_predict": 4,
                               "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    tok = lambda s: httpx.post(tiny.url + "/tokenize", json={"content": s}, headers=AUTH).json()["tokens"]  # noqa: E731
    expected = [0, 3, *tok(prefix), 4, *tok(suffix), 5, *tok("c =")]  # BOS, PRE, prefix, SUF, suffix, MID, prompt
    same = post(tiny, "/completion", {"prompt": expected, "n_predict": 4, "temperature": 0}).json()
    assert out["tokens_evaluated"] == len(expected) and out["content"] == same["content"]
    extra = post(tiny, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 2,
                                   "input_extra": [{"filename": "a.py", "text": "x = 1\n"}]}).json()
    assert extra["tokens_evaluated"] == len(expected) - len(tok("c =")) + len(tok("x = 1\n"))
    bad = post(tiny, "/infill", {"input_prefix": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input_prefix"


# -- the probes ---------------------------------------------------------------------------------------


def test_tokenize_detokenize(tiny):
    r = httpx.post(tiny.url + "/tokenize", json={"content": "hello world"}, headers=AUTH).json()
    with_bos = httpx.post(tiny.url + "/tokenize", json={"content": "hello world", "add_special": True},
                          headers=AUTH).json()
    assert with_bos["tokens"] == [0, *r["tokens"]]
    pieces = httpx.post(tiny.url + "/tokenize", json={"content": "hello world", "with_pieces": True},
                        headers=AUTH).json()["tokens"]
    assert [p["id"] for p in pieces] == r["tokens"] and "".join(p["piece"] for p in pieces) == "hello world"
    back = httpx.post(tiny.url + "/detokenize", json={"tokens": r["tokens"]}, headers=AUTH).json()
    assert back == {"content": "hello world"}
    for path, body, param in [("/tokenize", {"content": 5}, "content"), ("/tokenize", {}, "content"),
                              ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces")]:
        bad = httpx.post(tiny.url + path, json=body, headers=AUTH)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_props_and_slots(tiny, tiny_path):
    props = httpx.get(tiny.url + "/props", headers=AUTH).json()
    assert props["total_slots"] == 3 and props["model_path"] == str(tiny_path) and props["model_alias"] == "tiny"
    settings = props["default_generation_settings"]
    # 3 slots sharing 384 positions (a unified cache, as llama-server's --kv-unified): each may use them all
    assert settings["n_ctx"] == 384 and settings["params"]["temperature"] == 0.8 and settings["params"]["top_k"] == 40
    assert props["build_info"].startswith("minfer") and "chat_template" in props
    slots = httpx.get(tiny.url + "/slots", headers=AUTH).json()
    assert [s["id"] for s in slots] == [0, 1, 2] and all(s["n_ctx"] == 384 for s in slots)
    assert all(s["preempted"] == 0 and s["kv_blocks"] >= 0 for s in slots)
    assert not any(s["is_processing"] for s in slots)


def test_strict_model_and_no_slots(tiny_path):
    with ServerProcess(tiny_path, ["--parallel", "1", "--ctx-size", "128", "--alias", "tiny", "--strict-model",
                                   "--no-slots", "--no-cors"]) as s:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "x", "model": "gpt-4"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "x", "model": "tiny"}).status_code == 200
        r = httpx.get(s.url + "/slots")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
        # --no-cors: no CORS headers, and a preflight is routed like any request (405: no OPTIONS route)
        pre = httpx.options(s.url + "/v1/embeddings",
                            headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
        r = httpx.get(s.url + "/v1/models", headers={"Origin": ORIGIN})
        assert "access-control-allow-origin" not in r.headers


def test_pooling_flags(tiny_path):
    with ServerProcess(tiny_path, ["--parallel", "1", "--ctx-size", "128", "--pooling", "last"]) as s:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": REFS[0]["ids"]}).json()
        assert cosine(r["data"][0]["embedding"], REFS[0]["last"]) > 1 - 1e-5
    with ServerProcess(tiny_path, ["--parallel", "1", "--ctx-size", "128", "--pooling", "none"]) as s:
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "x"})
        assert r.status_code == 400 and "/embedding" in r.json()["error"]["message"]
        rows = httpx.post(s.url + "/embedding", json={"content": REFS[2]["ids"]}).json()[0]["embedding"]
        assert len(rows) == len(REFS[2]["ids"])
        assert cosine(np.mean(rows, axis=0), REFS[2]["mean"]) > 1 - 1e-5
    with ServerProcess(tiny_path, ["--parallel", "1", "--ctx-size", "128", "--no-normalize"]) as s:
        v = httpx.post(s.url + "/v1/embeddings", json={"input": "x"}).json()["data"][0]["embedding"]
        assert abs(np.linalg.norm(v) - 1) > 1e-3


# -- SmolLM2: a model with a chat template and no FIM tokens ------------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2_path):
    with ServerProcess(smollm2_path, ["--parallel", "2", "--ctx-size", "2048"]) as s:
        yield s


def test_smollm2_apply_template_infill_and_chat_without_v1(smol):
    import minfer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = httpx.post(smol.url + "/apply-template", json={"messages": messages}).json()["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n")
    r = httpx.post(smol.url + "/infill", json={"input_prefix": "def f(", "input_suffix": "):"})
    assert r.status_code == 400 and "no fill-in-the-middle tokens" in r.json()["error"]["message"]
    client = OpenAI(base_url=smol.url, api_key="x", max_retries=0, timeout=120)  # no /v1 in the base URL
    chat = client.chat.completions.create(model="llama", messages=messages, max_tokens=8, temperature=0)
    native = httpx.post(smol.url + "/completion", json={"prompt": prompt, "n_predict": 8, "temperature": 0},
                        timeout=120).json()
    # the chat route tokenizes the rendered template without adding BOS; so does a prompt of token ids
    ids = httpx.post(smol.url + "/tokenize", json={"content": prompt}).json()["tokens"]
    by_ids = httpx.post(smol.url + "/completion", json={"prompt": ids, "n_predict": 8, "temperature": 0},
                        timeout=120).json()
    assert chat.choices[0].message.content == by_ids["content"]
    assert native["content"]
    assert minfer.__version__ in httpx.get(smol.url + "/props").json()["build_info"]


def test_timings_on_the_openai_routes(tiny):
    """llama-server answers every ``/v1/completions`` with ``timings``, asked for (``timings_per_token``) or not."""
    body = {"prompt": "The fox", "max_tokens": 5, "temperature": 0}
    assert post(tiny, "/v1/completions", body).json()["timings"]["predicted_n"] == 5
    t = post(tiny, "/v1/completions", {**body, "timings_per_token": True}).json()["timings"]
    n_prompt = len(httpx.post(tiny.url + "/tokenize", json={"content": "The fox", "add_special": True},
                              headers=AUTH).json()["tokens"])
    assert t["predicted_n"] == 5 and t["prompt_n"] + t["cache_n"] == n_prompt and t["predicted_per_second"] > 0
    with httpx.stream("POST", tiny.url + "/v1/completions", json={**body, "stream": True, "timings_per_token": True},
                      headers=AUTH, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["timings"]["predicted_n"] == 5
    bad = post(tiny, "/v1/completions", {**body, "timings_per_token": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timings_per_token"


def test_readme_curl_examples_work_as_written(smol):
    """Each ``curl localhost:8080/...`` line of the README's llama.cpp section, sent as written."""
    import shlex

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("### Embeddings, and what llama.cpp's clients expect"):]
    section = section[: section.index("\n### ", 10)] if "\n### " in section[10:] else section
    lines = [line.split("  #")[0] for line in section.splitlines() if line.startswith("curl ")]
    assert len(lines) >= 9
    expected = {"/infill": 400}  # SmolLM2 has no FIM tokens
    for line in lines:
        args = shlex.split(line)
        url = next(a for a in args if a.startswith("localhost:8080"))
        path = url[len("localhost:8080"):]
        body = json.loads(args[args.index("-d") + 1]) if "-d" in args else None
        r = httpx.request("POST" if body is not None else "GET", smol.url + path, json=body, timeout=120)
        assert r.status_code == expected.get(path, 200), (line, r.text)


def test_embeddings_share_the_passes_with_generation(smol, smollm2_path):
    """An embedding sent while a long generation streams is answered before that generation ends, with
    the vector it gets when nothing else runs."""
    import minfer

    eog = {str(t): -100 for t in minfer.load(smollm2_path, n_ctx=64).tokenizer.eog_ids}
    alone = httpx.post(smol.url + "/v1/embeddings", json={"input": "a quiet text"}, timeout=120).json()
    body = {"prompt": "Write a very long story.", "max_tokens": 900, "temperature": 0.8, "stream": True,
            "logit_bias": eog}
    with httpx.stream("POST", smol.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        shared = httpx.post(smol.url + "/v1/embeddings", json={"input": "a quiet text"}, timeout=120).json()
        still_running = httpx.get(smol.url + "/health").json()["slots_running"]
    assert still_running == 1  # the story was still being generated when the embedding came back
    np.testing.assert_allclose(shared["data"][0]["embedding"], alone["data"][0]["embedding"], atol=1e-5)
