"""The layers of ARCHITECTURE.md hold: import-linter's contracts (``[tool.importlinter]`` in
pyproject.toml) are kept, and a deliberate upward import would break them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    return subprocess.run([exe, "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_import_linter_contract_is_kept():
    done = lint_imports()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout
    assert done.stdout.count("KEPT") == 5


def test_there_is_no_import_cycle_between_modules():
    import grimp

    graph = grimp.build_graph("minfer")
    cycles = sorted({tuple(sorted((a, b))) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                     if graph.chain_exists(importer=b, imported=a)})
    assert cycles == []
