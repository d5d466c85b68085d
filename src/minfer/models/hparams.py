"""Hyperparameters of a decoder-only transformer, read from GGUF metadata with clear errors."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from minfer.errors import FormatError, ModelError
from minfer.formats.gguf_file import GGUFFile
from minfer.models.rope_scaling import RopeScaling, rope_scaling_from_gguf

GGUF_LAYER = re.compile(r"blk\.(\d+)\.")


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


# over 80 lines on purpose: one read per hyperparameter key, a table written as code
def hparams_from_gguf(f: GGUFFile, n_vocab: int) -> HParams:
    arch = f.architecture

    def key(name: str) -> str:
        return f"{arch}.{name}"

    def req_int(name: str) -> int:
        return int(f.require(key(name), int))

    def opt_int(name: str, default: int) -> int:
        return int(f.require(key(name), int)) if key(name) in f.metadata else default

    def opt_float(name: str, default: float) -> float:
        return float(f.require(key(name), (int, float))) if key(name) in f.metadata else default

    n_layer = req_int("block_count")
    check_layer_count(n_layer, layer_indices(f.tensors, GGUF_LAYER), str(f.path), key("block_count"))
    n_embd = req_int("embedding_length")
    n_head = req_int("attention.head_count")
    n_head_kv = opt_int("attention.head_count_kv", n_head)
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
    head_dim_k = opt_int("attention.key_length", n_embd // n_head)
    head_dim_v = opt_int("attention.value_length", head_dim_k)
    n_rot = opt_int("rope.dimension_count", head_dim_k)
    for name, value in [("attention.key_length", head_dim_k), ("attention.value_length", head_dim_v),
                        ("rope.dimension_count", n_rot)]:
        if value <= 0:
            raise FormatError(f"{f.path}: metadata key {key(name)!r} must be positive, got {value}")
    if n_rot > head_dim_k or n_rot % 2:
        raise ModelError(f"{f.path}: rope.dimension_count {n_rot} must be even and <= head dim {head_dim_k}")

    n_expert = opt_int("expert_count", 0)
    n_expert_used = opt_int("expert_used_count", 0)
    if n_expert < 0 or (n_expert and not 0 < n_expert_used <= n_expert):
        raise ModelError(f"{f.path}: {key('expert_used_count')} {n_expert_used} must be between 1 and "
                         f"{key('expert_count')} {n_expert}")
    n_ff_exp = opt_int("expert_feed_forward_length", n_ff) if n_expert else 0
    n_ff_shexp = opt_int("expert_shared_feed_forward_length", 0) if n_expert else 0

    freq_base = opt_float("rope.freq_base", 10000.0)
    if not math.isfinite(freq_base) or freq_base <= 0:
        raise FormatError(f"{f.path}: metadata key {key('rope.freq_base')!r} must be a finite number > 0, "
                          f"got {freq_base}")
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


# -- the one validation pass ------------------------------------------------------------------------

# where each field comes from, for the messages: the GGUF key (after "<arch>.") and the config.json field
FIELD_SOURCES: dict[str, tuple[str, str]] = {
    "n_vocab": ("token_embd.weight rows", "vocab_size"),
    "n_ctx_train": ("context_length", "max_position_embeddings"),
    "n_embd": ("embedding_length", "hidden_size"),
    "n_layer": ("block_count", "num_hidden_layers"),
    "n_head": ("attention.head_count", "num_attention_heads"),
    "n_head_kv": ("attention.head_count_kv", "num_key_value_heads"),
    "n_ff": ("feed_forward_length", "intermediate_size"),
    "head_dim_k": ("attention.key_length", "head_dim"),
    "head_dim_v": ("attention.value_length", "head_dim"),
    "n_rot": ("rope.dimension_count", "head_dim x partial_rotary_factor"),
    "rope_freq_base": ("rope.freq_base", "rope_theta"),
    "rope_freq_scale": ("rope.scaling.factor", "rope_scaling factor"),
    "rms_eps": ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
    "attn_scale": ("attention scale", "query_pre_attn_scalar"),
    "sliding_window": ("attention.sliding_window", "sliding_window"),
    "rope_freq_base_swa": ("rope.freq_base_swa", "rope_local_base_freq"),
    "rope_freq_scale_swa": ("rope.freq_scale_swa", "rope_local_base_freq"),
    "embd_scale": ("embedding scale", "embedding scale"),
}
POSITIVE_INTS = ("n_vocab", "n_ctx_train", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "head_dim_k",
                 "head_dim_v", "n_rot")
POSITIVE_FLOATS = ("rope_freq_base", "rope_freq_scale", "rms_eps", "attn_scale", "rope_freq_base_swa",
                   "rope_freq_scale_swa", "embd_scale")


def layer_indices(tensor_names: Iterable[str], pattern: re.Pattern[str]) -> set[int]:
    """The layer numbers tensors are named after (``pattern``'s first group: ``blk.(\\d+).``)."""
    return {int(m.group(1)) for name in tensor_names if (m := pattern.match(name)) is not None}


def check_layer_count(n_layer: int, present: set[int], where: str, key: str) -> None:
    """Refuse a layer count the tensors do not bear out, before anything is sized by it (a corrupt
    ``block_count`` of 16 million would otherwise be looped over and allocated for)."""
    if n_layer <= 0:
        raise FormatError(f"{where}: {key} must be a positive number of layers, got {n_layer}")
    n_present = max(present) + 1 if present else 0
    if n_layer != n_present or len(present) != n_present:
        missing = sorted(set(range(n_present)) - present)[:3]
        holes = f" (no tensors for layer {', '.join(map(str, missing))})" if missing else ""
        raise FormatError(f"{where}: {key} says {n_layer} layers but the tensors are for {n_present}{holes}")


def gguf_field_name(fld: str) -> str:
    """The GGUF metadata key (after ``<arch>.``) a hyperparameter is read from."""
    return FIELD_SOURCES.get(fld, (fld, fld))[0]


def hf_field_name(fld: str) -> str:
    """The config.json field a hyperparameter is read from."""
    return FIELD_SOURCES.get(fld, (fld, fld))[1]


def check_hparams(hp: HParams, where: str, name: Callable[[str], str]) -> None:
    """The one pass over every hyperparameter, whatever file it came from: counts positive and
    consistent, every float finite and in range. A value that would load and then give NaN logits
    (``rope.freq_base`` NaN or <= 0, a negative epsilon, a zero rotary width) is a FormatError naming it
    (``name``: the field's name in the checkpoint's format)."""

    for fld in POSITIVE_INTS:
        v = getattr(hp, fld)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise FormatError(f"{where}: {name(fld)} must be a positive integer, got {v!r}")
    for fld in POSITIVE_FLOATS:
        v = getattr(hp, fld)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise FormatError(f"{where}: {name(fld)} must be a finite number > 0, got {v!r}")
    if hp.n_rot % 2 or hp.n_rot > hp.head_dim_k:
        raise ModelError(f"{where}: {name('n_rot')} {hp.n_rot} must be even and <= the head dim {hp.head_dim_k}")
    if hp.n_head % hp.n_head_kv:
        raise ModelError(f"{where}: {hp.n_head} attention heads is not a multiple of {hp.n_head_kv} kv heads "
                         f"({name('n_head_kv')})")
    if hp.sliding_window < 0:
        raise FormatError(f"{where}: {name('sliding_window')} must be >= 0, got {hp.sliding_window}")
    if hp.swa_layers and len(hp.swa_layers) != hp.n_layer:
        raise FormatError(f"{where}: the sliding-window layout lists {len(hp.swa_layers)} layers, the model has "
                          f"{hp.n_layer}")
    _check_rope_scaling(hp.rope_scaling, where)


def _check_rope_scaling(s: RopeScaling, where: str) -> None:
    what = f"{where}: RoPE scaling ({s.source or s.kind})"
    for fld in ("factor", "mscale"):
        v = getattr(s, fld)
        if not math.isfinite(v) or v <= 0:
            raise FormatError(f"{what}: {fld} must be a finite number > 0, got {v!r}")
    for fld in ("beta_fast", "beta_slow", "ext_factor", "low_freq_factor", "high_freq_factor"):
        v = getattr(s, fld)
        if not math.isfinite(v):
            raise FormatError(f"{what}: {fld} must be a finite number, got {v!r}")
    if s.n_ctx_orig < 0:
        raise FormatError(f"{what}: the original context must be >= 0, got {s.n_ctx_orig}")
    if s.freq_factors is not None and not all(math.isfinite(x) and x > 0 for x in s.freq_factors):
        bad = next(x for x in s.freq_factors if not (math.isfinite(x) and x > 0))
        raise FormatError(f"{what}: the frequency factors must be finite and > 0, got {bad!r}")
