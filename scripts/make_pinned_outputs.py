"""Writes ``tests/data/pinned_outputs.json``: the greedy and seeded (seed 7, temperature 0.8) outputs of
SmolLM2 and of the tiny fixtures, through the Python API and a real server, as the engine gives them
now. ``tests/test_pinned_outputs.py`` holds every later engine to these tokens: a refactor that changes
what a user gets shows up there. Rebuild only when a change of output is intended, and say why.

    python3 scripts/make_pinned_outputs.py
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    # the cases are the test's own module, loaded from its file (tests/ is not a package)
    spec = importlib.util.spec_from_file_location("pinned_cases", ROOT / "tests" / "pinned_cases.py")
    assert spec is not None and spec.loader is not None
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    out = ROOT / "tests" / "data" / "pinned_outputs.json"
    out.write_text(json.dumps(cases.run_all(), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
