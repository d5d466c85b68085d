"""IBM Granite 3 (GGUF ``granite``, HF ``GraniteForCausalLM``): the Llama recipe with four multipliers.

* token embeddings multiplied by ``embedding_multiplier`` (GGUF ``granite.embedding_scale``);
* the attention output and the FFN output each multiplied by ``residual_multiplier``
  (``granite.residual_scale``) before their residual add;
* attention scores scaled by ``attention_multiplier`` (``granite.attention.scale``) instead of
  1/sqrt(head_dim);
* logits divided by ``logits_scaling`` (``granite.logit_scale``).

The GGUF converter (``GraniteModel``, a ``LlamaModel``) permutes W_q/W_k rows as for Llama, so the GGUF
pairs RoPE dimensions (2i, 2i+1).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from minfer.errors import FormatError
from minfer.formats.gguf_file import GGUFFile
from minfer.graph.ir import RopeStyle
from minfer.models.architecture import HF_ATTENTION, HF_FFN, HF_PRE_NORMS, HF_QKV_BIAS, Architecture, HFArchitecture
from minfer.models.hparams import HParams

# GGUF key (after "granite.") -> the HParams field it sets, and the config.json field it comes from
MULTIPLIERS = (
    ("embedding_scale", "embd_scale", "embedding_multiplier"),
    ("residual_scale", "residual_scale", "residual_multiplier"),
    ("attention.scale", "attn_scale", "attention_multiplier"),
    ("logit_scale", "logit_scale", "logits_scaling"),
)


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise FormatError(f"{where} must be a positive number, got {value!r}")
    return float(value)


def granite_gguf_hparams(f: GGUFFile, hp: HParams) -> HParams:
    """The multipliers from ``granite.*`` keys; an absent key leaves the Llama value (llama.cpp's default)."""
    changes = {}
    for key, field, _ in MULTIPLIERS:
        value = f.get(f"{f.architecture}.{key}")
        if value is not None:
            changes[field] = _positive(value, f"{f.path}: metadata key '{f.architecture}.{key}'")
    return dataclasses.replace(hp, **changes)


def granite_hf_hparams(cfg: Mapping[str, Any], hp: HParams, where: Path) -> HParams:
    changes = {}
    for _, field, name in MULTIPLIERS:
        value = cfg.get(name)
        if value is not None:
            changes[field] = _positive(value, f"{where}: field {name!r}")
    return dataclasses.replace(hp, **changes)


ARCH = Architecture(
    name="granite",
    rope_style=RopeStyle.NORMAL,
    gguf_extra_hparams=granite_gguf_hparams,
    hf=HFArchitecture(
        "granite", ("GraniteForCausalLM",), {**HF_PRE_NORMS, **HF_ATTENTION, **HF_QKV_BIAS, **HF_FFN},
        # GraniteConfig's defaults (its multipliers 1.0: the Llama recipe)
        defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0,
                  "tie_word_embeddings": False},
        extra_hparams=granite_hf_hparams,
    ),
)
