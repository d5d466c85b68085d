"""Qwen2 / Qwen2.5: biases on q/k/v, NEOX RoPE pairing (i, i + d/2), usually tied embeddings."""

from minfer.graph.ir import RopeStyle
from minfer.models.architecture import HF_ATTENTION, HF_FFN, HF_PRE_NORMS, HF_QKV_BIAS, Architecture, HFArchitecture

ARCH = Architecture(
    name="qwen2",
    rope_style=RopeStyle.NEOX,
    qkv_bias=True,
    hf=HFArchitecture(
        "qwen2", ("Qwen2ForCausalLM",), {**HF_PRE_NORMS, **HF_ATTENTION, **HF_QKV_BIAS, **HF_FFN},
        defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
                  "tie_word_embeddings": False},
    ),
)
