"""Gemma 2 (GGUF ``gemma2``, HF ``Gemma2ForCausalLM``), laid out as llama.cpp runs it.

What differs from the llama recipe (much as in Gemma 3, which has no soft-capping and adds QK-norm):

* token embeddings multiplied by sqrt(n_embd) (a float32 multiply); RMSNorm gains as stored (the GGUF
  converter wrote ``1 + w`` for HF's ``w``);
* the attention output and the FFN output are each RMS-normalized (``post_attention_norm``,
  ``post_ffw_norm``) before their residual add; the FFN gate goes through tanh GELU;
* attention scores soft-capped: ``cap * tanh(score / cap)`` before the mask (``gemma2.attn_logit_softcapping``,
  HF ``attn_logit_softcapping``), and the logits too (``final_logit_softcapping``);
* sliding-window layers alternate: layer il is local iff il is even (llama.cpp's ``set_swa_pattern(2)``, HF's
  ``layer_types``), seeing keys i - W < j <= i (``gemma2.attention.sliding_window`` = W); every layer has the
  same RoPE base;
* attention scale 1/sqrt(query_pre_attn_scalar): the GGUF has no key for it, and llama.cpp takes
  1/sqrt(head_dim), except for the 27B model (46 layers), where it is 1/sqrt(n_embd / n_head); so do we. The
  HF folder's ``query_pre_attn_scalar`` is read as it is;
* tied output; no QK-norm.
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
from minfer.models.architecture import HF_ATTENTION, HF_FFN, Architecture, HFArchitecture
from minfer.models.hparams import HParams

SWA_PATTERN = 2  # of every 2 layers the first is a sliding-window layer
N_LAYER_27B = 46  # llama.cpp's LLM_TYPE_27B for gemma2, whose attention scale is 1/sqrt(n_embd / n_head)


def _number(value: Any, where: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and value <= 0):
        raise FormatError(f"{where} must be a positive number, got {value!r}")
    return float(value)


def gemma2_layout(hp: HParams, window: int, swa_layers: tuple[bool, ...], attn_scale: float, attn_softcap: float,
                  final_softcap: float, source: str) -> HParams:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise FormatError(f"{source}: gemma2 sliding window must be a positive number of positions, got {window!r}")
    return dataclasses.replace(
        hp, sliding_window=window, swa_layers=swa_layers, rope_freq_base_swa=hp.rope_freq_base,
        rope_freq_scale_swa=hp.rope_freq_scale, attn_scale=attn_scale, attn_softcap=attn_softcap,
        final_softcap=final_softcap,
    )


def gemma2_gguf_hparams(f: GGUFFile, hp: HParams) -> HParams:
    arch = f.architecture
    key = f"{arch}.attention.sliding_window"
    caps = []
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = f.get(f"{arch}.{name}")
        caps.append(0.0 if value is None else _number(value, f"{f.path}: metadata key '{arch}.{name}'"))
    n = hp.n_embd // hp.n_head if hp.n_layer == N_LAYER_27B else hp.head_dim_k
    return gemma2_layout(hp, int(f.require(key, int)), tuple(il % SWA_PATTERN == 0 for il in range(hp.n_layer)),
                         1.0 / math.sqrt(n), caps[0], caps[1], f"{f.path}: {key}")


def gemma2_hf_hparams(cfg: Mapping[str, Any], hp: HParams, where: Path) -> HParams:
    """``sliding_window``, ``layer_types`` (default: alternating, sliding first), ``query_pre_attn_scalar`` and
    the two soft-capping values (null: off), as ``Gemma2Config`` reads them."""
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (il + 1) % SWA_PATTERN else "full_attention" for il in range(hp.n_layer)]
    if not isinstance(types, list) or len(types) != hp.n_layer or set(types) - {"sliding_attention", "full_attention"}:
        raise FormatError(f"{where}: field 'layer_types' must list 'sliding_attention' or 'full_attention' for each "
                          f"of the {hp.n_layer} layers, got {types!r}")
    scalar = _number(cfg.get("query_pre_attn_scalar", 256), f"{where}: field 'query_pre_attn_scalar'")
    caps = []
    for name, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        value = cfg.get(name, default)
        caps.append(0.0 if value is None else _number(value, f"{where}: field {name!r}"))
    return gemma2_layout(hp, cfg.get("sliding_window", 4096), tuple(t == "sliding_attention" for t in types),
                         scalar ** -0.5, caps[0], caps[1], f"{where}: field 'sliding_window'")


ARCH = Architecture(
    name="gemma2",
    rope_style=RopeStyle.NEOX,
    post_norms=True,
    ffn_act="gelu",
    scaled_embeddings=True,
    sliding_window=True,
    gguf_extra_hparams=gemma2_gguf_hparams,
    hf=HFArchitecture(
        "gemma2", ("Gemma2ForCausalLM",),
        {
            "input_layernorm.weight": "attn_norm.weight",
            **HF_ATTENTION,
            # as in Gemma 3: post_attention_layernorm normalizes the attention output
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
            **HF_FFN,
        },
        defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "rope_theta": 10000.0,
                  "tie_word_embeddings": True, "head_dim": 256},
        activation_key="hidden_activation", activation="gelu_pytorch_tanh", norm_gain_offset=True,
        extra_hparams=gemma2_hf_hparams,
    ),
)
