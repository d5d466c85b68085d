"""An encoder's tokenizer: a folder's ``tokenizer.json`` through the ``tokenizers`` library, with its own
post-processor adding the special tokens (BERT: ``[CLS] A [SEP]``, pairs ``[CLS] A [SEP] B [SEP]`` with token
types 0 and 1), so ids are transformers' and sentence-transformers' own.

A GGUF file's vocabulary is rebuilt as a ``tokenizers`` tokenizer (:func:`tokenizer_from_gguf`): BERT's WordPiece
(``tokenizer.ggml.model`` ``bert``) or XLM-RoBERTa's SentencePiece Unigram (``t5``: bge-m3, bge-reranker-v2-m3),
each as llama.cpp's converter writes it.

The file's own truncation and padding settings are switched off (all-MiniLM's ``tokenizer.json`` pads and
cuts everything to 128 tokens): a sequence longer than the model takes is either cut the way transformers
cuts it (``truncation=True``, "longest first" for pairs), when the caller asked for that, or refused with
its length named; never cut silently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from minfer.errors import BadRequestError, FormatError
from minfer.formats.gguf_file import GGUFFile

SPM_SPACE = "\u2581"  # "▁": llama.cpp's phantom space before a word-initial piece


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    token_types: list[int]
    truncated: int  # tokens cut away (0: the whole text)


class EncoderTokenizer:
    """Tokenizes single texts and (query, document) pairs into at most ``max_length`` tokens."""

    def __init__(self, tokenizer: Tokenizer, max_length: int) -> None:
        self._whole = tokenizer
        self._whole.no_truncation()
        self._whole.no_padding()
        self._cut = Tokenizer.from_str(self._whole.to_str())
        self._cut.enable_truncation(max_length)
        self.max_length = max_length
        self.vocab_size = self._whole.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], max_length: int) -> EncoderTokenizer:
        path = Path(path)
        if not path.is_file():
            raise FormatError(f"{path}: missing (an encoder folder needs its tokenizer.json)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the library's errors are Exception subclasses of its own
            raise FormatError(f"{path}: not a tokenizer.json the tokenizers library reads ({e})") from None
        return cls(tokenizer, max_length)

    def encode(self, text: str, pair: str | None = None, truncate: bool = False, what: str = "input") -> Encoded:
        """``text`` (and ``pair``) with the special tokens; longer than ``max_length``: cut where ``truncate``,
        else a :class:`BadRequestError` naming ``what`` and its length."""
        for value, name in ((text, what), (pair, "document")):
            if value is not None and not isinstance(value, str):
                raise BadRequestError(f"{name} must be a string, got {type(value).__name__}")
        whole = self._whole.encode(text, pair)
        n = len(whole.ids)
        if n <= self.max_length:
            return Encoded(list(whole.ids), list(whole.type_ids), 0)
        if not truncate:
            raise BadRequestError(f"{what} is {n} tokens, longer than the model's {self.max_length}; shorten it or "
                                  "ask for truncate: true")
        cut = self._cut.encode(text, pair)
        return Encoded(list(cut.ids), list(cut.type_ids), n - len(cut.ids))

    def decode(self, ids: list[int]) -> str:
        return self._whole.decode(ids)


GGUF_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL


def wordpiece_from_gguf(f: GGUFFile) -> Tokenizer:
    """The WordPiece tokenizer of a GGUF BERT (``tokenizer.ggml.model`` ``bert``) as the ``tokenizers`` library's:
    llama.cpp's converter wrote the vocabulary with "phantom spaces" (a word-initial piece ``w`` as ``▁w``, a
    continuation ``##w`` as ``w``, control tokens as they are), which is undone here; BERT's normaliser
    (lowercasing and accent stripping, as llama.cpp's WPM tokenizer always does), pre-tokenizer and template
    ``[CLS] A [SEP]`` / ``[CLS] A [SEP] B [SEP]`` with the file's ids."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    kind = f.get("tokenizer.ggml.model")
    if kind != "bert":
        raise FormatError(f"{f.path}: tokenizer.ggml.model is {kind!r}; an encoder's GGUF needs 'bert' (WordPiece)")
    tokens = f.require("tokenizer.ggml.tokens", list)
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise FormatError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for i, (tok, kind_id) in enumerate(zip(tokens, types, strict=True)):
        text = tok if kind_id == GGUF_CONTROL else tok[1:] if tok.startswith(SPM_SPACE) else "##" + tok
        vocab.setdefault(text, i)

    def special(key: str, fallback: str) -> tuple[str, int]:
        value = f.get(key)
        if value is None:
            value = vocab.get(fallback)
        if not isinstance(value, int) or not 0 <= value < len(tokens):
            raise FormatError(f"{f.path}: {key} is missing or outside the vocabulary ({value!r})")
        return tokens[value], value

    unk, _ = special("tokenizer.ggml.unknown_token_id", "[UNK]")
    cls_token = special("tokenizer.ggml.cls_token_id", "") if f.get("tokenizer.ggml.cls_token_id") is not None \
        else special("tokenizer.ggml.bos_token_id", "[CLS]")
    sep_token = special("tokenizer.ggml.seperator_token_id", "") if f.get("tokenizer.ggml.seperator_token_id") \
        is not None else special("tokenizer.ggml.eos_token_id", "[SEP]")
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=True,
                                                lowercase=bool(f.get("tokenizer.ggml.normalizer.lowercase", True)))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    (c, ci), (s_, si) = cls_token, sep_token
    tok.post_processor = processors.TemplateProcessing(single=f"{c} $A {s_}", pair=f"{c} $A {s_} $B:1 {s_}:1",
                                                       special_tokens=[(c, ci), (s_, si)])
    tok.decoder = decoders.WordPiece()
    return tok


GGUF_UNKNOWN, GGUF_USER_DEFINED = 2, 4  # llama.cpp's LLAMA_TOKEN_TYPE_UNKNOWN / _USER_DEFINED


def unigram_from_gguf(f: GGUFFile) -> Tokenizer:
    """The SentencePiece Unigram tokenizer of a GGUF XLM-RoBERTa (``tokenizer.ggml.model`` ``t5``, as llama.cpp's
    converter writes bge-m3 and bge-reranker-v2-m3) as the ``tokenizers`` library's, shaped like XLM-R's
    ``tokenizer.json``: the pieces and their scores with ``tokenizer.ggml.unknown_token_id``; the normaliser
    ``Precompiled(tokenizer.ggml.precompiled_charsmap)`` when the file has one; a Metaspace pre-tokenizer that
    prepends "▁" (``tokenizer.ggml.add_space_prefix``, default true); the template ``<s> $A </s>`` /
    ``<s> $A </s> </s> $B </s>`` (all token types 0) with the file's bos / eos ids; the Metaspace decoder. Control,
    unknown and user-defined pieces are added tokens, found in the text before the model runs (``<mask>`` eats the
    spaces before it, as XLM-R's ``AddedToken(lstrip=True)``).

    ``tokenizer.ggml.remove_extra_whitespaces`` true (what the converter writes from a ``sentencepiece.bpe.model``,
    as SentencePiece's own normaliser does and llama.cpp's UGM tokenizer does) drops leading and trailing spaces
    and merges runs of spaces into one, after the charsmap; false (the converter's value from a ``tokenizer.json``
    folder: transformers' ``clean_up_tokenization_spaces``) keeps every space as the ``tokenizer.json`` does,
    each extra one a "▁" piece. Scores are stored as float32 in the file (float64 in ``tokenizer.json``)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

    kind = f.get("tokenizer.ggml.model")
    if kind != "t5":
        raise FormatError(f"{f.path}: tokenizer.ggml.model is {kind!r}; a SentencePiece Unigram vocabulary is 't5'")
    tokens = f.require("tokenizer.ggml.tokens", list)
    scores = f.require("tokenizer.ggml.scores", list)
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    for key, values in (("scores", scores), ("token_type", types)):
        if len(values) != len(tokens):
            raise FormatError(f"{f.path}: tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} tokens")

    def special(*keys: str) -> int:
        for key in keys:
            value = f.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
                raise FormatError(f"{f.path}: {key} is outside the vocabulary ({value!r})")
            return value
        raise FormatError(f"{f.path}: missing metadata key {keys[0]!r}")

    unk = special("tokenizer.ggml.unknown_token_id")
    bos = special("tokenizer.ggml.bos_token_id", "tokenizer.ggml.cls_token_id")
    eos = special("tokenizer.ggml.eos_token_id", "tokenizer.ggml.seperator_token_id")
    tok = Tokenizer(models.Unigram([(t, float(s)) for t, s in zip(tokens, scores, strict=True)], unk, False))
    steps = []
    charsmap = f.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        steps.append(normalizers.Precompiled(bytes(charsmap)))
    if f.get("tokenizer.ggml.remove_extra_whitespaces", False):
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if steps:
        tok.normalizer = normalizers.Sequence(steps)
    # llama.cpp prepends the space to every word when it merges spaces, whatever add_space_prefix says
    prepend = bool(f.get("tokenizer.ggml.add_space_prefix", True)) or bool(
        f.get("tokenizer.ggml.remove_extra_whitespaces", False))
    scheme = "always" if prepend else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM_SPACE, prepend_scheme=scheme, split=True)
    tok.decoder = decoders.Metaspace(replacement=SPM_SPACE, prepend_scheme=scheme, split=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=t == "<mask>")
                            for t, ty in zip(tokens, types, strict=True)
                            if ty in (GGUF_CONTROL, GGUF_UNKNOWN, GGUF_USER_DEFINED)])
    b, e = tokens[bos], tokens[eos]
    tok.post_processor = processors.TemplateProcessing(single=f"{b} $A {e}", pair=f"{b} $A {e} {e} $B {e}",
                                                       special_tokens=[(b, bos), (e, eos)])
    return tok


def tokenizer_from_gguf(f: GGUFFile) -> Tokenizer:
    """The ``tokenizers`` tokenizer of an encoder's GGUF file, by ``tokenizer.ggml.model``: ``bert`` (WordPiece,
    :func:`wordpiece_from_gguf`) or ``t5`` (SentencePiece Unigram, :func:`unigram_from_gguf`)."""
    kind = f.get("tokenizer.ggml.model")
    if kind == "bert":
        return wordpiece_from_gguf(f)
    if kind == "t5":
        return unigram_from_gguf(f)
    raise FormatError(f"{f.path}: tokenizer.ggml.model is {kind!r}; an encoder's GGUF needs 'bert' (WordPiece) or "
                      "'t5' (SentencePiece Unigram)")
