"""Llama family (Llama 2/3, SmolLM2, Mistral-style GGUFs).

The GGUF converter permuted W_q/W_k rows so that RoPE pairs dimensions (2i, 2i+1) ("normal" style).
Biases on the projections are optional in some llama-arch files; the recipe uses them when present.
"""

from minfer.graph.ir import RopeStyle
from minfer.models.architecture import HF_ATTENTION, HF_FFN, HF_PRE_NORMS, HF_QKV_BIAS, Architecture, HFArchitecture

ARCH = Architecture(
    name="llama",
    rope_style=RopeStyle.NORMAL,
    hf=HFArchitecture(
        "llama", ("LlamaForCausalLM",), {**HF_PRE_NORMS, **HF_ATTENTION, **HF_QKV_BIAS, **HF_FFN},
        defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0,
                  "tie_word_embeddings": False},
    ),
)
