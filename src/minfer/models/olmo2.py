"""OLMo 2 (GGUF ``olmo2``, HF ``Olmo2ForCausalLM``), laid out as transformers and llama.cpp run it.

What differs from the llama recipe:

* no norm before attention or before the FFN: q/k/v and gate/up read the residual stream itself;
* RMSNorm of q over its whole width (n_head x head_dim values, one gain per value) and of k over its
  whole width, right after the projections and before the heads are split and rotated (Qwen3 normalizes
  each head instead); NEOX RoPE pairing (i, i + d/2), so the GGUF converter leaves W_q/W_k as trained;
* the attention output and the FFN output are each RMS-normalized (``post_attention_norm``,
  ``post_ffw_norm``) before they are added to the residual stream; HF calls the first
  ``post_attention_layernorm``, the name Llama gives its FFN input norm;
* untied output by default, no biases.

Its GGUF carries the common ``olmo2.*`` hyperparameter keys only.
"""

from minfer.graph.ir import RopeStyle
from minfer.models.architecture import HF_ATTENTION, HF_FFN, HF_QK_NORM, Architecture, HFArchitecture, QKNorm

ARCH = Architecture(
    name="olmo2",
    rope_style=RopeStyle.NEOX,
    pre_norms=False,
    qk_norm=QKNorm.WHOLE_WIDTH,
    post_norms=True,
    hf=HFArchitecture(
        "olmo2", ("Olmo2ForCausalLM",),
        {
            **HF_ATTENTION,
            **HF_QK_NORM,
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            **HF_FFN,
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        },
        # Olmo2Config's defaults (its rope_theta: transformers' default 10000)
        defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 10000.0,
                  "tie_word_embeddings": False},
    ),
)
