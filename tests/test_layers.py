"""The layers of ARCHITECTURE.md hold: import-linter's contracts (``[tool.importlinter]`` in
pyproject.toml) are kept, and a deliberate upward import would break them."""

from __future__ import annotations

import os
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
    assert "Contracts: 9 kept, 0 broken." in done.stdout  # (a contract's name may wrap through its KEPT)


def test_there_is_no_import_cycle_between_modules():
    import grimp

    graph = grimp.build_graph("minfer")
    cycles = sorted({tuple(sorted((a, b))) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                     if graph.chain_exists(importer=b, imported=a)})
    assert cycles == []


def test_only_the_scheduler_decides_what_a_step_runs():
    """Admission and placement (``slots``) and each sequence's speculation (``speculative.state``) are
    imported by the scheduler alone: the engine, the engine loop and the server only call it."""
    import grimp

    graph = grimp.build_graph("minfer")
    for decided in ("minfer.runtime.slots", "minfer.runtime.speculative.state"):
        assert graph.find_modules_that_directly_import(decided) == {"minfer.runtime.scheduler"}, decided


def lint_a_copy_with(tmp_path: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """lint-imports over a copy of the package whose ``module`` (a path under src/minfer) gained ``line``."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "src", copy / "src")
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    path = copy / "src" / "minfer" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402, F401\n")
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    env = {**os.environ, "PYTHONPATH": str(copy / "src")}
    return subprocess.run([exe, "--no-cache"], cwd=copy, capture_output=True, text=True, timeout=300, env=env)


def test_a_module_that_places_sequences_itself_breaks_the_scheduler_contract(tmp_path):
    """The contract can fail: a copy of the package whose engine imports the slots is refused."""
    done = lint_a_copy_with(tmp_path, "runtime/engine.py", "from minfer.runtime.slots import Slots")
    assert done.returncode != 0
    assert "only runtime/scheduler.py decides what runs in a step" in done.stdout
    assert "minfer.runtime.engine -> minfer.runtime.slots" in done.stdout


def test_a_model_that_opens_a_file_format_itself_breaks_the_tensor_source_contract(tmp_path):
    """The model reads checkpoints through ``TensorSource`` alone: a copy whose model imports the HF folder
    reader is refused."""
    done = lint_a_copy_with(tmp_path, "models/model.py", "from minfer.models.hf_checkpoint import open_hf_folder")
    assert done.returncode != 0
    assert "read a checkpoint only through TensorSource" in done.stdout
    assert "minfer.models.model -> minfer.models.hf_checkpoint" in done.stdout


def test_tooling_folders_share_code_without_path_edits():
    """What bench/, scripts/ and tests/ share is imported from ``minfer.testing``: none edits sys.path."""
    edits = [f"{path.relative_to(ROOT)}:{i}" for folder in ("bench", "scripts", "tests", "src")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if "sys.path." + "insert" in line or "sys.path." + "append" in line]
    assert edits == []
