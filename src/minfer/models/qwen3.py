"""Qwen3: per-head RMSNorm of q and k (not v) after the projections and before RoPE, NEOX RoPE,
no biases, and a head dim (``attention.key_length``) decoupled from n_embd / n_head."""

from minfer.graph.ir import RopeStyle
from minfer.models.architecture import (
    HF_ATTENTION,
    HF_FFN,
    HF_PRE_NORMS,
    HF_QK_NORM,
    HF_QKV_BIAS,
    Architecture,
    HFArchitecture,
    QKNorm,
)

ARCH = Architecture(
    name="qwen3",
    rope_style=RopeStyle.NEOX,
    qk_norm=QKNorm.PER_HEAD,
    hf=HFArchitecture(
        "qwen3", ("Qwen3ForCausalLM",), {**HF_PRE_NORMS, **HF_ATTENTION, **HF_QKV_BIAS, **HF_QK_NORM, **HF_FFN},
        defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
                  "tie_word_embeddings": False, "head_dim": 128},
    ),
)
