"""RoPE scaling for long-context checkpoints: Llama 3 frequency factors, linear interpolation and YaRN.

Both sources describe the same three mechanisms, and both end in one :class:`RopeScaling`:

* **GGUF** (llama.cpp's keys): ``{arch}.rope.scaling.type`` (``none``, ``linear``, ``yarn``; llama.cpp reads
  a missing type as ``linear``, which only matters when a factor is given), ``rope.scaling.factor`` (or the
  old ``rope.scale_linear``), ``rope.scaling.original_context_length``, ``rope.scaling.yarn_beta_fast`` /
  ``yarn_beta_slow`` / ``yarn_ext_factor`` / ``yarn_log_multiplier``, ``rope.scaling.attn_factor``. Llama 3
  scaling has no key: the converter stores the tensor ``rope_freqs.weight``, one divisor per rotating pair
  of the base frequencies, which ``ggml_rope_ext`` applies as ``theta / freq_factor``.
* **HF** ``config.json``: ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older files) with
  ``rope_type`` ``default`` / ``linear`` / ``llama3`` / ``yarn`` and their fields, as transformers'
  ``modeling_rope_utils`` reads them.

YaRN follows llama.cpp's ``rope_yarn`` and ``ggml_rope_yarn_corr_dims``: pair i rotates at
``interp * (1 - r_i) + extrap * r_i`` with ``interp = extrap / factor`` and a ramp r that is 1 below the
correction dim of ``beta_fast`` rotations and 0 above that of ``beta_slow`` rotations; cos and sin are
multiplied by the attention factor ``0.1 ln(factor) + 1`` (transformers' ``attention_factor``; llama.cpp
reaches the same product through ``yarn_attn_factor`` since its PR 17945). transformers'
``_compute_yarn_parameters`` is the same formula (``tests/test_rope_scaling.py`` checks the numbers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from minfer.errors import FormatError, ModelError
from minfer.graph.ir import RopeMeta, RopeStyle

SUPPORTED_HF_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "su")
SUPPORTED_GGUF_SCALING_TYPES = ("none", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How a model's RoPE frequencies depart from ``1 / base^(2i/n_rot)``; ``kind == "none"`` when they do not."""

    kind: str = "none"  # none | linear | llama3 | yarn | longrope
    factor: float = 1.0  # context extension factor (linear / yarn: frequencies divided by it)
    freq_factors: tuple[float, ...] | None = None  # per-pair divisors of the base frequencies (Llama 3)
    n_ctx_orig: int = 0  # the pre-scaling training context (YaRN's correction dims, Llama 3's wavelengths)
    beta_fast: float = 32.0  # YaRN: rotations above which a pair keeps its unscaled frequency
    beta_slow: float = 1.0  # YaRN: rotations below which a pair is fully scaled
    ext_factor: float = 0.0  # YaRN mix strength (1 for YaRN, 0 otherwise)
    truncate: bool = True  # YaRN: correction dims rounded outwards to whole pairs
    mscale: float = 1.0  # cos/sin magnitude (YaRN attention factor)
    # LongRoPE (Phi-3's "su"): freq_factors are the short factors, these the long ones, used when the context
    # exceeds n_ctx_orig (llama.cpp's choice by context size; transformers' by sequence length)
    long_freq_factors: tuple[float, ...] | None = None
    low_freq_factor: float = 0.0  # Llama 3 parameters, kept for display
    high_freq_factor: float = 0.0
    source: str = ""  # where it was read, for `minfer inspect`

    @property
    def freq_scale(self) -> float:
        return 1.0 / self.factor if self.kind in ("linear", "yarn") else 1.0

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def corr_dims(self, n_rot: int, freq_base: float) -> tuple[float, float]:
        """YaRN's ramp bounds in pair indices (``ggml_rope_yarn_corr_dims``)."""
        if not self.ext_factor:
            return (0.0, 0.0)

        def corr_dim(n_rotations: float) -> float:
            return n_rot * math.log(self.n_ctx_orig / (n_rotations * 2 * math.pi)) / (2 * math.log(freq_base))

        low, high = corr_dim(self.beta_fast), corr_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return (float(max(0.0, low)), float(min(n_rot - 1.0, high)))

    def describe(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "linear":
            text = f"linear, factor {self.factor:g}"
        elif self.kind == "llama3":
            text = f"llama3, factor {self.factor:g}"
            if self.low_freq_factor or self.high_freq_factor:
                text += f", low/high freq factor {self.low_freq_factor:g}/{self.high_freq_factor:g}"
            if self.n_ctx_orig:
                text += f", original context {self.n_ctx_orig}"
        elif self.kind == "longrope":
            text = (f"longrope, original context {self.n_ctx_orig}, attention factor {self.mscale:.6g} "
                    f"(long factors beyond the original context)")
        else:
            text = (f"yarn, factor {self.factor:g}, original context {self.n_ctx_orig}, beta fast/slow "
                    f"{self.beta_fast:g}/{self.beta_slow:g}, attention factor {self.mscale:.6g}")
        return f"{text} ({self.source})" if self.source else text


    def factors_for(self, n_ctx: int) -> tuple[float, ...] | None:
        """The per-pair frequency divisors a context of ``n_ctx`` positions uses (LongRoPE: long or short)."""
        if self.kind == "longrope" and n_ctx > self.n_ctx_orig:
            return self.long_freq_factors
        return self.freq_factors


def rope_meta(hp: Any, style: RopeStyle, n_head: int, freq_base: float | None = None,
              freq_scale: float | None = None, scaled: bool = True, n_ctx: int = 0) -> RopeMeta:
    """The RoPE node's meta for a model's hyperparameters (``HParams``), with its scaling applied.

    ``freq_base`` / ``freq_scale`` override the model's (layers with their own RoPE, such as Gemma 3's
    sliding-window ones); ``scaled=False`` leaves the scaling out (those layers are not scaled); ``n_ctx`` is the
    context the graph runs in (LongRoPE's long factors apply beyond the original context)."""
    s: RopeScaling = hp.rope_scaling if scaled else RopeScaling()
    base = hp.rope_freq_base if freq_base is None else freq_base
    return RopeMeta(
        n_head=n_head,
        head_dim=hp.head_dim_k,
        n_rot=hp.n_rot,
        freq_base=base,
        freq_scale=(hp.rope_freq_scale if scaled else 1.0) if freq_scale is None else freq_scale,
        style=style,
        freq_factors=s.factors_for(n_ctx),
        ext_factor=s.ext_factor,
        corr_dims=s.corr_dims(hp.n_rot, base),
        mscale=s.mscale,
    )


def layer_rope_meta(hp: Any, style: RopeStyle, n_head: int, il: int, n_ctx: int = 0) -> RopeMeta:
    """The RoPE meta of layer ``il``: the model's, or for a sliding-window layer (Gemma 3: ``hp.is_swa``) its
    own base and scale, without the model's scaling (which applies to the global layers only)."""
    if hp.is_swa(il):
        return rope_meta(hp, style, n_head, freq_base=hp.rope_freq_base_swa, freq_scale=hp.rope_freq_scale_swa,
                         scaled=False)
    return rope_meta(hp, style, n_head, n_ctx=n_ctx)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """``get_mscale`` of YaRN (transformers and llama.cpp): ``0.1 * mscale * ln(factor) + 1`` for factor > 1."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def llama3_freq_factors(n_rot: int, freq_base: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, n_ctx_orig: int) -> tuple[float, ...]:
    """Divisors of the base frequencies for Llama 3 scaling (what llama.cpp's converter stores as
    ``rope_freqs.weight``): 1 for wavelengths shorter than ``n_ctx_orig / high_freq_factor``, ``factor``
    for those longer than ``n_ctx_orig / low_freq_factor``, and a smooth interpolation between."""
    freqs = 1.0 / freq_base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    low_wavelen, high_wavelen = n_ctx_orig / low_freq_factor, n_ctx_orig / high_freq_factor
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = (n_ctx_orig / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


# ------------------------------------------------------------------------------------------------- GGUF


def rope_scaling_from_gguf(f: Any, n_rot: int, n_ctx_train: int) -> RopeScaling:
    """The scaling a GGUF file (``GGUFFile``) describes; errors name the key or tensor."""
    arch = f.architecture

    def key(name: str) -> str:
        return f"{arch}.rope.{name}"

    def number(name: str, default: float | None = None) -> float | None:
        value = f.get(key(name))
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FormatError(f"{f.path}: metadata key {key(name)!r} has value {value!r}, expected a number")
        return float(value)

    freq_factors = None
    t = f.tensors.get("rope_freqs.weight")
    if t is not None:
        from minfer.formats.quants import GGMLType

        if t.shape != (n_rot // 2,) or t.ggml_type != GGMLType.F32:
            raise ModelError(f"{f.path}: tensor 'rope_freqs.weight' is {t.ggml_type.name} {t.shape}, "
                             f"expected F32 ({n_rot // 2},) (one factor per rotating pair)")
        freq_factors = tuple(float(v) for v in t.data.view(np.float32).reshape(-1))
        if not all(math.isfinite(v) and v > 0 for v in freq_factors):
            raise ModelError(f"{f.path}: tensor 'rope_freqs.weight' holds a factor that is not a positive number")

    factor = number("scaling.factor")
    if factor is None:
        factor = number("scale_linear")  # the key's older name
    type_key = key("scaling.type")
    kind = f.get(type_key)
    if kind is None:
        kind = "linear" if factor not in (None, 0.0, 1.0) else "none"  # llama.cpp's default type is linear
    if not isinstance(kind, str):
        raise FormatError(f"{f.path}: metadata key {type_key!r} has value {kind!r}, expected a string")
    if kind not in SUPPORTED_GGUF_SCALING_TYPES:
        raise ModelError(f"{f.path}: {type_key} {kind!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_GGUF_SCALING_TYPES)}; Llama 3 scaling comes as rope_freqs.weight)")

    if kind == "none":
        if freq_factors is None:
            return RopeScaling()
        return RopeScaling(kind="llama3", factor=max(freq_factors), freq_factors=freq_factors,
                           source="GGUF rope_freqs.weight")
    if factor is None or not factor > 0:
        raise FormatError(f"{f.path}: {key('scaling.factor')} must be a positive number for {kind} scaling, "
                          f"got {factor}")
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor, freq_factors=freq_factors, source=f"GGUF {type_key}")

    n_ctx_orig = int(number("scaling.original_context_length", n_ctx_train) or n_ctx_train)
    log_mul = number("scaling.yarn_log_multiplier", 0.0) or 0.0
    if log_mul:
        mscale = yarn_mscale(factor, 1.0) / yarn_mscale(factor, log_mul)
    else:
        mscale = yarn_mscale(factor)
    mscale *= number("scaling.attn_factor", 1.0) or 1.0
    ext = number("scaling.yarn_ext_factor", 1.0)
    return RopeScaling(
        kind="yarn",
        factor=factor,
        freq_factors=freq_factors,
        n_ctx_orig=n_ctx_orig,
        beta_fast=number("scaling.yarn_beta_fast", 32.0) or 32.0,
        beta_slow=number("scaling.yarn_beta_slow", 1.0) or 1.0,
        ext_factor=1.0 if ext is None or ext < 0 else ext,  # llama.cpp: negative means "not set"
        mscale=mscale,
        source=f"GGUF {type_key}",
    )


# --------------------------------------------------------------------------------------------------- HF


def hf_rope_parameters(cfg: Mapping[str, Any], where: str, layer_type: str = "full_attention") -> dict[str, Any]:
    """The RoPE parameters of a config.json, merged as transformers' ``standardize_rope_params`` does:
    ``rope_parameters`` (transformers 5) or the older ``rope_scaling``, with a top-level ``rope_theta``.
    Parameters nested by layer type (``{"full_attention": {...}, "sliding_attention": {...}}``) give
    ``layer_type``'s."""
    params = cfg.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = cfg.get("rope_scaling"), "rope_scaling"
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise FormatError(f"{where}: field {field!r} must be an object, got {type(params).__name__}")
    if isinstance(params.get(layer_type), Mapping):
        params, field = params[layer_type], f"{field}.{layer_type}"
    out = dict(params)
    out.setdefault("rope_type", out.get("type", "default"))
    if "rope_theta" not in out and cfg.get("rope_theta") is not None:
        out["rope_theta"] = cfg["rope_theta"]
    out["_field"] = field
    return out


def rope_scaling_from_hf(params: Mapping[str, Any], cfg: Mapping[str, Any], n_rot: int, freq_base: float,
                         where: str) -> RopeScaling:
    """The scaling ``params`` (from :func:`hf_rope_parameters`) describe, as transformers computes it."""
    field = params.get("_field", "rope_parameters")
    rope_type = params.get("rope_type")
    if rope_type not in SUPPORTED_HF_ROPE_TYPES:
        raise ModelError(f"{where}: {field}.rope_type {rope_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_HF_ROPE_TYPES)})")
    if rope_type == "default":
        return RopeScaling()

    def num(name: str, default: float | None = None, required: bool = False) -> float | None:
        value = params.get(name)
        if value is None:
            if required:
                raise FormatError(f"{where}: {field}.{name} is required for rope_type {rope_type!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FormatError(f"{where}: {field}.{name} must be a number, got {value!r}")
        return float(value)

    source = f"config.json {field}"
    if rope_type == "linear":
        factor = num("factor", required=True)
        if not factor > 0:
            raise FormatError(f"{where}: {field}.factor must be positive, got {factor}")
        return RopeScaling(kind="linear", factor=factor, source=source)

    # llama3, yarn and longrope: transformers falls back to these top-level fields for the pre-scaling context
    n_ctx_orig = params.get("original_max_position_embeddings")
    if rope_type in ("longrope", "su") and n_ctx_orig is None:
        n_ctx_orig = cfg.get("original_max_position_embeddings")
    if rope_type == "yarn" and cfg.get("original_max_position_embeddings") is not None:
        n_ctx_orig = cfg["original_max_position_embeddings"]  # Phi3-style: outside, and it wins
    if n_ctx_orig is None:
        n_ctx_orig = cfg.get("max_position_embeddings")
    if isinstance(n_ctx_orig, bool) or not isinstance(n_ctx_orig, int) or n_ctx_orig <= 0:
        raise FormatError(f"{where}: {field}.original_max_position_embeddings must be a positive integer, "
                          f"got {n_ctx_orig!r}")

    if rope_type == "llama3":
        factor = num("factor", required=True)
        low = num("low_freq_factor", required=True)
        high = num("high_freq_factor", required=True)
        if not (factor > 0 and low > 0 and high > low):
            raise FormatError(f"{where}: {field} needs factor > 0 and high_freq_factor > low_freq_factor > 0, "
                              f"got {factor}, {low}, {high}")
        return RopeScaling(kind="llama3", factor=factor, n_ctx_orig=n_ctx_orig, low_freq_factor=low,
                           high_freq_factor=high, source=source,
                           freq_factors=llama3_freq_factors(n_rot, freq_base, factor, low, high, n_ctx_orig))

    factor = num("factor")
    if factor is None:
        factor = float(cfg["max_position_embeddings"]) / n_ctx_orig
    if not factor > 0:
        raise FormatError(f"{where}: {field}.factor must be positive, got {factor}")
    if rope_type in ("longrope", "su"):
        return _longrope_from_hf(params, field, n_rot, factor, n_ctx_orig, num("attention_factor"), where, source)
    attention_factor = num("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = num("mscale"), num("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    truncate = params.get("truncate", True)
    return RopeScaling(
        kind="yarn",
        factor=factor,
        n_ctx_orig=n_ctx_orig,
        beta_fast=num("beta_fast") or 32.0,
        beta_slow=num("beta_slow") or 1.0,
        ext_factor=1.0,
        truncate=bool(truncate),
        mscale=attention_factor,
        source=source,
    )


def _longrope_from_hf(params: Mapping[str, Any], field: str, n_rot: int, factor: float, n_ctx_orig: int,
                      attention_factor: float | None, where: str, source: str) -> RopeScaling:
    """transformers' ``_compute_longrope_parameters``: per-pair divisors ``short_factor`` / ``long_factor`` and
    the attention factor sqrt(1 + ln(factor) / ln(n_ctx_orig)) (1 when the context is not extended)."""
    sets = []
    for name in ("short_factor", "long_factor"):
        values = params.get(name)
        if (not isinstance(values, list) or len(values) != n_rot // 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values)):
            raise FormatError(f"{where}: {field}.{name} must list {n_rot // 2} positive numbers (one per rotating "
                              f"pair), got {values!r}")
        # transformers divides by the factors as float32 values
        sets.append(tuple(float(np.float32(v)) for v in values))
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(n_ctx_orig))
    return RopeScaling(kind="longrope", factor=factor, freq_factors=sets[0], long_freq_factors=sets[1],
                       n_ctx_orig=n_ctx_orig, mscale=attention_factor, source=source)
