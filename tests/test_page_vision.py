"""The chat page with a vision model, in a real browser (playwright driving Debian's chromium, as tests/test_pages.py):
an image attached with the button shows as a thumbnail, goes with the message, and the answer is the Python API's;
its Inspect link traces the exchange with the image."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from browser_support import Watched, guarded_context, launch_chromium

import minfer
from minfer.testing.server_process import ServerProcess

playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_vision"
IMAGE = FIXTURE / "images" / "rgb_45x20.png"


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    yield from launch_chromium(playwright_api)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(FIXTURE / "hf", ["-c", "256"]) as s:
        yield s


@pytest.fixture
def context(browser: object) -> Iterator[object]:
    yield from guarded_context(browser, 1200)


def test_an_attached_image_goes_with_the_message(server: ServerProcess, context: object) -> None:
    w = Watched(context)
    page = w.page
    page.goto(server.url + "/")
    page.wait_for_selector("#attach:not([hidden])", timeout=30_000)  # /props: the model takes images
    page.get_by_text("Settings").click()
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("8")
    page.set_input_files("#image-input", str(IMAGE))
    page.wait_for_selector("#attachments img.thumbnail")
    page.get_by_role("textbox", name="Message", exact=True).fill("What is in this image?")
    page.get_by_role("button", name="Send", exact=True).click()
    page.wait_for_selector("article.assistant .stats:has-text('finish')", timeout=120_000)
    assert page.locator("#attachments img").count() == 0  # sent: the composer is empty again
    sent = page.locator("article.user img.thumbnail")
    assert sent.count() == 1 and sent.get_attribute("src").startswith("data:image/png;base64,")
    answer = page.locator("article.assistant .content").inner_text()
    model = minfer.load(FIXTURE / "hf", n_ctx=256)
    want = model.chat([{"role": "user", "content": [{"type": "image", "path": str(IMAGE)},
                                                    {"type": "text", "text": "What is in this image?"}]}],
                      max_tokens=8, temperature=0)
    assert answer.strip() == want.strip()
    # Inspect: the explorer traces the exchange with its image (the tower's pass shown, the image rows labelled)
    page.locator("article.assistant a.inspect").click()
    page.wait_for_selector("body[data-ready='1']", timeout=120_000)
    assert page.locator("#vision-section").is_visible() and "images at rows" in page.locator("#run-info").inner_text()
    assert "<image 0>" in page.evaluate("window.minferExplorer.summary.labels")
    w.clean()
