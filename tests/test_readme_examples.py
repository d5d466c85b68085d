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
