"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model = "llama"``) as a ``tokenizers`` BPE.

A SentencePiece BPE vocabulary is stored in a GGUF as its pieces, a score per piece and a type per piece
(normal, control, user-defined, byte ``<0xNN>``...), with no merge list: llama.cpp's SPM tokenizer
merges, over and over, the adjacent pair whose concatenation is the best-scored piece, and falls back
to byte tokens for what no piece covers. ``▁`` (U+2581) stands for a space inside pieces.

We build the same thing the way transformers does for ``AutoTokenizer.from_pretrained(dir,
gguf_file=...)`` (``integrations/gguf/gguf_tokenizer_mapping.py``, the reference the tests compare
against): a ``tokenizers`` BPE with ``byte_fallback``, whose merges are every split of every piece into
two pieces, ranked by the piece's priority. Two shapes, chosen by architecture as transformers does:

* Gemma (``gemma``, ``gemma2``, ``gemma3``): spaces become ``▁`` in a normalizer, no prefix space; a
  piece made only of spaces is stored as real spaces ("  ") and is renamed to ``▁▁`` so that it is
  found; the priority is the piece's position in the file (Gemma's scores do not follow its merge order).
* everything else (Llama 2, Mistral, TinyLlama...): a ``Metaspace`` pre-tokenizer that writes spaces as
  ``▁`` and puts one before the text (``tokenizer.ggml.add_space_prefix``, true by default as in
  llama.cpp; transformers ignores the flag and always prefixes), the score as priority, and a decoder
  that drops the one leading space again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from minfer.errors import FormatError

SPACE = "\u2581"  # ▁, SentencePiece's space marker
GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})
UNK_TEXT = "<unk>"  # the unknown piece transformers' GemmaTokenizer / LlamaTokenizer name


@dataclass(frozen=True)
class SpmVocabulary:
    """The pieces as the BPE model spells them, and how text around them is shaped."""

    pieces: list[str]  # per id: the file's piece, renamed where the BPE model needs another spelling
    gemma_style: bool  # spaces -> ▁ by a normalizer, no prefix space
    add_space_prefix: bool  # Metaspace puts a ▁ before the text (and decoding removes one)


def spm_vocabulary(tokens: Sequence[str], architecture: str, add_space_prefix: bool | None) -> SpmVocabulary:
    gemma = architecture in GEMMA_ARCHITECTURES
    if gemma:
        pieces = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        return SpmVocabulary(pieces, gemma_style=True, add_space_prefix=False)
    return SpmVocabulary(list(tokens), gemma_style=False, add_space_prefix=add_space_prefix is not False)


def spm_merges(pieces: Sequence[str], priority: Sequence[float] | None) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best piece first (transformers' ``generate_merges``).

    ``priority`` is the score of each piece (higher merges first), or None for the position in the
    file (earlier merges first). Within a piece, splits with a longer left part come first. Ties between
    pieces keep file order, and a piece spelled twice counts once with its last id and score, as in a
    dict built from the list.
    """
    vocab = {p: i for i, p in enumerate(pieces)}
    merges: list[tuple[str, str]] = []
    if priority is None and len(vocab) == len(pieces):
        # by position: the order is the file's, no sort needed (the common, large case: Gemma's 262k)
        add = merges.append
        for piece in pieces:
            for k in range(len(piece) - 1, 0, -1):
                left = piece[:k]
                if left in vocab:
                    right = piece[k:]
                    if right in vocab:
                        add((left, right))
        return merges
    score: dict[str, float] = {}
    for i, p in enumerate(pieces):
        score[p] = -float(i) if priority is None else float(priority[i])
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for order, (piece, s) in enumerate(score.items()):
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-s, -len(left), -len(right), order, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(r[6], r[7]) for r in ranked]


def spm_backend(vocabulary: SpmVocabulary, merges: list[tuple[str, str]]) -> HFTokenizer:
    """The ``tokenizers`` pipeline (added tokens not yet added)."""
    vocab = {p: i for i, p in enumerate(vocabulary.pieces)}
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, unk_token=UNK_TEXT, fuse_unk=True, byte_fallback=True,
                         dropout=None)
    except Exception as e:  # tokenizers' bare Exception for a vocabulary it cannot build on
        raise FormatError(f"the SentencePiece vocabulary is not usable ({str(e).splitlines()[0]})") from None
    backend = HFTokenizer(bpe)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocabulary.gemma_style:
        backend.normalizer = normalizers.Replace(" ", SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        scheme = "first" if vocabulary.add_space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
        if vocabulary.add_space_prefix:
            steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def byte_piece_value(piece: str) -> int | None:
    """The byte a ``<0xNN>`` piece stands for (the rule of the ``ByteFallback`` decoder), else None."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


def spm_piece_bytes(piece: str) -> bytes:
    """The bytes a piece stands for in decoded text: a byte piece's byte, else its text with ▁ as space."""
    value = byte_piece_value(piece)
    if value is not None:
        return bytes((value,))
    return piece.replace(SPACE, " ").encode("utf-8")
