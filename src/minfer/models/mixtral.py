"""Mixtral (HF ``MixtralForCausalLM``): the Llama recipe with a mixture-of-experts FFN in every layer.

Its GGUF files are ``llama`` files with expert tensors (``llama.expert_count``, ``llama.expert_used_count``,
``ffn_gate_inp`` and the stacked ``ffn_{gate,up,down}_exps``), which ``llama.py``'s architecture runs; this
module reads the HF folders (``model_type`` ``mixtral``): the router ``block_sparse_moe.gate``, the experts
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up) and ``w2`` (down), ``num_local_experts`` experts of
width ``intermediate_size``, ``num_experts_per_tok`` of them per token with their softmax weights always
renormalized over the chosen ones (as transformers and llama.cpp do).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from minfer.graph.ir import RopeStyle
from minfer.models.architecture import HF_ATTENTION, HF_PRE_NORMS, Architecture, HFArchitecture
from minfer.models.hparams import HParams
from minfer.models.moe import hf_moe_hparams


def mixtral_hf_hparams(cfg: Mapping[str, Any], hp: HParams, where: Path) -> HParams:
    return hf_moe_hparams(cfg, hp, where, count_keys=("num_local_experts",), ff_key="intermediate_size",
                          normalize=True)


ARCH = Architecture(
    name="mixtral",
    gguf=False,  # GGUF files say "llama"
    rope_style=RopeStyle.NORMAL,
    hf=HFArchitecture(
        "mixtral", ("MixtralForCausalLM",),
        {**HF_PRE_NORMS, **HF_ATTENTION, "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"},
        # MixtralConfig's defaults
        defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 1e6,
                  "tie_word_embeddings": False},
        expert_tensors={
            "block_sparse_moe.experts.{e}.w1.weight": "ffn_gate_exps.weight",
            "block_sparse_moe.experts.{e}.w3.weight": "ffn_up_exps.weight",
            "block_sparse_moe.experts.{e}.w2.weight": "ffn_down_exps.weight",
        },
        expert_count_key="num_local_experts",
        extra_hparams=mixtral_hf_hparams,
    ),
)
