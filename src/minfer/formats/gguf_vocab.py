"""llama.cpp's ``tokenizer.ggml.*`` vocabulary metadata, read from a GGUF file's key/value pairs.

Typed getters that name the key and the file in their errors; the per-token types and scores; the
named special ids (BOS, EOS, UNK, PAD) and whether to add BOS/EOS; the added tokens a ``tokenizers``
backend gets from the token types; and the end-of-generation set, found as llama.cpp's vocab loader
finds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from numbers import Integral, Real
from typing import Any

from tokenizers import AddedToken

from minfer.errors import FormatError

__all__ = [
    "EOG_TEXTS",
    "add_added_tokens",
    "read_add_bos_eos",
    "read_eog_ids",
    "read_named_ids",
    "read_scores",
    "read_string_list",
    "read_token_types",
    "read_value",
]

# llama.cpp's token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def read_value(metadata: Mapping[str, Any], key: str, kind: type | tuple[type, ...], source: str) -> Any:
    """``metadata[key]``, checked to be a ``kind``; None where absent."""
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


def read_string_list(metadata: Mapping[str, Any], key: str, source: str) -> list[str]:
    """The array of strings under ``key``, which must be present."""
    value = metadata.get(key)
    if value is None:
        raise FormatError(f"{source}: missing {key}")
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise FormatError(f"{source}: {key} must be an array of strings")
    value = list(value)
    if not all(isinstance(v, str) for v in value):
        raise FormatError(f"{source}: {key} must be an array of strings")
    return value


def read_token_types(metadata: Mapping[str, Any], n_vocab: int, source: str) -> list[int]:
    """llama.cpp's type of each token (all normal when the file has none)."""
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


def read_add_bos_eos(
    metadata: Mapping[str, Any], default_add_bos: bool, bos_id: int | None, eos_id: int | None, source: str
) -> tuple[bool, bool]:
    """Whether encoding adds BOS and EOS (``default_add_bos`` where the file does not say)."""
    add_bos = read_value(metadata, "tokenizer.ggml.add_bos_token", bool, source)
    add_bos = default_add_bos if add_bos is None else add_bos
    add_eos = bool(read_value(metadata, "tokenizer.ggml.add_eos_token", bool, source))
    if add_bos and bos_id is None:
        raise FormatError(
            f"{source}: tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set"
        )
    if add_eos and eos_id is None:
        raise FormatError(
            f"{source}: tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set"
        )
    return add_bos, add_eos


def read_scores(metadata: Mapping[str, Any], n_vocab: int, source: str) -> list[float] | None:
    """The score of each token; None where the file has none."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        return None
    if isinstance(scores, (str, bytes)) or not isinstance(scores, Iterable):
        raise FormatError(f"{source}: tokenizer.ggml.scores must be an array of numbers")
    scores = list(scores)
    if len(scores) != n_vocab or not all(isinstance(x, Real) for x in scores):
        raise FormatError(f"{source}: tokenizer.ggml.scores must be {n_vocab} numbers")
    return [float(x) for x in scores]


def read_named_ids(metadata: Mapping[str, Any], n_vocab: int, source: str) -> tuple[int | None, ...]:
    """BOS, EOS, UNK and PAD ids from the metadata (None where absent)."""
    return tuple(
        _get_id(metadata, f"tokenizer.ggml.{name}_token_id", n_vocab, source)
        for name in ("bos", "eos", "unknown", "padding")
    )


def add_added_tokens(
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


# --- end of generation -----------------------------------------------------------------------------
# Texts llama.cpp's vocab loader treats as end-of-generation whatever their token type.
EOG_TEXTS = frozenset(
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


def read_eog_ids(metadata: Mapping[str, Any], tokens: list[str], eos_id: int | None, source: str) -> frozenset[int]:
    """End-of-generation ids, found as llama.cpp's vocab loader finds them.

    EOS, EOT and EOM from their keys; every token whose text is one of llama.cpp's end texts
    (whatever its type: llama.cpp promotes such tokens to control); and the fill-in-the-middle
    pad/repo/separator tokens, from their keys or else by text.
    """
    n_vocab = len(tokens)
    eog: set[int] = {i for i, text in enumerate(tokens) if text in EOG_TEXTS}
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
