"""The HTML trace view, opened in headless Chromium (Debian's chromium; .ci/run installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from conftest import FIXTURES, fixture_dir

import minfer
from minfer.trace.html import example_page_data, render, trace_page_data

ARTIFACTS = FIXTURES.parent.parent / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(*args: str) -> str:
    """Run headless Chromium; fails on any message the page wrote to its console (errors included)."""
    assert CHROMIUM, "Debian's chromium is needed for the HTML view tests (apt-get install chromium)"
    with tempfile.TemporaryDirectory() as profile:
        r = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--enable-logging=stderr", "--v=0", f"--user-data-dir={profile}", *args],
            capture_output=True, text=True, timeout=120,
        )
    assert r.returncode == 0, r.stderr[-2000:]
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    return r.stdout


def table_values(dom: str, table_id: str) -> list[list[float]]:
    table = re.search(rf'<table id="{table_id}">(.*?)</table>', dom, re.S)
    assert table, f"no table {table_id} in the rendered page"
    rows = []
    for row in re.findall(r"<tr>(.*?)</tr>", table.group(1), re.S):
        cells = re.findall(r'data-value="([^"]*)"', row)
        if cells:
            rows.append([float(c) for c in cells])  # "-inf" parses as -inf
    return rows


def test_learning_page_2x2_example_shows_exactly_its_values(tmp_path):
    eye = np.eye(2, dtype=np.float32)
    page = tmp_path / "example.html"
    page.write_text(render(example_page_data(eye, eye, np.array([[10, 0], [0, 20]], np.float32), ["t0", "t1"])))
    dom = chromium("--dump-dom", page.as_uri())
    assert re.search(r'<div id="errors"></div>', dom), "the page reported a script error"
    np.testing.assert_allclose(table_values(dom, "scores"), [[0.70710678, 0], [0, 0.70710678]], rtol=1e-7)
    masked = table_values(dom, "masked")
    assert masked[0][1] == -np.inf
    np.testing.assert_allclose([masked[0][0], *masked[1]], [0.70710678, 0, 0.70710678], rtol=1e-7)
    np.testing.assert_allclose(table_values(dom, "weights"), [[1, 0], [0.33023846, 0.66976154]], rtol=1e-7)
    np.testing.assert_allclose(table_values(dom, "output"), [[10, 0], [3.3023846, 13.395231]], rtol=1e-7)


def test_fixture_page_is_self_contained_and_consistent(tmp_path):
    model = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=64)
    data = trace_page_data(model, "Hello world")
    text = render(data)
    assert "http://" not in text and "https://" not in text and "<script src" not in text
    assert len(data["layers"]) == 3 and len(data["layers"][0]["heads"]) == 4  # 4 query heads over 2 kv heads
    for layer in data["layers"]:
        for head in layer["heads"]:
            np.testing.assert_allclose(np.sum(head["weights"], axis=1), 1.0, rtol=1e-12)
    # the view's attention output for each head is the engine's own attention output (within f32 rounding)
    capture_model = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=64, dump_dir=tmp_path / "d",
                                dump_filter="blk.0.attn")
    capture_model.logits(model.tokenize("Hello world"))
    entry = json.loads((tmp_path / "d" / "manifest.json").read_text())["entries"][0]
    attn = np.load(tmp_path / "d" / entry["file"]).reshape(len(data["tokens"]), 4, 32)
    for h in range(4):
        np.testing.assert_allclose(data["layers"][0]["heads"][h]["output"], attn[:, h], atol=1e-5)


@pytest.mark.slow
def test_smollm2_attention_screenshot(smollm2_path):
    model = minfer.load(smollm2_path, n_ctx=128)
    ARTIFACTS.mkdir(exist_ok=True)
    page = ARTIFACTS / "trace-smollm2.html"
    page.write_text(render(trace_page_data(model, "The capital of France is")))
    dom = chromium("--dump-dom", page.as_uri())
    assert '<div id="errors"></div>' in dom and 'id="weights"' in dom
    shot = ARTIFACTS / "trace-smollm2.png"
    chromium("--window-size=1400,1000", f"--screenshot={shot}", page.as_uri())
    assert shot.stat().st_size > 10_000


def test_gemma3_page_shows_sliding_windows(tmp_path):
    """Gemma 3's sliding-window layers (window 6 in the fixture) mask keys 6 or more positions back; the
    view's output per head is still the engine's own attention output, layer by layer kind."""
    model = minfer.load(fixture_dir("gemma3") / "model-f32.gguf", n_ctx=64)
    prompt = "The capital of France is Paris. The capital of Japan is Tokyo."
    data = trace_page_data(model, prompt)
    n = len(data["tokens"])
    assert n > 12
    assert [layer["window"] for layer in data["layers"]] == [6, 6, 6, 6, 6, 0, 6]
    local, glob = data["layers"][0]["heads"][0], data["layers"][5]["heads"][0]
    assert local["masked"][n - 1][n - 7] is None and local["masked"][n - 1][n - 6] is not None
    assert all(x is not None for x in glob["masked"][n - 1])
    dumps = minfer.load(fixture_dir("gemma3") / "model-f32.gguf", n_ctx=64, dump_dir=tmp_path / "d",
                        dump_filter="blk.0.attn,blk.5.attn")
    dumps.logits(model.tokenize(prompt))
    for entry in json.loads((tmp_path / "d" / "manifest.json").read_text())["entries"]:
        il = int(entry["name"].split(".")[1])
        attn = np.load(tmp_path / "d" / entry["file"]).reshape(n, 4, 16)
        for h in range(4):
            np.testing.assert_allclose(data["layers"][il]["heads"][h]["output"], attn[:, h], atol=1e-5)
    page = tmp_path / "gemma3.html"
    page.write_text(render(data))
    dom = chromium("--dump-dom", page.as_uri())
    assert '<div id="errors"></div>' in dom and "sliding window of 6" in dom


def test_static_page_caps_its_inline_data_and_says_what_it_left_out(tmp_path):
    model = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=64)
    data = trace_page_data(model, "The capital of France is Paris.", layers=[1], heads=[0, 2], max_positions=3)
    assert [x["layer"] for x in data["layers"]] == [1] and [h["head"] for h in data["layers"][0]["heads"]] == [0, 2]
    assert np.array(data["layers"][0]["heads"][0]["weights"]).shape == (3, 3)
    assert len(data["omitted"]) == 3 and "positions 3.." in data["omitted"][2]
    small = trace_page_data(model, "The capital of France is Paris.", max_cells=1)  # the default cap, squeezed
    assert [x["layer"] for x in small["layers"]] == [0] and "2 of 3 layers" in small["omitted"][0]
    out = tmp_path / "t.html"
    r = subprocess.run([sys.executable, "-m", "minfer", "trace", str(fixture_dir("qwen3") / "model-f32.gguf"),
                        "Hello world", "--html", str(out), "--layers", "0-1", "--heads", "1", "--positions", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "left out: the attention of 1 of 3 layers" in r.stdout and "Left out of this page" not in r.stdout
    dom = chromium("--dump-dom", out.as_uri())
    assert '<div id="errors"></div>' in dom and "Left out of this page" in dom
    r = subprocess.run([sys.executable, "-m", "minfer", "trace", str(fixture_dir("qwen3") / "model-f32.gguf"),
                        "Hello", "--html", str(out), "--layers", "7"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "layer 7 is outside 0..2" in r.stderr and "Traceback" not in r.stderr
