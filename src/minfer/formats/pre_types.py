"""How a byte-level BPE vocabulary splits text before its merges, by GGUF ``tokenizer.ggml.pre`` name.

llama.cpp and transformers' GGUF converter each keep a table from the ``pre`` name a converter wrote to
the regexes that cut text into words; this is ours, limited to the names both agree on or whose
difference we know (noted next to each).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRE_TYPES", "SUPPORTED_PRE_TYPES", "PreType"]

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
class PreType:
    """How text is split before the BPE merges, and the add_bos default that goes with it."""

    splits: tuple[str, ...]  # regexes applied in turn; each isolates its matches from the rest
    add_bos: bool = False  # llama.cpp's add_bos when the file has no tokenizer.ggml.add_bos_token


_GPT2 = PreType((_GPT2_SPLIT,))
_LLAMA3 = PreType((_LLAMA3_SPLIT,), add_bos=True)

# `tokenizer.ggml.pre` -> how to split. Only names for which llama.cpp and transformers' GGUF
# converter agree, or where we know exactly how they differ (noted below), are listed.
PRE_TYPES: dict[str, PreType] = {
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
    "dbrx": PreType((_LLAMA3_SPLIT,)),
    "smaug-bpe": PreType((_LLAMA3_SPLIT,)),
    "qwen2": PreType((_QWEN2_SPLIT,)),
    "deepseek-r1-qwen": PreType((_QWEN2_SPLIT,)),
    "kormo": PreType((_QWEN2_SPLIT,)),
    "f2llmv2": PreType((_QWEN2_SPLIT,)),
    "megrez": PreType((_QWEN2_SPLIT,)),
    "qwen35": PreType((_QWEN35_SPLIT,)),
    "gpt-4o": PreType((_GPT4O_SPLIT,)),
    "llama4": PreType((_GPT4O_SPLIT,)),
    "kanana2": PreType((_GPT4O_SPLIT,)),
    "talkie": PreType((_GPT4O_SPLIT,)),
    "minimax-m2": PreType((_GPT4O_SPLIT,)),
    "tekken": PreType((_TEKKEN_SPLIT,), add_bos=True),
}

SUPPORTED_PRE_TYPES: tuple[str, ...] = tuple(sorted(PRE_TYPES))
