"""The GGUF tokenizer against transformers' tokenizer for the same files.

References are in tests/data/tokenizer_refs/, written by scripts/make_tokenizer_refs.py from
``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` (transformers 5.24.0, tokenizers 0.23.3).

Where llama.cpp would tokenize differently from transformers we follow transformers; the cases:

* ``pre = "default"`` (our three fixtures): llama.cpp splits with four regexes in turn, e.g. " (" and
  "1234" come apart; transformers (and the fixtures' own tokenizer.json) use GPT-2's regex.
* ``pre = "smollm"``: llama.cpp isolates digits before GPT-2's regex, like SmolLM2's original
  tokenizer.json; transformers does not. SmolLM2's vocabulary has no token that joins a digit to
  another character, so only whitespace before a digit can tell: in "b  42" (in TEXTS)
  transformers gives "b" "Ġ" "Ġ" "4" "2" and llama.cpp "b" "ĠĠ" "4" "2"; in " ½" (in the "Mixed"
  text) transformers merges the space with the first UTF-8 byte of "½" ("ĠÂ" "½") where llama.cpp
  has "Ġ" then "½"'s two byte tokens.
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer

from minfer.errors import BadRequestError, FormatError
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.tokenizer import SUPPORTED_PRE_TYPES, Tokenizer

TESTS = Path(__file__).resolve().parent
REFS = TESTS / "data" / "tokenizer_refs"
FIXTURES = TESTS / "fixtures"
FIXTURE_MODELS = ("llama", "qwen2", "qwen3", "gemma3")


@cache
def read_metadata(path: str) -> dict[str, Any]:
    return GGUFFile(path).metadata


@cache
def refs(name: str) -> dict[str, Any]:
    return json.loads((REFS / f"{name}.json").read_text(encoding="utf-8"))


@cache
def fixture_tokenizer(model: str, pre: str | None = None) -> Tokenizer:
    metadata = read_metadata(str(FIXTURES / model / "model-f32.gguf"))
    if pre is not None:
        metadata = {**metadata, "tokenizer.ggml.pre": pre}
    return Tokenizer.from_gguf_metadata(metadata, source=model)


def stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> tuple[list[str], str]:
    detok = tok.detokenizer(skip_special=skip_special)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces, "".join(pieces)


def check_case(tok: Tokenizer, case: dict[str, Any]) -> None:
    text = case["text"]
    assert tok.encode(text) == case["ids"], text
    assert tok.encode(text, add_special=False) == case["ids_no_special"], text
    plain = case.get("ids_no_parse_special", case["ids_no_special"])
    assert tok.encode(text, add_special=False, parse_special=False) == plain, text
    assert tok.decode(case["ids"]) == case["decoded"], text
    assert tok.decode(case["ids"], skip_special=True) == case["decoded_skip_special"], text
    assert stream(tok, case["ids"])[1] == case["decoded"], text
    assert stream(tok, case["ids"], skip_special=True)[1] == case["decoded_skip_special"], text


def check_described(tok: Tokenizer, described: dict[str, Any]) -> None:
    assert tok.bos_id == described["bos_id"]
    assert tok.eos_id == described["eos_id"]
    assert tok.add_bos == described["add_bos_token"]
    assert tok.add_eos == described["add_eos_token"]


# --- the three tiny fixtures ------------------------------------------------------------------------
@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_fixture_matches_transformers(model: str) -> None:
    ref = refs(model)
    tok = fixture_tokenizer(model)
    check_described(tok, ref["tokenizer"])
    assert tok.vocab_size == len(read_metadata(str(FIXTURES / model / "model-f32.gguf"))["tokenizer.ggml.tokens"])
    assert len(ref["cases"]) >= 30
    for case in ref["cases"]:
        check_case(tok, case)


@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_fixture_tokens_json_cases(model: str) -> None:
    # tokens.json was made by transformers from the fixture's hf/ folder. For qwen2 that loads
    # Qwen2Tokenizer, which re-splits with Qwen2's regex whatever tokenizer.json says, while the
    # GGUF says pre "default" (GPT-2's regex): " 123" is "Ġ1" "2" "3" from the GGUF and "Ġ" "1" "2"
    # "3" from the folder. With pre "qwen2" we get the folder's ids.
    tok = fixture_tokenizer(model, pre="qwen2" if model == "qwen2" else None)
    cases = json.loads((FIXTURES / model / "tokens.json").read_text(encoding="utf-8"))["tokenizer_cases"]
    for case in cases:
        ids = tok.encode(case["text"])
        assert ids == case["ids_with_bos"], case["text"]
        assert tok.decode(ids, skip_special=True) == case["decoded_without_specials"]


@pytest.mark.parametrize("model", FIXTURE_MODELS)
def test_fixture_matches_its_tokenizer_json(model: str) -> None:
    # The fixture's tokenizer.json run by `tokenizers` itself (GPT-2 regex, BOS post-processor).
    hf = HFTokenizer.from_file(str(FIXTURES / model / "hf" / "tokenizer.json"))
    tok = fixture_tokenizer(model)
    for case in refs(model)["cases"]:
        assert tok.encode(case["text"]) == hf.encode(case["text"]).ids, case["text"]


# --- SentencePiece-style vocabularies (tokenizer.ggml.model = "llama") ---------------------------------
def spm_llama_metadata() -> dict[str, Any]:
    """The gemma3 fixture's vocabulary as if a llama-architecture file carried it (without Gemma's
    add_space_prefix = false, as a Llama 2 file)."""
    metadata = dict(read_metadata(str(FIXTURES / "gemma3" / "model-f32.gguf")))
    metadata["general.architecture"] = "llama"
    del metadata["tokenizer.ggml.add_space_prefix"]
    return metadata


def test_gemma3_fixture_vocabulary() -> None:
    tok = fixture_tokenizer("gemma3")
    assert (tok.model, tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == ("llama", 2, 1, True, False)
    assert tok.eog_ids == frozenset({1, 6})  # <eos>, and <end_of_turn> by its text (llama.cpp's rule)
    assert tok.strip_first_space is False  # Gemma: no prefix space
    assert tok.token_text(9) == "  " and tok.token_bytes(9) == b"  "  # a run of spaces, stored as spaces
    assert tok.token_bytes(10 + 0x41) == b"A"  # byte tokens <0x00>.. start at id 10
    assert tok.token_text(10 + 0x41) == "<0x41>"
    assert tok.encode(" x", add_special=False) == tok.encode("\u2581x", add_special=False)  # ▁ is the space
    assert tok.decode(tok.encode("  two  spaces ")) == "<bos>  two  spaces "
    assert tok.is_special(5) and not tok.is_special(7)  # <start_of_turn> control; "\n" user-defined


def test_spm_llama_style_matches_transformers() -> None:
    # another architecture: transformers' LlamaTokenizer shape (prefix space, merges by score, decoder
    # strips the prefix space again)
    ref = refs("spm_llama")
    tok = Tokenizer.from_gguf_metadata(spm_llama_metadata(), source="spm-llama")
    check_described(tok, ref["tokenizer"])
    assert tok.strip_first_space is True
    assert len(ref["cases"]) >= 30
    for case in ref["cases"]:
        check_case(tok, case)


def test_spm_add_space_prefix_false_follows_llama_cpp() -> None:
    # transformers does not read tokenizer.ggml.add_space_prefix (it always prefixes a Llama-style
    # vocabulary); llama.cpp does, and so do we: no ▁ before the text, and none stripped when decoding
    metadata = {**spm_llama_metadata(), "tokenizer.ggml.add_space_prefix": False}
    plain = Tokenizer.from_gguf_metadata(metadata)
    prefixed = Tokenizer.from_gguf_metadata(spm_llama_metadata())
    assert plain.strip_first_space is False
    ids = plain.encode("the cat", add_special=False)
    assert not plain.token_text(ids[0]).startswith("\u2581")
    assert prefixed.token_text(prefixed.encode("the cat", add_special=False)[0]).startswith("\u2581")
    assert plain.decode(ids) == "the cat" == prefixed.decode(prefixed.encode("the cat", add_special=False))
    assert stream(plain, ids)[1] == "the cat"


def test_spm_stream_splits_a_character_across_byte_tokens() -> None:
    tok = fixture_tokenizer("gemma3")
    ids = tok.encode("日", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["<0xE6>", "<0x97>", "<0xA5>"]  # byte fallback
    detok = tok.detokenizer()
    assert [detok.push(i) for i in ids] == ["", "", "日"]
    assert detok.flush() == ""
    # a Llama-style stream drops the one prefix space, once, where the text starts
    llama = Tokenizer.from_gguf_metadata(spm_llama_metadata())
    ids = llama.encode("日 and 日", add_special=False)
    pieces, joined = stream(llama, ids)
    assert joined == "日 and 日" == llama.decode(ids)
    assert llama.token_text(ids[0]) == "\u2581"  # the prefix space, then the byte tokens of 日
    assert pieces[:4] == ["", "", "", "日"]


def test_spm_stream_matches_decode() -> None:
    """Streaming equals decode() for any ids, except inside a run of byte tokens that is not valid UTF-8,
    where decode() (tokenizers' ByteFallback) writes one U+FFFD per byte of the run and the stream,
    which may already have released the run's valid characters, one per invalid sequence."""
    for tok in (fixture_tokenizer("gemma3"), Tokenizer.from_gguf_metadata(spm_llama_metadata())):
        byte_ids = {i for i in range(tok.vocab_size) if tok.token_text(i).startswith("<0x")}
        rng = random.Random(0)
        others = [i for i in range(tok.vocab_size) if i not in byte_ids]
        for _ in range(200):
            ids = [rng.choice(others) for _ in range(rng.randrange(0, 12))]
            text = "".join(rng.choice("aé日😀 \n") for _ in range(rng.randrange(0, 4)))
            ids[rng.randrange(len(ids) + 1) :] = tok.encode(text, add_special=False) + ids[len(ids) // 2 :]
            for skip in (False, True):
                assert stream(tok, ids, skip_special=skip)[1] == tok.decode(ids, skip_special=skip), ids
    tok = fixture_tokenizer("gemma3")
    e6, b97, a = 10 + 0xE6, 10 + 0x97, tok.encode("a", add_special=False)[0]
    assert tok.decode([e6, a]) == "\ufffda" == stream(tok, [e6, a])[1]
    assert tok.decode([e6, b97, a]) == "\ufffd\ufffda"  # one per byte of the invalid run
    assert stream(tok, [e6, b97, a])[1] == "\ufffda"  # one per invalid sequence


# --- pre-tokenizers and token types on varied vocabularies -------------------------------------------
def variant_cases(data: dict[str, Any], variant: dict[str, Any]) -> list[dict[str, Any]]:
    while "cases" not in variant:
        variant = next(v for v in data["variants"] if v["name"] == variant["same_as"])
    return [{"text": text, **case} for text, case in zip(data["texts"], variant["cases"], strict=True)]


def variant_tokenizer(data: dict[str, Any], variant: dict[str, Any]) -> Tokenizer:
    metadata = dict(read_metadata(str(TESTS.parent / data["base_gguf"])))
    metadata.update(data.get("vocabulary", {}))
    for key, value in variant["overrides"].items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    if variant["token_types"]:
        types = list(metadata["tokenizer.ggml.token_type"])
        for index, kind in variant["token_types"].items():
            types[int(index)] = kind
        metadata["tokenizer.ggml.token_type"] = types
    return Tokenizer.from_gguf_metadata(metadata, source=variant["name"])


def test_pre_types_cover_supported_names() -> None:
    names = {v["overrides"]["tokenizer.ggml.pre"] for v in refs("pre_types")["variants"]}
    assert names == set(SUPPORTED_PRE_TYPES)


@pytest.mark.parametrize("variant", [v["name"] for v in refs("pre_types")["variants"]])
def test_pre_type_matches_transformers(variant: str) -> None:
    # A synthetic vocabulary whose merges cross every boundary where the regexes differ; the
    # references fall into six groups (GPT-2, Llama 3, Qwen2, Qwen 3.5, GPT-4o, Tekken).
    data = refs("pre_types")
    spec = next(v for v in data["variants"] if v["name"] == variant)
    tok = variant_tokenizer(data, spec)
    for case in variant_cases(data, spec):
        assert tok.encode(case["text"], add_special=False) == case["ids_no_special"], case["text"]


def test_pre_type_groups_differ() -> None:
    # Guards the reference itself: if two groups gave the same ids, a wrong mapping could pass.
    data = refs("pre_types")
    groups = [v for v in data["variants"] if "cases" in v]
    assert len(groups) == 6
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            assert a["cases"] != b["cases"]


@pytest.mark.parametrize("variant", [v["name"] for v in refs("token_types")["variants"]])
def test_token_types_match_transformers(variant: str) -> None:
    # User-defined tokens ("the", "Ġand", "ing") are matched whole anywhere in the text, even with
    # parse_special off, and survive skip_special; a control "the" is matched only when parsing
    # special tokens, and is skipped by skip_special.
    data = refs("token_types")
    spec = next(v for v in data["variants"] if v["name"] == variant)
    tok = variant_tokenizer(data, spec)
    check_described(tok, spec["tokenizer"])
    for case in variant_cases(data, spec):
        check_case(tok, case)


# --- SmolLM2 ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_metadata(smollm2_path: Path) -> dict[str, Any]:
    return GGUFFile(smollm2_path).metadata


@pytest.fixture(scope="module")
def smollm2(smollm2_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm2_metadata, source="SmolLM2")


@pytest.fixture(scope="module")
def gemma3_270m(gemma3_270m_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(gemma3_270m_path).metadata, source="Gemma 3 270M")


@pytest.mark.slow
def test_gemma3_270m_matches_transformers(gemma3_270m: Tokenizer) -> None:
    """Gemma 3 270M's 262144-piece vocabulary: ids, decoding and streaming identical to transformers' tokenizer
    for the same GGUF on the varied text set (ASCII, runs of spaces, newlines and tabs, digits, code, accents,
    CJK, Arabic, Devanagari, emoji, control tokens such as <start_of_turn> written in the text)."""
    ref = refs("gemma3_270m")
    check_described(gemma3_270m, ref["tokenizer"])
    assert gemma3_270m.vocab_size == ref["tokenizer"]["vocab_size"] == 262144
    assert len(ref["cases"]) >= 35
    for case in ref["cases"]:
        check_case(gemma3_270m, case)
    # <eos>, <end_of_turn> and "</s>" (a user-defined token, by its text): llama.cpp's llama_vocab_is_eog
    # gives the same three ids for this file
    assert gemma3_270m.eog_ids == frozenset({1, 106, 212})
    assert gemma3_270m.encode("<start_of_turn>user\nhi<end_of_turn>") == [2, 105, 2364, 107, 2202, 106]


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2: Tokenizer) -> None:
    ref = refs("smollm2")
    check_described(smollm2, ref["tokenizer"])
    assert smollm2.vocab_size == ref["tokenizer"]["vocab_size"] == 49152
    assert smollm2.pre == "smollm"
    for case in ref["cases"]:
        check_case(smollm2, case)


@pytest.mark.slow
def test_smollm2_specials(smollm2: Tokenizer) -> None:
    # llama.cpp's loader: EOS <|im_end|> (2), <|endoftext|> (0) by its text, and <reponame> (4),
    # which it takes for the fill-in-the-middle repo token.
    assert smollm2.eog_ids == frozenset({0, 2, 4})
    assert smollm2.token_text(1) == "<|im_start|>"
    assert smollm2.token_text(260) == "Ġthe"
    chat = "<|im_start|>user\nhi<|im_end|>\n"
    assert smollm2.encode(chat) == [1, 4093, 198, 6004, 2, 198]
    assert 1 not in smollm2.encode(chat, parse_special=False)
    # The two-space run before a digit is where llama.cpp would differ (see the module docstring).
    assert smollm2.encode("b  42", add_special=False) == [82, 216, 216, 36, 34]


@pytest.mark.slow
def test_smollm2_streaming_holds_back_partial_characters(smollm2: Tokenizer) -> None:
    text = "Emoji 😀 and 北京 and 👨\u200d👩\u200d👧"
    ids = smollm2.encode(text, add_special=False)
    pieces, joined = stream(smollm2, ids)
    assert joined == text == smollm2.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces[:-1]  # some byte tokens completed no character on their own


# --- streaming ----------------------------------------------------------------------------------------
def test_stream_splits_a_character_across_byte_tokens() -> None:
    tok = fixture_tokenizer("llama")
    ids = tok.encode("😀", add_special=False)
    assert len(ids) == 4  # the tiny vocabulary has only the four byte tokens
    detok = tok.detokenizer()
    assert [detok.push(i) for i in ids] == ["", "", "", "😀"]
    assert detok.flush() == ""


def test_stream_flush_and_invalid_bytes_match_decode() -> None:
    tok = fixture_tokenizer("qwen3")
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 12))]
        for skip in (False, True):
            assert stream(tok, ids, skip_special=skip)[1] == tok.decode(ids, skip_special=skip), ids
    # A truncated character comes out as U+FFFD at the end, as decode() has it.
    ids = tok.encode("😀", add_special=False)[:3]
    detok = tok.detokenizer()
    assert [detok.push(i) for i in ids] == ["", "", ""]
    assert detok.flush() == "\ufffd" == tok.decode(ids)


# --- attributes and errors ------------------------------------------------------------------------------
def test_fixture_attributes() -> None:
    tok = fixture_tokenizer("llama")
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (0, 1, True, False)
    assert tok.eog_ids == frozenset({1})
    assert tok.token_text(0) == "<|bos|>"
    assert tok.is_special(0) and not tok.is_special(50)
    assert tok.encode("") == [0]
    assert tok.encode("", add_special=False) == []
    assert tok.decode([]) == ""
    with pytest.raises(BadRequestError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(BadRequestError):
        tok.token_text(-1)
    with pytest.raises(BadRequestError, match="string"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def small_metadata(**changes: Any) -> dict[str, Any]:
    metadata = dict(read_metadata(str(FIXTURES / "llama" / "model-f32.gguf")))
    for key, value in changes.items():
        key = "tokenizer.ggml." + key
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    return metadata


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": "bert"}, r"unsupported tokenizer.ggml.model 'bert'; supported: gpt2, llama"),
        ({"model": "llama"}, r"missing tokenizer.ggml.scores"),
        ({"model": "llama", "scores": [0.5, 1]}, r"tokenizer.ggml.scores must be 512 numbers"),
        ({"model": None}, r"missing tokenizer.ggml.model"),
        ({"pre": "deepseek-llm"}, r"unsupported tokenizer.ggml.pre 'deepseek-llm'; supported: .*smollm"),
        ({"tokens": None}, r"missing tokenizer.ggml.tokens"),
        ({"merges": None}, r"missing tokenizer.ggml.merges"),
        ({"merges": ["a b c"]}, r"tokenizer.ggml.merges\[0\]"),
        ({"bos_token_id": 10_000}, r"tokenizer.ggml.bos_token_id = 10000 is outside"),
        ({"bos_token_id": None}, r"add_bos_token is true, but tokenizer.ggml.bos_token_id is not set"),
        ({"token_type": [1, 2]}, r"tokenizer.ggml.token_type"),
    ],
)
def test_format_errors(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(FormatError, match=message) as err:
        Tokenizer.from_gguf_metadata(small_metadata(**changes), source="x.gguf")
    assert str(err.value).startswith("x.gguf: ")
    assert "\n" not in str(err.value)


def test_add_bos_default_follows_llama_cpp() -> None:
    # Without tokenizer.ggml.add_bos_token llama.cpp adds BOS for the Llama 3 family (and Tekken)
    # only. transformers would add none; the file key, when present, decides for both.
    assert Tokenizer.from_gguf_metadata(small_metadata(add_bos_token=None)).add_bos is False
    llama3 = Tokenizer.from_gguf_metadata(small_metadata(add_bos_token=None, pre="llama-bpe"))
    assert llama3.add_bos is True and llama3.encode("a")[0] == 0
    assert Tokenizer.from_gguf_metadata(small_metadata(add_bos_token=False, pre="llama-bpe")).add_bos is False
    with_eos = Tokenizer.from_gguf_metadata(small_metadata(add_eos_token=True))
    assert with_eos.encode("a") == [0, with_eos.encode("a", add_special=False)[0], 1]


def test_missing_pre_means_default() -> None:
    assert Tokenizer.from_gguf_metadata(small_metadata(pre=None)).pre == "default"


def with_tokens(metadata: dict[str, Any], extra: dict[str, int]) -> dict[str, Any]:
    """``metadata`` with tokens (text -> type) appended to the vocabulary."""
    return {
        **metadata,
        "tokenizer.ggml.tokens": [*metadata["tokenizer.ggml.tokens"], *extra],
        "tokenizer.ggml.token_type": [*metadata["tokenizer.ggml.token_type"], *extra.values()],
    }


def test_eog_ids_follow_llama_cpp() -> None:
    names = ["<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|end|>", "<|return|>", "<|call|>", "<|x|>"]
    metadata = with_tokens(small_metadata(), {name: 3 for name in names})
    first = len(small_metadata()["tokenizer.ggml.tokens"])
    ids = {name: first + i for i, name in enumerate(names)}
    metadata["tokenizer.ggml.eot_token_id"] = ids["<|x|>"]
    tok = Tokenizer.from_gguf_metadata(metadata)
    # EOS, EOT, the end texts and the FIM pad; <|end|> is dropped because <|return|> and <|call|>
    # are there (gpt-oss keeps generating after it).
    expected = {1} | {ids[n] for n in names if n != "<|end|>"}
    assert tok.eog_ids == frozenset(expected)
    without_call = dict(metadata, **{"tokenizer.ggml.eot_token_id": None})
    without_call["tokenizer.ggml.tokens"] = [
        t if t != "<|call|>" else "<|y|>" for t in metadata["tokenizer.ggml.tokens"]
    ]
    tok = Tokenizer.from_gguf_metadata(without_call)
    assert ids["<|end|>"] in tok.eog_ids and ids["<|x|>"] not in tok.eog_ids


def test_control_token_outside_byte_alphabet_is_left_out() -> None:
    # transformers takes a control token spelled with characters a byte-level vocabulary cannot
    # hold for a converter mislabel and does not add it: its text is tokenized as text.
    metadata = with_tokens(small_metadata(), {"<｜User｜>": 3, "<think>": 4})
    tok = Tokenizer.from_gguf_metadata(metadata)
    user, think = tok.vocab_size - 2, tok.vocab_size - 1
    assert user not in tok.encode("<｜User｜>")
    assert tok.token_text(user) == "<｜User｜>"
    assert tok.decode([user]) == "<｜User｜>"
    # A user-defined token is matched whole, even without special parsing, and is not special.
    assert tok.encode("a<think>b", add_special=False, parse_special=False)[1] == think
    assert tok.decode([think], skip_special=True) == "<think>"
