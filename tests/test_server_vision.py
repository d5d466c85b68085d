"""Images through every server API of a real ``minfer serve`` over loopback (the official openai, anthropic and
ollama clients, and httpx for llama-server's ``/completion``), each answer checked against the greedy reply of
``minfer.load(...).chat`` in this process; and the 400s of bad images, after which the server keeps serving."""

from __future__ import annotations

import base64
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from conftest import static_http_server

import minfer
from minfer.runtime.vision import MEDIA_MARKER, ImageInput, PassImage
from minfer.testing.server_process import ServerProcess

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_vision"
HF = FIXTURE / "hf"
GGUF = FIXTURE / "gguf" / "model-f32.gguf"
MMPROJ = FIXTURE / "gguf" / "mmproj-f32.gguf"
IMAGES = FIXTURE / "images"
MAX_TOKENS = 8
ARGS = ["--ctx-size", "1024", "--batch-size", "64"]


def image(name: str) -> bytes:
    return (IMAGES / name).read_bytes()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(data)}"


PNG, JPEG = image("rgb_64x64.png"), image("photo_40x28.jpg")


def oai_messages(*parts: str | bytes) -> list[dict]:
    """One user message of text and images (bytes), as OpenAI's content parts with data: URLs."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else
               {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]
    return [{"role": "user", "content": content}]


def local_messages(*parts: str | bytes) -> list[dict]:
    """The same message for the Python API (images as bytes)."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def vlm():
    return minfer.load(HF, n_ctx=512)


@pytest.fixture(scope="module")
def expected(vlm):
    cache: dict = {}

    def reply(*parts: str | bytes) -> str:
        if parts not in cache:
            cache[parts] = vlm.chat(local_messages(*parts), max_tokens=MAX_TOKENS, temperature=0)
        return cache[parts]

    return reply


@pytest.fixture(scope="module")
def server():
    with ServerProcess(HF, ["--parallel", "2", *ARGS]) as s:
        yield s


@pytest.fixture(scope="module")
def text_server():
    with ServerProcess(GGUF, ["--parallel", "1", *ARGS]) as s:  # the text model alone: no --mmproj
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def alive(server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text


# -- OpenAI ------------------------------------------------------------------------------------------------


def test_openai_chat_with_an_image_whole_and_streamed(client, expected):
    parts = ("What is in this picture?", PNG)
    want = expected(*parts)
    r = client.chat.completions.create(model="m", messages=oai_messages(*parts), max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens > 16  # the image's 16 tokens are in the prompt
    stream = client.chat.completions.create(model="m", messages=oai_messages(*parts), max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_openai_two_images_in_one_message_and_n_2(client, expected):
    parts = ("Compare", PNG, "with", JPEG, "please.")
    want = expected(*parts)
    r = client.chat.completions.create(model="m", messages=oai_messages(*parts), max_tokens=MAX_TOKENS,
                                       temperature=0, n=2)
    assert [c.message.content for c in r.choices] == [want, want]


def test_the_image_reaches_the_model(client, vlm):
    # the tiny random model's greedy text hardly depends on the image: its log-probabilities do
    def first_logprob(img: bytes) -> float:
        r = client.chat.completions.create(model="m", messages=oai_messages("Describe", img), max_tokens=1,
                                           temperature=0, logprobs=True)
        return r.choices[0].logprobs.content[0].logprob

    assert first_logprob(PNG) != first_logprob(JPEG)
    r = client.chat.completions.create(model="m", messages=oai_messages("Describe", PNG), max_tokens=1)
    prompt = vlm.render_chat([{"role": "user", "content": "Describe" + MEDIA_MARKER}])
    ids, _ = vlm.image_prompt(prompt, [ImageInput(PNG, "x")])
    assert r.usage.prompt_tokens == len(ids)  # the image's tokens, as the Python API places them


# -- Anthropic -------------------------------------------------------------------------------------------


def test_anthropic_messages_with_a_base64_image_block(server, expected):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    msg = client.messages.create(model="m", max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[{
        "role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": b64(JPEG)}},
            {"type": "text", "text": "what is it?"}]}])
    assert "".join(b.text for b in msg.content if b.type == "text") == expected("Look:", JPEG, "what is it?")


# -- Responses -------------------------------------------------------------------------------------------


def test_responses_input_image(client, expected):
    r = client.responses.create(model="m", max_output_tokens=MAX_TOKENS, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_text", "text": "See"},
                                    {"type": "input_image", "image_url": data_url(PNG)}]}])
    assert r.output_text == expected("See", PNG)


# -- ollama ----------------------------------------------------------------------------------------------


def test_ollama_chat_and_generate_with_images(server, expected):
    client = ollama.Client(host=server.url, timeout=120)
    name = client.list().models[0].model
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    r = client.chat(model=name, messages=[{"role": "user", "content": "What is this?", "images": [PNG]}],
                    options=options)
    assert r.message.content == expected(PNG, "What is this?")  # ollama puts the images before the text
    r = client.generate(model=name, prompt="Describe it.", images=[JPEG], options=options)
    assert r.response == expected(JPEG, "Describe it.")
    assert "vision" in client.show(name).capabilities


# -- llama-server ----------------------------------------------------------------------------------------


def test_completion_with_multimodal_data(server, vlm):
    prompt = "<start_of_turn>user\n<__media__>Describe.<end_of_turn>\n<start_of_turn>model\n"
    ids, placed = vlm.image_prompt(prompt, [ImageInput(PNG, "x")])
    bos = [vlm.tokenizer.bos_id] if vlm.tokenizer.add_bos else []
    want = "".join(s.text for s in vlm.stream(bos + ids, MAX_TOKENS, temperature=0,
                                              images=[PassImage(p.first + len(bos), p.vectors) for p in placed]))
    r = httpx.post(server.url + "/completion", json={"prompt": prompt, "multimodal_data": [b64(PNG)],
                                                     "n_predict": MAX_TOKENS, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == want
    bad = httpx.post(server.url + "/completion", json={"prompt": prompt, "multimodal_data": [b64(PNG)] * 2,
                                                       "n_predict": 2}, timeout=60)
    assert bad.status_code == 400 and "multimodal_data" in bad.json()["error"]["message"]


# -- what the model takes ----------------------------------------------------------------------------------


def test_props_models_and_show_say_whether_the_model_takes_images(server, text_server):
    assert httpx.get(server.url + "/props").json()["modalities"] == {"vision": True, "video": False, "audio": False}
    no_images = {"vision": False, "video": False, "audio": False}
    assert httpx.get(text_server.url + "/props").json()["modalities"] == no_images
    assert "multimodal" in httpx.get(server.url + "/v1/models").json()["data"][0]["capabilities"]
    assert "multimodal" not in httpx.get(text_server.url + "/v1/models").json()["data"][0]["capabilities"]
    name = httpx.get(text_server.url + "/api/tags").json()["models"][0]["model"]
    assert "vision" not in httpx.post(text_server.url + "/api/show", json={"model": name}).json()["capabilities"]


def test_a_gguf_with_mmproj_serves_images(vlm):
    local = minfer.load(GGUF, n_ctx=512, mmproj=MMPROJ)
    want = local.chat(local_messages("What is this?", PNG), max_tokens=MAX_TOKENS, temperature=0)
    with ServerProcess(GGUF, ["--parallel", "1", "--mmproj", str(MMPROJ), *ARGS]) as s:
        assert httpx.get(s.url + "/props").json()["modalities"]["vision"] is True
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": oai_messages("What is this?", PNG),
                                                             "max_tokens": MAX_TOKENS, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want


# -- the 400s --------------------------------------------------------------------------------------------

CORRUPT = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40


@pytest.mark.parametrize("part,field,needle", [
    ({"type": "image_url", "image_url": {"url": data_url(CORRUPT)}}, "messages[0].content[1]", "image"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     "messages[0].content[1].image_url", "remote"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@not base64@@@"}},
     "messages[0].content[1].image_url", "base64"),
    ({"type": "image_url", "image_url": {"url": data_url(image("rgb_64x64.png"))}}, None, None),  # (fine)
])
def test_openai_bad_images_are_400s_naming_the_field(server, part, field, needle):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    if field is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] and needle in error["message"] and error["param"] == field
    alive(server)


def test_too_many_pixels_is_a_400(server):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8000, 8000)).save(buf, "PNG")  # 64 M pixels: over the limit
    body = {"messages": oai_messages("x", buf.getvalue()), "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "pixels" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages[0].content[1]"
    alive(server)


def test_other_protocols_bad_images_are_400s(server):
    r = httpx.post(server.url + "/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [{
        "role": "user", "content": [{"type": "text", "text": "x"},
                                    {"type": "image", "source": {"type": "url", "url": "https://e.com/a.png"}}]}]})
    assert r.status_code == 400 and "messages[0].content[1].source.url" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [{
        "role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                 "data": b64(CORRUPT)}}]}]})
    assert r.status_code == 400 and "messages[0].content[0]" in r.json()["error"]["message"], r.text
    name = httpx.get(server.url + "/api/tags").json()["models"][0]["model"]
    r = httpx.post(server.url + "/api/chat", json={"model": name, "stream": False, "messages": [
        {"role": "user", "content": "x", "images": ["%%%"]}]})
    assert r.status_code == 400 and "messages[0].images[0]" in r.json()["error"], r.text
    r = httpx.post(server.url + "/api/generate", json={"model": name, "stream": False, "prompt": "x", "raw": True,
                                                       "images": [b64(PNG)]})
    assert r.status_code == 400 and "images" in r.json()["error"], r.text
    alive(server)


def test_a_text_model_refuses_images_on_every_api(text_server):
    url = text_server.url
    r = httpx.post(url + "/v1/chat/completions", json={"messages": oai_messages("x", PNG), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]", r.text
    assert "takes no images" in r.json()["error"]["message"]
    name = httpx.get(url + "/api/tags").json()["models"][0]["model"]
    r = httpx.post(url + "/api/chat", json={"model": name, "stream": False, "messages": [
        {"role": "user", "content": "x", "images": [b64(PNG)]}]})
    assert r.status_code == 400 and "images" in r.json()["error"] and "takes no images" in r.json()["error"]
    r = httpx.post(url + "/completion", json={"prompt": "<__media__>x", "multimodal_data": [b64(PNG)],
                                             "n_predict": 2})
    assert r.status_code == 400 and "multimodal_data[0]" in r.json()["error"]["message"], r.text
    alive(text_server)


# -- remote images: fetched only with --allow-image-urls -----------------------------------------------------


@pytest.fixture(scope="module")
def image_host():
    """A plain HTTP server on loopback serving the fixture's images, and a 21 MiB file at /big.png."""
    big = b"\x89PNG\r\n\x1a\n" + b"\x00" * (21 * 1024 * 1024)
    with static_http_server(IMAGES, {"/big.png": big}) as url:
        yield url


@pytest.fixture(scope="module")
def url_server(tmp_path_factory):
    media = tmp_path_factory.mktemp("media")  # --media-path: the fixture's images, and a link out of the folder
    (media / "pics").mkdir()
    (media / "pics" / "rgb.png").write_bytes(PNG)
    (media / "escape.png").symlink_to(IMAGES / "rgb_64x64.png")
    with ServerProcess(HF, ["--parallel", "1", "--allow-image-urls", "--media-path", str(media), *ARGS]) as s:
        yield s


def test_allow_image_urls_fetches_an_http_image(url_server, image_host, expected):
    c = openai.OpenAI(base_url=url_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_host + "/rgb_64x64.png"}},
                                             {"type": "text", "text": "What is it?"}]}]
    r = c.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == expected(PNG, "What is it?")


@pytest.mark.parametrize("path, needle", [("/missing.png", "HTTP 404"), ("/big.png", "larger than")])
def test_allow_image_urls_refuses_what_it_cannot_fetch_within_limits(url_server, image_host, path, needle):
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_host + path}},
                                                      {"type": "text", "text": "x"}]}], "max_tokens": 2}
    r = httpx.post(url_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == "messages[0].content[0].image_url"
    alive(url_server)


def file_url_body(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What is it?"}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0}


def test_media_path_reads_file_urls_inside_it(url_server, expected):
    """llama-server's --media-path: ``file://`` + a path relative to the folder is read from it (here in a subfolder)
    and answers as the same image sent inline."""
    r = httpx.post(url_server.url + "/v1/chat/completions", json=file_url_body("file://pics/rgb.png"), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected(PNG, "What is it?")


@pytest.mark.parametrize("url, needle", [
    ("file://../x.png", "not allowed"), ("file:///etc/passwd", "not allowed"), ("file://escape.png", "out of"),
    ("file://pics", "not a regular file"), ("file://nothing.png", "does not exist"),
])
def test_media_path_refuses_paths_out_of_it(url_server, url, needle):
    """llama-server refuses '..' and absolute paths (fs_validate_filename); minfer also refuses a symlink that leads
    out of the folder, and names the field."""
    r = httpx.post(url_server.url + "/v1/chat/completions", json=file_url_body(url), timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == "messages[0].content[0].image_url"


def test_file_urls_without_media_path_are_refused(server):
    """llama-server: "file:// URLs are not allowed unless --media-path is specified"."""
    r = httpx.post(server.url + "/v1/chat/completions", json=file_url_body("file://rgb_64x64.png"), timeout=60)
    assert r.status_code == 400 and "--media-path" in r.json()["error"]["message"]
    alive(server)


def test_a_follow_up_turn_reports_the_images_tokens_as_cached(client, vlm):
    """The second turn about the same image is answered from the cached rows: usage says the image and what precedes
    it were cached, and the tower does not run again (the image's own ids in the prompt match the cache's)."""
    first = oai_messages(JPEG, "Describe the picture.")
    a = client.chat.completions.create(model="m", messages=first, max_tokens=4, temperature=0)
    follow = [*first, {"role": "assistant", "content": a.choices[0].message.content},
              {"role": "user", "content": "And its colours?"}]
    b = client.chat.completions.create(model="m", messages=follow, max_tokens=4, temperature=0)
    n_image = vlm.transformer.vision.hparams.tokens_per_image
    assert b.usage.prompt_tokens_details.cached_tokens >= n_image
    assert b.usage.prompt_tokens_details.cached_tokens > a.usage.prompt_tokens - 4
