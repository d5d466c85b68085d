"""Mixture-of-experts hyperparameters from an HF ``config.json``, shared by the MoE families' modules.

The layer itself is the decoder's (``models/decoder.py``, ``moe_ffn``): router logits ``W_gate_inp · x``, the
softmax over every expert, the ``n_expert_used`` most probable experts (weights renormalized over them where
the model says so), their SwiGLU FFNs and the weighted sum (``MOE_ROUTE`` and ``MOE_EXPERTS`` graph ops).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from minfer.errors import FormatError, ModelError
from minfer.models.hparams import HParams


def _positive_int(cfg: Mapping[str, Any], name: str, where: Path) -> int:
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FormatError(f"{where}: field {name!r} must be a positive integer, got {value!r}")
    return value


def hf_moe_hparams(cfg: Mapping[str, Any], hp: HParams, where: Path, *, count_keys: Sequence[str], ff_key: str,
                   normalize: bool | str) -> HParams:
    """``hp`` with the experts of ``config.json``: their number (the first of ``count_keys`` present), experts per
    token (``num_experts_per_tok``), FFN width (``ff_key``) and whether the chosen weights are renormalized
    (a bool, or the name of the boolean field that says, e.g. ``norm_topk_prob``)."""
    count_key = next((k for k in count_keys if cfg.get(k) is not None), None)
    if count_key is None:
        raise FormatError(f"{where}: missing field {count_keys[0]!r} (the number of experts)")
    n_expert = _positive_int(cfg, count_key, where)
    n_used = _positive_int(cfg, "num_experts_per_tok", where)
    if n_used > n_expert:
        raise ModelError(f"{where}: num_experts_per_tok {n_used} is above {count_key} {n_expert}")
    if isinstance(normalize, str):
        value = cfg.get(normalize, False)
        if not isinstance(value, bool):
            raise FormatError(f"{where}: field {normalize!r} must be true or false, got {value!r}")
        normalize = value
    return dataclasses.replace(hp, n_expert=n_expert, n_expert_used=n_used,
                               n_ff_exp=_positive_int(cfg, ff_key, where), expert_weights_norm=normalize)
