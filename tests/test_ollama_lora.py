"""LoRA adapters as ollama model variants, through a real ``minfer serve`` over loopback with the official ``ollama``
client: the adapters loaded at startup are listed, shown and run as ``<base>:<adapter>``, and ``create_blob`` +
``create`` make one more while the server runs. Each variant's greedy text is checked against the same turn on
``/v1/chat/completions`` with the per-request ``lora`` it stands for, and against the base's (the adapter is big
enough to change the text)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading

import httpx
import ollama
import pytest
from conftest import fixture_dir
from openai import OpenAI

from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = fixture_dir("qwen3") / "model-f32.gguf"
LORA = fixture_dir("qwen3") / "lora" / "r16-all"
GGUF_ADAPTER = LORA / "adapter-f32.gguf"  # the PEFT folder's adapter, as llama.cpp's file
ASK = [{"role": "user", "content": "The capital of France is"}]
GREEDY = {"temperature": 0, "num_predict": 12}
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
BASE, PEFT, HALF = "model-f32:latest", "model-f32:peft", "model-f32:adapter-f32"


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    return tmp_path_factory.mktemp("blobs")


@pytest.fixture(scope="module")
def server(tmp_path_factory, blobs):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    # adapter 0: the PEFT folder at 1.0; adapter 1: the same adapter's GGUF file at 0.5; --strict-model: a variant's
    # name must reach it all the same
    args = ["--parallel", "2", "--ctx-size", "512", "--strict-model", "--chat-template-file", str(template),
            "--lora", str(LORA / "peft"), "--lora-scaled", str(GGUF_ADAPTER), "0.5",
            "--ollama-blobs", str(blobs)]
    with ServerProcess(MODEL, args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, model: str, messages=ASK) -> str:
    return client.chat(model=model, messages=messages, options=GREEDY, stream=False).message.content


def openai_chat(oai, lora=None, messages=ASK) -> str:
    extra = {} if lora is None else {"lora": lora}
    r = oai.chat.completions.create(model="model-f32", messages=messages, temperature=0, max_tokens=12,
                                    extra_body=extra)
    return r.choices[0].message.content


def sha256(path) -> str:
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(path)}\0{hashlib.sha256(p.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


def mixed(adapter) -> str:
    return hashlib.sha256(f"{sha256(MODEL)}\n{sha256(adapter)}\n".encode()).hexdigest()


def test_tags_and_ps_list_each_startup_adapter_as_a_variant_of_the_base(client):
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {BASE, PEFT, HALF}
    assert listed[BASE].digest == sha256(MODEL) and listed[BASE].details.parent_model == ""
    for name, adapter in ((PEFT, LORA / "peft"), (HALF, GGUF_ADAPTER)):
        assert listed[name].details.parent_model == BASE
        assert listed[name].digest == mixed(adapter)
        assert listed[name].size > listed[BASE].size
        assert listed[name].details.family == listed[BASE].details.family
    assert {m.model for m in client.ps().models} == {BASE, PEFT, HALF}


def test_show_gives_a_variant_s_modelfile_and_parent(client):
    shown = client.show(HALF)
    assert f"FROM {MODEL}" in shown.modelfile and f"ADAPTER {GGUF_ADAPTER}" in shown.modelfile
    assert shown.details.parent_model == BASE
    assert "ADAPTER" not in client.show(BASE).modelfile


def test_a_variant_runs_its_adapter_alone_at_its_loaded_scale(client, oai):
    base, off = chat(client, BASE), openai_chat(oai, [])
    assert base == openai_chat(oai)  # the base: the server's defaults (both adapters on)
    for name, lora in ((PEFT, [{"id": 0, "scale": 1.0}]), (HALF, [{"id": 1, "scale": 0.5}])):
        text = chat(client, name)
        assert text == openai_chat(oai, lora)
        assert text != base and text != off  # the adapter alone changes the greedy text
        streamed = "".join(p.message.content for p in client.chat(model=name, messages=ASK, options=GREEDY,
                                                                 stream=True))
        assert streamed == text
    generated = client.generate(model=HALF, prompt=ASK[0]["content"], options=GREEDY).response
    assert generated == openai_chat(oai, [{"id": 1, "scale": 0.5}])


def test_blobs_are_checked_and_held(server, client, blobs):
    digest = "sha256:" + sha256(GGUF_ADAPTER)
    assert httpx.head(f"{server.url}/api/blobs/sha256:{'0' * 64}").status_code == 404
    r = httpx.post(f"{server.url}/api/blobs/sha256:{'0' * 64}", content=b"not this")
    assert r.status_code == 400 and "sha256:" + "0" * 64 in r.json()["error"]
    assert httpx.head(f"{server.url}/api/blobs/sha256:{'0' * 64}").status_code == 404  # nothing left behind
    assert httpx.post(f"{server.url}/api/blobs/md5:abc", content=b"x").status_code == 400
    assert client.create_blob(GGUF_ADAPTER) == digest
    assert httpx.head(f"{server.url}/api/blobs/{digest}").status_code == 200
    assert (blobs / f"sha256-{digest.removeprefix('sha256:')}").read_bytes() == GGUF_ADAPTER.read_bytes()


@pytest.mark.parametrize("kind", ["file", "no parent"])
def test_a_bad_blobs_folder_is_a_one_line_error(tmp_path, kind):
    folder = tmp_path / "file" if kind == "file" else tmp_path / "no" / "such"
    if kind == "file":
        folder.write_text("x")
    r = subprocess.run([sys.executable, "-m", "minfer", "serve", str(MODEL), "--ollama-blobs", str(folder)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"--ollama-blobs {str(folder)!r}" in r.stderr and "Traceback" not in r.stderr


def test_create_makes_a_variant_that_runs_the_uploaded_adapter(server, client, oai):
    base_before = chat(client, BASE)
    digest = client.create_blob(GGUF_ADAPTER)
    done = client.create(model="pirate", from_="model-f32", adapters={"pirate.gguf": digest})
    assert done.status == "success"
    assert "pirate:latest" in {m.model for m in client.list().models}
    text = chat(client, "pirate")
    # the new adapter (id 2) at ollama's 1.0 runs as the same adapter loaded at startup (id 1) does at 1.0
    assert text == openai_chat(oai, [{"id": 1, "scale": 1.0}]) == openai_chat(oai, [{"id": 2, "scale": 1.0}])
    assert text != chat(client, HALF)  # (which runs it at 0.5)
    assert chat(client, BASE) == base_before  # the new adapter starts off: the base's text is unchanged
    adapters = httpx.get(server.url + "/lora-adapters").json()
    assert [a["scale"] for a in adapters] == [1.0, 0.5, 0.0]
    assert client.show("pirate").details.parent_model == BASE

    # streamed status lines, a system prompt and default options; the same blob loads nothing again
    lines = [p.status for p in client.create(model="pirate:formal", from_=BASE, adapters={"a.gguf": digest},
                                             system="Answer in French.", parameters={"num_predict": 5},
                                             stream=True)]
    assert lines[-1] == "success"
    assert len(httpx.get(server.url + "/lora-adapters").json()) == 3
    assert 'SYSTEM """Answer in French."""' in client.show("pirate:formal").modelfile
    assert httpx.post(server.url + "/api/show", json={"model": "pirate:formal"}).json()["system"] == "Answer in French."
    formal = client.chat(model="pirate:formal", messages=ASK, options={"temperature": 0}).message.content
    french = [{"role": "system", "content": "Answer in French."}, *ASK]
    r = oai.chat.completions.create(model="model-f32", messages=french, temperature=0, max_tokens=5,
                                    extra_body={"lora": [{"id": 2, "scale": 1.0}]})
    assert formal == r.choices[0].message.content

    client.delete("pirate:formal")
    assert "pirate:formal" not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as e:
        chat(client, "pirate:formal")
    assert e.value.status_code == 404


def test_a_variant_made_while_a_stream_runs_leaves_the_stream_s_text_alone(client):
    long = {"temperature": 0, "num_predict": 60}
    alone = client.chat(model=PEFT, messages=ASK, options=long).message.content
    pieces: list[str] = []
    started = threading.Event()

    def stream() -> None:
        for p in client.chat(model=PEFT, messages=ASK, options=long, stream=True):
            pieces.append(p.message.content)
            started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    client.create(model="during", from_=BASE, adapters={"d.gguf": client.create_blob(LORA / "adapter-f32.gguf")})
    t.join(120)
    assert "".join(pieces) == alone


@pytest.mark.parametrize("body,status,fragment", [
    ({"model": "x", "from": "llama3", "adapters": {}}, 404, "from: model 'llama3' not found"),
    ({"model": "x", "from": HALF, "adapters": {}}, 400, "from:"),
    ({"model": "x", "from": BASE}, 501, "adapters: is required"),
    ({"model": "x"}, 501, "minfer does not build models from Modelfiles"),
    ({"model": "x", "adapters": {}}, 400, "from: is required"),
    ({"model": "x", "from": BASE, "adapters": {"a.gguf": "sha256:" + "1" * 64}}, 400, "upload it first"),
    ({"model": "x", "from": BASE, "adapters": {"a.gguf": "nope"}}, 400, "adapters['a.gguf']"),
    ({"model": "x", "from": BASE, "adapters": {"a": "sha256:" + "1" * 64, "b": "sha256:" + "2" * 64}}, 400,
     "adapters: must be an object naming one"),
    ({"model": "x", "from": BASE, "quantize": "q4_K_M"}, 501, "quantize:"),
    ({"model": "x", "files": {"m.gguf": "sha256:" + "1" * 64}}, 501, "files:"),
    ({"model": "x", "from": BASE, "template": "{{ .Prompt }}"}, 501, "template:"),
    ({"model": BASE, "from": BASE, "adapters": {"a": "sha256:" + "1" * 64}}, 400, None),
])
def test_bad_create_bodies_are_refused_naming_the_field(server, body, status, fragment):
    r = httpx.post(server.url + "/api/create", json=body, timeout=30)
    assert r.status_code == status, r.text
    if fragment is not None:
        assert fragment in r.json()["error"]


def test_create_refuses_bad_parameters_and_a_blob_that_is_not_an_adapter(server, client, tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a gguf file at all")
    digest = client.create_blob(junk)
    r = httpx.post(server.url + "/api/create", json={"model": "j", "from": BASE, "adapters": {"j.gguf": digest}})
    assert r.status_code == 400 and "adapters['j.gguf']" in r.json()["error"]
    good = client.create_blob(GGUF_ADAPTER)
    r = httpx.post(server.url + "/api/create", json={"model": "p", "from": BASE, "adapters": {"a": good},
                                                     "parameters": {"temprature": 0.5}})
    assert r.status_code == 400 and "parameters.temprature" in r.json()["error"]


def test_delete_removes_only_created_variants(server):
    def delete(name):
        return httpx.request("DELETE", server.url + "/api/delete", json={"model": name}, timeout=30)

    assert delete(BASE).status_code == 501  # the base stays: minfer keeps no model store
    assert delete(PEFT).status_code == 400 and "--lora" in delete(PEFT).json()["error"]
    assert delete("no-such:model").status_code == 404
