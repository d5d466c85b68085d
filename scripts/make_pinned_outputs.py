"""Writes ``tests/data/pinned_outputs.json``: the greedy and seeded (seed 7, temperature 0.8) outputs of
SmolLM2 and of the tiny fixtures, through the Python API and a real server, as the engine gives them
now. ``tests/test_pinned_outputs.py`` holds every later engine to these tokens: a refactor that changes
what a user gets shows up there. Rebuild only when a change of output is intended, and say why.

    python3 scripts/make_pinned_outputs.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from pinned_cases import run_all  # noqa: E402


def main() -> None:
    out = ROOT / "tests" / "data" / "pinned_outputs.json"
    out.write_text(json.dumps(run_all(), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
