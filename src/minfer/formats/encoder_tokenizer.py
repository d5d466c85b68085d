"""An encoder's tokenizer: a folder's ``tokenizer.json`` through the ``tokenizers`` library, with its own
post-processor adding the special tokens (BERT: ``[CLS] A [SEP]``, pairs ``[CLS] A [SEP] B [SEP]`` with token
types 0 and 1), so ids are transformers' and sentence-transformers' own.

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


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    token_types: list[int]
    truncated: int  # tokens cut away (0: the whole text)


class EncoderTokenizer:
    """Tokenizes single texts and (query, document) pairs into at most ``max_length`` tokens."""

    def __init__(self, path: str | os.PathLike[str], max_length: int) -> None:
        path = Path(path)
        if not path.is_file():
            raise FormatError(f"{path}: missing (an encoder folder needs its tokenizer.json)")
        try:
            self._whole = Tokenizer.from_file(str(path))
        except Exception as e:  # the library's errors are Exception subclasses of its own
            raise FormatError(f"{path}: not a tokenizer.json the tokenizers library reads ({e})") from None
        self._whole.no_truncation()
        self._whole.no_padding()
        self._cut = Tokenizer.from_str(self._whole.to_str())
        self._cut.enable_truncation(max_length)
        self.max_length = max_length
        self.vocab_size = self._whole.get_vocab_size(with_added_tokens=True)

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
