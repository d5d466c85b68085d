"""What an architecture module declares: the family's layer recipe flags, its tensor shapes and how its
Hugging Face folders name things.

Each ``minfer.models.<family>`` module defines one :class:`Architecture` as ``ARCH``; the registry finds
them there (:mod:`minfer.models.registry`), the decoder reads their flags (:mod:`minfer.models.decoder`)
and the HF loader their :class:`HFArchitecture` (:mod:`minfer.models.hf_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from minfer.formats.gguf_file import GGUFFile
from minfer.graph.ir import RopeStyle
from minfer.models.hparams import HParams, hparams_from_gguf

# The HF names of the tensors the families here share, after transformers' Llama module tree, and the engine
# (GGUF) names they take; a family's layer table (names after "model.layers.{i}.") is made of these and of its
# own entries.
HF_GLOBAL_TENSORS: Mapping[str, str] = MappingProxyType({
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
})
HF_ATTENTION: Mapping[str, str] = MappingProxyType({
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
})
# Llama's post_attention_layernorm is the FFN's input norm (in Gemma 3 and OLMo 2 it normalizes the attention output)
HF_PRE_NORMS: Mapping[str, str] = MappingProxyType({
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
})
HF_QKV_BIAS: Mapping[str, str] = MappingProxyType({
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
})
HF_QK_NORM: Mapping[str, str] = MappingProxyType({
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
})
HF_FFN: Mapping[str, str] = MappingProxyType({
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
})


@dataclass(frozen=True)
class HFArchitecture:
    """The ``config.json`` ``model_type`` a family's HF folders carry, and how to read them."""

    model_type: str
    classes: tuple[str, ...]  # accepted config.json "architectures" entries
    layer_tensors: Mapping[str, str]  # name after "model.layers.{i}." -> name after "blk.{i}."
    global_tensors: Mapping[str, str] = field(default_factory=lambda: HF_GLOBAL_TENSORS)
    defaults: Mapping[str, Any] = field(default_factory=dict)  # the transformers config class's defaults
    activation_key: str = "hidden_act"
    activation: str = "silu"  # the MLP activation the engine's recipe for the family computes
    norm_gain_offset: bool = False  # HF RMSNorm gains are w where the recipe (like GGUF) multiplies by 1 + w
    # what the family reads from config.json beyond the common fields (Gemma 3: its sliding-window layout,
    # attention scale and local RoPE), applied after them
    extra_hparams: Callable[[Mapping[str, Any], HParams, Path], HParams] | None = None
    # mixture-of-experts folders: per-expert tensor names after "model.layers.{i}." with "{e}" for the expert
    # -> the engine's stacked name (``ffn_gate_exps.weight``); the experts of a layer become one stack
    expert_tensors: Mapping[str, str] = field(default_factory=dict)
    expert_count_key: str = "num_experts"  # the config.json field holding the number of experts

    def __post_init__(self) -> None:
        # the registry hands these out to every caller: read-only views, whatever the module passed
        for name in ("layer_tensors", "global_tensors", "defaults", "expert_tensors"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


class QKNorm(Enum):
    """Which values one RMSNorm of q (and of k) spans, after the projections and before RoPE."""

    PER_HEAD = "per head"  # each head's head_dim values, one gain of head_dim shared by the heads (Qwen3, Gemma 3)
    WHOLE_WIDTH = "whole width"  # all n_head x head_dim values of q, all of k, gains that wide (OLMo 2)


@dataclass(frozen=True)
class Architecture:
    """A GGUF ``general.architecture`` the engine runs, and the features its layer recipe uses."""

    name: str
    rope_style: RopeStyle
    hf: HFArchitecture
    gguf: bool = True  # GGUF files name this architecture (Mixtral's say "llama": only its HF folders are its own)
    pre_norms: bool = True  # RMSNorm of the residual stream before attention and before the FFN
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    qk_norm: QKNorm | None = None  # RMSNorm of q and k before RoPE (Qwen3, Gemma 3, OLMo 2)
    post_norms: bool = False  # RMSNorm of the attention output and of the FFN output before each residual add
    ffn_act: str = "silu"  # gate activation of the FFN: "silu" (SwiGLU) or "gelu" (tanh GELU, GEGLU: Gemma)
    scaled_embeddings: bool = False  # token embeddings multiplied by sqrt(n_embd), rounded to float32 (Gemma)
    # some layers attend to a window of recent positions only (Gemma 3); their layout is read by the hooks
    # below, and a config.json asking for windows is refused for a family without them
    sliding_window: bool = False
    # what the family reads from GGUF metadata beyond the common keys (Gemma 3: ``<arch>.attention.sliding_window``,
    # and what llama.cpp derives from it), applied after them
    gguf_extra_hparams: Callable[[GGUFFile, HParams], HParams] | None = None
    # tensors the family stores fused, split into the recipe's (views of the same rows, no copies): Phi-3's
    # attn_qkv into attn_q/k/v and its gate_up ffn_up into ffn_gate and ffn_up. Gets the tensors by engine
    # name, the hyperparameters and a describer of a tensor's origin for errors; returns the new tensors
    split_fused: Callable[[dict[str, Any], HParams, Callable[[str], str]], dict[str, Any]] | None = None

    def hparams_from_gguf(self, f: GGUFFile, n_vocab: int) -> HParams:
        """The hyperparameters of a GGUF file of this family: the common keys, then the family's own."""
        hp = hparams_from_gguf(f, n_vocab)
        hp = dataclasses.replace(hp, embd_scale=self.embedding_scale(hp.n_embd))
        return hp if self.gguf_extra_hparams is None else self.gguf_extra_hparams(f, hp)

    def embedding_scale(self, n_embd: int) -> float:
        """The factor token embeddings are multiplied by (1.0: none)."""
        return float(np.float32(math.sqrt(n_embd))) if self.scaled_embeddings else 1.0

    def qk_norm_width(self, hp: HParams) -> int | None:
        """How many values one q/k RMSNorm spans: a head's, or None for the whole row."""
        return hp.head_dim_k if self.qk_norm is QKNorm.PER_HEAD else None

    def layer_tensor_shapes(self, hp: HParams, il: int) -> dict[str, tuple[int, ...]]:
        """The tensors layer ``il`` must have, with their shapes in numpy order ([out, in] for matrices)."""
        p = f"blk.{il}."
        shapes: dict[str, tuple[int, ...]] = {}
        if self.pre_norms:
            shapes[p + "attn_norm.weight"] = (hp.n_embd,)
        shapes[p + "attn_q.weight"] = (hp.q_width, hp.n_embd)
        shapes[p + "attn_k.weight"] = (hp.k_width, hp.n_embd)
        shapes[p + "attn_v.weight"] = (hp.v_width, hp.n_embd)
        shapes[p + "attn_output.weight"] = (hp.n_embd, hp.n_head * hp.head_dim_v)
        if self.pre_norms:
            shapes[p + "ffn_norm.weight"] = (hp.n_embd,)
        if hp.n_expert:
            shapes[p + "ffn_gate_inp.weight"] = (hp.n_expert, hp.n_embd)
            shapes[p + "ffn_gate_exps.weight"] = (hp.n_expert, hp.n_ff_exp, hp.n_embd)
            shapes[p + "ffn_up_exps.weight"] = (hp.n_expert, hp.n_ff_exp, hp.n_embd)
            shapes[p + "ffn_down_exps.weight"] = (hp.n_expert, hp.n_embd, hp.n_ff_exp)
            if hp.n_ff_shexp:
                shapes[p + "ffn_gate_shexp.weight"] = (hp.n_ff_shexp, hp.n_embd)
                shapes[p + "ffn_up_shexp.weight"] = (hp.n_ff_shexp, hp.n_embd)
                shapes[p + "ffn_down_shexp.weight"] = (hp.n_embd, hp.n_ff_shexp)
                shapes[p + "ffn_gate_inp_shexp.weight"] = (1, hp.n_embd)
        else:
            shapes[p + "ffn_gate.weight"] = (hp.n_ff, hp.n_embd)
            shapes[p + "ffn_up.weight"] = (hp.n_ff, hp.n_embd)
            shapes[p + "ffn_down.weight"] = (hp.n_embd, hp.n_ff)
        if self.qkv_bias:
            shapes[p + "attn_q.bias"] = (hp.q_width,)
            shapes[p + "attn_k.bias"] = (hp.k_width,)
            shapes[p + "attn_v.bias"] = (hp.v_width,)
        if self.qk_norm is QKNorm.PER_HEAD:
            shapes[p + "attn_q_norm.weight"] = (hp.head_dim_k,)
            shapes[p + "attn_k_norm.weight"] = (hp.head_dim_k,)
        elif self.qk_norm is QKNorm.WHOLE_WIDTH:
            shapes[p + "attn_q_norm.weight"] = (hp.q_width,)
            shapes[p + "attn_k_norm.weight"] = (hp.k_width,)
        if self.post_norms:
            shapes[p + "post_attention_norm.weight"] = (hp.n_embd,)
            shapes[p + "post_ffw_norm.weight"] = (hp.n_embd,)
        return shapes

    def global_tensor_shapes(self, hp: HParams) -> dict[str, tuple[int, ...]]:
        return {"token_embd.weight": (hp.n_vocab, hp.n_embd), "output_norm.weight": (hp.n_embd,)}
