"""The trace explorer on a pass holding images (issue 35, item 6): image rows marked and labelled, Gemma 3's
image rows attending to their whole image in the attention panel (the reference equal to the fused kernel), the
merged embedding rows shown, the logit lens on the text after an image, and ``minfer trace --image``."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minfer
from minfer.runtime.vision import MEDIA_MARKER, ImageInput

GEMMA3 = Path(__file__).parent / "fixtures" / "gemma3_vision"
SMOLVLM = Path(__file__).parent / "fixtures" / "smolvlm"
PROMPT = f"{MEDIA_MARKER}What is in this image?"


def f32(o: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(o["b64"]), "<f4").reshape(o["shape"])


def image_input(folder: Path, name: str) -> ImageInput:
    return ImageInput((folder / "images" / name).read_bytes(), name)


@pytest.fixture(scope="module")
def gemma3() -> minfer.Model:
    return minfer.load(GEMMA3 / "hf", n_ctx=256)


@pytest.fixture(scope="module")
def traced(gemma3):
    ids, placed = gemma3.image_prompt(PROMPT, [image_input(GEMMA3, "rgb_45x20.png")], add_special=True)
    return gemma3.trace_forward(ids, images=placed), ids, placed


def test_image_rows_are_marked_and_labelled(traced):
    trace, ids, placed = traced
    (img,) = placed
    summary = trace.summary()
    assert summary["images"] == [[img.first, img.end]] and img.end - img.first == img.vectors.shape[0]
    assert summary["labels"][img.first:img.end] == ["<image 0>"] * (img.end - img.first)
    assert "<image" not in "".join(summary["labels"][:img.first] + summary["labels"][img.end:])
    assert summary["tokens"] == ids


def test_merged_embedding_rows_are_the_images_tokens(traced):
    trace, _, (img,) = traced
    merged = trace.tensor(trace.by_name["embd.image_rows"])
    # the image's rows of the pass's input are the projector's tokens, the text rows the (scaled) embeddings
    np.testing.assert_array_equal(merged[img.first:img.end], img.vectors)
    text = trace.tensor(trace.by_name["embd.text_rows"])
    np.testing.assert_array_equal(merged[:img.first], text[:img.first])
    assert not np.any(text[img.first:img.end])
    view = trace.tensor_view(trace.by_name["embd.image_rows"].id)
    assert view["labels"][img.first] == "<image 0>"


def test_image_rows_see_their_whole_image_in_the_attention_panel(gemma3, traced):
    trace, ids, (img,) = traced
    hp = gemma3.hparams
    n = len(ids)
    for layer in range(hp.n_layer):
        engine = trace.tensor(trace.attention_nodes(layer)["attn"]).reshape(n, hp.n_head, hp.head_dim_v)
        for head in range(hp.n_head):
            a = trace.attention(layer, head)
            assert a["check"]["equal"], (layer, head, a["check"])
            np.testing.assert_array_equal(f32(a["output"]), engine[:, head])
            weights = f32(a["weights"])
            ends = np.asarray(a["visible_to"])
            assert list(ends[img.first:img.end]) == [img.end - 1] * (img.end - img.first)
            assert list(ends[:img.first]) == list(range(img.first)) and list(ends[img.end:]) == list(range(img.end, n))
            # the image's first row weighs its later rows (both ways), a text row before it none of them
            assert np.all(weights[img.first, img.first + 1:img.end] > 0)
            assert np.all(weights[:img.first, img.first:] == 0)
    # a window of query rows inside the image reads keys up to the image's end
    a = trace.attention(0, 0, (img.first, img.first + 2))
    assert a["keys"] == img.end and len(a["labels"]) == img.end


def test_causal_image_rows_are_not_widened():
    """SmolVLM (Idefics3) attends causally over its image rows: the panel's ends are the rows' own positions."""
    model = minfer.load(SMOLVLM / "hf", n_ctx=2048)
    inputs = [image_input(GEMMA3, "rgb_64x64.png")]
    ids, placed = model.image_prompt(PROMPT, inputs, add_special=True)
    trace = model.trace_forward(ids, images=placed, image_inputs=inputs)
    assert not trace.images_bidirectional and len(trace.images) == len(placed) >= 1
    # the tower's pass holds every tile the processor cut (one PassImage each), the last node their tokens
    vision = trace.vision
    assert vision.n_tiles == len(placed)
    last = vision.by_id[vision.summary()["nodes"][-1]["id"]]
    np.testing.assert_array_equal(vision.tensor(last).reshape(len(placed), -1, placed[0].vectors.shape[1]),
                                  np.stack([p.vectors for p in placed]))
    a = trace.attention(0, 0)
    assert a["check"]["equal"] and a["visible_to"] == list(range(len(ids)))


def test_logit_lens_after_an_image(gemma3, traced):
    trace, ids, (img,) = traced
    positions = list(range(img.end, len(ids)))
    lens = trace.lens(positions)
    assert lens["model_top"] == [int(trace.top_tokens[p][0]) for p in positions]
    assert [cell[0][0] for cell in lens["layers"][-1]] == lens["model_top"]  # the last layer is the model's own


def test_trace_cli_with_an_image(tmp_path):
    out = tmp_path / "page.html"
    image = GEMMA3 / "images" / "rgb_45x20.png"
    r = subprocess.run([sys.executable, "-m", "minfer", "trace", str(GEMMA3 / "gguf" / "model-f32.gguf"),
                        "What is in this image?", "--mmproj", str(GEMMA3 / "gguf" / "mmproj-f32.gguf"),
                        "--image", str(image), "--html", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    assert "&lt;image 0&gt;" in page or "<image 0>" in page
    bad = subprocess.run([sys.executable, "-m", "minfer", "trace", str(GEMMA3 / "gguf" / "model-f32.gguf"), "hi",
                          "--image", str(image), "--html", str(out)], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "image" in bad.stderr


def test_html_page_data_widens_an_image_rows_keys(gemma3, traced):
    from minfer.trace.html import trace_page_data

    _, ids, _ = traced
    ids2, placed = gemma3.image_prompt(PROMPT, [image_input(GEMMA3, "rgb_45x20.png")], add_special=True)
    (img,) = placed
    data = trace_page_data(gemma3, ids2, layers=[0], heads=[0], max_positions=img.first + 1, images=placed)
    assert data["images"] == [[img.first, img.end]] and data["tokens"][img.first] == "<image 0>"
    masked = data["layers"][0]["heads"][0]["masked"]
    assert len(masked) == img.first + 1
    # the image's first row scores every key of its image; the row before it only keys up to its own
    assert all(x is not None for x in masked[img.first][:img.end])
    assert all(x is None for x in masked[img.first - 1][img.first:])
    weights = np.asarray(data["layers"][0]["heads"][0]["weights"])
    np.testing.assert_allclose(weights.sum(axis=1), 1, atol=1e-9)


def test_the_vision_towers_pass_is_traced(gemma3):
    """Every node of the tower and projector with its statistics; its last node's rows are the image's tokens the
    text pass took; a node beyond the budget is captured again with the same values."""
    inputs = [image_input(GEMMA3, "rgb_45x20.png")]
    ids, placed = gemma3.image_prompt(PROMPT, inputs, add_special=True)
    trace = gemma3.trace_forward(ids, images=placed, image_inputs=inputs)
    vision = trace.vision
    summary = vision.summary()
    assert trace.summary()["vision"] and summary["tiles"] == 1
    nodes = summary["nodes"]
    assert len(nodes) > 10 and all(n["stats"] is not None for n in nodes)
    assert any(n["layer"] == 0 for n in nodes) and any(".attn" in n["name"] for n in nodes)
    last = vision.by_id[nodes[-1]["id"]]
    np.testing.assert_array_equal(vision.tensor(last), placed[0].vectors)
    view = vision.tensor_view(last.id)
    assert view["shape"] == list(placed[0].vectors.shape) and view["labels"][0] == "tile 0 · 0"
    # with no budget nothing is held, and each node asked for is the same bits again
    tight = gemma3.trace_forward(ids, images=placed, image_inputs=inputs, budget=0).vision
    assert tight.tensors == {} and tight.held_bytes() == 0
    for n in nodes[::5]:
        node = vision.by_id[n["id"]]
        np.testing.assert_array_equal(tight.tensor(node), vision.tensor(node))
    assert tight.recaptures == len(nodes[::5])


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def test_explorer_routes_and_page_with_an_image():
    """`minfer trace GEMMA3 --mmproj --image --serve` as a user runs it: the run's summary marks the image rows and
    names its vision pass; the vision routes answer; a chat exchange holding an image (a data: URL) traces with its
    image; ``{"run": id}`` traces the same prompt and image again under another cache type; the page, in chromium,
    shows the vision tower's nodes and a node's tensor, and the attention panel's image rows see their image."""
    import httpx

    playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    from browser_support import Watched, guarded_context, launch_chromium, wait_js
    from explorer_process import explorer_process

    image = GEMMA3 / "images" / "rgb_45x20.png"
    args = [str(GEMMA3 / "gguf" / "model-f32.gguf"), "What is in this image?", "--mmproj",
            str(GEMMA3 / "gguf" / "mmproj-f32.gguf"), "--image", str(image), "-c", "256"]
    with explorer_process(args) as url:
        base = url.split("/trace")[0]
        rid = url.split("run=")[1].split("&")[0]
        with httpx.Client(base_url=base, timeout=120) as client:
            run = client.get(f"/trace/api/runs/{rid}").json()
            assert run["vision"] and len(run["images"]) == 1
            first, end = run["images"][0]
            assert run["labels"][first:end] == ["<image 0>"] * (end - first)
            vision = client.get(f"/trace/api/runs/{rid}/vision").json()
            assert vision["tiles"] == 1 and vision["tokens_per_tile"] == end - first
            last = vision["nodes"][-1]
            view = client.get(f"/trace/api/runs/{rid}/vision/nodes/{last['id']}").json()
            assert view["shape"] == [end - first, last["shape"][1]]
            weight = next(n for n in client.get(f"/trace/api/runs/{rid}/layers/0/graph").json()["nodes"]
                          if n["op"] == "weight")
            bad = client.get(f"/trace/api/runs/{rid}/vision/nodes/{weight['id'] + 10_000}")
            assert bad.status_code == 400 and "vision pass" in bad.json()["error"]["message"]
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                                     {"type": "text", "text": "What is in this image?"}]}]
            chat = client.post("/trace/api/runs", json={"messages": messages}).json()
            assert chat["vision"] and len(chat["images"]) == 1 and "1 images" in chat["description"]
            again = client.post("/trace/api/runs", json={"run": rid, "cache_type": "q8_0"}).json()
            assert again["tokens"] == run["tokens"] and again["images"] == run["images"] and again["vision"]
            assert again["cache_type"] == "q8_0"
            text_only = client.post("/trace/api/runs", json={"prompt": "hello"}).json()
            assert client.get(f"/trace/api/runs/{text_only['id']}/vision").status_code == 404
            remote = client.post("/trace/api/runs", json={"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]})
            assert remote.status_code == 400 and "data: URL" in remote.json()["error"]["message"]
            broken = client.post("/trace/api/runs", json={"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
            assert broken.status_code == 400, broken.text
        for browser in launch_chromium(playwright_api):
            for context in guarded_context(browser, 1500):
                w = Watched(context)
                page = w.page
                page.goto(url)
                page.wait_for_selector("body[data-ready='1']", timeout=60_000)
                assert page.locator("#vision-section").is_visible()
                assert page.locator("#vision table tr").count() == len(vision["nodes"]) + 1
                assert f"{first}..{end - 1}" in page.locator("#run-info").inner_text()
                page.locator(f"[data-vision-node='{last['id']}']").click()
                wait_js(page, f"window.minferExplorer.node && window.minferExplorer.node.node.id === {last['id']}")
                assert "Vision node" in page.locator("#node-title").inner_text()
                ends = page.evaluate("window.minferExplorer.attention.visible_to")
                assert ends[first:end] == [end - 1] * (end - first)
                assert "equal" in page.locator("#attention-check").inner_text()
                w.clean()
