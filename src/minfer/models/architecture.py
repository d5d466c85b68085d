"""What distinguishes one decoder architecture from another: RoPE layout, optional pieces, tensor shapes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from minfer.formats.gguf_file import GGUFFile
from minfer.graph.ir import RopeStyle
from minfer.models.hparams import HParams


@dataclass(frozen=True)
class Architecture:
    """A GGUF ``general.architecture`` the engine runs, and the features its layer recipe uses."""

    name: str
    rope_style: RopeStyle
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    post_norms: bool = False  # RMSNorm of the attention output and of the FFN output before each residual add
    ffn_act: str = "silu"  # gate activation of the FFN: "silu" (SwiGLU) or "gelu" (tanh GELU, GEGLU: Gemma)
    # what the architecture reads from GGUF metadata beyond the common hyperparameters (Gemma 3: the
    # sliding-window layout, its RoPE, the embedding scale), applied after hparams_from_gguf
    gguf_hparams: Callable[[GGUFFile, HParams], HParams] | None = None

    def layer_tensor_shapes(self, hp: HParams, il: int) -> dict[str, tuple[int, ...]]:
        """The tensors layer ``il`` must have, with their shapes in numpy order ([out, in] for matrices)."""
        p = f"blk.{il}."
        shapes: dict[str, tuple[int, ...]] = {
            p + "attn_norm.weight": (hp.n_embd,),
            p + "attn_q.weight": (hp.q_width, hp.n_embd),
            p + "attn_k.weight": (hp.k_width, hp.n_embd),
            p + "attn_v.weight": (hp.v_width, hp.n_embd),
            p + "attn_output.weight": (hp.n_embd, hp.n_head * hp.head_dim_v),
            p + "ffn_norm.weight": (hp.n_embd,),
            p + "ffn_gate.weight": (hp.n_ff, hp.n_embd),
            p + "ffn_up.weight": (hp.n_ff, hp.n_embd),
            p + "ffn_down.weight": (hp.n_embd, hp.n_ff),
        }
        if self.qkv_bias:
            shapes[p + "attn_q.bias"] = (hp.q_width,)
            shapes[p + "attn_k.bias"] = (hp.k_width,)
            shapes[p + "attn_v.bias"] = (hp.v_width,)
        if self.qk_norm:
            shapes[p + "attn_q_norm.weight"] = (hp.head_dim_k,)
            shapes[p + "attn_k_norm.weight"] = (hp.head_dim_k,)
        if self.post_norms:
            shapes[p + "post_attention_norm.weight"] = (hp.n_embd,)
            shapes[p + "post_ffw_norm.weight"] = (hp.n_embd,)
        return shapes

    def global_tensor_shapes(self, hp: HParams) -> dict[str, tuple[int, ...]]:
        return {"token_embd.weight": (hp.n_vocab, hp.n_embd), "output_norm.weight": (hp.n_embd,)}
