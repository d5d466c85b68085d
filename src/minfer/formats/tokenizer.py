"""A text tokenizer built from a GGUF file's own vocabulary metadata.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, the BPE merges, a type per token and
the special token ids under llama.cpp's ``tokenizer.ggml.*`` keys. We rebuild a HF ``tokenizers``
tokenizer from those, the way transformers does for ``AutoTokenizer.from_pretrained(dir,
gguf_file=name)``, which is the reference the tests compare ids against. Where llama.cpp and
transformers disagree on how a file should tokenize we follow transformers and say so next to the
choice; llama.cpp's vocab loader is followed for what transformers has no notion of (the
end-of-generation set, the default of ``add_bos``).

Two vocabulary models: byte-level BPE (``tokenizer.ggml.model == "gpt2"``) and SentencePiece-style BPE
(``"llama"``: scores, byte fallback, the ▁ space marker; built in :mod:`minfer.formats.sentencepiece`).
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from numbers import Integral, Real
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from minfer.errors import BadRequestError, FormatError
from minfer.formats.sentencepiece import spm_backend, spm_merges, spm_piece_bytes, spm_vocabulary

__all__ = ["StreamingDetokenizer", "Tokenizer", "SUPPORTED_MODELS", "SUPPORTED_PRE_TYPES"]

# llama.cpp's token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# --- pre-tokenizer regexes -------------------------------------------------------------------------
# GPT-2's split, the one `tokenizers.pre_tokenizers.ByteLevel(use_regex=True)` applies. transformers
# uses it for every `pre` it has no entry for.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# The next ones are the original tokenizer.json regexes, as transformers' GGUF converter writes them.
# llama.cpp spells the case-insensitive contractions out ('[sS]...) because its regex engine lacks
# (?i:); onig has it, and both mean the same.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp approximates the \p{Lu}/\p{Ll} classes of these two with lookaheads that treat every
# non-ASCII letter as both cases; transformers keeps the original classes, and so do we.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreType:
    splits: tuple[str, ...]  # regexes applied in turn; each isolates its matches from the rest
    add_bos: bool = False  # llama.cpp's add_bos when the file has no tokenizer.ggml.add_bos_token


_GPT2 = _PreType((_GPT2_SPLIT,))
_LLAMA3 = _PreType((_LLAMA3_SPLIT,), add_bos=True)

# `tokenizer.ggml.pre` -> how to split. Only names for which llama.cpp and transformers' GGUF
# converter agree, or where we know exactly how they differ (noted below), are listed.
_PRE_TYPES: dict[str, _PreType] = {
    # llama.cpp's "default" runs four regexes in turn (punctuation runs, GPT-2, digit runs, then
    # digits in threes), which splits e.g. " (" or "1234" differently; transformers, and the
    # tokenizer.json that came with our fixtures, use GPT-2's regex.
    "default": _GPT2,
    "gpt2": _GPT2,  # not a llama.cpp name (it spells it "gpt-2"), but an obvious one
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    # llama.cpp isolates every digit first (\p{N}) and then applies GPT-2's regex, as the original
    # SmolLM2/StarCoder tokenizer.json do (Digits(individual_digits=True) before ByteLevel). Their
    # vocabularies have no token joining a digit to another character, so this only changes ids
    # when whitespace precedes a digit: "a  1" ends "ĠĠ" "1" for llama.cpp and "Ġ" "Ġ" "1" for
    # transformers, and " ½" merges the space with the first byte of "½" ("ĠÂ") only in
    # transformers. transformers' GGUF converter has no entry for these names and uses GPT-2's
    # regex; we match transformers.
    "smollm": _GPT2,
    "starcoder": _GPT2,
    "refact": _GPT2,
    # llama.cpp also sets ignore_merges for the Llama 3 family; transformers' converter does not, and
    # we match transformers.
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "falcon-h1": _LLAMA3,
    "pixtral": _LLAMA3,
    "midm-2.0": _LLAMA3,
    "lfm2": _LLAMA3,
    "jina-v5-nano": _LLAMA3,
    "dbrx": _PreType((_LLAMA3_SPLIT,)),
    "smaug-bpe": _PreType((_LLAMA3_SPLIT,)),
    "qwen2": _PreType((_QWEN2_SPLIT,)),
    "deepseek-r1-qwen": _PreType((_QWEN2_SPLIT,)),
    "kormo": _PreType((_QWEN2_SPLIT,)),
    "f2llmv2": _PreType((_QWEN2_SPLIT,)),
    "megrez": _PreType((_QWEN2_SPLIT,)),
    "qwen35": _PreType((_QWEN35_SPLIT,)),
    "gpt-4o": _PreType((_GPT4O_SPLIT,)),
    "llama4": _PreType((_GPT4O_SPLIT,)),
    "kanana2": _PreType((_GPT4O_SPLIT,)),
    "talkie": _PreType((_GPT4O_SPLIT,)),
    "minimax-m2": _PreType((_GPT4O_SPLIT,)),
    "tekken": _PreType((_TEKKEN_SPLIT,), add_bos=True),
}

SUPPORTED_MODELS: tuple[str, ...] = ("gpt2", "llama")
SUPPORTED_PRE_TYPES: tuple[str, ...] = tuple(sorted(_PRE_TYPES))

# --- end of generation -----------------------------------------------------------------------------
# Texts llama.cpp's vocab loader treats as end-of-generation whatever their token type.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[",
    }
)  # fmt: skip
# Fill-in-the-middle tokens llama.cpp finds by text (when their id key is absent) and also stops on.
_FIM_TEXTS = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": (
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the one byte-level BPE vocabularies are spelled in)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _char_to_byte() -> dict[str, int]:
    return {c: b for b, c in _byte_alphabet().items()}


def _respell(token: str) -> str:
    """A token as byte-level BPE spells it.

    Most GGUF tokens already are; a few converters store some (often multi-space or added ones) as
    the raw text. transformers re-spells those from their UTF-8 bytes, so the merges that name them
    in byte form still apply, and so do we.
    """
    alphabet = _char_to_byte()
    if all(c in alphabet for c in token):
        return token
    table = _byte_alphabet()
    return "".join(table[b] for b in token.encode("utf-8"))


def _token_bytes(token: str) -> bytes:
    """The bytes a token decodes to, as the ByteLevel decoder computes them.

    A token with a character outside the byte alphabet (an added token such as "<｜User｜>") decodes
    to its own UTF-8 text, as in `tokenizers`.
    """
    alphabet = _char_to_byte()
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _get(metadata: Mapping[str, Any], key: str, kind: type | tuple[type, ...], source: str) -> Any:
    value = metadata.get(key)
    if value is not None and not isinstance(value, kind):
        raise FormatError(f"{source}: {key} has type {type(value).__name__}, expected {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _get_id(metadata: Mapping[str, Any], key: str, n_vocab: int, source: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise FormatError(f"{source}: {key} has type {type(value).__name__}, expected int")
    if not 0 <= value < n_vocab:
        raise FormatError(f"{source}: {key} = {value} is outside the vocabulary (size {n_vocab})")
    return int(value)


def _string_list(metadata: Mapping[str, Any], key: str, source: str) -> list[str]:
    value = metadata.get(key)
    if value is None:
        raise FormatError(f"{source}: missing {key}")
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise FormatError(f"{source}: {key} must be an array of strings")
    value = list(value)
    if not all(isinstance(v, str) for v in value):
        raise FormatError(f"{source}: {key} must be an array of strings")
    return value


def _token_types(metadata: Mapping[str, Any], n_vocab: int, source: str) -> list[int]:
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is None:
        return [_NORMAL] * n_vocab
    # Any sequence of integers will do (a reader may hand out a numpy array).
    if isinstance(token_types, (str, bytes)) or not isinstance(token_types, Iterable):
        raise FormatError(f"{source}: tokenizer.ggml.token_type must be an array of integers")
    token_types = list(token_types)
    if len(token_types) < n_vocab or not all(isinstance(t, Integral) for t in token_types):
        raise FormatError(f"{source}: tokenizer.ggml.token_type must be {n_vocab} integers")
    return token_types


def _add_bos_eos(
    metadata: Mapping[str, Any], default_add_bos: bool, bos_id: int | None, eos_id: int | None, source: str
) -> tuple[bool, bool]:
    add_bos = _get(metadata, "tokenizer.ggml.add_bos_token", bool, source)
    add_bos = default_add_bos if add_bos is None else add_bos
    add_eos = bool(_get(metadata, "tokenizer.ggml.add_eos_token", bool, source))
    if add_bos and bos_id is None:
        raise FormatError(
            f"{source}: tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set"
        )
    if add_eos and eos_id is None:
        raise FormatError(
            f"{source}: tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set"
        )
    return add_bos, add_eos


def _scores(metadata: Mapping[str, Any], n_vocab: int, source: str) -> list[float] | None:
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        return None
    if isinstance(scores, (str, bytes)) or not isinstance(scores, Iterable):
        raise FormatError(f"{source}: tokenizer.ggml.scores must be an array of numbers")
    scores = list(scores)
    if len(scores) != n_vocab or not all(isinstance(x, Real) for x in scores):
        raise FormatError(f"{source}: tokenizer.ggml.scores must be {n_vocab} numbers")
    return [float(x) for x in scores]


def _named_ids(metadata: Mapping[str, Any], n_vocab: int, source: str) -> tuple[int | None, ...]:
    """BOS, EOS, UNK and PAD ids from the metadata (None where absent)."""
    return tuple(
        _get_id(metadata, f"tokenizer.ggml.{name}_token_id", n_vocab, source)
        for name in ("bos", "eos", "unknown", "padding")
    )


def _add_added_tokens(
    backend: Any,
    tokens: Sequence[str],
    token_types: Sequence[int],
    named_ids: Sequence[int | None],
    is_piece: Callable[[str], bool],
    spellable: Callable[[str], bool],
) -> None:
    """The added tokens, as transformers makes them. Control tokens stay whole in text and are special
    (skipped by skip_special); user-defined tokens (like "<think>") are matched whole in text, always, by
    llama.cpp and by transformers, but are ordinary text otherwise; then the named special tokens (BOS,
    EOS, UNK, PAD) become special when they are not added tokens already, whatever their type."""
    special = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _CONTROL and spellable(token)
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _USER_DEFINED and is_piece(token)
    ]
    named = {tokens[i] for i in named_ids if i is not None}
    named -= {t.content for t in special} | {t.content for t in user_defined}
    special += [AddedToken(text, normalized=False, special=True) for text in sorted(named) if spellable(text)]
    backend.add_special_tokens(special)
    if user_defined:
        backend.add_tokens(user_defined)


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary.

    Build it with :meth:`from_gguf_metadata`. ``encode`` and ``decode`` agree with transformers'
    tokenizer for the same file; ``eog_ids`` and ``add_bos`` follow llama.cpp's vocab loader.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    model: str
    pre: str

    def __init__(
        self,
        backend: HFTokenizer,
        tokens: list[str],
        *,
        model: str,
        pre: str,
        bos_id: int | None,
        eos_id: int | None,
        eog_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
        piece_bytes: Callable[[str], bytes] | None = None,
        strip_first_space: bool = False,
    ) -> None:
        """Wrap a ready ``tokenizers.Tokenizer``; use :meth:`from_gguf_metadata` rather than this.

        ``piece_bytes`` maps a token's text in the backend's vocabulary to the bytes it decodes to
        (default: byte-level BPE spelling); ``strip_first_space``: the decoder drops one leading space
        of the text (SentencePiece vocabularies that prefix the text with one)."""
        self._hf = backend
        self._tokens = tokens
        self._hf_plain: HFTokenizer | None = None  # copy that leaves special-token texts as text
        self._lock = threading.Lock()
        self.vocab_size = len(tokens)
        self.model = model
        self.pre = pre
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eog_ids = eog_ids
        self.add_bos = add_bos
        self.add_eos = add_eos
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._bytes_cache: dict[int, bytes] = {}
        self._piece_bytes = piece_bytes or _token_bytes
        self.strip_first_space = strip_first_space

    # --- construction ------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str = "<gguf>") -> Tokenizer:
        """Build the tokenizer a GGUF file describes.

        ``metadata`` maps GGUF keys to python values, as ``{k: f.contents() for k, f in
        gguf.GGUFReader(path).fields.items()}`` gives them. ``source`` names the file in errors.
        Raises :class:`FormatError` for a missing or malformed vocabulary, or a tokenizer model or
        pre-tokenizer we do not support.
        """
        model = _get(metadata, "tokenizer.ggml.model", str, source)
        if model is None:
            raise FormatError(f"{source}: missing tokenizer.ggml.model")
        if model == "llama":
            return cls._from_spm_metadata(metadata, source)
        if model not in SUPPORTED_MODELS:
            supported = ", ".join(SUPPORTED_MODELS)
            raise FormatError(f"{source}: unsupported tokenizer.ggml.model {model!r}; supported: {supported}")
        # llama.cpp falls back to "default" (with a loud warning) when the key is absent.
        pre = _get(metadata, "tokenizer.ggml.pre", str, source) or "default"
        pre_type = _PRE_TYPES.get(pre)
        if pre_type is None:
            supported = ", ".join(SUPPORTED_PRE_TYPES)
            raise FormatError(f"{source}: unsupported tokenizer.ggml.pre {pre!r}; supported: {supported}")

        tokens = _string_list(metadata, "tokenizer.ggml.tokens", source)
        merges = _string_list(metadata, "tokenizer.ggml.merges", source)
        n_vocab = len(tokens)
        if n_vocab == 0:
            raise FormatError(f"{source}: tokenizer.ggml.tokens is empty")
        token_types = _token_types(metadata, n_vocab, source)

        # A dict, as in transformers: should two tokens spell the same after re-spelling, the later id
        # wins the text (llama.cpp refuses such a file; no real one has it).
        vocab = {_respell(token): i for i, token in enumerate(tokens)}
        pairs: list[tuple[str, str]] = []
        for i, merge in enumerate(merges):
            parts = merge.split(" ")
            if len(parts) != 2:
                raise FormatError(f"{source}: tokenizer.ggml.merges[{i}] = {merge!r} is not two tokens")
            pairs.append((parts[0], parts[1]))

        backend = HFTokenizer(
            models.BPE(
                vocab=vocab,
                merges=pairs,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in pre_type.splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()

        bos_id, eos_id, unk_id, pad_id = _named_ids(metadata, n_vocab, source)
        # A control token spelled outside the byte alphabet cannot be a real byte-level token:
        # transformers takes it for a converter mislabel and leaves it out, which we copy.
        alphabet = _char_to_byte()
        _add_added_tokens(backend, tokens, token_types, (bos_id, eos_id, unk_id, pad_id),
                          is_piece=vocab.__contains__, spellable=lambda t: all(c in alphabet for c in t))

        add_bos, add_eos = _add_bos_eos(metadata, pre_type.add_bos, bos_id, eos_id, source)

        eog_ids = _eog_ids(metadata, tokens, eos_id, source)
        return cls(
            backend,
            tokens,
            model=model,
            pre=pre,
            bos_id=bos_id,
            eos_id=eos_id,
            eog_ids=eog_ids,
            add_bos=add_bos,
            add_eos=add_eos,
        )

    @classmethod
    def _from_spm_metadata(cls, metadata: Mapping[str, Any], source: str) -> Tokenizer:
        """A SentencePiece-style vocabulary (``tokenizer.ggml.model = "llama"``), as transformers builds it
        (see :mod:`minfer.formats.sentencepiece`). No ``tokenizer.ggml.pre`` applies: there is no
        pre-tokenizer split, the BPE runs over the text between added tokens."""
        tokens = _string_list(metadata, "tokenizer.ggml.tokens", source)
        n_vocab = len(tokens)
        if n_vocab == 0:
            raise FormatError(f"{source}: tokenizer.ggml.tokens is empty")
        token_types = _token_types(metadata, n_vocab, source)
        scores = _scores(metadata, n_vocab, source)
        architecture = _get(metadata, "general.architecture", str, source) or ""
        add_space_prefix = _get(metadata, "tokenizer.ggml.add_space_prefix", bool, source)
        vocabulary = spm_vocabulary(tokens, architecture, add_space_prefix)
        if scores is None and not vocabulary.gemma_style:
            raise FormatError(
                f"{source}: missing tokenizer.ggml.scores (a SentencePiece vocabulary ranks its merges by them)"
            )
        merges = spm_merges(vocabulary.pieces, None if vocabulary.gemma_style else scores)
        backend = spm_backend(vocabulary, merges)

        bos_id, eos_id, unk_id, pad_id = _named_ids(metadata, n_vocab, source)
        # As for byte-level vocabularies; user-defined tokens are checked against the renamed vocabulary
        # (as transformers does), so Gemma's runs of real spaces are left to the merges.
        _add_added_tokens(backend, tokens, token_types, (bos_id, eos_id, unk_id, pad_id),
                          is_piece=set(vocabulary.pieces).__contains__, spellable=lambda t: True)

        # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary that does not say otherwise
        add_bos, add_eos = _add_bos_eos(metadata, True, bos_id, eos_id, source)
        return cls(
            backend,
            tokens,
            model="llama",
            pre=_get(metadata, "tokenizer.ggml.pre", str, source) or "default",
            bos_id=bos_id,
            eos_id=eos_id,
            eog_ids=_eog_ids(metadata, tokens, eos_id, source),
            add_bos=add_bos,
            add_eos=add_eos,
            piece_bytes=spm_piece_bytes,
            strip_first_space=vocabulary.add_space_prefix,
        )

    # --- encoding ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        ``add_special`` prepends BOS when the vocabulary asks for it (``add_bos``) and appends EOS
        when it asks for that (``add_eos``). ``parse_special`` turns control-token texts written in
        ``text`` (e.g. ``"<|im_start|>"``) into their ids; without it they are tokenized as plain
        text. User-defined tokens are always matched, as llama.cpp does.
        """
        if not isinstance(text, str):
            raise BadRequestError(f"text to encode must be a string, got {type(text).__name__}")
        backend = self._hf if parse_special else self._plain_backend()
        ids: list[int] = backend.encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def _plain_backend(self) -> HFTokenizer:
        # `encode_special_tokens` is a setting of the whole tokenizer, not of one call, so flipping it
        # on the shared one would race with other threads; a second copy is built once instead.
        if self._hf_plain is None:
            with self._lock:
                if self._hf_plain is None:
                    plain = HFTokenizer.from_str(self._hf.to_str())
                    plain.encode_special_tokens = True
                    self._hf_plain = plain
        return self._hf_plain

    # --- decoding ----------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD.

        ``skip_special`` drops special tokens (control tokens, BOS/EOS...), as transformers'
        ``skip_special_tokens`` does.
        """
        checked = [self._check_id(i) for i in ids]
        return self._hf.decode(checked, skip_special_tokens=skip_special)

    def token_text(self, id: int) -> str:
        """The token's string exactly as the GGUF vocabulary stores it (byte-level spelling: "Ġthe")."""
        return self._tokens[self._check_id(id)]

    def token_bytes(self, id: int) -> bytes:
        """The bytes the token stands for in decoded text (may be part of a UTF-8 character)."""
        cached = self._bytes_cache.get(id)
        if cached is None:
            text = self._hf.id_to_token(self._check_id(id))
            cached = self._piece_bytes(text if text is not None else "")
            self._bytes_cache[id] = cached
        return cached

    def is_special(self, id: int) -> bool:
        """Whether ``decode(..., skip_special=True)`` drops this token."""
        return self._check_id(id) in self._special_ids

    def is_eog(self, id: int) -> bool:
        """Whether generating this token ends the generation."""
        return id in self.eog_ids

    def detokenizer(self, skip_special: bool = False) -> StreamingDetokenizer:
        """A streaming detokenizer: push ids one at a time, get back the text they complete."""
        return StreamingDetokenizer(self, skip_special=skip_special)

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (encodes without BOS/EOS; do not modify it)."""
        return self._hf

    def _check_id(self, id: int) -> int:
        if isinstance(id, bool) or not isinstance(id, int) or not 0 <= id < self.vocab_size:
            raise BadRequestError(f"token id {id!r} is outside the vocabulary (size {self.vocab_size})")
        return id

    def __repr__(self) -> str:
        return (
            f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})"
        )


class StreamingDetokenizer:
    """Turns a stream of token ids into text, one piece per id.

    Byte-level tokens (and SentencePiece byte-fallback tokens ``<0xNN>``) can end in the middle of a
    UTF-8 character (an emoji is often two or three tokens); such bytes are held back until the
    character is complete, so every returned piece is final. Concatenating all pieces and
    :meth:`flush` gives exactly ``Tokenizer.decode(ids)``, with one exception: a run of SentencePiece
    byte tokens that is not valid UTF-8, which ``decode`` (the ``tokenizers`` ``ByteFallback`` decoder)
    turns into one U+FFFD per byte of the whole run, while the stream, which has already released the
    valid characters of the run, marks only the invalid bytes (Python's "replace" rule).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        """Start an empty stream over ``tokenizer``'s vocabulary."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        # Replaces invalid bytes by U+FFFD with the same "maximal subpart" rule as Rust's
        # from_utf8_lossy, which the tokenizers decoder uses, so the stream and decode() agree.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_space = tokenizer.strip_first_space  # until the first character is out

    def push(self, id: int) -> str:
        """Add one token; return the text it completes (possibly ``""``)."""
        if self._skip_special and self._tokenizer.is_special(id):
            return ""
        text = self._utf8.decode(self._tokenizer.token_bytes(id))
        if self._strip_space and text:
            self._strip_space = False
            if text[0] == " ":
                text = text[1:]
        return text

    def flush(self) -> str:
        """End the stream: return what is held back, an incomplete character becoming U+FFFD."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self._strip_space = self._tokenizer.strip_first_space
        return text


def _eog_ids(metadata: Mapping[str, Any], tokens: list[str], eos_id: int | None, source: str) -> frozenset[int]:
    """End-of-generation ids, found as llama.cpp's vocab loader finds them.

    EOS, EOT and EOM from their keys; every token whose text is one of llama.cpp's end texts
    (whatever its type: llama.cpp promotes such tokens to control); and the fill-in-the-middle
    pad/repo/separator tokens, from their keys or else by text.
    """
    n_vocab = len(tokens)
    eog: set[int] = {i for i, text in enumerate(tokens) if text in _EOG_TEXTS}
    for key, texts in _FIM_TEXTS.items():
        fim = _get_id(metadata, key, n_vocab, source)
        if fim is None:
            # llama.cpp takes whichever match its hash map yields first; the lowest id is our choice.
            fim = next((i for i, text in enumerate(tokens) if text in texts), None)
        if fim is not None:
            eog.add(fim)
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = _get_id(metadata, key, n_vocab, source)
        if extra is not None:
            eog.add(extra)
    if eos_id is not None:
        eog.add(eos_id)

    texts = {tokens[i]: i for i in eog}
    # gpt-oss (<|return|>, <|call|>) and solar-open (<|calls|>, <|flush|>) end a message with <|end|>
    # but keep generating after it; llama.cpp drops it from the set for them.
    if "<|end|>" in texts and (
        ("<|return|>" in texts and "<|call|>" in texts) or ("<|calls|>" in texts and "<|flush|>" in texts)
    ):
        eog.discard(texts["<|end|>"])
    # Gemma 4 and PaddleOCR: "</s>" is not an end there.
    if "<|tool_response>" in texts and "</s>" in texts:
        eog.discard(texts["</s>"])
    return frozenset(eog)
