"""Several models behind one server (``minfer serve --models-dir DIR``, ``minfer serve A B``): each loaded on its
first request in a process of its own, the least recently used idle one unloaded under ``--models-max``; every
answer equals the one its model's own one-model server gives, through the openai and ollama clients."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import ollama
import pytest
from conftest import TWO_MODELS, fixture_dir, static_http_server
from openai import OpenAI

from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODELS = TWO_MODELS
PROMPT = "The quick brown fox"



def complete(url: str, model: str, n: int = 8) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": n,
                                                  "temperature": 0}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def solo() -> dict[str, str]:
    """Each model's text from a one-model server of its own."""
    out = {}
    for name, path in MODELS.items():
        with ServerProcess(path, ["--ctx-size", "256"]) as s:
            out[name] = complete(s.url, name, 24)
    return out


@pytest.fixture(scope="module")
def one_at_a_time(models_dir):
    with ServerProcess(f"--models-dir={models_dir}", ["--models-max", "1", "--ctx-size", "256"]) as s:
        yield s


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def states(url: str) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in httpx.get(url + "/v1/models").json()["data"]}


def test_models_are_listed_before_any_loads(one_at_a_time):
    assert states(one_at_a_time.url) == {"gemma3": "unloaded", "llama": "unloaded"}
    tags = ollama.Client(host=one_at_a_time.url).list().models
    assert {(m.model, m.details.family) for m in tags} == {("llama:latest", "llama"), ("gemma3:latest", "gemma3")}


def test_models_max_1_switches_and_every_answer_is_the_solo_one(one_at_a_time, solo):
    url = one_at_a_time.url
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    first = None
    for round_ in range(20):  # 20 switches: the front's memory stays bounded
        for name in ("llama", "gemma3"):
            text = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
            assert text == solo[name]
            assert states(url)[name] == "loaded" and list(states(url).values()).count("loaded") == 1
            assert [m.model for m in ollama.Client(host=url).ps().models] == [f"{name}:latest"]
        if round_ == 1:
            first = rss_kib(one_at_a_time.proc.pid)
    assert first is not None and rss_kib(one_at_a_time.proc.pid) - first < 50 * 1024
    # ollama's names and the chat client work across the switch too
    r = ollama.Client(host=url).generate(model="llama:latest", prompt=PROMPT, raw=True,
                                         options={"temperature": 0, "num_predict": 24})
    assert r.response == solo["llama"]


def test_an_unknown_model_is_a_404_naming_the_models(one_at_a_time):
    r = httpx.post(one_at_a_time.url + "/v1/chat/completions",
                   json={"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "gemma3, llama" in r.json()["error"]["message"]
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=one_at_a_time.url).chat(model="llama3:8b", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 404 and "gemma3, llama" in err.value.error


def test_load_and_unload_routes(one_at_a_time):
    url = one_at_a_time.url
    assert httpx.post(url + "/models/load", json={"model": "gemma3"}, timeout=300).json() == {"success": True}
    assert states(url)["gemma3"] == "loaded"
    assert httpx.post(url + "/models/unload", json={"model": "gemma3"}, timeout=300).json() == {"success": True}
    assert set(states(url).values()) == {"unloaded"}
    assert httpx.post(url + "/models/load", json={"model": "nope"}).status_code == 404
    assert httpx.post(url + "/models/load", json={}).status_code == 400


@pytest.fixture(scope="module")
def both_loaded(models_dir):
    # two positional files (named by their stems: llama, gemma3), both loaded at once
    with ServerProcess(models_dir / "llama.gguf", [str(models_dir / "gemma3.gguf"), "--models-max", "2",
                                                   "--ctx-size", "256"]) as s:
        yield s


def test_two_models_stream_at_once_and_each_is_its_solo_text(both_loaded, solo):
    client = OpenAI(base_url=both_loaded.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    texts: dict[str, str] = {}

    def stream(name: str) -> None:
        parts = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
        texts[name] = "".join(p.choices[0].text for p in parts if p.choices)

    threads = [threading.Thread(target=stream, args=(n,)) for n in ("llama", "gemma3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert texts == solo


def test_resumable_streams_go_to_the_model_that_holds_them(both_loaded):
    """As llama-server's router: a stream sent with X-Conversation-Id is kept by its model's server, and GET /v1/stream,
    /v1/streams/lookup and DELETE /v1/stream reach that server alone (the other model's has no such stream)."""
    url, streamed = both_loaded.url, {}
    for name in ("llama", "gemma3"):
        with httpx.stream("POST", url + "/v1/completions", headers={"X-Conversation-Id": f"c-{name}"}, timeout=300,
                          json={"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                "stream": True}) as r:
            streamed[name] = b"".join(r.iter_raw())
    for name in ("llama", "gemma3"):
        replay = httpx.get(url + "/v1/stream", params={"conv_id": f"c-{name}", "from": 0}, timeout=60)
        assert replay.status_code == 200 and replay.content == streamed[name]
    found = httpx.post(url + "/v1/streams/lookup", json={"conversation_ids": ["c-llama", "c-gemma3", "c-none"]},
                       timeout=60).json()
    assert sorted(s["conversation_id"] for s in found) == ["c-gemma3", "c-llama"] and all(s["is_done"] for s in found)
    assert httpx.delete(url + "/v1/stream", params={"conv_id": "c-llama"}, timeout=60).status_code == 204
    gone = httpx.get(url + "/v1/stream", params={"conv_id": "c-llama"}, timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    assert httpx.get(url + "/v1/stream", params={"conv_id": "c-gemma3"}, timeout=60).content == streamed["gemma3"]
    assert httpx.get(url + "/v1/stream", timeout=60).status_code == 400
    assert httpx.post(url + "/v1/streams/lookup", json={"conversation_ids": "c-llama"}, timeout=60).status_code == 400


def test_one_model_flags_are_refused_with_several(models_dir):
    r = subprocess.run([sys.executable, "-m", "minfer", "serve", f"--models-dir={models_dir}", "--alias", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--alias apply to one model" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "minfer", "serve", "--models-dir=/nonexistent"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "is not a folder" in r.stderr and "Traceback" not in r.stderr


def test_keep_alive_and_sleep_idle_unload_a_model(models_dir, solo):
    with ServerProcess(f"--models-dir={models_dir}", ["--sleep-idle-seconds", "1.5", "--ctx-size", "256"]) as s:
        client = ollama.Client(host=s.url)
        options = {"temperature": 0, "num_predict": 24}
        # keep_alive 0: the model unloads as soon as this request is answered (ollama's way to unload one)
        assert client.generate(model="llama", prompt=PROMPT, raw=True, options=options, keep_alive=0).response == \
            solo["llama"]
        deadline = time.monotonic() + 30
        while states(s.url)["llama"] != "unloaded" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert states(s.url)["llama"] == "unloaded"
        # -1: never unloaded, --sleep-idle-seconds notwithstanding; the other model, without one, sleeps after 1.5 s
        client.generate(model="llama", prompt=PROMPT, raw=True, options=options, keep_alive=-1)
        client.generate(model="gemma3", prompt=PROMPT, raw=True, options=options)
        assert client.ps().models[0].expires_at is not None
        time.sleep(4)
        assert states(s.url) == {"gemma3": "unloaded", "llama": "loaded"}
        assert client.generate(model="gemma3", prompt=PROMPT, raw=True, options=options).response == solo["gemma3"]


def test_ollama_s_unload_request_unloads_without_loading(one_at_a_time):
    """ollama's unload request (no prompt or no messages, keep_alive 0): the model unloads, and one that is not
    loaded is not loaded for it; the load request (no prompt, no keep_alive 0) loads it."""
    client = ollama.Client(host=one_at_a_time.url)
    loaded = client.generate(model="llama")
    assert loaded.done_reason == "load" and states(one_at_a_time.url) == {"llama": "loaded", "gemma3": "unloaded"}
    r = client.generate(model="gemma3:latest", keep_alive=0)
    assert (r.model, r.done, r.done_reason) == ("gemma3:latest", True, "unload")
    assert states(one_at_a_time.url) == {"llama": "loaded", "gemma3": "unloaded"}
    r = client.chat(model="llama", messages=[], keep_alive="0s")
    assert (r.done_reason, r.message.role) == ("unload", "assistant")
    assert states(one_at_a_time.url) == {"llama": "unloaded", "gemma3": "unloaded"}
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="nope", keep_alive=0)
    assert e.value.status_code == 404


def test_the_front_serves_the_pages_itself(models_dir):
    """The chat page and its files come from the front, open without the key as a one-model server's, saying
    whether the front wants one (not its models' servers' internal key), and load no model to show."""
    for flags, meta in (([], '<meta name="minfer-key" content="">'),
                        (["--api-key", "secret"], '<meta name="minfer-key" content="required">')):
        with ServerProcess(f"--models-dir={models_dir}", flags) as s:
            page = httpx.get(s.url + "/", timeout=60)
            assert page.status_code == 200 and meta in page.text and "text/html" in page.headers["content-type"]
            assert httpx.get(s.url + "/static/chat.js", timeout=60).status_code == 200
            assert httpx.get(s.url + "/trace", timeout=60).status_code == 200
            assert httpx.get(s.url + "/health", timeout=60).json()["models"] == {"gemma3": "unloaded",
                                                                                  "llama": "unloaded"}
            if flags:
                assert httpx.get(s.url + "/v1/models", timeout=60).status_code == 401


def test_an_encoder_beside_a_generating_model_gets_only_its_own_flags(tmp_path):
    """--ctx-size (and the other generating flags) go to the generating models' servers only: an encoder's server
    refuses them, so it loaded nothing when they were given to it too."""
    (tmp_path / "bert.gguf").symlink_to(fixture_dir("bert") / "model-f32.gguf")
    with ServerProcess(MODELS["llama"], [str(tmp_path / "bert.gguf"), "--ctx-size", "256", "--cache-ram", "8"]) as s:
        vectors = ollama.Client(host=s.url).embed(model="bert", input=["a cat"]).embeddings
        assert len(vectors) == 1 and len(vectors[0]) > 0
        assert httpx.get(s.url + "/props", params={"model": "model-f32"}, timeout=300).json()["n_ctx"] == 256


def test_an_encoder_s_options_among_several_drop_the_generating_ones():
    """What --ray gives each model's replicas: an encoder's without --ctx-size and the like (as above)."""
    from minfer.server import ServeOptions, for_model

    opts = ServeOptions(ctx_size=256, cache_ram=8, parallel=3)
    encoder = for_model(opts, fixture_dir("bert") / "model-f32.gguf")
    assert (encoder.ctx_size, encoder.cache_ram, encoder.parallel) == (ServeOptions().ctx_size, 0, 3)
    assert for_model(opts, MODELS["llama"]) is opts


# -- vision models: a folder of a GGUF and its mmproj*.gguf (llama-server's router layout) -----------------------

VISION = fixture_dir("gemma3_vision")
VISION_GGUF, VISION_MMPROJ = VISION / "gguf" / "model-f32.gguf", VISION / "gguf" / "mmproj-f32.gguf"
IMAGE = VISION / "images" / "rgb_45x20.png"
VISION_ARGS = ["--models-max", "1", "--ctx-size", "1024", "--batch-size", "64"]


def vision_folder(folder: Path) -> Path:
    folder.mkdir()
    shutil.copy(VISION_GGUF, folder / "model-f32.gguf")
    shutil.copy(VISION_MMPROJ, folder / "mmproj-f32.gguf")
    return folder


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A text GGUF, a vision GGUF with its mmproj in a folder of their own, an HF vision-language folder, an encoder,
    and a stray mmproj file (no model of its own)."""
    folder = tmp_path_factory.mktemp("vision-models")
    (folder / "gemma3.gguf").symlink_to(MODELS["gemma3"])  # (the llama fixture has no chat template)
    vision_folder(folder / "gemma3v")
    (folder / "hfvision").symlink_to(VISION / "hf")
    (folder / "bert.gguf").symlink_to(fixture_dir("bert") / "model-f32.gguf")
    shutil.copy(VISION_MMPROJ, folder / "mmproj-stray.gguf")
    return folder


@pytest.fixture(scope="module")
def image_host():
    """A plain HTTP server on loopback serving the vision fixture's images."""
    with static_http_server(IMAGE.parent) as url:
        yield url


@pytest.fixture(scope="module")
def vision_front(vision_dir):
    with ServerProcess(f"--models-dir={vision_dir}", [*VISION_ARGS, "--allow-image-urls"]) as s:
        yield s


@pytest.fixture(scope="module")
def vision_expected() -> str:
    """The Python API's greedy answer to a question about IMAGE, from the GGUF with its mmproj."""
    import minfer

    model = minfer.load(VISION_GGUF, mmproj=VISION_MMPROJ, n_ctx=1024)
    return model.chat([{"role": "user", "content": [{"type": "image", "path": str(IMAGE)},
                                                    {"type": "text", "text": "What is in this image?"}]}],
                      temperature=0, max_tokens=8)


def image_chat(url: str, model: str, image_url: str) -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": image_url}},
               {"type": "text", "text": "What is in this image?"}]
    return httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 8})


def test_the_listing_gives_each_model_s_capabilities_without_loading_any(vision_front, vision_dir):
    for route in ("/v1/models", "/models"):
        data = httpx.get(vision_front.url + route, timeout=60).json()["data"]
        assert {m["id"]: m["capabilities"] for m in data} == {
            "bert": ["embedding"], "gemma3v": ["completion", "multimodal"], "hfvision": ["completion", "multimodal"],
            "gemma3": ["completion"]}  # the stray mmproj file is no model
        assert {m["status"]["value"] for m in data} == {"unloaded"}
    assert next(m for m in data if m["id"] == "gemma3v")["path"] == str(vision_dir / "gemma3v" / "model-f32.gguf")
    assert set(httpx.get(vision_front.url + "/health", timeout=60).json()["models"].values()) == {"unloaded"}


def test_an_image_to_the_vision_folder_s_model_gets_the_python_api_s_answer(vision_front, vision_expected, image_host):
    data = "data:image/png;base64," + base64.b64encode(IMAGE.read_bytes()).decode()
    r = image_chat(vision_front.url, "gemma3v", data)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == vision_expected
    assert states(vision_front.url)["gemma3v"] == "loaded"
    # --allow-image-urls reached the model's server: it fetches an http image, the same one
    r = image_chat(vision_front.url, "gemma3v", f"{image_host}/{IMAGE.name}")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == vision_expected
    # a text model's server answers the image with its own 400 (it has no vision model), through the front
    r = image_chat(vision_front.url, "gemma3", data)
    assert r.status_code == 400 and r.json()["error"]["code"] == "images_not_supported", r.text


def test_bad_model_folders_are_one_line_errors_naming_the_folder(tmp_path):
    from minfer.errors import BadRequestError
    from minfer.server.model_router import model_entries

    two_models = tmp_path / "two-models"
    vision_folder(two_models)
    shutil.copy(MODELS["llama"], two_models / "other.gguf")
    two_projectors = tmp_path / "two-projectors"
    vision_folder(two_projectors)
    shutil.copy(VISION_MMPROJ, two_projectors / "mmproj-second.gguf")
    projector_alone = tmp_path / "projector-alone"
    projector_alone.mkdir()
    shutil.copy(VISION_MMPROJ, projector_alone / "mmproj-f32.gguf")
    for bad, needle in ((projector_alone, "no model GGUF beside its mmproj file"),
                        (two_models, "2 model GGUFs (model-f32.gguf, other.gguf)"),
                        (two_projectors, "2 mmproj files (mmproj-f32.gguf, mmproj-second.gguf)")):
        with pytest.raises(BadRequestError, match=re.escape(needle)) as e:
            model_entries([], str(tmp_path))  # the folders are read in name order: each bad one removed in turn
        assert str(bad) in str(e.value) and "\n" not in str(e.value)
        shutil.rmtree(bad)
    # the command line: the same line, no traceback
    vision_folder(tmp_path / "fine")
    shutil.copy(VISION_MMPROJ, tmp_path / "fine" / "mmproj-extra.gguf")
    r = subprocess.run([sys.executable, "-m", "minfer", "serve", f"--models-dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "2 mmproj files" in r.stderr
    assert str(tmp_path / "fine") in r.stderr


def test_a_good_vision_folder_and_the_flags_with_several_models(tmp_path):
    from minfer.server import ServeOptions, refuse_one_model_flags
    from minfer.server.model_router import model_entries

    vision_folder(tmp_path / "vision")
    (tmp_path / "mmproj-lone.gguf").symlink_to(VISION_MMPROJ)
    (entry,) = model_entries([], str(tmp_path))  # the mmproj file directly in the folder is no model
    assert (entry.name, entry.path, entry.mmproj) == ("vision", tmp_path / "vision" / "model-f32.gguf",
                                                      tmp_path / "vision" / "mmproj-f32.gguf")
    refuse_one_model_flags(ServeOptions(allow_image_urls=True))  # given to every generating model's server
    with pytest.raises(Exception, match="--mmproj apply to one model.*mmproj\\*.gguf in a folder"):
        refuse_one_model_flags(ServeOptions(mmproj=str(VISION_MMPROJ)))
