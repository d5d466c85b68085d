"""Llama family (Llama 2/3, SmolLM2, Mistral-style GGUFs).

The GGUF converter permuted W_q/W_k rows so that RoPE pairs dimensions (2i, 2i+1) ("normal" style).
Biases on the projections are optional in some llama-arch files; the recipe uses them when present.
"""

from minfer.graph.ir import RopeStyle
from minfer.models.architecture import Architecture

ARCH = Architecture(name="llama", rope_style=RopeStyle.NORMAL)
