"""The chat page in front of several models (``minfer serve A B``), in a real browser (playwright driving Debian's
chromium, as tests/test_pages.py): the picker lists each model with its state, every request names the chosen one
and gets that model's greedy answer, and a conversation keeps its model across a reload; one model: no picker."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from browser_support import Watched, guarded_context, launch_chromium, wait_js
from conftest import fixture_dir, rewrite_gguf

import minfer
from minfer.testing.server_process import ServerProcess

playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")

pytestmark = pytest.mark.slow

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts" / "pages"
# the llama fixture has no chat template, and the page only chats: ChatML, written into a copy
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    yield from launch_chromium(playwright_api)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("page-models")
    llama = rewrite_gguf(fixture_dir("llama") / "model-f32.gguf", folder / "llama.gguf",
                         {"tokenizer.chat_template": CHATML})
    gemma3 = folder / "gemma3.gguf"
    gemma3.symlink_to(fixture_dir("gemma3") / "model-f32.gguf")
    # both stay loaded (--models-max 2): the test switches between them
    with ServerProcess(llama, [str(gemma3), "--models-max", "2", "--ctx-size", "256"]) as s:
        yield s


@pytest.fixture
def context(browser: object) -> Iterator[object]:
    yield from guarded_context(browser, 1200)


def open_page(context: object, url: str) -> tuple[Watched, list[dict], list[str]]:
    """The chat page (the front wants no key: the page asks for none), and the chat bodies and /props URLs it
    sends, as it sends them."""
    w = Watched(context)
    page = w.page
    bodies: list[dict] = []
    props: list[str] = []

    def seen(request: object) -> None:
        if request.url.endswith("/v1/chat/completions"):  # type: ignore[attr-defined]
            bodies.append(request.post_data_json)  # type: ignore[attr-defined]
        elif "/props" in request.url:  # type: ignore[attr-defined]
            props.append(request.url)  # type: ignore[attr-defined]

    page.on("request", seen)
    page.goto(url + "/")
    return w, bodies, props


def ask(page: object, text: str) -> str:
    """Sends ``text`` and gives the answer as the page keeps it (the raw text, not its markdown rendering)."""
    n = page.locator("article.assistant").count()  # type: ignore[attr-defined]
    page.get_by_role("textbox", name="Message", exact=True).fill(text)  # type: ignore[attr-defined]
    page.get_by_role("button", name="Send", exact=True).click()  # type: ignore[attr-defined]
    page.wait_for_selector(f"article.assistant >> nth={n} >> .stats:has-text('finish')",  # type: ignore[attr-defined]
                           timeout=120_000)
    conversations = json.loads(page.evaluate("localStorage.getItem('minfer.conversations')"))  # type: ignore[attr-defined]
    current = page.evaluate("localStorage.getItem('minfer.current')")  # type: ignore[attr-defined]
    messages = next(c for c in conversations if c["id"] == current)["messages"]
    assert messages[-1]["role"] == "assistant" and "error" not in messages[-1], messages[-1]
    return messages[-1]["content"]


def direct(url: str, body: dict) -> str:
    """The server's answer to the page's own request, asked without the page (not streamed)."""
    r = httpx.post(url + "/v1/chat/completions", json={**{k: v for k, v in body.items() if k != "stream_options"},
                                                       "stream": False}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def picker(page: object) -> tuple[str, list[str]]:
    select = page.get_by_label("Model", exact=True)  # type: ignore[attr-defined]
    return select.input_value(), select.locator("option").all_inner_texts()


def test_the_picker_chooses_each_requests_model_and_a_conversation_keeps_it(server: ServerProcess,
                                                                            context: object) -> None:
    w, bodies, props = open_page(context, server.url)
    page = w.page
    page.wait_for_selector("#model-picker:not([hidden])", timeout=60_000)
    assert page.locator("#model-name").is_hidden()
    # the page comes from the front, which loads no model to show it: none is loaded, and the first is chosen
    assert picker(page) == ("llama", ["llama (unloaded)", "gemma3 (unloaded)"])
    page.get_by_text("Settings").click()
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("8")

    first = ask(page, "Hello there")
    assert bodies[-1]["model"] == "llama" and bodies[-1]["temperature"] == 0
    llama_answer = direct(server.url, bodies[-1])
    assert first == llama_answer

    page.get_by_role("button", name="New chat").click()
    page.get_by_label("Model", exact=True).select_option("gemma3")
    # choosing a model loads nothing: its vision comes from the listing's capabilities, not /props?model=
    assert page.locator("#attach").is_hidden()  # neither model takes images
    assert httpx.get(server.url + "/v1/models", timeout=60).json()["data"][1]["status"]["value"] == "unloaded"
    # sent at once: the request waits while gemma3 loads
    second = ask(page, "Hello there")
    assert not props, props
    assert bodies[-1]["model"] == "gemma3"
    assert second == direct(server.url, bodies[-1])
    assert first and second != first  # another model answered the same request
    # the states are read again after the answer
    wait_js(page, "document.getElementById('model').selectedOptions[0].textContent === 'gemma3 (loaded)'")

    # each conversation brings back its model; a reload keeps the current one's (not the first loaded: llama)
    chats = page.locator("#conversations button.open")
    chats.nth(1).click()
    assert picker(page)[0] == "llama"
    chats.nth(0).click()
    assert picker(page)[0] == "gemma3"
    page.reload()
    wait_js(page, "!document.getElementById('model-picker').hidden")
    assert picker(page) == ("gemma3", ["llama (loaded)", "gemma3 (loaded)"])
    page.locator("#conversations button.open").nth(1).click()
    assert picker(page)[0] == "llama"
    assert ask(page, "Hello there") == direct(server.url, bodies[-1]) and bodies[-1]["model"] == "llama"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat-models.png"))
    w.clean()


def test_one_model_shows_its_name_and_no_picker(server: ServerProcess, context: object) -> None:
    """A one-model server's /v1/models (here the front's, cut to its first model): the page as it always was."""
    listing = httpx.get(server.url + "/v1/models", timeout=60).json()
    listing["data"] = listing["data"][:1]
    context.route("**/v1/models", lambda route: route.fulfill(json=listing))  # type: ignore[attr-defined]
    w, bodies, _ = open_page(context, server.url)
    page = w.page
    wait_js(page, "document.getElementById('model-name').textContent === 'llama'")
    assert page.locator("#model-picker").is_hidden() and page.locator("#model-name").is_visible()
    page.get_by_text("Settings").click()
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("4")
    ask(page, "Hi")
    assert bodies[-1]["model"] == "llama"
    w.clean()


def test_inspect_traces_the_model_that_answered(server: ServerProcess, context: object) -> None:
    """On a server of several, Inspect opens the explorer on the conversation's model: every explorer request
    names it (?model=), so its run is held, and found again, by that model's own server."""
    w, bodies, _ = open_page(context, server.url)
    page = w.page
    page.wait_for_selector("#model-picker:not([hidden])", timeout=60_000)
    page.get_by_label("Model", exact=True).select_option("gemma3")
    page.get_by_text("Settings").click()
    page.get_by_label("Max tokens").fill("8")  # the exchange traced must fit the context (256)
    ask(page, "Hello there")
    assert bodies[-1]["model"] == "gemma3"
    traced: list[str] = []
    page.on("request", lambda r: traced.append(r.url) if "/trace/api/" in r.url else None)
    page.locator("article.assistant a.inspect").last.click()
    page.wait_for_selector("body[data-ready='1']", timeout=120_000)
    assert traced and all("model=gemma3" in u for u in traced), traced
    run = page.evaluate("window.minferExplorer.run")
    assert "model=gemma3" in page.url and f"run={run}" in page.url  # a reload opens the same run of the same model
    runs = {name: [r["id"] for r in httpx.get(server.url + "/trace/api/runs", params={"model": name},
                                               timeout=60).json()["runs"]] for name in ("llama", "gemma3")}
    assert run in runs["gemma3"] and run not in runs["llama"]
    w.clean()


VISION = fixture_dir("gemma3_vision")
IMAGE = VISION / "images" / "rgb_45x20.png"


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A text model and a vision model (its GGUF and mmproj*.gguf in a folder of their own), one loaded at a time."""
    folder = tmp_path_factory.mktemp("page-vision-models")
    rewrite_gguf(fixture_dir("llama") / "model-f32.gguf", folder / "llama.gguf", {"tokenizer.chat_template": CHATML})
    (folder / "vision").mkdir()
    shutil.copy(VISION / "gguf" / "model-f32.gguf", folder / "vision" / "model-f32.gguf")
    shutil.copy(VISION / "gguf" / "mmproj-f32.gguf", folder / "vision" / "mmproj-f32.gguf")
    with ServerProcess(f"--models-dir={folder}", ["--models-max", "1", "--ctx-size", "1024"]) as s:
        yield s


def test_the_picker_shows_images_for_a_vision_model_without_loading_it(vision_server: ServerProcess,
                                                                       context: object) -> None:
    """The attach button follows the chosen model's capabilities in the listing: choosing one loads nothing (no
    /props?model=), and an image sent to the vision model gets the Python API's answer."""
    w, bodies, props = open_page(context, vision_server.url)
    page = w.page
    page.wait_for_selector("#model-picker:not([hidden])", timeout=60_000)
    assert picker(page) == ("llama", ["llama (unloaded)", "vision (unloaded)"])
    assert page.locator("#attach").is_hidden()
    page.get_by_label("Model", exact=True).select_option("vision")
    page.wait_for_selector("#attach:not([hidden])", timeout=10_000)
    page.get_by_label("Model", exact=True).select_option("llama")
    page.wait_for_selector("#attach", state="hidden", timeout=10_000)
    page.get_by_label("Model", exact=True).select_option("vision")
    page.wait_for_selector("#attach:not([hidden])", timeout=10_000)
    listing = httpx.get(vision_server.url + "/v1/models", timeout=60).json()["data"]
    assert {m["id"]: m["status"]["value"] for m in listing} == {"llama": "unloaded", "vision": "unloaded"}
    assert not props, props

    page.get_by_text("Settings").click()
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("8")
    page.set_input_files("#image-input", str(IMAGE))
    page.wait_for_selector("#attachments img.thumbnail")
    answer = ask(page, "What is in this image?")
    assert bodies[-1]["model"] == "vision"
    model = minfer.load(VISION / "gguf" / "model-f32.gguf", mmproj=VISION / "gguf" / "mmproj-f32.gguf", n_ctx=1024)
    want = model.chat([{"role": "user", "content": [{"type": "image", "path": str(IMAGE)},
                                                    {"type": "text", "text": "What is in this image?"}]}],
                      max_tokens=8, temperature=0)
    assert answer == want
    assert not props, props
    w.clean()
