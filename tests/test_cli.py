"""The minfer command, run as a user runs it: a subprocess, its stdout, stderr and exit status."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import fixture_dir

QWEN3 = str(fixture_dir("qwen3") / "model-f32.gguf")


def minfer(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minfer", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def assert_clean_error(r: subprocess.CompletedProcess, *fragments: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_run_greedy_on_fixture_is_deterministic():
    a = minfer("run", QWEN3, "The capital of France is", "-n", "8", "--temp", "0")
    b = minfer("run", QWEN3, "The capital of France is", "-n", "8", "--temp", "0", "-t", "1")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
    assert "generated 8 tokens" in a.stderr


def test_inspect_prints_metadata_and_hparams():
    r = minfer("inspect", QWEN3, "--tensors")
    assert r.returncode == 0, r.stderr
    assert "architecture: qwen3" in r.stdout
    assert "head_dim_k = 32" in r.stdout and "QK-norm" in r.stdout
    assert "blk.0.attn_q_norm.weight" in r.stdout


@pytest.mark.parametrize("fmt", ["text", "dot", "json"])
def test_inspect_graph(fmt):
    r = minfer("inspect", QWEN3, "--graph", "--format", fmt, "--tokens", "3")
    assert r.returncode == 0, r.stderr
    if fmt == "json":
        nodes = json.loads(r.stdout)["nodes"]
        assert any(n["op"] == "attn" for n in nodes)
    elif fmt == "dot":
        assert r.stdout.startswith("digraph") and "kv_store" in r.stdout
    else:
        assert "attn(" in r.stdout and "rope(" in r.stdout


def test_missing_file(tmp_path):
    assert_clean_error(minfer("run", str(tmp_path / "missing.gguf"), "hi"), "no such file")


def test_not_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("not a model")
    assert_clean_error(minfer("run", str(p), "hi"), "not a GGUF file")


def test_truncated(tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes((fixture_dir("qwen3") / "model-f32.gguf").read_bytes()[:300_000])
    assert_clean_error(minfer("inspect", str(p)), "truncated")


def test_unsupported_architecture(tmp_path):
    from test_gguf_file import _write_gguf

    p = _write_gguf(tmp_path / "m.gguf", arch="mamba")
    assert_clean_error(minfer("run", str(p), "hi"), "unsupported architecture 'mamba'")


def test_prompt_longer_than_context():
    assert_clean_error(minfer("run", QWEN3, "word " * 200, "-c", "16"), "more than the context of 16")


def test_bad_sampling_parameter():
    assert_clean_error(minfer("run", QWEN3, "hi", "--top-p", "1.5"), "top_p")


def test_generation_past_context_stops_at_length_unless_context_shift():
    r = minfer("run", QWEN3, "The capital of France is", "-c", "32", "-n", "96", "--temp", "0")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "finish: length" in r.stderr and "--ctx-size" in r.stderr and "--context-shift" in r.stderr, r.stderr
    r = minfer("run", QWEN3, "The capital of France is", "-c", "32", "-n", "96", "--temp", "0", "--context-shift",
               "--keep", "2")
    assert r.returncode == 0, r.stderr
    assert "generated 96 tokens" in r.stderr
