"""What :func:`minfer.load` settles around a :class:`~minfer.api.Model` before and after building it: the
threads it runs on, its speculative-decoding default and draft model, and the frozen garbage collector of
a process that keeps it.

Apart from :mod:`minfer.api` so that module reads as the Model's own methods; none of these needs a
Model (the CLI and the server call :func:`default_threads` and :func:`keep_for_process` on their own,
through ``minfer.api`` where they have always found them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from minfer.errors import BadRequestError, MinferError
from minfer.formats.tokenizer import Tokenizer
from minfer.models.model import TransformerModel
from minfer.pull import resolve_model
from minfer.runtime.speculative import SpeculativeSettings
from minfer.runtime.speculative.draft_model import check_vocabulary


def default_threads() -> int:
    """Cores this process may run on (the machine's physical cores where affinity is not restricted)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def speculative_settings(
    draft: object, lookup: bool, speculative: SpeculativeSettings | Mapping[str, Any] | None
) -> SpeculativeSettings:
    """The engine's default speculative decoding from ``load``'s arguments: a draft model drafts, else
    ``lookup=True`` looks up; ``speculative`` adds the limits (or the mode itself)."""
    if draft is not None and lookup:
        raise BadRequestError("use either a draft model or prompt lookup as the default, not both")
    mode = "draft" if draft is not None else "lookup" if lookup else None
    if isinstance(speculative, SpeculativeSettings):
        return speculative if mode is None else speculative.updated({"mode": mode})
    fields = dict(speculative or {})
    if mode is not None:
        fields.setdefault("mode", mode)
    return SpeculativeSettings().updated(fields)


def load_draft(path: str | os.PathLike[str], target: Tokenizer, threads: int) -> TransformerModel:
    """The draft model at ``path`` (a GGUF file, an HF folder or a known name), its vocabulary checked
    against the target's ``tokenizer``; any failure is one line naming the draft."""
    try:
        model = TransformerModel.from_path(resolve_model(path), threads=threads)
        check_vocabulary(target, model.load_tokenizer(), f"draft model {model.path}")
    except MinferError as e:
        text = str(e)
        message = text if text.startswith("draft model") else \
            f"draft model: {text}" if str(path) in text else f"draft model {path}: {text}"
        raise type(e)(message) from None
    return model


def keep_for_process(collect: bool = False) -> None:
    """Freeze what is loaded so far (the model, the tokenizer's tables, the plans) out of the cyclic garbage
    collector's walks, for a process that keeps its model until it exits (``minfer run``, ``chat``,
    ``serve``). Unfrozen, SmolLM2's ~190,000 loaded objects make a full collection take ~45 ms, and one
    lands inside the first passes of a generation, where allocations bind the plans' kernels: it cost a
    verifying pass of 9 tokens 59 ms instead of 11. ``collect`` first frees what is already garbage (a
    server's one-time cost at start; a run skips it for its start time)."""
    import gc

    if collect:
        gc.collect()
    gc.freeze()
