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
The ``tokenizer.ggml.*`` keys are read in :mod:`minfer.formats.gguf_vocab`, the ``tokenizer.ggml.pre``
table is :mod:`minfer.formats.pre_types`, and GPT-2's byte alphabet is :mod:`minfer.formats.byte_level`.
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from minfer.errors import BadRequestError, FormatError
from minfer.formats.byte_level import is_byte_spelled, respell, token_bytes
from minfer.formats.gguf_vocab import (
    add_added_tokens,
    read_add_bos_eos,
    read_eog_ids,
    read_named_ids,
    read_scores,
    read_string_list,
    read_token_types,
    read_value,
)
from minfer.formats.pre_types import PRE_TYPES, SUPPORTED_PRE_TYPES
from minfer.formats.sentencepiece import spm_backend, spm_merges, spm_piece_bytes, spm_vocabulary

__all__ = ["StreamingDetokenizer", "Tokenizer", "SUPPORTED_MODELS", "SUPPORTED_PRE_TYPES"]

SUPPORTED_MODELS: tuple[str, ...] = ("gpt2", "llama")


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
        self._piece_bytes = piece_bytes or token_bytes
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
        model = read_value(metadata, "tokenizer.ggml.model", str, source)
        if model is None:
            raise FormatError(f"{source}: missing tokenizer.ggml.model")
        if model == "llama":
            return cls._from_spm_metadata(metadata, source)
        if model not in SUPPORTED_MODELS:
            supported = ", ".join(SUPPORTED_MODELS)
            raise FormatError(f"{source}: unsupported tokenizer.ggml.model {model!r}; supported: {supported}")
        # llama.cpp falls back to "default" (with a loud warning) when the key is absent.
        pre = read_value(metadata, "tokenizer.ggml.pre", str, source) or "default"
        pre_type = PRE_TYPES.get(pre)
        if pre_type is None:
            supported = ", ".join(SUPPORTED_PRE_TYPES)
            raise FormatError(f"{source}: unsupported tokenizer.ggml.pre {pre!r}; supported: {supported}")

        tokens = read_string_list(metadata, "tokenizer.ggml.tokens", source)
        merges = read_string_list(metadata, "tokenizer.ggml.merges", source)
        n_vocab = len(tokens)
        if n_vocab == 0:
            raise FormatError(f"{source}: tokenizer.ggml.tokens is empty")
        token_types = read_token_types(metadata, n_vocab, source)

        # A dict, as in transformers: should two tokens spell the same after re-spelling, the later id
        # wins the text (llama.cpp refuses such a file; no real one has it).
        vocab = {respell(token): i for i, token in enumerate(tokens)}
        pairs: list[tuple[str, str]] = []
        for i, merge in enumerate(merges):
            parts = merge.split(" ")
            if len(parts) != 2:
                raise FormatError(f"{source}: tokenizer.ggml.merges[{i}] = {merge!r} is not two tokens")
            # tokenizers refuses these with a bare Exception; say which merge and which token
            for token in (parts[0], parts[1], parts[0] + parts[1]):
                if token not in vocab:
                    raise FormatError(f"{source}: tokenizer.ggml.merges[{i}] = {merge!r} needs the token "
                                      f"{token!r}, which is not in the vocabulary")
            pairs.append((parts[0], parts[1]))

        try:
            bpe = models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                             end_of_word_suffix="", fuse_unk=False)
        except Exception as e:  # the Rust side's refusal of a vocabulary the checks above let through
            raise FormatError(f"{source}: the BPE vocabulary is not usable ({str(e).splitlines()[0]})") from None
        backend = HFTokenizer(bpe)
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in pre_type.splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()

        bos_id, eos_id, unk_id, pad_id = read_named_ids(metadata, n_vocab, source)
        # A control token spelled outside the byte alphabet cannot be a real byte-level token:
        # transformers takes it for a converter mislabel and leaves it out, which we copy.
        add_added_tokens(backend, tokens, token_types, (bos_id, eos_id, unk_id, pad_id),
                         is_piece=vocab.__contains__, spellable=is_byte_spelled)

        add_bos, add_eos = read_add_bos_eos(metadata, pre_type.add_bos, bos_id, eos_id, source)

        eog_ids = read_eog_ids(metadata, tokens, eos_id, source)
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
        tokens = read_string_list(metadata, "tokenizer.ggml.tokens", source)
        n_vocab = len(tokens)
        if n_vocab == 0:
            raise FormatError(f"{source}: tokenizer.ggml.tokens is empty")
        token_types = read_token_types(metadata, n_vocab, source)
        scores = read_scores(metadata, n_vocab, source)
        architecture = read_value(metadata, "general.architecture", str, source) or ""
        add_space_prefix = read_value(metadata, "tokenizer.ggml.add_space_prefix", bool, source)
        vocabulary = spm_vocabulary(tokens, architecture, add_space_prefix)
        if scores is None and not vocabulary.gemma_style:
            raise FormatError(
                f"{source}: missing tokenizer.ggml.scores (a SentencePiece vocabulary ranks its merges by them)"
            )
        merges = spm_merges(vocabulary.pieces, None if vocabulary.gemma_style else scores)
        backend = spm_backend(vocabulary, merges)

        bos_id, eos_id, unk_id, pad_id = read_named_ids(metadata, n_vocab, source)
        # As for byte-level vocabularies; user-defined tokens are checked against the renamed vocabulary
        # (as transformers does), so Gemma's runs of real spaces are left to the merges.
        add_added_tokens(backend, tokens, token_types, (bos_id, eos_id, unk_id, pad_id),
                         is_piece=set(vocabulary.pieces).__contains__, spellable=lambda t: True)

        # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary that does not say otherwise
        add_bos, add_eos = read_add_bos_eos(metadata, True, bos_id, eos_id, source)
        return cls(
            backend,
            tokens,
            model="llama",
            pre=read_value(metadata, "tokenizer.ggml.pre", str, source) or "default",
            bos_id=bos_id,
            eos_id=eos_id,
            eog_ids=read_eog_ids(metadata, tokens, eos_id, source),
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
