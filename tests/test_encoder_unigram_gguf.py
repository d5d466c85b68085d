"""XLM-RoBERTa from GGUF, as llama.cpp's converter writes it (bge-m3, bge-reranker-v2-m3): ``tokenizer.ggml.model``
"t5" (a SentencePiece Unigram vocabulary) and position embeddings without RoBERTa's first ``pad_token_id + 1`` rows.
The fixtures' ``model-f32.gguf`` files are ``scripts/bert_to_gguf.py``'s, byte-identical to llama.cpp's converter
(its docstring says how that was checked); here their vocabularies are held to the folders' tokenizer (their hidden
states and scores against transformers' are in ``test_encoders.py``'s tables, ``xlmr-gguf-f32``). The
``Precompiled`` normaliser path uses ``tests/data/unigram_charsmap.json``, a charsmap compiled by SentencePiece
itself (``scripts/make_unigram_charsmap_data.py``)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from fuzz_support import rewrite_gguf
from gguf import GGUFValueType, GGUFWriter
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

import minfer
from minfer.errors import FormatError
from minfer.formats.encoder_tokenizer import tokenizer_from_gguf, unigram_from_gguf
from minfer.formats.gguf_file import GGUFFile

FIXTURES = Path(__file__).parent / "fixtures"
DATA = Path(__file__).parent / "data"
XLMR, XLMR_RERANK = FIXTURES / "xlmr", FIXTURES / "xlmr_rerank"

ODD_TEXTS = [
    "Café crème brûlée, naïve Zoë, Ångström, façade", "東京タワーと北京の中文字符", "한국어 텍스트",
    "emoji 😀🎉👍🏽 done",
    "ctrl\x00\x01\x07\x1b chars", "tab\there\nnewline\r\n", "a" * 300, "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "spaces   between     words  ", "  leading and trailing  ", "", " ", "   ", "<mask> and <s> </s> <pad> <unk>",
    "x <mask>y", "\u00a0nbsp\u3000ideographic space", "ＦＵＬＬ ｗｉｄｔｈ ﬁ ligature", "zero\u200bwidth\ufeffbom",
    "cafe\u0301 decomposed", "ⅷ ① ㎏ ＄", "RTL عربي עברית", "’quotes’ “double” «guillemets» …",
]


def _texts(folder: Path) -> list[str]:
    spec = json.loads((folder / "texts.json").read_text())
    return spec if isinstance(spec, list) else [spec["query"], *spec["documents"]]


# --- the tokenizer from the fixture's GGUF against the folder's tokenizer.json ------------------------------


@pytest.mark.parametrize("folder", [XLMR, XLMR_RERANK], ids=["xlmr", "xlmr_rerank"])
def test_gguf_ids_equal_the_folders_tokenizer(folder):
    ours = tokenizer_from_gguf(GGUFFile(folder / "model-f32.gguf"))
    theirs = Tokenizer.from_file(str(folder / "tokenizer.json"))
    texts = _texts(folder) + ODD_TEXTS
    for t in texts:
        for special in (True, False):
            assert ours.encode(t, add_special_tokens=special).ids == theirs.encode(t, add_special_tokens=special).ids, t
    for a, b in zip(texts, texts[1:], strict=False):  # pairs: <s> A </s> </s> B </s>
        got, want = ours.encode(a, b), theirs.encode(a, b)
        assert (got.ids, got.type_ids) == (want.ids, want.type_ids)
    some = theirs.encode("Café 東京 words").ids
    assert ours.decode(some) == theirs.decode(some)


# --- a vocabulary with a precompiled charsmap -----------------------------------------------------------------

CHARSMAP = json.loads((DATA / "unigram_charsmap.json").read_text(encoding="utf-8"))
GGUF_TYPES = {"normal": 1, "unknown": 2, "control": 3}


def _vocab_gguf(path: Path, charsmap: bool = True, remove_extra_whitespaces: bool = False) -> GGUFFile:
    """A GGUF holding only the "t5" vocabulary of ``unigram_charsmap.json`` (<unk> 0, <s> 1, </s> 2)."""
    w = GGUFWriter(str(path), "bert")
    w.add_tokenizer_model("t5")
    w.add_tokenizer_pre("default")
    w.add_token_list([p for p, _ in CHARSMAP["pieces"]])
    w.add_token_scores([float(s) for _, s in CHARSMAP["pieces"]])
    w.add_token_types([GGUF_TYPES[k] for k in CHARSMAP["kinds"]])
    w.add_add_space_prefix(True)
    w.add_remove_extra_whitespaces(remove_extra_whitespaces)
    if charsmap:
        w.add_precompiled_charsmap(base64.b64decode(CHARSMAP["charsmap"]))
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


def _reference(charsmap: bool) -> Tokenizer:
    """What transformers' converter makes of such a SentencePiece model: Precompiled + Metaspace + Unigram."""
    tok = Tokenizer(models.Unigram([(p, s) for p, s in CHARSMAP["pieces"]], 0, False))
    if charsmap:
        tok.normalizer = normalizers.Precompiled(base64.b64decode(CHARSMAP["charsmap"]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    return tok


def test_a_charsmap_gives_a_precompiled_normalizer_with_the_same_ids(tmp_path):
    tok = unigram_from_gguf(_vocab_gguf(tmp_path / "v.gguf"))
    assert "Precompiled" in json.dumps(json.loads(tok.to_str())["normalizer"])
    ref = _reference(charsmap=True)
    texts = CHARSMAP["texts"] + ODD_TEXTS
    for t in texts:
        assert tok.encode(t, add_special_tokens=False).ids == ref.encode(t).ids, t
    assert tok.encode("ＦＵＬＬ ﬁ").ids[0] == 1 and tok.encode("ＦＵＬＬ ﬁ").ids[-1] == 2  # <s> .. </s>
    # the charsmap does something: full-width letters and ligatures become ASCII, as without it they are unknown
    plain = unigram_from_gguf(_vocab_gguf(tmp_path / "plain.gguf", charsmap=False))
    assert tok.normalizer.normalize_str("ＦＵＬＬ ﬁ") == "FULL fi"
    odd = "ＦＵＬＬ ﬁ"
    assert plain.encode(odd, add_special_tokens=False).ids != tok.encode(odd, add_special_tokens=False).ids
    assert all(plain.encode(t, add_special_tokens=False).ids == _reference(charsmap=False).encode(t).ids for t in texts)


def test_remove_extra_whitespaces_gives_sentencepieces_own_ids(tmp_path):
    """With ``remove_extra_whitespaces`` (a GGUF converted from a ``sentencepiece.bpe.model``), spaces are merged
    and stripped as SentencePiece (and llama.cpp) do: ids equal to the ``sentencepiece`` library's own."""
    tok = unigram_from_gguf(_vocab_gguf(tmp_path / "v.gguf", remove_extra_whitespaces=True))
    want = CHARSMAP["sentencepiece_ids"]
    assert len(want) == len(CHARSMAP["texts"])
    for t, ids in zip(CHARSMAP["texts"], want, strict=True):
        assert tok.encode(t, add_special_tokens=False).ids == ids, t
    assert tok.encode("  a   b  ", add_special_tokens=False).ids == tok.encode("a b", add_special_tokens=False).ids


# --- what is refused ----------------------------------------------------------------------------------------




def test_another_tokenizer_model_is_a_one_line_error(tmp_path):
    path = tmp_path / "gpt2.gguf"
    rewrite_gguf(XLMR / "model-f32.gguf", path, {"tokenizer.ggml.model": ("gpt2", GGUFValueType.STRING, None)})
    with pytest.raises(FormatError) as e:
        minfer.load(path)
    msg = str(e.value)
    assert "tokenizer.ggml.model is 'gpt2'" in msg and "'bert'" in msg and "'t5'" in msg and "\n" not in msg
