"""Constrained decoding (minfer.runtime.constraints): masks checked by brute force over the vocabulary,
random walks to completion checked by independent parsers (json + jsonschema, a recursive-descent
recognizer), and the errors a bad grammar or schema gives.

Fast tests use the tiny qwen3 fixture's 1000-token byte-level vocabulary; the ``slow`` ones repeat the
central checks on SmolLM2's real 49152-token vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from minfer.errors import BadRequestError, ModelError
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.tokenizer import Tokenizer
from minfer.runtime.constraints import Constraint, _compiled_for

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3" / "model-f32.gguf"

# --- grammars and the languages they denote ------------------------------------------------------------
# Finite languages, so that the exact set of valid prefixes can be listed and every token checked.
WORDS_GBNF = 'root ::= ("yes" | "no" | "maybe") " " [0-9] [0-9]? "!"'
WORDS = [f"{w} {n}!" for w in ("yes", "no", "maybe") for n in [*map(str, range(10)), *(f"{i:02d}" for i in range(100))]]
# Non-ASCII through GBNF's \u escapes and as literal text: tokens may end inside a UTF-8 character.
UNICODE_GBNF = 'root ::= ("caf\\u00e9" | "\\u65e5\\u672c" | "über") ("," [a-c])?'
UNICODE = [w + s for w in ("café", "日本", "über") for s in ("", ",a", ",b", ",c")]

ARITH_GBNF = """
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


def parse_arith(text: str) -> None:
    """Recognize ARITH_GBNF's language (raises ValueError otherwise); independent of llguidance."""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def expr() -> None:
        nonlocal pos
        term()
        while peek() in ("+", "-"):
            pos += 1
            term()

    def term() -> None:
        nonlocal pos
        factor()
        while peek() in ("*", "/"):
            pos += 1
            factor()

    def factor() -> None:
        nonlocal pos
        if peek() == "(":
            pos += 1
            expr()
            if peek() != ")":
                raise ValueError(f"expected ')' at {pos} in {text!r}")
            pos += 1
        elif peek().isdigit():
            while peek().isdigit():
                pos += 1
        else:
            raise ValueError(f"expected a factor at {pos} in {text!r}")

    expr()
    if pos != len(text):
        raise ValueError(f"trailing text at {pos} in {text!r}")


# --- helpers -------------------------------------------------------------------------------------------
class Vocab:
    """A tokenizer with its token bytes and special ids listed once (the brute force reads them often)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.n = tokenizer.vocab_size
        self.bytes = [tokenizer.token_bytes(i) for i in range(self.n)]
        self.special = frozenset(i for i in range(self.n) if tokenizer.is_special(i))
        self.eog = frozenset(tokenizer.eog_ids)
        self.eog_array = np.array(sorted(self.eog))
        self.first_byte = np.array([b[0] if b else 256 for b in self.bytes])


def load_vocab(path: Path) -> Vocab:
    return Vocab(Tokenizer.from_gguf_metadata(GGUFFile(path).metadata))


@pytest.fixture(scope="module")
def tiny() -> Vocab:
    return load_vocab(FIXTURE)


@pytest.fixture(scope="module")
def smol(smollm2_path: Path) -> Vocab:
    return load_vocab(smollm2_path)


def allowed_ids(c: Constraint, n_logits: int) -> set[int]:
    logits = np.random.default_rng(n_logits).standard_normal(n_logits).astype(np.float32)
    before = logits.copy()
    c.mask_logits(logits)
    finite = np.isfinite(logits)
    # Allowed logits are left exactly as they were; the rest are -inf (never NaN, never +inf).
    assert np.array_equal(logits[finite], before[finite])
    assert np.all(logits[~finite] == -np.inf)
    return set(np.flatnonzero(finite).tolist())


def check_masks_by_brute_force(v: Vocab, gbnf: str, language: Iterable[str], walks: int, seed: int) -> None:
    """Walk random allowed tokens to the end; at every step compare the mask with the language's prefixes.

    A token is valid after the text so far when text + its bytes is a prefix of a sentence; the end
    tokens are valid when the text is a sentence. Where the grammar leaves a choice the mask must be
    exactly that set. Where the next bytes are forced, llguidance offers only the tokens of their
    canonical tokenization (so the model is not pushed into token sequences it never saw): there the
    mask must be a non-empty subset of the valid tokens.
    """
    sentences = {s.encode() for s in language}
    prefixes = {s[:k] for s in sentences for k in range(len(s) + 1)}
    rng = np.random.default_rng(seed)
    seen = {"choice": 0, "forced": 0}
    for _ in range(walks):
        c = Constraint.from_grammar(gbnf, v.tok)
        text = b""
        while True:
            allowed = allowed_ids(c, v.n + 13)  # the model's output may be wider than the vocabulary
            assert all(i < v.n for i in allowed)
            valid = {i for i in range(v.n) if i not in v.special and text + v.bytes[i] in prefixes}
            if text in sentences:
                valid |= v.eog
            next_bytes = {s[len(text)] for s in prefixes if len(s) > len(text) and s.startswith(text)}
            forced = text not in sentences and len(next_bytes) == 1
            bad = sorted(allowed - valid)
            assert not bad, f"after {text!r} the mask allows invalid tokens {[v.bytes[i] for i in bad[:10]]}"
            if forced:
                assert allowed, f"nothing allowed after {text!r}"
            else:
                missing = sorted(valid - allowed)
                assert not missing, f"after {text!r} the mask misses {[v.bytes[i] for i in missing[:10]]}"
            seen["forced" if forced else "choice"] += 1
            assert c.is_accepting() == (text in sentences)
            assert c.is_finished() == (text in sentences and not next_bytes)
            token = int(rng.choice(sorted(allowed)))
            c.accept(token)
            if token in v.eog:
                break
            text += v.bytes[token]
    assert seen["choice"] > 0 and seen["forced"] > 0


def walk(
    c: Constraint,
    v: Vocab,
    rng: np.random.Generator,
    end_bias: float = 0.5,
    damp: bytes = b"",
    limit: int = 3000,
) -> str:
    """Random allowed tokens until an end token; returns the text generated.

    Each step ends with probability ``end_bias`` when it may; otherwise it draws a first byte among
    those the allowed tokens start with (bytes in ``damp`` at a quarter of the weight), then a token
    with that first byte (those containing a ``damp`` byte at a tenth). Drawing by first byte keeps
    walks short and varied: a string ends within a few hundred steps rather than after the thousands a
    uniform draw over the vocabulary would take; damping "(" keeps nesting from running away.
    """
    ids: list[int] = []
    logits = np.empty(v.n, np.float32)
    for _ in range(limit):
        logits.fill(0.0)
        c.mask_logits(logits)
        allowed = np.flatnonzero(logits == 0.0)
        assert allowed.size and np.all(logits[logits != 0.0] == -np.inf)
        is_end = np.isin(allowed, v.eog_array)
        ends, others = allowed[is_end], allowed[~is_end]
        if c.is_finished():
            assert not others.size, "a finished grammar must allow only end tokens"
        if ends.size and (not others.size or rng.random() < end_bias):
            c.accept(int(ends[0]))
            assert c.is_accepting()
            return v.tok.decode(ids)
        firsts = v.first_byte[others]
        choices = np.unique(firsts)
        weights = np.where(np.isin(choices, np.frombuffer(damp, np.uint8)), 0.25, 1.0)
        first = rng.choice(choices, p=weights / weights.sum())
        group = others[firsts == first]
        if damp:
            weights = np.array([0.1 if any(b in v.bytes[i] for b in damp) else 1.0 for i in group])
            token = int(rng.choice(group, p=weights / weights.sum()))
        else:
            token = int(rng.choice(group))
        c.accept(token)
        ids.append(token)
    raise AssertionError(f"no end after {limit} tokens: {v.tok.decode(ids)[:200]!r}")


# --- the vocabulary llguidance sees ----------------------------------------------------------------------
def check_same_bytes(v: Vocab) -> None:
    llt = _compiled_for(v.tok).tokenizer
    assert llt.vocab_size == v.n
    assert sorted(llt.eos_tokens) == sorted(v.eog)
    for i in range(v.n):
        if i in v.special:
            assert llt.is_special_token(i), i
        elif v.bytes[i] == b"\xff":
            # llguidance marks special tokens internally with a leading 0xFF byte, so the lone byte
            # 0xFF reads as special there. It is never valid UTF-8, so no grammar could allow it anyway.
            assert llt.is_special_token(i)
        else:
            assert llt.decode_bytes([i]) == v.bytes[i], (i, llt.decode_bytes([i]), v.bytes[i])


def test_library_sees_exact_token_bytes(tiny: Vocab) -> None:
    check_same_bytes(tiny)


@pytest.mark.slow
def test_library_sees_exact_token_bytes_smollm2(smol: Vocab) -> None:
    check_same_bytes(smol)


# --- masks by brute force --------------------------------------------------------------------------------
@pytest.mark.parametrize(("gbnf", "language"), [(WORDS_GBNF, WORDS), (UNICODE_GBNF, UNICODE)], ids=["ascii", "utf8"])
def test_masks_allow_exactly_the_valid_tokens(tiny: Vocab, gbnf: str, language: list[str]) -> None:
    check_masks_by_brute_force(tiny, gbnf, language, walks=15, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize(("gbnf", "language"), [(WORDS_GBNF, WORDS), (UNICODE_GBNF, UNICODE)], ids=["ascii", "utf8"])
def test_masks_allow_exactly_the_valid_tokens_smollm2(smol: Vocab, gbnf: str, language: list[str]) -> None:
    check_masks_by_brute_force(smol, gbnf, language, walks=8, seed=2)


# --- random walks to completion ----------------------------------------------------------------------------
def check_walks(v: Vocab, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(n):
        parse_arith(walk(Constraint.from_grammar(ARITH_GBNF, v.tok), v, rng, end_bias=0.1, damp=b"("))
    for _ in range(n):
        text = walk(Constraint.from_json_schema(SCHEMA, v.tok), v, rng)
        jsonschema.validate(json.loads(text), SCHEMA)
    for _ in range(n):
        assert isinstance(json.loads(walk(Constraint.from_json_schema(None, v.tok), v, rng)), dict)


def test_random_walks_give_valid_output(tiny: Vocab) -> None:
    check_walks(tiny, n=6, seed=3)


@pytest.mark.slow
def test_random_walks_give_valid_output_smollm2(smol: Vocab) -> None:
    check_walks(smol, n=8, seed=4)


def test_json_schema_as_text_and_unicode_strings(tiny: Vocab) -> None:
    schema = {
        "type": "object",
        "properties": {"s": {"const": "naïve 日本"}},
        "required": ["s"],
        "additionalProperties": False,
    }
    rng = np.random.default_rng(5)
    for _ in range(3):
        assert json.loads(walk(Constraint.from_json_schema(json.dumps(schema), tiny.tok), tiny, rng)) == {
            "s": "naïve 日本"
        }


def test_json_whitespace_is_bounded(tiny: Vocab) -> None:
    # After "{" at most one newline-and-indent run (or one space) may come before the key.
    c = Constraint.from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, tiny.tok)
    for token in tiny.tok.encode("{\n\n" + " " * 20, add_special=False):
        c.accept(token)
    allowed = allowed_ids(c, tiny.n)
    assert allowed, "the key or the closing brace must still be allowed"
    assert not [tiny.bytes[i] for i in allowed if tiny.bytes[i][:1] in (b" ", b"\t", b"\n")]


# --- end of generation -----------------------------------------------------------------------------------------
def test_end_tokens_only_where_the_grammar_ends(tiny: Vocab) -> None:
    c = Constraint.from_grammar('root ::= "ab" [0-9]?', tiny.tok)
    with pytest.raises(BadRequestError, match="incomplete"):
        c.accept(tiny.tok.eos_id)
    for token in tiny.tok.encode("ab", add_special=False):
        c.accept(token)
    assert c.is_accepting() and not c.is_finished()
    assert tiny.eog <= allowed_ids(c, tiny.n)
    c.accept(tiny.tok.encode("7", add_special=False)[0])
    assert c.is_finished()
    assert allowed_ids(c, tiny.n) == set(tiny.eog)
    c.accept(tiny.tok.eos_id)
    with pytest.raises(BadRequestError, match="after the end"):
        c.accept(tiny.tok.eos_id)


@pytest.mark.slow
def test_every_end_token_ends_and_specials_never_appear_in_text_smollm2(smol: Vocab) -> None:
    assert smol.eog == {0, 2, 4}  # <|endoftext|>, <|im_end|>, <reponame>
    c = Constraint.from_json_schema({"type": "object", "properties": {"s": {"type": "string"}}}, smol.tok)
    for token in smol.tok.encode('{"s": "', add_special=False):
        c.accept(token)
    inside = allowed_ids(c, smol.n)
    assert not inside & smol.special and len(inside) > 40000  # any text, but never a control token
    for token in smol.tok.encode('x"}', add_special=False):
        c.accept(token)
    assert c.is_finished() and allowed_ids(c, smol.n) == {0, 2, 4}
    c.accept(2)


# --- accept() ---------------------------------------------------------------------------------------------------
def test_refused_token_leaves_the_state_usable(tiny: Vocab) -> None:
    c = Constraint.from_grammar(WORDS_GBNF, tiny.tok)
    before = allowed_ids(c, tiny.n)
    refused = next(i for i in range(tiny.n) if i not in before)
    with pytest.raises(BadRequestError, match=rf"^grammar: token {refused} .* is not allowed here"):
        c.accept(refused)
    assert allowed_ids(c, tiny.n) == before
    for token in tiny.tok.encode("no 5!", add_special=False):
        c.accept(token)
    assert c.is_finished()


@pytest.mark.parametrize("token", [-1, 1000, 10**9, 2.0, "3", True])
def test_accept_rejects_ids_outside_the_vocabulary(tiny: Vocab, token: object) -> None:
    c = Constraint.from_json_schema(None, tiny.tok)
    with pytest.raises(BadRequestError, match="^json_schema: token .* outside the vocabulary"):
        c.accept(token)  # type: ignore[arg-type]
    c.accept(np.int64(tiny.tok.encode("{", add_special=False)[0]))  # numpy ids are fine


def test_constraints_from_one_grammar_are_independent(tiny: Vocab) -> None:
    a = Constraint.from_grammar(WORDS_GBNF, tiny.tok)
    first = allowed_ids(a, tiny.n)
    for token in tiny.tok.encode("yes 1", add_special=False):
        a.accept(token)
    b = Constraint.from_grammar(WORDS_GBNF, tiny.tok)  # from the compiled-grammar cache
    assert allowed_ids(b, tiny.n) == first
    assert allowed_ids(a, tiny.n) != first


def test_mask_logits_checks_its_input(tiny: Vocab) -> None:
    c = Constraint.from_grammar(WORDS_GBNF, tiny.tok)
    with pytest.raises(ModelError, match="999 logits for a vocabulary of 1000"):
        c.mask_logits(np.zeros(999, np.float32))
    with pytest.raises(ModelError, match="float32"):
        c.mask_logits(np.zeros(1000, np.float64))
    with pytest.raises(ModelError, match="float32"):
        c.mask_logits(np.zeros((1, 1000), np.float32))


# --- bad grammars and schemas ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("gbnf", "message"),
    [
        ("root ::= foo", "Rule 'foo' not found"),
        ('item ::= "a"', "No 'root' rule found"),
        ("root ::= [a-", "Unexpected end of input"),
        ('root ::= "abc', "Unexpected end of input"),
        ("root = 'a'", "Expected ::="),
        ('root ::= "\\uZZ12"', "invalid escape"),
        ('root ::= "\\U00110000"', "not a Unicode scalar value"),
        ("", "empty"),
        ("%llguidance {}\nstart: foo", 'unknown name: "foo"'),  # Lark goes straight to llguidance's compiler
        (None, "must be a string"),
    ],
)
def test_bad_grammar_is_a_bad_request_naming_the_parameter(tiny: Vocab, gbnf: object, message: str) -> None:
    with pytest.raises(BadRequestError) as e:
        Constraint.from_grammar(gbnf, tiny.tok)  # type: ignore[arg-type]
    text = str(e.value)
    assert text.startswith("grammar: ") and "\n" not in text
    assert message in text


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ("{", "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        (3, "must be a JSON object, got int"),
        ({"type": "strnig"}, "strnig"),
        ({"type": "string", "format": "no-such-format"}, "no-such-format"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "nsatisfiable"),
    ],
)
def test_bad_schema_is_a_bad_request_naming_the_parameter(tiny: Vocab, schema: object, message: str) -> None:
    with pytest.raises(BadRequestError) as e:
        Constraint.from_json_schema(schema, tiny.tok)  # type: ignore[arg-type]
    text = str(e.value)
    assert text.startswith("json_schema: ") and "\n" not in text
    assert message in text


def test_gbnf_features(tiny: Vocab) -> None:
    # Features of llama.cpp's GBNF beyond the grammars above: comments, multi-line groups, negated
    # classes, bounded repetition, escapes, recursion (left and right) and empty alternatives.
    grammar = r"""
# a list of words, then a number
root  ::= (
    list          # left-recursive
    ws "=" ws num
  )
list  ::= list "," word | word
word  ::= [^,= \n\x00-\x1f]{1,4}
num   ::= "0" | [1-9] [0-9]{0,2}
ws    ::= | " " ws
"""
    rng = np.random.default_rng(6)
    for _ in range(10):
        text = walk(Constraint.from_grammar(grammar, tiny.tok), tiny, rng, end_bias=0.5)
        words, num = text.split("=")
        assert all(1 <= len(w) <= 4 for w in words.rstrip(" ").split(","))
        assert num.strip(" ").isdigit() and len(num.strip(" ")) <= 3


def test_llguidance_lark_grammars_pass_through(tiny: Vocab) -> None:
    # As in llama.cpp built with llguidance: a grammar starting with %llguidance is llguidance's Lark.
    grammar = '%llguidance {}\nstart: "n=" NUM ("," NUM)*\nNUM: /[1-9][0-9]{0,2}/'
    rng = np.random.default_rng(7)
    for _ in range(5):
        text = walk(Constraint.from_grammar(grammar, tiny.tok), tiny, rng)
        assert text.startswith("n=") and all(1 <= int(x) <= 999 for x in text[2:].split(","))
