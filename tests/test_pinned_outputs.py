"""What a user gets, pinned: greedy and seeded outputs of the fixtures and of SmolLM2 through the API, a
conversation and a real server, equal to ``tests/data/pinned_outputs.json`` (recorded before the engine
step refactor by ``scripts/make_pinned_outputs.py``; see ``pinned_cases.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pinned_cases import FIXTURE_ARCHS, fixture_cases, server_cases, smollm2_cases

PINNED = json.loads((Path(__file__).parent / "data" / "pinned_outputs.json").read_text())


def _check(got: dict[str, object]) -> None:
    assert got, "no cases ran"
    for key, value in got.items():
        assert value == PINNED[key], f"{key}: got {value!r}, pinned {PINNED[key]!r}"


@pytest.mark.parametrize("arch", FIXTURE_ARCHS)
def test_fixture_outputs_are_pinned(arch):
    _check(fixture_cases(arch))


@pytest.mark.slow
def test_smollm2_api_outputs_are_pinned(smollm2_path):
    _check(smollm2_cases(smollm2_path))


@pytest.mark.slow
def test_smollm2_server_outputs_are_pinned(smollm2_path):
    _check(server_cases(smollm2_path))
