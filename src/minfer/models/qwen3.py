"""Qwen3: per-head RMSNorm of q and k (not v) after the projections and before RoPE, NEOX RoPE,
no biases, and a head dim (``attention.key_length``) decoupled from n_embd / n_head."""

from minfer.graph.ir import RopeStyle
from minfer.models.architecture import Architecture

ARCH = Architecture(name="qwen3", rope_style=RopeStyle.NEOX, qk_norm=True)
