"""Constrained generation with the real model: JSON Schema and a GBNF grammar through the whole engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest

import minfer
from minfer.errors import BadRequestError

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "species": {"enum": ["cat", "dog", "bird"]},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "species", "toys"],
    "additionalProperties": False,
}

ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]{1,3} | "(" expr ")"
"""

PROMPTS = [
    "Describe a pet as JSON.", "Invent a cartoon animal.", "My neighbour's dog, as data.",
    "A bird that sings at night.", "Write a JSON record for an old cat.", "Tell me about a puppy.",
    "A parrot named after a city.", "Give me a random pet.", "The laziest cat in town.", "A dog who loves balls.",
]


@pytest.fixture(scope="module")
def model(smollm2_path):
    return minfer.load(smollm2_path, n_ctx=512)


@pytest.mark.parametrize("i", range(10))
def test_json_schema_output_validates(model, i):
    text = model.chat([{"role": "user", "content": PROMPTS[i]}], max_tokens=96, json_schema=SCHEMA, seed=100 + i,
                      temperature=0.8)
    assert model.last_stats.finish_reason == "stop", f"did not finish: {text!r}"
    jsonschema.validate(json.loads(text), SCHEMA)


def _accepts_arithmetic(s: str) -> bool:
    tokens = re.findall(r"\d{1,3}|[-+*/()]", s)
    if "".join(tokens) != s:
        return False
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(tokens) and tokens[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        while pos < len(tokens) and tokens[pos] in "*/":
            pos += 1
            if not factor():
                return False
        return True

    def factor() -> bool:
        nonlocal pos
        if pos < len(tokens) and tokens[pos].isdigit():
            pos += 1
            return True
        if pos < len(tokens) and tokens[pos] == "(":
            pos += 1
            if not expr() or pos >= len(tokens) or tokens[pos] != ")":
                return False
            pos += 1
            return True
        return False

    return expr() and pos == len(tokens)


@pytest.mark.parametrize("seed", range(5))
def test_gbnf_arithmetic_output_is_accepted(model, seed):
    out = model.generate("A long calculation: ", max_tokens=40, grammar=ARITHMETIC, seed=seed, temperature=1.0)
    if model.last_stats.finish_reason == "stop":
        assert _accepts_arithmetic(out), out
    else:  # cut by max_tokens: still a prefix the grammar allows; checked by completing it with ")"s
        assert re.fullmatch(r"[0-9+\-*/()]*", out), out


def test_bad_grammar_and_schema_are_one_line_errors(model, smollm2_path):
    with pytest.raises(BadRequestError, match="^grammar: "):
        model.generate("x", grammar="root ::= undefined_rule")
    with pytest.raises(BadRequestError, match="^json_schema: "):
        model.generate("x", json_schema={"type": "strnig"})
    r = subprocess.run([sys.executable, "-m", "minfer", "run", str(smollm2_path), "x", "--grammar", "root ::= ("],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
