"""Qwen3-MoE (GGUF ``qwen3moe``, HF ``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k RMSNorm, NEOX
RoPE) with a mixture-of-experts FFN in every layer.

The router ``ffn_gate_inp`` (HF ``mlp.gate``) scores the experts, the ``expert_used_count`` most probable
(``num_experts_per_tok``) run, weighted by their softmax probabilities renormalized over the chosen ones
(HF ``norm_topk_prob``; llama.cpp always renormalizes for qwen3moe, which its GGUF files assume). Experts are
SwiGLU FFNs of width ``expert_feed_forward_length`` (HF ``moe_intermediate_size``), stacked in the GGUF
(``ffn_{gate,up,down}_exps``) and one tensor each in the HF folder (``mlp.experts.{e}.{gate,up,down}_proj``).
No shared expert. Layers without experts (``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from minfer.errors import ModelError
from minfer.graph.ir import RopeStyle
from minfer.models.architecture import (
    HF_ATTENTION,
    HF_PRE_NORMS,
    HF_QK_NORM,
    Architecture,
    HFArchitecture,
    QKNorm,
)
from minfer.models.hparams import HParams
from minfer.models.moe import hf_moe_hparams


def qwen3moe_hf_hparams(cfg: Mapping[str, Any], hp: HParams, where: Path) -> HParams:
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ModelError(f"{where}: dense layers among the expert layers (mlp_only_layers "
                         f"{cfg.get('mlp_only_layers')!r}, decoder_sparse_step {cfg.get('decoder_sparse_step')!r}) "
                         "are not supported")
    return hf_moe_hparams(cfg, hp, where, count_keys=("num_experts", "num_local_experts"),
                          ff_key="moe_intermediate_size", normalize="norm_topk_prob")


ARCH = Architecture(
    name="qwen3moe",
    rope_style=RopeStyle.NEOX,
    qk_norm=QKNorm.PER_HEAD,
    hf=HFArchitecture(
        "qwen3_moe", ("Qwen3MoeForCausalLM",),
        {**HF_PRE_NORMS, **HF_ATTENTION, **HF_QK_NORM, "mlp.gate.weight": "ffn_gate_inp.weight"},
        defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
                  "tie_word_embeddings": False},
        expert_tensors={
            "mlp.experts.{e}.gate_proj.weight": "ffn_gate_exps.weight",
            "mlp.experts.{e}.up_proj.weight": "ffn_up_exps.weight",
            "mlp.experts.{e}.down_proj.weight": "ffn_down_exps.weight",
        },
        expert_count_key="num_experts",
        extra_hparams=qwen3moe_hf_hparams,
    ),
)
