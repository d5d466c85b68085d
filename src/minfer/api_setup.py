"""What :func:`minfer.load` settles around a :class:`~minfer.api.Model` before and after building it: the
threads it runs on, its speculative-decoding default and draft model, and the frozen garbage collector of
a process that keeps it.

Apart from :mod:`minfer.api` so that module reads as the Model's own methods; none of these needs a
Model (the CLI and the server call :func:`default_threads` and :func:`keep_for_process` on their own,
through ``minfer.api`` where they have always found them).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
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


LoraSpec = str | os.PathLike[str] | tuple[str | os.PathLike[str], float]


def lora_specs(lora: LoraSpec | Sequence[LoraSpec] | None) -> list[tuple[str | os.PathLike[str], float]]:
    """``load``'s ``lora`` argument as (adapter path, scale) pairs: a path (scale 1), a (path, scale) pair, or a
    list of them."""
    if lora is None:
        return []
    items = [lora] if isinstance(lora, str | os.PathLike | tuple) else list(lora)
    out = []
    for item in items:
        path, scale = item if isinstance(item, tuple) else (item, 1.0)
        if not isinstance(path, str | os.PathLike):
            raise BadRequestError(f"lora: expected an adapter path or (path, scale), got {item!r}")
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise BadRequestError(f"lora: the scale of {os.fspath(path)} must be a finite number, got {scale!r}")
        out.append((path, float(scale)))
    return out


def lora_scales(scales: Mapping[int, float] | Sequence[Mapping[str, Any]], n_adapters: int) -> list[float]:
    """Scales of ``n_adapters`` adapters from llama-server's ``[{"id": 0, "scale": 0.5}, ...]`` (or ``{0: 0.5}``);
    an adapter not named gets 0. A bad id or scale is a one-line error naming it."""
    pairs = list(scales.items()) if isinstance(scales, Mapping) else None
    if pairs is None:
        if isinstance(scales, str | bytes) or not isinstance(scales, Sequence):
            raise BadRequestError('lora: expected a list of {"id": ..., "scale": ...}')
        pairs = []
        for i, item in enumerate(scales):
            if not isinstance(item, Mapping) or "id" not in item or "scale" not in item:
                raise BadRequestError(f'lora[{i}]: expected {{"id": ..., "scale": ...}}, got {item!r}')
            pairs.append((item["id"], item["scale"]))
    out = [0.0] * n_adapters
    for k, scale in pairs:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n_adapters:
            have = f"0..{n_adapters - 1}" if n_adapters else "none: no adapter is loaded"
            raise BadRequestError(f"lora: adapter id {k!r} is not loaded (ids: {have})")
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise BadRequestError(f"lora: the scale of adapter {k} must be a finite number, got {scale!r}")
        out[k] = float(scale)
    return out


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
