"""Fill-in-the-middle tokens: the prefix / suffix / middle markers (and the repository and file-separator
tokens of repo-level FIM) a code model was trained with, found as llama.cpp's vocab loader finds them:
the GGUF's ``tokenizer.ggml.fim_*_token_id`` keys, else the vocabulary's token with one of the known texts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}  # fmt: skip


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None = None  # repo-level FIM: the repository name token
    sep: int | None = None  # and the file separator


def find_fim_tokens(metadata: Mapping[str, Any], token_to_id: Callable[[str], int | None],
                    n_vocab: int) -> FimTokens | None:
    """The model's FIM tokens, or None when it lacks any of prefix, suffix and middle."""
    found: dict[str, int | None] = {}
    for role, texts in _TEXTS.items():
        raw = metadata.get(f"tokenizer.ggml.fim_{role}_token_id")
        tid = int(raw) if raw is not None and 0 <= int(raw) < n_vocab else None
        if tid is None:
            tid = next((i for i in map(token_to_id, texts) if i is not None), None)
        found[role] = tid
    pre, suf, mid = found["pre"], found["suf"], found["mid"]
    if pre is None or suf is None or mid is None:
        return None
    return FimTokens(pre, suf, mid, found["rep"], found["sep"])
