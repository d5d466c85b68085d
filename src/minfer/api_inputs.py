"""The input forms the Python API accepts, turned into token ids: the inputs of an embedding (a string, a
list of strings, token ids, lists of token ids) and the layout of a fill-in-the-middle prompt.

Apart from :mod:`minfer.api` so that module reads as the Model's own methods; these need only the
model's tokenizer, passed in as the function that encodes a text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from minfer.errors import BadRequestError
from minfer.formats.fim import FimTokens

Encode = Callable[[str], list[int]]  # a text's token ids


def embedding_inputs(texts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                     encode: Encode) -> list[list[int]]:
    """The token ids of each input (see :meth:`minfer.api.Model.embed_inputs`); ``encode`` tokenizes a
    string with the model's special tokens."""
    if isinstance(texts, str):
        texts = [texts]
    items = list(texts)
    if not items:
        raise BadRequestError("the input is empty: give a string, token ids, or a list of them")
    if all(_is_token(t) for t in items):
        items = [items]  # one list of token ids
    out: list[list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise BadRequestError(f"input {i} is an empty string (nothing to embed)")
            ids = encode(item)
        elif isinstance(item, Sequence) and all(_is_token(t) for t in item):
            ids = list(item)
        else:
            raise BadRequestError(f"input {i} is neither a string nor a list of token ids: {item!r:.60}")
        if not ids:
            raise BadRequestError(f"input {i} is empty (no tokens to embed)")
        out.append(ids)
    return out


def _is_token(t: Any) -> bool:
    return isinstance(t, int | np.integer) and not isinstance(t, bool)


def infill_layout(fim: FimTokens, enc: Encode, bos: list[int], prefix: str, suffix: str, prompt: str,
                  extra: Sequence[tuple[str, str]]) -> list[int]:
    """The token ids of a fill-in-the-middle prompt (see :meth:`minfer.api.Model.infill_prompt`): ``bos``
    (the model's BOS, or nothing), then the ``extra`` chunks and ``<PRE>prefix<SUF>suffix<MID>prompt``;
    ``enc`` tokenizes a text without special tokens."""
    ids = list(bos)
    if fim.rep is not None and fim.sep is not None:
        ids += [fim.rep, *enc("myproject\n")]
        for filename, text in extra:
            ids += [fim.sep, *enc(filename + "\n"), *enc(text)]
        ids += [fim.sep, *enc("filename\n")]
    else:
        for _, text in extra:
            ids += enc(text)
    return [*ids, fim.pre, *enc(prefix), fim.suf, *enc(suffix), fim.mid, *enc(prompt)]
