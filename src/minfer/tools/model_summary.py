"""``minfer inspect``: what a checkpoint is, named: format, architecture, tensor types, vocabulary, geometry,
RoPE and the features its layer recipe turns on. :func:`summarize` gives it as plain data (the JSON output),
:func:`format_summary` as text."""

from __future__ import annotations

from collections import Counter
from typing import Any

from minfer.models.architecture import QKNorm
from minfer.models.model import TransformerModel


def summarize(model: TransformerModel) -> dict[str, Any]:
    """What ``minfer inspect`` reports about a loaded model, as JSON-ready data."""
    hp, arch = model.hparams, model.arch
    types = Counter(t.ggml_type.name for t in model.tensors.values())
    features = []
    if hp.n_head_kv < hp.n_head:
        features.append(f"GQA ({hp.n_group} query heads per kv head)" if hp.n_head_kv > 1 else "MQA")
    if arch.qk_norm is not None:
        features.append("QK-norm" if arch.qk_norm is QKNorm.PER_HEAD else f"QK-norm ({arch.qk_norm.value})")
    if model.has_tensor("blk.0.attn_q.bias"):
        features.append("qkv bias")
    if model.tied_output:
        features.append("tied embeddings")
    window = getattr(hp, "sliding_window", None)
    if window:
        local = [il for il in range(hp.n_layer) if hp.is_swa(il)]
        if local:
            features.append(f"sliding window {window} on {len(local)} of {hp.n_layer} layers (global: "
                            f"{', '.join(str(il) for il in range(hp.n_layer) if il not in local)}; local RoPE base "
                            f"{hp.rope_freq_base_swa:g}, unscaled)")
        else:
            features.append(f"sliding window {window}")
    if not arch.pre_norms:
        features.append("no pre-norms")
    if arch.post_norms:
        features.append("post-attention and post-FFN norms")
    if arch.ffn_act == "gelu":
        features.append("GELU (tanh) gate")
    if hp.embd_scale != 1.0:
        features.append(f"embeddings x {hp.embd_scale:.6g}")
    if hp.rope_scaling.active:
        features.append(f"rope scaling ({hp.rope_scaling.kind})")
    if hp.n_expert:
        norm = ", weights renormalized" if hp.expert_weights_norm else ""
        shared = f", shared expert of width {hp.n_ff_shexp}" if hp.n_ff_shexp else ""
        features.append(f"mixture of experts ({hp.n_expert} experts of width {hp.n_ff_exp}, {hp.n_expert_used} per "
                        f"token{norm}{shared})")
    if hp.attn_softcap or hp.final_softcap:
        features.append(f"soft-capping (attention {hp.attn_softcap:g}, logits {hp.final_softcap:g})")
    if hp.residual_scale != 1.0 or hp.logit_scale != 1.0:
        features.append(f"residual x {hp.residual_scale:g}, logits / {hp.logit_scale:g}")
    if model.quantized:
        note = ""
        if model.quantized == "q4_k" and ("Q5_0" in types or "F16" in types):
            note = "; rows that are not whole 256-value super-blocks fall back to Q5_0 (or F16), as in llama.cpp"
        features.append(f"quantized at load ({model.quantized}{note})")
    source = model.source.source_summary()
    style = model.rope_style.value
    pairs = "(i, i + n_rot/2)" if style == "neox" else "(2i, 2i+1)"
    return {
        "path": str(model.path),
        **source,
        "architecture": arch.name,
        "n_tensors": len(model.tensors),
        "weight_bytes": model.weight_bytes,
        "tensor_types": dict(types.most_common()),
        "vocab": model.source.vocab_summary(),
        "context_length": hp.n_ctx_train,
        "geometry": {"n_layer": hp.n_layer, "n_embd": hp.n_embd, "n_ff": hp.n_ff, "n_head": hp.n_head,
                     "n_head_kv": hp.n_head_kv, "head_dim_k": hp.head_dim_k, "head_dim_v": hp.head_dim_v,
                     "n_rot": hp.n_rot, "attn_scale": hp.attn_scale},
        "rope": {"style": style, "pairs": pairs, "freq_base": hp.rope_freq_base, "freq_scale": hp.rope_freq_scale,
                 "scaling": hp.rope_scaling.describe()},
        "features": features,
        "kv_f32_bytes_per_position": hp.kv_f32_bytes_per_position,
    }


def format_summary(s: dict[str, Any]) -> str:
    g, r, v = s["geometry"], s["rope"], s["vocab"]
    arch = s["architecture"]
    if "hf_model_type" in s:
        arch += f" (HF model_type {s['hf_model_type']!r}, {', '.join(s.get('hf_architectures') or [])})"
    lines = [
        f"file: {s['path']}",
        f"format: {s['format']}, {s['n_tensors']} tensors, {format_bytes(s['weight_bytes'])} of weights",
        f"architecture: {arch}",
        "tensor types: " + ", ".join(f"{k}: {n}" for k, n in s["tensor_types"].items()),
        f"vocab: {v['type']}, {v['size']} tokens (bos {v['bos_id']}, eos {v['eos_id']}, add_bos {v['add_bos']})",
        f"context length: {s['context_length']} (training)",
        f"geometry: {g['n_layer']} layers, n_embd {g['n_embd']}, n_ff {g['n_ff']}, {g['n_head']} query heads / "
        f"{g['n_head_kv']} kv heads, head dim {g['head_dim_k']} (v {g['head_dim_v']}), {g['n_rot']} rotary dims",
        f"rope: {r['style']} pairs {r['pairs']}, base {r['freq_base']:g}, scaling: {r['scaling']}",
        "features: " + (", ".join(s["features"]) or "none"),
    ]
    return "\n".join(lines)


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
