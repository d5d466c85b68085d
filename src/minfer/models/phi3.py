"""Phi-3 (GGUF ``phi3``, HF ``Phi3ForCausalLM``): the Llama recipe with fused projections and LongRoPE.

* q, k and v come from one fused matrix (GGUF ``attn_qkv``, HF ``qkv_proj``: q rows, then k, then v), and
  the FFN's gate and up from one (GGUF ``ffn_up`` of 2 x n_ff rows, HF ``gate_up_proj``: gate rows first).
  The loader splits them into the recipe's matrices as views of the same rows (no copies);
* NEOX RoPE pairing (the converter leaves W_q/W_k as trained);
* LongRoPE ("su") scaling in the 128k models: two sets of per-pair frequency divisors, GGUF tensors
  ``rope_factors_short`` / ``rope_factors_long`` (HF ``rope_scaling.short_factor`` / ``long_factor``), and
  cos/sin multiplied by ``rope.scaling.attn_factor`` (HF: sqrt(1 + ln(s) / ln(n_orig)) with s the ratio of
  ``max_position_embeddings`` to ``original_max_position_embeddings``). The long factors apply when the
  context exceeds the original one: llama.cpp decides by the context size, and so do we (transformers
  decides by the sequence length; they agree for sequences that fill their context).

Phi-3's sliding window (2047 positions in the mini models) is not applied, as llama.cpp does not apply it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from minfer.errors import FormatError, ModelError
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.quants import GGMLType
from minfer.formats.tensors import WeightTensor, tensor_rows
from minfer.graph.ir import RopeStyle
from minfer.models.architecture import HF_PRE_NORMS, Architecture, HFArchitecture
from minfer.models.hparams import HParams
from minfer.models.rope_scaling import RopeScaling


def phi3_split_fused(tensors: dict[str, Any], hp: HParams, describe: Callable[[str], str]) -> dict[str, Any]:
    """``attn_qkv`` -> ``attn_q``/``attn_k``/``attn_v`` and a gate_up ``ffn_up`` -> ``ffn_gate``/``ffn_up``."""
    out = dict(tensors)
    widths = (hp.q_width, hp.k_width, hp.v_width)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        qkv = out.pop(p + "attn_qkv.weight", None)
        if qkv is not None:
            want = (sum(widths), hp.n_embd)
            if qkv.shape != want:
                raise ModelError(f"{describe(p + 'attn_qkv.weight')} has shape {qkv.shape}, expected {want} "
                                 f"(q {widths[0]} + k {widths[1]} + v {widths[2]} rows)")
            r = 0
            for which, n in zip("qkv", widths, strict=True):
                out[f"{p}attn_{which}.weight"] = tensor_rows(qkv, r, r + n, f"{p}attn_{which}.weight")
                r += n
        up = out.get(p + "ffn_up.weight")
        if up is not None and p + "ffn_gate.weight" not in out:
            want = (2 * hp.n_ff, hp.n_embd)
            if up.shape != want:
                raise ModelError(f"{describe(p + 'ffn_up.weight')} has shape {up.shape}, expected {want} "
                                 f"(the fused gate and up rows, {hp.n_ff} each)")
            out[p + "ffn_gate.weight"] = tensor_rows(up, 0, hp.n_ff, p + "ffn_gate.weight")
            out[p + "ffn_up.weight"] = tensor_rows(up, hp.n_ff, 2 * hp.n_ff, p + "ffn_up.weight")
    return out


def _factors(f: GGUFFile, name: str, n_rot: int) -> tuple[float, ...] | None:
    t: WeightTensor | None = f.tensors.get(name)
    if t is None:
        return None
    if t.shape != (n_rot // 2,) or t.ggml_type != GGMLType.F32:
        raise ModelError(f"{f.path}: tensor {name!r} is {t.ggml_type.name} {t.shape}, expected F32 ({n_rot // 2},) "
                         "(one factor per rotating pair)")
    values = tuple(float(v) for v in t.data.view(np.float32).reshape(-1))
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ModelError(f"{f.path}: tensor {name!r} holds a factor that is not a positive number")
    return values


def phi3_gguf_hparams(f: GGUFFile, hp: HParams) -> HParams:
    """LongRoPE from ``rope_factors_long/short.weight``, ``rope.scaling.attn_factor`` and the original context."""
    long, short = _factors(f, "rope_factors_long.weight", hp.n_rot), _factors(f, "rope_factors_short.weight", hp.n_rot)
    if long is None and short is None:
        return hp
    if long is None or short is None:
        missing = "rope_factors_long.weight" if long is None else "rope_factors_short.weight"
        raise FormatError(f"{f.path}: missing tensor {missing!r} (LongRoPE needs both factor sets)")
    key = f"{f.architecture}.rope.scaling."
    n_orig = int(f.get(key + "original_context_length", hp.n_ctx_train))
    attn_factor = f.get(key + "attn_factor", 1.0)
    if isinstance(attn_factor, bool) or not isinstance(attn_factor, (int, float)) or not attn_factor > 0:
        raise FormatError(f"{f.path}: metadata key {key + 'attn_factor'!r} must be a positive number, "
                          f"got {attn_factor!r}")
    scaling = RopeScaling(kind="longrope", freq_factors=short, long_freq_factors=long, n_ctx_orig=n_orig,
                          mscale=float(attn_factor), source="GGUF rope_factors_long/short.weight")
    return dataclasses.replace(hp, rope_scaling=scaling)


ARCH = Architecture(
    name="phi3",
    rope_style=RopeStyle.NEOX,
    gguf_extra_hparams=phi3_gguf_hparams,
    split_fused=phi3_split_fused,
    hf=HFArchitecture(
        "phi3", ("Phi3ForCausalLM",),
        {
            **HF_PRE_NORMS,
            "self_attn.qkv_proj.weight": "attn_qkv.weight",
            "self_attn.o_proj.weight": "attn_output.weight",
            "mlp.gate_up_proj.weight": "ffn_up.weight",
            "mlp.down_proj.weight": "ffn_down.weight",
        },
        # Phi3Config's defaults
        defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "rope_theta": 10000.0,
                  "tie_word_embeddings": False},
    ),
)
