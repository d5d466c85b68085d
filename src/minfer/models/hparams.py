"""Hyperparameters of a decoder-only transformer, read from GGUF metadata with clear errors."""

from __future__ import annotations

import math
from dataclasses import dataclass

from minfer.errors import FormatError, ModelError
from minfer.formats.gguf_file import GGUFFile
from minfer.models.rope_scaling import RopeScaling, rope_scaling_from_gguf


@dataclass(frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    head_dim_k: int  # query and key head dim (Qwen3 decouples it from n_embd / n_head)
    head_dim_v: int
    n_rot: int  # rotated dims per head
    rope_freq_base: float
    rope_freq_scale: float
    rms_eps: float
    attn_scale: float
    rope_scaling: RopeScaling = RopeScaling()  # Llama 3 / linear / YaRN (rope_freq_scale is its freq_scale)
    sliding_window: int = 0  # attention window of the sliding-window layers, 0 = none
    # Sliding-window attention (Gemma 3): layer il with swa_layers[il] attends to the last `sliding_window`
    # positions only (key j visible to query i iff i - j < sliding_window) and has its own, unscaled RoPE.
    swa_layers: tuple[bool, ...] = ()
    rope_freq_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    embd_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(n_embd), in float32)
    residual_scale: float = 1.0  # attention and FFN outputs are multiplied by this before each residual add (Granite)
    logit_scale: float = 1.0  # logits are divided by this (Granite's logits_scaling)
    attn_softcap: float = 0.0  # attention scores become cap * tanh(score / cap) before the mask (Gemma 2); 0 = off
    final_softcap: float = 0.0  # logits become cap * tanh(logit / cap) (Gemma 2); 0 = off
    # mixture of experts (0 experts: a dense FFN): each token's FFN is the weighted sum of the n_expert_used
    # experts (SwiGLU FFNs of width n_ff_exp) its router ranks highest, the weights the router's softmax over
    # all experts, renormalized over the chosen ones when expert_weights_norm
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_norm: bool = False
    n_ff_shexp: int = 0  # a shared expert every token also runs, gated by sigmoid(w · x) (Qwen2-MoE); 0 = none

    def is_swa(self, il: int) -> bool:
        """Whether layer ``il`` is a sliding-window layer."""
        return self.sliding_window > 0 and il < len(self.swa_layers) and self.swa_layers[il]

    def layer_window(self, il: int) -> int:
        """The attention window of layer ``il`` in positions, 0 for full causal attention."""
        return self.sliding_window if self.is_swa(il) else 0

    def layer_rope(self, il: int) -> tuple[float, float]:
        """RoPE ``(freq_base, freq_scale)`` of layer ``il`` (sliding-window layers have their own)."""
        if self.is_swa(il):
            return self.rope_freq_base_swa, self.rope_freq_scale_swa
        return self.rope_freq_base, self.rope_freq_scale

    @property
    def n_group(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.n_head // self.n_head_kv

    @property
    def k_width(self) -> int:
        return self.n_head_kv * self.head_dim_k

    @property
    def v_width(self) -> int:
        return self.n_head_kv * self.head_dim_v

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim_k

    @property
    def kv_f32_bytes_per_position(self) -> int:
        return 4 * self.n_layer * (self.k_width + self.v_width)


def hparams_from_gguf(f: GGUFFile, n_vocab: int) -> HParams:
    arch = f.architecture

    def key(name: str) -> str:
        return f"{arch}.{name}"

    def req_int(name: str) -> int:
        return int(f.require(key(name), int))

    n_embd = req_int("embedding_length")
    n_layer = req_int("block_count")
    n_head = req_int("attention.head_count")
    n_head_kv = int(f.get(key("attention.head_count_kv"), n_head))
    n_ff = req_int("feed_forward_length")
    n_ctx_train = req_int("context_length")
    for name, value in [
        ("embedding_length", n_embd),
        ("block_count", n_layer),
        ("attention.head_count", n_head),
        ("attention.head_count_kv", n_head_kv),
        ("feed_forward_length", n_ff),
        ("context_length", n_ctx_train),
    ]:
        if value <= 0:
            raise FormatError(f"{f.path}: metadata key {key(name)!r} must be positive, got {value}")
    if n_head % n_head_kv:
        raise ModelError(
            f"{f.path}: {n_head} attention heads is not a multiple of {n_head_kv} kv heads "
            f"({key('attention.head_count_kv')})"
        )
    if n_embd % n_head and key("attention.key_length") not in f.metadata:
        raise ModelError(f"{f.path}: n_embd {n_embd} is not divisible by {n_head} heads and no key_length is given")
    head_dim_k = int(f.get(key("attention.key_length"), n_embd // n_head))
    head_dim_v = int(f.get(key("attention.value_length"), head_dim_k))
    n_rot = int(f.get(key("rope.dimension_count"), head_dim_k))
    if n_rot > head_dim_k or n_rot % 2:
        raise ModelError(f"{f.path}: rope.dimension_count {n_rot} must be even and <= head dim {head_dim_k}")

    n_expert = int(f.get(key("expert_count"), 0))
    n_expert_used = int(f.get(key("expert_used_count"), 0))
    if n_expert < 0 or (n_expert and not 0 < n_expert_used <= n_expert):
        raise ModelError(f"{f.path}: {key('expert_used_count')} {n_expert_used} must be between 1 and "
                         f"{key('expert_count')} {n_expert}")
    n_ff_exp = int(f.get(key("expert_feed_forward_length"), n_ff)) if n_expert else 0
    n_ff_shexp = int(f.get(key("expert_shared_feed_forward_length"), 0)) if n_expert else 0

    freq_base = float(f.get(key("rope.freq_base"), 10000.0))
    scaling = rope_scaling_from_gguf(f, n_rot, n_ctx_train)
    rms_eps = float(f.require(key("attention.layer_norm_rms_epsilon"), float))

    return HParams(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        n_rot=n_rot,
        rope_freq_base=freq_base,
        rope_freq_scale=scaling.freq_scale,
        rms_eps=rms_eps,
        attn_scale=1.0 / math.sqrt(head_dim_k),
        rope_scaling=scaling,
        n_expert=n_expert,
        n_expert_used=n_expert_used if n_expert else 0,
        n_ff_exp=n_ff_exp,
        n_ff_shexp=n_ff_shexp,
        # llama.cpp renormalizes the chosen experts' weights for llama (Mixtral) and qwen3moe files
        expert_weights_norm=bool(f.get(key("expert_weights_norm"), True)) if n_expert else False,
    )
