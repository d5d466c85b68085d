"""``minfer trace ENCODER TEXT --html FILE``: the trace page of one BERT pass (the fixture's two layers, four
heads of 8 dims), its attention recomputed without a mask and checked against the engine's and numpy's."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import fixture_dir
from test_trace_html import CHROMIUM, chromium, table_values

import minfer
from minfer.errors import BadRequestError
from minfer.trace.encoder_page import encoder_trace_page_data
from minfer.trace.html import render

BERT = fixture_dir("bert")
TEXT = "some text to trace"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minfer", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def encoder():
    return minfer.load(BERT)


def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps) * g + b


def numpy_layer0_qkv(encoder, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer 0's q, k, v ``[n, n_embd]`` in float64 straight from the fixture's weights (no engine kernel)."""
    hp = encoder.hparams
    w = lambda name: np.asarray(encoder.backend.dequantize(encoder.model.tensor(name)), np.float64)  # noqa: E731
    pos = np.arange(len(ids)) + hp.position_offset
    x = w("token_embd.weight")[ids] + w("position_embd.weight")[pos] + w("token_types.weight")[0]
    x = layer_norm(x, w("token_embd_norm.weight"), w("token_embd_norm.bias"), hp.norm_eps)
    return tuple(x @ w(f"blk.0.attn_{c}.weight").T + w(f"blk.0.attn_{c}.bias") for c in "qkv")


def test_cli_writes_a_self_contained_page_of_every_layer(tmp_path):
    out = tmp_path / "bert.html"
    r = cli("trace", str(BERT), "some text", "--html", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == str(out)
    text = out.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text and "<script src" not in text
    for name in ("blk.0.attn", "blk.0.q.bias", "blk.0.ffn_gelu", "blk.1.out_norm", "blk.1.attn", "enc_attn"):
        assert f'"{name}"' in text, name
    data = re.search(r'<script id="data" type="application/json">(.*?)</script>', text, re.S)
    page = json.loads(data.group(1))
    assert page["encoder"] is True and page["top_tokens"] == []
    assert "no vocabulary projection" in page["no_logits"]
    layers_with_stats = {s["layer"] for s in page["stats"]}
    assert {0, 1} <= layers_with_stats
    n = len(page["tokens"])
    assert page["tokens"][0] == "[CLS]" and page["tokens"][-1] == "[SEP]"
    for s in page["stats"]:
        assert s["shape"][0] == n, s  # cropped to the text's rows: no padding in the statistics
        assert s["nan"] == 0 and s["inf"] == 0
    assert {g["name"] for g in page["graph"]["nodes"]} >= {"blk.0.attn", "blk.0.out_norm", "embd_norm"}
    assert all(g["layer"] in (0, None) for g in page["graph"]["nodes"])


def test_serve_is_refused_in_one_line():
    r = cli("trace", str(BERT), "hello", "--serve")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("minfer: error:") and r.stderr.count("\n") == 1, r.stderr
    assert "--serve" in r.stderr and "encoder" in r.stderr and "--html" in r.stderr


def test_generating_flags_are_refused(tmp_path):
    r = cli("trace", str(BERT), "hello", "--html", str(tmp_path / "x.html"), "-c", "64")
    assert r.returncode == 1 and "is an encoder model" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "x.html").exists()


def test_attention_is_unmasked_and_equals_the_engine_and_numpy(encoder):
    data = encoder_trace_page_data(encoder, TEXT)
    ids = encoder.tokenize(TEXT)
    n, hp = len(ids), encoder.hparams
    d = hp.head_dim
    assert [x["layer"] for x in data["layers"]] == [0, 1] and len(data["layers"][0]["heads"]) == hp.n_head
    assert data["omitted"] == []
    # the engine's own blk.0.attn output and its q/k/v node outputs, from the same observed pass
    outputs: dict[str, np.ndarray] = {}
    encoder.run_observed(ids, lambda s, _: outputs.__setitem__(s.node.name, np.array(s.out[:n], copy=True)))
    engine = outputs["blk.0.attn"].reshape(n, hp.n_head, d)
    q, k, v = numpy_layer0_qkv(encoder, ids)
    for c, ref in zip("qkv", (q, k, v), strict=True):
        np.testing.assert_allclose(outputs[f"blk.0.{c}.bias"], ref, atol=1e-5)
    for h, head in enumerate(data["layers"][0]["heads"]):
        assert head["head"] == h
        weights = np.array(head["weights"])
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-12)
        assert (weights > 0).all()  # no mask: every token sees every token, the later ones included
        np.testing.assert_allclose(head["output"], engine[:, h], atol=1e-5)
        assert head["check"]["equal"] and head["check"]["max_abs"] <= 1e-5
        # independently: numpy's attention from the fixture's weights
        qh, kh, vh = (a[:, h * d:(h + 1) * d] for a in (q, k, v))
        s = qh @ kh.T / np.sqrt(d)
        np.testing.assert_allclose(head["scores"], s, atol=1e-5)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(head["output"], p @ vh, atol=1e-5)
    for head in data["layers"][1]["heads"]:
        assert head["check"]["equal"]
        np.testing.assert_allclose(head["output"], outputs["blk.1.attn"].reshape(n, hp.n_head, d)[:, head["head"]],
                                   atol=1e-5)


def test_a_rotary_encoder_s_page_reads_q_and_k_after_rope():
    """nomic-bert has no q/k/v biases and rotates q and k: the page recomputes each head from the roped q and k
    (checked here against numpy's RoPE of the unrotated projections) and equals the engine's attention."""
    enc = minfer.load(fixture_dir("nomic"))
    data = encoder_trace_page_data(enc, TEXT)
    ids = enc.tokenize(TEXT)
    n, hp = len(ids), enc.hparams
    d = hp.head_dim
    outputs: dict[str, np.ndarray] = {}
    enc.run_observed(ids, lambda s, _: outputs.__setitem__(s.node.name, np.array(s.out[:n], copy=True)))
    half = d // 2
    angle = np.arange(n)[:, None] * hp.rope_base ** (-np.arange(half) / half)
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    for c in "qk":  # NeoX pairs (i, i + d/2) of each head
        x = outputs[f"blk.0.{c}"].astype(np.float64).reshape(n, hp.n_head, d)
        a, b = x[..., :half], x[..., half:]
        rotated = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(n, -1)
        np.testing.assert_allclose(outputs[f"blk.0.{c}_rope"], rotated, atol=1e-5)
    for layer in data["layers"]:
        engine = outputs[f"blk.{layer['layer']}.attn"].reshape(n, hp.n_head, d)
        for head in layer["heads"]:
            assert head["check"]["equal"]
            np.testing.assert_allclose(head["output"], engine[:, head["head"]], atol=1e-5)


def test_cropped_page_says_what_it_left_out(encoder):
    data = encoder_trace_page_data(encoder, TEXT, layers=[1], heads=[2], max_positions=3)
    assert [x["layer"] for x in data["layers"]] == [1] and [h["head"] for h in data["layers"][0]["heads"]] == [2]
    head = data["layers"][0]["heads"][0]
    assert np.array(head["weights"]).shape == (3, 3) and np.array(head["output"]).shape == (3, encoder.hparams.head_dim)
    assert head["check"]["equal"]  # checked over every position, whatever is inlined
    assert len(data["omitted"]) == 3 and "positions 3.." in data["omitted"][2]
    with pytest.raises(BadRequestError, match="layer 5 is outside 0..1"):
        encoder_trace_page_data(encoder, TEXT, layers=[5])


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is needed for the HTML view tests")
def test_page_renders_in_chromium_without_errors(encoder, tmp_path):
    data = encoder_trace_page_data(encoder, TEXT)
    page = tmp_path / "bert.html"
    page.write_text(render(data), encoding="utf-8")
    dom = chromium("--dump-dom", page.as_uri())
    assert '<div id="errors"></div>' in dom, "the page reported a script error"
    assert 'id="masked"' not in dom  # no causal window to show
    assert "no vocabulary projection" in dom and "(equal)" in dom
    head = data["layers"][0]["heads"][0]
    np.testing.assert_allclose(table_values(dom, "weights"), head["weights"], rtol=1e-6)
    np.testing.assert_allclose(table_values(dom, "output"), head["output"], rtol=1e-6)
