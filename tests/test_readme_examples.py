"""The README's examples work as written: the files they name are shipped, the grammar example's output
follows its grammar, and the JSON-schema example's answer cannot be an empty object."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import fixture_dir

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_commands(flag: str) -> list[list[str]]:
    lines = [line.split("  #")[0] for line in README.splitlines() if line.startswith("minfer ") and flag in line]
    assert lines, f"the README has no example with {flag}"
    return [shlex.split(line) for line in lines]


def test_the_grammar_example_file_is_shipped_and_its_output_follows_it():
    for cmd in readme_commands("--grammar-file"):
        grammar = ROOT / cmd[cmd.index("--grammar-file") + 1]
        assert grammar.is_file(), f"{grammar} is not shipped"
        prompt = cmd[2]
        r = subprocess.run([sys.executable, "-m", "minfer", "run", str(fixture_dir("llama") / "model-f32.gguf"),
                            prompt, "--grammar-file", str(grammar), "-n", "10", "--temp", "0"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        # arith.gbnf: integers joined by + - * / and parentheses (a cut-off expression is a prefix of one)
        assert re.fullmatch(r"[0-9+\-*/()]+", r.stdout.strip()), r.stdout


def test_the_json_schema_example_requires_what_it_describes():
    for cmd in readme_commands("--json-schema"):
        schema = json.loads(cmd[cmd.index("--json-schema") + 1])
        assert set(schema["required"]) == set(schema["properties"]), "an answer of {} would validate"
        assert schema.get("additionalProperties") is False


def readme_setup_commands() -> list[str]:
    """The README's two first commands (set up and generate; set up and test), comments cut off."""
    block = README.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    assert len(lines) == 2, lines
    return lines


def test_ci_runs_the_readmes_test_command_in_a_venv_it_builds():
    run_command, test_command = readme_setup_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines(), "the README's test command is not the one .ci/run runs"
    for command in (run_command, test_command):  # each builds the environment it then uses
        assert "python3 -m venv .venv && . .venv/bin/activate && pip install -e " in command, command
    constraints = test_command.split(" -c ", 1)[1].split()[0]
    pins = [line for line in (ROOT / constraints).read_text().splitlines() if line and not line.startswith("#")]
    pinned = {line.split("==")[0].lower() for line in pins}
    assert all("==" in line for line in pins), [line for line in pins if "==" not in line]
    assert {"pytest", "hypothesis", "schemathesis", "numba", "numpy"} <= pinned
    assert "minfer" not in pinned
