"""The trace: a JSON line per executed node with its statistics, and the top tokens per call."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import fixture_dir, fixture_sequences

import minfer


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_node_of_every_call_is_traced(tmp_path):
    path = tmp_path / "trace.jsonl"
    model = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=64, trace=path)
    seq = fixture_sequences("qwen3")[1]
    logits = model.logits(seq)
    model.tracer.close()
    records = read(path)
    nodes = [r for r in records if "node" in r]
    calls = [r for r in records if "top5" in r]
    assert len(calls) == 1 and calls[0]["positions"] == list(range(len(seq)))
    assert len(nodes) == len(model.runner.plan(len(seq), len(seq)).steps)
    out = next(r for r in nodes if r["name"] == "output")
    assert out["shape"] == list(logits.shape) and out["nan"] == 0 and out["inf"] == 0
    assert out["min"] == pytest.approx(float(logits.min()), rel=1e-6)
    assert out["max"] == pytest.approx(float(logits.max()), rel=1e-6)
    assert out["mean"] == pytest.approx(float(logits.astype(np.float64).mean()), rel=1e-5)
    assert out["rms"] == pytest.approx(float(np.sqrt((logits.astype(np.float64) ** 2).mean())), rel=1e-5)
    top = [t for t, _, _ in calls[0]["top5"]]
    assert top == [int(i) for i in np.argsort(-logits[-1], kind="stable")[:5]]
    assert all(r["us"] >= 0 for r in nodes)
    assert {r["op"] for r in nodes} >= {"matmul", "rope", "kv_store", "attn", "rms_norm_mul", "swiglu"}


def test_trace_from_the_environment_and_the_cli(tmp_path, monkeypatch):
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv("MINFER_TRACE", str(path))
    model = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=64)
    model.generate("Hello", max_tokens=3, temperature=0)
    model.tracer.close()
    calls = [r for r in read(path) if "top5" in r]
    assert len(calls) == 3  # prefill + two decode steps (the third token is sampled from the last)
    assert calls[1]["positions"] == [calls[0]["positions"][-1] + 1]
