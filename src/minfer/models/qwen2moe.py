"""Qwen2-MoE (GGUF ``qwen2moe``, HF ``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v biases, NEOX RoPE) with a
mixture of experts in every layer and a shared expert.

The router ``ffn_gate_inp`` (HF ``mlp.gate``) picks ``expert_used_count`` (``num_experts_per_tok``) of the
experts (SwiGLU FFNs of width ``expert_feed_forward_length``, HF ``moe_intermediate_size``), weighted by their
softmax probabilities, renormalized over the chosen ones only where HF's ``norm_topk_prob`` says so (its
default, and llama.cpp's qwen2moe, do not). Every token also runs the shared expert (``ffn_{gate,up,down}_shexp``,
HF ``mlp.shared_expert.*``, width ``expert_shared_feed_forward_length`` / ``shared_expert_intermediate_size``),
scaled by ``sigmoid(ffn_gate_inp_shexp · x)`` (HF ``mlp.shared_expert_gate``), and adds it to the experts' sum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from minfer.errors import ModelError
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.tensors import WeightTensor
from minfer.graph.ir import RopeStyle
from minfer.models.architecture import HF_ATTENTION, HF_PRE_NORMS, HF_QKV_BIAS, Architecture, HFArchitecture
from minfer.models.hparams import HParams
from minfer.models.moe import hf_moe_hparams


def qwen2moe_gguf_hparams(f: GGUFFile, hp: HParams) -> HParams:
    # llama.cpp's qwen2moe does not renormalize the chosen experts' weights
    return dataclasses.replace(hp, expert_weights_norm=bool(f.get(f"{f.architecture}.expert_weights_norm", False)))


def qwen2moe_hf_hparams(cfg: Mapping[str, Any], hp: HParams, where: Path) -> HParams:
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ModelError(f"{where}: dense layers among the expert layers (mlp_only_layers "
                         f"{cfg.get('mlp_only_layers')!r}, decoder_sparse_step {cfg.get('decoder_sparse_step')!r}) "
                         "are not supported")
    hp = hf_moe_hparams(cfg, hp, where, count_keys=("num_experts", "num_local_experts"),
                        ff_key="moe_intermediate_size", normalize="norm_topk_prob")
    n_sh = cfg.get("shared_expert_intermediate_size")
    if isinstance(n_sh, bool) or not isinstance(n_sh, int) or n_sh <= 0:
        raise ModelError(f"{where}: field 'shared_expert_intermediate_size' must be a positive integer, got {n_sh!r}")
    return dataclasses.replace(hp, n_ff_shexp=n_sh)


def shared_gate_as_row(tensors: dict[str, Any], hp: HParams, describe: Callable[[str], str]) -> dict[str, Any]:
    """The shared expert's gate vector as a one-row matrix (GGUF may store it 1-D): the recipe multiplies by it."""
    out = dict(tensors)
    for il in range(hp.n_layer):
        name = f"blk.{il}.ffn_gate_inp_shexp.weight"
        t = out.get(name)
        if isinstance(t, WeightTensor) and len(t.shape) == 1:
            out[name] = WeightTensor(name, t.ggml_type, (1, t.shape[0]), t.data.reshape(1, -1))
    return out


ARCH = Architecture(
    name="qwen2moe",
    rope_style=RopeStyle.NEOX,
    qkv_bias=True,
    gguf_extra_hparams=qwen2moe_gguf_hparams,
    split_fused=shared_gate_as_row,
    hf=HFArchitecture(
        "qwen2_moe", ("Qwen2MoeForCausalLM",),
        {**HF_PRE_NORMS, **HF_ATTENTION, **HF_QKV_BIAS, "mlp.gate.weight": "ffn_gate_inp.weight",
         "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
         "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
         "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
         "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"},
        defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
                  "tie_word_embeddings": False},
        expert_tensors={
            "mlp.experts.{e}.gate_proj.weight": "ffn_gate_exps.weight",
            "mlp.experts.{e}.up_proj.weight": "ffn_up_exps.weight",
            "mlp.experts.{e}.down_proj.weight": "ffn_down_exps.weight",
        },
        expert_count_key="num_experts",
        extra_hparams=qwen2moe_hf_hparams,
    ),
)
