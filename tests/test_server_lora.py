"""LoRA adapters through a real ``minfer serve`` over loopback: llama-server's ``GET/POST /lora-adapters`` and a
per-request ``lora`` field, with several adapters in one batch (the official openai client and httpx)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import fixture_dir

from minfer.testing.server_process import ServerProcess

LORA = fixture_dir("qwen3") / "lora" / "r16-all"
PROMPTS = ["The capital of France", "hello world, said the", "Once upon a time there", "zebra quantum 42"]
# two with adapter A (id 0), one with B (id 1: A as llama.cpp's file, at another scale), one with none
CHOICES = [[{"id": 0, "scale": 1.0}], [{"id": 0, "scale": 1.0}], [{"id": 1, "scale": -0.8}], []]


@pytest.fixture(scope="module")
def server():
    args = ["--parallel", "4", "--ctx-size", "512", "--batch-size", "64", "--lora", str(LORA / "peft"),
            "--lora-scaled", str(LORA / "adapter-f32.gguf"), "0.5"]
    with ServerProcess(fixture_dir("qwen3") / "model-f32.gguf", args) as s:
        yield s


def complete(server, prompt: str, lora=None, path: str = "/v1/completions") -> str:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    if lora is not None:
        body["lora"] = lora
    if path == "/completion":
        body = {**body, "n_predict": body.pop("max_tokens")}
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["content"] if path == "/completion" else r.json()["choices"][0]["text"]


def test_lora_adapters_lists_the_loaded_adapters_and_their_default_scales(server):
    r = httpx.get(server.url + "/lora-adapters")
    assert r.status_code == 200
    assert r.json() == [
        {"id": 0, "path": str(LORA / "peft"), "scale": 1.0, "task_name": "", "prompt_prefix": ""},
        {"id": 1, "path": str(LORA / "adapter-f32.gguf"), "scale": 0.5, "task_name": "", "prompt_prefix": ""},
    ]


def test_a_batch_mixing_adapters_gives_each_request_its_solo_text(server):
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda pc: complete(server, *pc), zip(PROMPTS, CHOICES, strict=True)))
    alone = [complete(server, p, c) for p, c in zip(PROMPTS, CHOICES, strict=True)]
    assert together == alone
    # the adapters matter: the same prompt under A, B and none gives three texts
    texts = {complete(server, PROMPTS[0], c) for c in (CHOICES[0], CHOICES[2], CHOICES[3])}
    assert len(texts) == 3


def test_post_lora_adapters_sets_the_default_and_every_route_takes_a_per_request_lora(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    half = [{"id": 0, "scale": 0.5}]
    explicit = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                         extra_body={"lora": half}).choices[0].text
    assert complete(server, PROMPTS[1], half, path="/completion") == explicit
    try:
        r = httpx.post(server.url + "/lora-adapters", json=half, timeout=30)
        assert r.status_code == 200 and r.json() == {"success": True}
        assert [a["scale"] for a in httpx.get(server.url + "/lora-adapters").json()] == [0.5, 0.0]
        assert complete(server, PROMPTS[1]) == explicit  # no 'lora': the new defaults
    finally:
        httpx.post(server.url + "/lora-adapters", json=[{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}])


def test_generation_settings_show_the_adapter_scales(server):
    props = httpx.get(server.url + "/props").json()
    assert props["default_generation_settings"]["params"]["lora"] == [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]
    r = httpx.post(server.url + "/completion", json={"prompt": "hi", "n_predict": 2, "lora": [{"id": 1, "scale": 2}]})
    assert r.json()["generation_settings"]["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 2.0}]


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/completions", {"prompt": "x", "lora": [{"id": 7, "scale": 1.0}]}, "adapter id 7 is not loaded"),
    ("/v1/completions", {"prompt": "x", "lora": {"id": 0}}, "'lora' must be a list"),
    ("/completion", {"prompt": "x", "lora": [{"id": 0, "scale": "big"}]}, "'lora[0]' must be"),
    ("/lora-adapters", {"id": 0, "scale": 1.0}, "must be an array"),
    ("/lora-adapters", [{"id": -1, "scale": 1.0}], "adapter id -1 is not loaded"),
])
def test_bad_lora_fields_get_400_naming_them(server, path, body, fragment):
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_ray_replicas_get_the_adapters_of_the_front():
    """``minfer serve --ray`` hands each replica's engine process its options as JSON: the (path, scale) pairs
    come back as pairs."""
    from minfer.server import ServeOptions
    from minfer.server.cluster.engine_process import options_from_json, options_to_json

    opts = ServeOptions(model="m.gguf", lora=[(str(LORA / "peft"), 0.5)], lora_init_without_apply=True)
    assert options_from_json(options_to_json(opts)) == opts
