"""nomic-bert (nomic-embed-text v1 / v1.5): a BERT whose positions are rotary and whose FFN is gated.

    x = LN_embd(tok_embd[token] + type_embd[token_type])
    per layer:  q, k, v = W_qkv · x                          (one fused matrix, no biases)
                x = LN_attn(x + W_o · attn(rope(q), rope(k), v))
                x = LN_out(x + W_down · (silu(W_gate · x) * W_up · x))

RoPE rotates the pairs ``(i, i + head_dim/2)`` of each head (``rotary_emb_interleaved`` false) at base
``rotary_emb_base`` (1000), over the whole head. A folder holds the original checkpoint's tensor names
(``emb_ln``, ``encoder.layers.N.attn.Wqkv``, ``mlp.fc11`` the up projection, ``mlp.fc12`` the gate, ``mlp.fc2``,
``norm1``, ``norm2``; transformers' ``save_pretrained`` writes these too) and either config: nomic's own
(``n_embd``, ``n_head``, ``n_inner``, ``n_positions``, ``rotary_emb_base``, ``activation_function`` swiglu:
what the hub's nomic-embed-text folders carry) or transformers' ``NomicBertConfig`` (``hidden_size``, ...,
``rope_parameters``). A GGUF file as llama.cpp's converter writes it has ``general.architecture`` ``nomic-bert``,
``nomic-bert.rope.freq_base`` and the fused ``blk.N.attn_qkv``; both are split here into q/k/v views of the
same bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from minfer.errors import FormatError, ModelError

MODEL_TYPE = "nomic_bert"
GGUF_ARCH = "nomic-bert"
CLASSES = ("NomicBertModel", "NomicBertForPreTraining", "NomicBertForMaskedLM")

GLOBAL_TENSORS = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "emb_ln.weight": "token_embd_norm.weight",
    "emb_ln.bias": "token_embd_norm.bias",
}
LAYER_TENSORS = {
    "attn.Wqkv": "attn_qkv",
    "attn.out_proj": "attn_output",
    "norm1": "attn_output_norm",
    "mlp.fc11": "ffn_up",
    "mlp.fc12": "ffn_gate",
    "mlp.fc2": "ffn_down",
    "norm2": "layer_output_norm",
}
LAYER = re.compile(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)")

# nomic's config name, then transformers' NomicBertConfig name, of each hyperparameter
_FIELDS = {
    "n_embd": ("n_embd", "hidden_size"),
    "n_head": ("n_head", "num_attention_heads"),
    "n_layer": ("n_layer", "num_hidden_layers"),
    "n_ff": ("n_inner", "intermediate_size"),
    "n_positions": ("n_positions", "max_position_embeddings"),
}
# nomic config fields whose other values change the recipe: (field, the value this recipe computes)
_FIXED = (("prenorm", False), ("causal", False), ("qkv_proj_bias", False), ("mlp_fc1_bias", False),
          ("mlp_fc2_bias", False), ("rotary_emb_fraction", 1.0), ("rotary_emb_interleaved", False),
          ("rotary_emb_scale_base", None), ("rotary_scaling_factor", None), ("parallel_block", False),
          ("use_rms_norm", False), ("moe_every_n_layers", 0))


def _positive(cfg: Mapping[str, Any], names: tuple[str, ...], where: Path, default: int | None = None) -> int:
    name = next((n for n in names if n in cfg), names[0])
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FormatError(f"{where}: field {name!r} must be a positive integer, got {value!r}")
    return value


def config_hparams(cfg: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """The keyword arguments of ``EncoderHParams`` for a nomic-bert ``config.json`` (either naming, see the module
    docstring); one-line errors naming the field."""
    classes = cfg.get("architectures")
    if isinstance(classes, list) and classes and not any(c in CLASSES for c in classes):
        raise ModelError(f"{where}: architectures {classes} is not an encoder minfer runs for model_type "
                         f"{MODEL_TYPE!r} (supported: {', '.join(CLASSES)})")
    for name, value in _FIXED:
        if name in cfg and cfg[name] != value and not (value == 0 and cfg[name] is None):
            raise ModelError(f"{where}: {name} {cfg[name]!r} is not supported for nomic_bert (only {value!r})")
    act = cfg.get("activation_function", cfg.get("hidden_act", "swiglu"))
    if act not in ("swiglu", "silu"):
        raise ModelError(f"{where}: activation {act!r} is not supported for nomic_bert (only swiglu)")
    rope = cfg.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
            raise ModelError(f"{where}: rope_parameters {rope!r} is not supported (only rope_type 'default')")
        base = rope.get("rope_theta", 1000.0)
        base_field = "rope_parameters.rope_theta"
    else:
        base, base_field = cfg.get("rotary_emb_base", 1000.0), "rotary_emb_base"
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise FormatError(f"{where}: field {base_field!r} must be a positive number, got {base!r}")
    eps_field = "layer_norm_epsilon" if "layer_norm_epsilon" in cfg else "layer_norm_eps"
    eps = cfg.get(eps_field, 1e-12)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise FormatError(f"{where}: field {eps_field!r} must be a positive number, got {eps!r}")
    sizes = {key: _positive(cfg, names, where, 2048 if key == "n_positions" else None)
             for key, names in _FIELDS.items()}
    if sizes["n_embd"] % sizes["n_head"]:
        raise ModelError(f"{where}: the width {sizes['n_embd']} is not divisible by {sizes['n_head']} heads")
    return {
        "arch": MODEL_TYPE,
        "n_vocab": _positive(cfg, ("vocab_size",), where),
        "n_ctx_train": sizes["n_positions"],
        "n_embd": sizes["n_embd"],
        "n_layer": sizes["n_layer"],
        "n_head": sizes["n_head"],
        "n_ff": sizes["n_ff"],
        "n_token_types": _positive(cfg, ("type_vocab_size",), where, 2),
        "norm_eps": float(eps),
        "activation": "swiglu",
        "rope_base": float(base),
    }


def engine_name(name: str) -> str | None:
    """The engine's name of a nomic-bert checkpoint tensor (the fused ``attn_qkv`` before its split); None for a
    tensor the recipe does not read."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    m = LAYER.fullmatch(name)
    if m is not None and m.group(2) in LAYER_TENSORS:
        return f"blk.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    return None


def stored_name(name: str) -> str:
    """The checkpoint's name of an engine tensor (q/k/v: the fused matrix they are rows of)."""
    by_engine = {v: k for k, v in GLOBAL_TENSORS.items()}
    if name in by_engine:
        return by_engine[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)\.(weight|bias)", name)
    if m is None:
        return name
    part = "attn_qkv" if m.group(2) in ("attn_q", "attn_k", "attn_v") else m.group(2)
    stored = {v: k for k, v in LAYER_TENSORS.items()}.get(part, part)
    return f"encoder.layers.{m.group(1)}.{stored}.{m.group(3)}"
