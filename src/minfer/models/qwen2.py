"""Qwen2 / Qwen2.5: biases on q/k/v, NEOX RoPE pairing (i, i + d/2), usually tied embeddings."""

from minfer.graph.ir import RopeStyle
from minfer.models.architecture import Architecture

ARCH = Architecture(name="qwen2", rope_style=RopeStyle.NEOX, qkv_bias=True)
