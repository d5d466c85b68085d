"""Mutated Hugging Face folders: each one a clean one-line MinferError, or a model that loads and gives
finite logits. ``config.json`` values (top level and inside ``rope_parameters``) set to NaN, infinities,
zero, negatives, huge counts (``num_hidden_layers`` 2**31) and wrong types; a non-UTF-8
``chat_template.jinja``; deep, truncated or non-JSON configs; truncated weights. Then hypothesis.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import fixture_dir
from fuzz_support import SEED, Tally
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minfer

FAMILIES = ("qwen2", "gemma3")
BAD_VALUES: list[tuple[str, Any]] = [
    ("nan", float("nan")), ("inf", float("inf")), ("zero", 0), ("neg", -1), ("huge", 2**31), ("huge", 2**63),
    ("type", "text"), ("type", [1]), ("type", None), ("type", {"a": 1}),
]
# fields no loader reads (transformers' training and bookkeeping settings): left out to keep the test fast
UNREAD = {"_sliding_window_pattern", "attention_dropout", "dtype", "initializer_range", "transformers_version",
          "use_cache", "use_bidirectional_attention", "attention_bias", "max_window_layers", "architectures",
          "pad_token_id"}


def load_and_run(folder: Path) -> str:
    model = minfer.load(folder, n_ctx=32, threads=1, kernels="reference")
    ids = model.tokenize("Hello, world")[:8] or [0]
    if model.chat_template is not None:
        model.render_chat([{"role": "user", "content": "hi"}])
    return "ok" if np.isfinite(model.logits(ids)).all() else "nan"


@pytest.fixture(scope="module")
def tally(request):
    t = Tally("hf")
    yield t
    t.report(request.config)


def _folder(tmp_path: Path, family: str) -> Path:
    """A copy of the family's HF fixture whose weights are a symlink (they are not mutated here)."""
    src = fixture_dir(family) / "hf"
    dst = tmp_path / f"{family}-hf"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy(f, dst / f.name)
    return dst


def test_config_values(tally, tmp_path):
    for family in FAMILIES:
        folder = _folder(tmp_path, family)
        config = json.loads((fixture_dir(family) / "hf" / "config.json").read_text())
        paths = [(k,) for k in config if k not in UNREAD]
        rope = config.get("rope_parameters", {})
        for k, v in rope.items():
            paths += [("rope_parameters", k, kk) for kk in v] if isinstance(v, dict) else [("rope_parameters", k)]
        for p in paths:
            for name, value in BAD_VALUES:
                edited = json.loads(json.dumps(config))
                node = edited
                for part in p[:-1]:
                    node = node[part]
                node[p[-1]] = value
                (folder / "config.json").write_text(json.dumps(edited))
                kind = {"nan": "nan_values", "inf": "nan_values", "huge": "huge_counts"}.get(name, "bad_values")
                tally.run(kind, f"{family} {'.'.join(p)}={value!r}", lambda folder=folder: load_and_run(folder))
    tally.assert_clean()


def test_files(tally, tmp_path):
    rng = random.Random(SEED)
    for family in FAMILIES:
        src = fixture_dir(family) / "hf"
        cases: dict[str, dict[str, bytes]] = {
            "config nested 100,000 deep": {"config.json": b"[" * 100_000 + b"]" * 100_000},
            "config with a 5000-digit integer": {"config.json": b'{"num_hidden_layers": ' + b"9" * 5000 + b"}"},
            "config not JSON": {"config.json": b"{not json"},
            "config not UTF-8": {"config.json": b'{"a": "\xff\xfe"}'},
            "config a list": {"config.json": b"[1, 2]"},
            "chat_template.jinja not UTF-8": {"chat_template.jinja": b"{{ messages }}\xff\xfe\xc3"},
            "chat_template.jinja bad jinja": {"chat_template.jinja": b"{% for %}"},
            "tokenizer.json truncated": {"tokenizer.json": (src / "tokenizer.json").read_bytes()[:500]},
            "tokenizer_config not an object": {"tokenizer_config.json": b"7"},
            "generation_config bad": {"generation_config.json": b'{"temperature": "hot", "top_k": -5}'},
        }
        weights = (src / "model.safetensors").read_bytes()
        for cut in sorted(rng.sample(range(1, len(weights)), 12)) + [8, 64]:
            cases[f"weights cut at {cut}"] = {"model.safetensors": weights[:cut]}
        for i in range(12):
            blob = bytearray(weights)
            header_len = int.from_bytes(weights[:8], "little")
            blob[rng.randrange(0, 8 + header_len)] ^= 1 << rng.randrange(8)
            cases[f"weights header flip #{i}"] = {"model.safetensors": bytes(blob)}
        for name, files in cases.items():
            folder = _folder(tmp_path, family)
            for fname, content in files.items():
                (folder / fname).unlink(missing_ok=True)
                (folder / fname).write_bytes(content)
            kind = "truncation" if "cut" in name or "truncated" in name else "flips" if "flip" in name else \
                "deep_json" if "deep" in name else "huge_ints" if "digit" in name else "bad_files"
            tally.run(kind, f"{family} {name}", lambda folder=folder: load_and_run(folder))
    tally.assert_clean()


CONFIG = json.loads((fixture_dir("qwen2") / "hf" / "config.json").read_text())
VALUES = st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=6) | \
    st.lists(st.integers(-3, 3), max_size=3)


@settings(max_examples=80, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(st.dictionaries(st.sampled_from(sorted(CONFIG)), VALUES, min_size=1, max_size=3))
def test_property_config_values(tally, tmp_path_factory, edits):
    folder = _folder(tmp_path_factory.mktemp("hf"), "qwen2")
    (folder / "config.json").write_text(json.dumps({**CONFIG, **edits}))
    tally.run("hypothesis_config", repr(edits)[:120], lambda: load_and_run(folder))
    tally.assert_clean()
