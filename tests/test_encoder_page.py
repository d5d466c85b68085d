"""The encoder page (``/`` of ``minfer serve`` with an encoder) in a real browser: playwright (PyPI) driving Debian's
chromium (/usr/bin/chromium) against real servers on loopback: the tiny embedder ``tests/fixtures/bert`` (no
rerank head) and the tiny reranker ``tests/fixtures/bert_rerank`` (behind an API key: the page asks for it once).

Every test fails on a console error, an uncaught page error, or a request to anything but this machine (route
interception aborts it and records it); the 400s that the bad-input test asks for are the only console errors
let through. The numbers the page shows are checked against the API's own answers. Screenshots land in
artifacts/pages/ (git-ignored)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from browser_support import Watched, guarded_context, launch_chromium

from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts" / "pages"
KEY = "encoder-page-key"
TEXTS = ["The cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell sharply today."]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    yield from launch_chromium(playwright_api)


@pytest.fixture(scope="module")
def embedder() -> Iterator[ServerProcess]:
    with ServerProcess(FIXTURES / "bert", ["--alias", "tiny-embedder"]) as s:
        yield s


@pytest.fixture(scope="module")
def reranker() -> Iterator[ServerProcess]:
    with ServerProcess(FIXTURES / "bert_rerank", ["--alias", "tiny-reranker", "--api-key", KEY]) as s:
        yield s


@pytest.fixture
def context(browser: object) -> Iterator[object]:
    yield from guarded_context(browser, 1300)


def api(server: ServerProcess, key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=120)


def wait_js(page: object, expression: str, timeout: float = 60_000) -> None:
    """Poll ``expression`` with page.evaluate until it is truthy (wait_for_function evaluates strings in the
    page, which the page's Content-Security-Policy rightly refuses)."""
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"timed out waiting for {expression}"
        time.sleep(0.05)


def give_key(page: object) -> None:
    dialog = page.get_by_role("dialog")  # type: ignore[attr-defined]
    dialog.get_by_label("API key").fill(KEY)
    dialog.get_by_role("button", name="Save key").click()


def open_page(page: object, server: ServerProcess, key: bool = False) -> None:
    page.goto(server.url + "/")  # type: ignore[attr-defined]
    if key:
        give_key(page)  # asked before the first API call: the server said it wants a key
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)  # type: ignore[attr-defined]


def cosines(vectors: np.ndarray) -> np.ndarray:
    v = vectors.astype(np.float64)
    n = np.linalg.norm(v, axis=1)
    return (v @ v.T) / np.outer(n, n)


def embed_in_page(page: object, texts: list[str]) -> None:
    page.get_by_role("textbox", name="Texts").fill("\n".join(texts))  # type: ignore[attr-defined]
    page.evaluate("window.minferEncoder.embed = null")  # type: ignore[attr-defined]
    page.get_by_role("button", name="Embed", exact=True).click()  # type: ignore[attr-defined]
    wait_js(page, "window.minferEncoder.embed !== null || document.getElementById('embed-error').textContent !== ''")


def check_embeddings(page: object, server: ServerProcess, key: str | None = None) -> None:
    """Three texts: the page's matrix has 1.000 on its diagonal and the API's cosines elsewhere, its token counts
    are /tokenize's and its norms and first values are the vectors'."""
    embed_in_page(page, TEXTS)
    assert page.locator("#embed-error").inner_text() == ""  # type: ignore[attr-defined]
    with api(server, key) as client:
        body = client.post("/v1/embeddings", json={"input": TEXTS}).json()
        tokens = [len(client.post("/tokenize", json={"content": t}).json()["tokens"]) for t in TEXTS]
    vectors = np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], np.float64)
    want = cosines(vectors)
    rows = page.locator("#similarity tr").all()  # type: ignore[attr-defined]
    assert len(rows) == 4  # the header and three rows
    shown = [[td.inner_text() for td in row.locator("td").all()] for row in rows[1:]]
    values = [[float(td.get_attribute("data-value")) for td in row.locator("td").all()] for row in rows[1:]]
    assert [len(r) for r in shown] == [3, 3, 3]
    for i in range(3):
        assert shown[i][i] == "1.000"
        for j in range(3):
            assert abs(float(shown[i][j]) - want[i, j]) <= 0.0005 + 1e-9, (i, j, shown[i][j], want[i, j])
            assert abs(values[i][j] - want[i, j]) <= 1e-9
            assert shown[i][j] == f"{want[i, j]:.3f}", (i, j)
    # the cells are coloured (through the CSSOM: the page's CSP allows no inline style attribute)
    colour = page.locator("#similarity td").first.evaluate("(td) => td.style.backgroundColor")  # type: ignore
    assert colour.startswith("rgb")
    table = page.locator("#vectors tr").all()  # type: ignore[attr-defined]
    assert len(table) == 4
    for k, row in enumerate(table[1:]):
        assert row.locator("td.tokens").inner_text() == str(tokens[k])
        assert row.locator("td.norm").inner_text() == f"{np.linalg.norm(vectors[k]):.4f}"
        first = row.locator("td.values").inner_text()
        assert first.startswith("[" + ", ".join(f"{x:.4f}" for x in vectors[k][:6]))
    assert f"{body['usage']['prompt_tokens']} tokens" in page.locator("#embed-info").inner_text()  # type: ignore
    assert sum(tokens) == body["usage"]["prompt_tokens"]


def test_embedder_page_embeds_and_says_no_chat_no_rerank(embedder: ServerProcess, context: object) -> None:
    w = Watched(context)
    page = w.page
    open_page(page, embedder)
    note = page.locator("#kind-note").inner_text()
    assert "tiny-embedder" in note and "encoder" in note and "chat is not available" in note
    assert "tiny-embedder" in page.locator("#model-name").inner_text()
    assert "64 tokens" in page.locator("#model-info").inner_text()
    # no reranking head: the section says so, and offers no form
    assert page.locator("#rerank-unavailable").is_visible()
    assert "no reranking head" in page.locator("#rerank-unavailable").inner_text()
    assert not page.locator("#rerank-form").is_visible()
    check_embeddings(page, embedder)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "encoder-embedder.png"), full_page=True)
    w.clean()
    # served as the other pages are: the page with its CSP, the favicon, the static files
    with api(embedder) as client:
        r = client.get("/")
        assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
        assert '<meta name="minfer-key" content="">' in r.text
        assert client.get("/favicon.ico").headers["content-type"].startswith("image/svg+xml")
        for name in ("encoder.js", "encoder.css", "common.js", "page.css"):
            assert client.get(f"/static/{name}").status_code == 200, name
        assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400  # still an encoder


def test_bad_inputs_show_the_api_error(embedder: ServerProcess, context: object) -> None:
    w = Watched(context)
    page = w.page
    open_page(page, embedder)
    long_text = "word " * 100  # more than the fixture's 64 tokens
    with api(embedder) as client:
        empty = client.post("/v1/embeddings", json={"input": [""]})
        too_long = client.post("/v1/embeddings", json={"input": ["hello", long_text.rstrip()]})
    assert empty.status_code == too_long.status_code == 400
    for texts, want in (([""], empty.json()["error"]["message"]),
                        (["hello", long_text.rstrip()], too_long.json()["error"]["message"])):
        embed_in_page(page, texts)
        error = page.locator("#embed-error")
        assert error.is_visible() and error.inner_text() == want
        assert len(error.inner_text().splitlines()) == 1
    assert "empty string" in empty.json()["error"]["message"] and "64" in too_long.json()["error"]["message"]
    # a good request afterwards clears the message
    embed_in_page(page, TEXTS[:2])
    assert page.locator("#embed-error").inner_text() == ""
    w.clean(allow="status of 400")


def test_reranker_page_ranks_like_the_api_and_embeds(reranker: ServerProcess, context: object) -> None:
    w = Watched(context)
    page = w.page
    open_page(page, reranker, key=True)
    assert "tiny-reranker" in page.locator("#kind-note").inner_text()
    assert "chat is not available" in page.locator("#kind-note").inner_text()
    assert page.locator("#rerank-form").is_visible() and not page.locator("#rerank-unavailable").is_visible()
    query = "What do cats like?"
    documents = ["The stock market closed higher.", "Cats like to sleep in the sun.", "Dogs enjoy long walks."]
    page.get_by_role("textbox", name="Query").fill(query)
    page.get_by_role("textbox", name="Documents").fill("\n".join(documents))
    page.get_by_role("button", name="Rank", exact=True).click()
    page.wait_for_selector("#ranking tr td", timeout=60_000)
    with api(reranker, KEY) as client:
        want = client.post("/v1/rerank", json={"query": query, "documents": documents}).json()["results"]
    rows = page.locator("#ranking tr").all()[1:]
    assert len(rows) == 3
    got = [(int(r.get_attribute("data-index")), r.locator("td.score").inner_text(), r.locator("td.text").inner_text())
           for r in rows]
    assert got == [(x["index"], f"{x['relevance_score']:.4f}", documents[x["index"]]) for x in want]
    # its embeddings work too
    check_embeddings(page, reranker, KEY)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "encoder-reranker.png"), full_page=True)
    w.clean()
