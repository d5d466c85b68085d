"""A slot's cache in a file (llama-server's ``POST /slots/{id}?action=save|restore``): the tokens a slot holds
and their KV cells, written and read back as a :mod:`session file <minfer.runtime.session_file>`.

The session format fits as it is: it is written atomically, its checksum covers every byte after the
version, and its header names the model (:func:`~minfer.runtime.prompt_cache.cells_fingerprint`: the
weights, the adapters applied, the cell type) and the cell type, so a file of another model, another cell
type or a damaged one is refused before any cell is touched. What marks it a slot's and not a
conversation's is ``meta.kind``; ``meta.lora`` holds the adapter scales its cells were computed with (a
slot's tokens are only reused under the same ones). Image rows keep their negative ids (an image's digest,
:func:`~minfer.runtime.vision.image_token_id`): they are int32 values like any token, and a later prompt
showing the same image has the same ids, so it reuses them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minfer.errors import BadRequestError, FormatError, MinferError
from minfer.runtime.session_file import SessionData, load_session, save_session

KIND = "minfer slot"

class SlotBusyError(MinferError):
    """The slot is processing a request: its contents can be saved, restored or erased once it is done."""


Cells = list[tuple[np.ndarray, np.ndarray]]  # per layer: K and V rows, in the cache's stored type


@dataclass
class SlotState:
    """What a slot holds: its tokens (image rows negative), their cells, the adapter scales they were
    computed with."""

    tokens: list[int]
    cells: Cells
    lora: np.ndarray


def save_slot(path: str | os.PathLike[str], state: SlotState, fingerprint: str, cache_type: str,
              capacity: int) -> int:
    """Write ``state`` to ``path`` atomically; the bytes written."""
    arrays = {}
    for il, (k, v) in enumerate(state.cells):
        arrays[f"k{il}"] = k
        arrays[f"v{il}"] = v
    save_session(path, SessionData(
        model_fingerprint=fingerprint, cache_type=cache_type, n_ctx=capacity, tokens=list(state.tokens),
        sampler_state={}, meta={"kind": KIND, "lora": [float(s) for s in state.lora]}, arrays=arrays,
    ))
    return os.path.getsize(path)


def load_slot(path: str | os.PathLike[str], fingerprint: str, cache_type: str, capacity: int, n_vocab: int,
              layout: Sequence[tuple[tuple[int, ...], np.dtype, tuple[int, ...], np.dtype]],
              n_adapters: int) -> tuple[SlotState, int]:
    """The slot ``path`` holds and its size in bytes, every part checked against this cache: ``layout`` gives
    each layer's K and V row shape and dtype. A damaged or foreign file is a :class:`FormatError`, one of
    another model or cell type, or too long for a slot, a :class:`BadRequestError`; both name the file."""
    shown = os.fspath(path)
    data = load_session(shown, expect_fingerprint=fingerprint, expect_cache_type=cache_type)

    def bad(problem: str) -> FormatError:
        return FormatError(f"slot file {shown}: {problem}")

    if data.meta.get("kind") != KIND:
        raise bad("it is a minfer session, not a saved slot")
    n = len(data.tokens)
    if n > capacity:
        raise BadRequestError(f"slot file {shown} holds {n} tokens, more than a slot's context of {capacity}")
    for i, t in enumerate(data.tokens):
        if t >= n_vocab:  # (negative: an image's rows, or -1 where nothing was written)
            raise bad(f"tokens[{i}] = {t} is outside the vocabulary (0..{n_vocab - 1})")
    lora = data.meta.get("lora")
    if (not isinstance(lora, list) or len(lora) != n_adapters
            or not all(isinstance(s, int | float) and not isinstance(s, bool) for s in lora)):
        raise BadRequestError(f"slot file {shown} was saved with {len(lora) if isinstance(lora, list) else '?'} "
                              f"LoRA adapter scales; this server has {n_adapters} adapters")
    if set(data.arrays) != {f"{kv}{il}" for il in range(len(layout)) for kv in "kv"}:
        raise bad(f"its arrays are not the K and V cells of {len(layout)} layers")
    cells: Cells = []
    for il, (k_shape, k_dtype, v_shape, v_dtype) in enumerate(layout):
        pair = []
        for name, shape, dtype in ((f"k{il}", k_shape, k_dtype), (f"v{il}", v_shape, v_dtype)):
            arr = data.arrays[name]
            if arr.shape != (n, *shape) or arr.dtype != dtype:
                raise bad(f"array {name} does not fit this model's KV cache")
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise bad(f"array {name} holds non-finite values (NaN or infinity)")
            pair.append(arr)
        cells.append((pair[0], pair[1]))
    return SlotState(list(data.tokens), cells, np.asarray(lora, np.float32)), os.path.getsize(shown)
