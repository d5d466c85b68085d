"""GPT-2's byte-level alphabet: how byte-level BPE vocabularies spell raw bytes as printable characters.

Every byte is one character: the printable Latin-1 ones stand for themselves, the others are shifted
past U+00FF. A token's text in such a vocabulary is the spelling of its bytes, "Ġthe" for b" the".
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["is_byte_spelled", "respell", "token_bytes"]


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


def is_byte_spelled(token: str) -> bool:
    """Whether every character of ``token`` is in the byte alphabet."""
    alphabet = _char_to_byte()
    return all(c in alphabet for c in token)


def respell(token: str) -> str:
    """A token as byte-level BPE spells it.

    Most GGUF tokens already are; a few converters store some (often multi-space or added ones) as
    the raw text. transformers re-spells those from their UTF-8 bytes, so the merges that name them
    in byte form still apply, and so do we.
    """
    if is_byte_spelled(token):
        return token
    table = _byte_alphabet()
    return "".join(table[b] for b in token.encode("utf-8"))


def token_bytes(token: str) -> bytes:
    """The bytes a token decodes to, as the ByteLevel decoder computes them.

    A token with a character outside the byte alphabet (an added token such as "<｜User｜>") decodes
    to its own UTF-8 text, as in `tokenizers`.
    """
    alphabet = _char_to_byte()
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:
        return token.encode("utf-8")
