"""Gemma 3 (GGUF ``gemma3``, text only), laid out as llama.cpp runs it.

What differs from the llama recipe:

* token embeddings multiplied by sqrt(n_embd) (a float32 multiply, as llama.cpp's ``ggml_scale``);
* RMSNorm gains as stored: the GGUF converter already wrote ``1 + w`` for HF's ``w``;
* per-head RMSNorm of q and k before RoPE (as Qwen3); NEOX RoPE pairing (i, i + d/2);
* the attention output and the FFN output are each RMS-normalized (``post_attention_norm``,
  ``post_ffw_norm``) before they are added to the residual stream;
* the FFN gate goes through tanh-approximated GELU: ``down(gelu(gate(x)) * up(x))``;
* sliding-window layers: layer il is local iff il % 6 < 5 (llama.cpp's ``set_swa_pattern(6)``, HF's
  ``layer_types``); a local layer's query at position i sees keys i - W < j <= i
  (``gemma3.attention.sliding_window`` = W) and uses RoPE base 10000, scale 1; global layers see every
  earlier position with ``rope.freq_base`` and the file's RoPE scaling (linear x8 in the larger models);
* attention scale 1/sqrt(head_dim) (HF's ``query_pre_attn_scalar`` = head_dim), except for the 27B
  model (62 layers), where it is 1/sqrt(n_embd / n_head): the GGUF has no key for it and llama.cpp
  decides by layer count, so do we;
* the output matrix is the embedding table (tied); no final logit soft-capping in Gemma 3.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from minfer.errors import FormatError, ModelError
from minfer.formats.gguf_file import GGUFFile
from minfer.graph.ir import RopeStyle
from minfer.models.architecture import HF_ATTENTION, HF_FFN, HF_QK_NORM, Architecture, HFArchitecture, QKNorm
from minfer.models.hparams import HParams
from minfer.models.rope_scaling import hf_rope_parameters

SWA_PATTERN = 6  # of every 6 layers the first 5 are sliding-window layers
ROPE_BASE_LOCAL = 10000.0
N_LAYER_27B = 62  # llama.cpp's LLM_TYPE_27B for gemma3, whose attention scale is 1/sqrt(n_embd / n_head)


def gemma3_layout(
    hp: HParams,
    sliding_window: int,
    source: str = "",
    *,
    swa_layers: tuple[bool, ...] | None = None,
    attn_scale: float | None = None,
    rope_base_local: float = ROPE_BASE_LOCAL,
) -> HParams:
    """``hp`` completed with Gemma 3's sliding-window layout, local RoPE and attention scale.

    Shared by the GGUF reader (llama.cpp's rules: layers il % 6 < 5 local, the attention scale by layer
    count) and the HF folder reader (``config.json``'s ``layer_types``, ``query_pre_attn_scalar`` and the
    sliding layers' ``rope_theta``)."""
    if sliding_window < 1:
        where = f"{source}: " if source else ""
        raise FormatError(f"{where}gemma3 sliding window must be a positive number of positions, got {sliding_window}")
    if attn_scale is None:
        n = hp.n_embd // hp.n_head if hp.n_layer == N_LAYER_27B else hp.head_dim_k
        attn_scale = 1.0 / math.sqrt(n)
    if swa_layers is None:
        swa_layers = tuple(il % SWA_PATTERN < SWA_PATTERN - 1 for il in range(hp.n_layer))
    return dataclasses.replace(
        hp,
        attn_scale=attn_scale,
        sliding_window=sliding_window,
        swa_layers=swa_layers,
        rope_freq_base_swa=rope_base_local,
        rope_freq_scale_swa=1.0,
    )


def gemma3_gguf_hparams(f: GGUFFile, hp: HParams) -> HParams:
    key = f"{f.architecture}.attention.sliding_window"
    return gemma3_layout(hp, int(f.require(key, int)), f"{f.path}: {key}")


def gemma3_hf_hparams(cfg: Mapping[str, Any], hp: HParams, where: Path) -> HParams:
    """``hp`` (the common config.json fields) completed from a ``Gemma3TextConfig`` as transformers reads it:
    ``sliding_window``, ``layer_types`` (default: the 6-layer pattern), ``query_pre_attn_scalar`` (the
    attention scale is its inverse square root), the sliding layers' own ``rope_theta``; no soft-capping."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ModelError(f"{where}: field {key!r} ({cfg[key]!r}) is not supported (Gemma 3 has none)")
    window = cfg.get("sliding_window", 4096)
    if isinstance(window, bool) or not isinstance(window, int):
        raise FormatError(f"{where}: field 'sliding_window' must be an integer, got {window!r}")
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", SWA_PATTERN)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise FormatError(f"{where}: field 'sliding_window_pattern' must be a positive integer, got {pattern!r}")
        types = ["sliding_attention" if (il + 1) % pattern else "full_attention" for il in range(hp.n_layer)]
    if not isinstance(types, list) or len(types) != hp.n_layer or set(types) - {"sliding_attention", "full_attention"}:
        raise FormatError(f"{where}: field 'layer_types' must list 'sliding_attention' or 'full_attention' for each "
                          f"of the {hp.n_layer} layers, got {types!r}")
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
        raise FormatError(f"{where}: field 'query_pre_attn_scalar' must be a positive number, got {scalar!r}")
    local = hf_rope_parameters(cfg, str(where), layer_type="sliding_attention")
    if local.get("rope_type", "default") != "default":
        raise ModelError(f"{where}: {local['_field']}: rope_type {local['rope_type']!r} on the sliding-window layers "
                         "is not supported (Gemma 3's are unscaled)")
    base = local.get("rope_theta", cfg.get("rope_local_base_freq", ROPE_BASE_LOCAL))
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
        raise FormatError(f"{where}: {local['_field']}: rope_theta must be a number > 1, got {base!r}")
    return gemma3_layout(hp, window, f"{where}: field 'sliding_window'",
                         swa_layers=tuple(t == "sliding_attention" for t in types),
                         attn_scale=float(scalar) ** -0.5, rope_base_local=float(base))


ARCH = Architecture(
    name="gemma3",
    rope_style=RopeStyle.NEOX,
    qk_norm=QKNorm.PER_HEAD,
    post_norms=True,
    ffn_act="gelu",
    scaled_embeddings=True,
    sliding_window=True,
    gguf_extra_hparams=gemma3_gguf_hparams,
    hf=HFArchitecture(
        "gemma3_text", ("Gemma3ForCausalLM",),
        {
            "input_layernorm.weight": "attn_norm.weight",
            **HF_ATTENTION,
            **HF_QK_NORM,
            # Gemma 3's post_attention_layernorm is the norm of the attention output (Llama's is the FFN's input)
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
            **HF_FFN,
        },
        defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "rope_theta": 1_000_000.0,
                  "tie_word_embeddings": True, "head_dim": 256},
        activation_key="hidden_activation", activation="gelu_pytorch_tanh", norm_gain_offset=True,
        extra_hparams=gemma3_hf_hparams,
    ),
)
