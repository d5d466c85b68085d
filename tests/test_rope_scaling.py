"""RoPE scaling (Llama 3 frequency factors, linear, YaRN) from HF config.json and from GGUF metadata.

References: transformers' ``ROPE_INIT_FUNCTIONS`` numbers for several configs (``rope_scaling_refs.json``)
and transformers' fp32 logits of two tiny models whose RoPE is scaled (``llama/variants/llama3``,
``qwen3/variants/yarn``; same weights as the base fixtures, so the HF folders and GGUF files are derived
from the base fixtures here). The fixture script checks independently that llama.cpp's formulas (the
``rope_freqs.weight`` divisors, ``rope_yarn``) reproduce those logits in float64.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import (
    FIXTURES,
    copy_hf_folder,
    derive_gguf,
    fixture_dir,
    fixture_logits,
    fixture_sequences,
    load_json,
    variant_dir,
)

import minfer
from minfer.backends.cpu import reference as ref
from minfer.backends.cpu import rope as rope_kernels
from minfer.errors import FormatError, ModelError
from minfer.graph.ir import RopeMeta, RopeStyle
from minfer.models.rope_scaling import hf_rope_parameters, rope_scaling_from_hf

TOL = 1e-4
VARIANTS = {"llama3": "llama", "yarn": "qwen3"}


def _meta_from_hf(cfg: dict) -> RopeMeta:
    params = hf_rope_parameters(cfg, "config.json")
    n_rot = cfg["head_dim"]
    base = float(params["rope_theta"])
    s = rope_scaling_from_hf(params, cfg, n_rot, base, "config.json")
    return RopeMeta(1, n_rot, n_rot, base, s.freq_scale, RopeStyle.NEOX, freq_factors=s.freq_factors,
                    ext_factor=s.ext_factor, corr_dims=s.corr_dims(n_rot, base), mscale=s.mscale)


@pytest.mark.parametrize("case", load_json(FIXTURES / "rope_scaling_refs.json")["cases"],
                         ids=lambda c: f"{c['config']['rope_parameters']['rope_type']}-{c['config']['head_dim']}")
def test_frequencies_and_attention_factor_match_transformers(case):
    """Our float64 frequencies against transformers' float32 ones: within the rounding of its float32 chain
    (base**x, 1/x, the ramp or the smoothing: a few float32 ulps, ~6e-8 each)."""
    meta = _meta_from_hf(case["config"])
    got, want = ref.rope_freqs(meta), np.asarray(case["inv_freq"])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert meta.mscale == pytest.approx(case["attention_factor"], rel=1e-12)


def _variant_folder(tmp_path, name: str):
    config = json.loads((variant_dir(VARIANTS[name], name) / "config.json").read_text())
    return copy_hf_folder(tmp_path / name, VARIANTS[name], config=config)


def _variant_gguf(tmp_path, name: str):
    arch = VARIANTS[name]
    meta = load_json(variant_dir(arch, name) / "meta.json")["gguf"]
    extra = {"rope_freqs.weight": np.asarray(meta["rope_freqs"], np.float32)} if meta["rope_freqs"] else {}
    return derive_gguf(fixture_dir(arch) / "model-f32.gguf", tmp_path / f"{name}.gguf", kv=meta["metadata"],
                       tensors=extra)


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize(("threads", "kernels"), [(1, "fast"), (2, "fast"), (1, "reference"), (2, "reference")])
def test_scaled_rope_logits_match_transformers(tmp_path, name, source, threads, kernels):
    path = _variant_folder(tmp_path, name) if source == "hf" else _variant_gguf(tmp_path, name)
    model = minfer.load(path, n_ctx=64, threads=threads, kernels=kernels)
    assert model.hparams.rope_scaling.kind == name
    seq = fixture_sequences(VARIANTS[name])[2]
    want = np.load(variant_dir(VARIANTS[name], name) / "logits_2.npy")
    diff = float(np.abs(model.logits(seq) - want).max())
    assert diff <= TOL, f"{name} from {source}: max |dlogit| = {diff:.3g}"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_scaling_changes_the_logits(tmp_path, name):
    """The scaled references are far from the unscaled model's: a loader that ignored the scaling fails."""
    arch = VARIANTS[name]
    seq = fixture_sequences(arch)[2]
    unscaled = minfer.load(fixture_dir(arch) / "hf", n_ctx=64).logits(seq)
    np.testing.assert_allclose(unscaled, fixture_logits(arch, 2), atol=TOL)
    scaled_ref = np.load(variant_dir(arch, name) / "logits_2.npy")
    assert float(np.abs(unscaled - scaled_ref).max()) > 1.0


def test_hf_and_gguf_describe_the_same_scaling(tmp_path):
    for name in VARIANTS:
        hf = minfer.load(_variant_folder(tmp_path, name), n_ctx=16).hparams
        gg = minfer.load(_variant_gguf(tmp_path, name), n_ctx=16).hparams
        mh = ref.rope_freqs(_rope_meta(hf))
        mg = ref.rope_freqs(_rope_meta(gg))
        np.testing.assert_allclose(mh, mg, rtol=1e-6)  # GGUF stores the factors / keys as float32
        assert hf.rope_scaling.mscale == pytest.approx(gg.rope_scaling.mscale, rel=1e-6)
        assert name in hf.rope_scaling.describe() and "config.json" in hf.rope_scaling.describe()
        assert "GGUF" in gg.rope_scaling.describe()


def _rope_meta(hp):
    from minfer.models.rope_scaling import rope_meta

    return rope_meta(hp, RopeStyle.NEOX, 1)


def test_linear_scaling_from_gguf_and_hf(tmp_path):
    """Linear: every frequency divided by the factor (freq_scale = 1/factor), from either source."""
    gguf_path = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path / "lin.gguf",
                            kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    hp = minfer.load(gguf_path, n_ctx=16).hparams
    assert hp.rope_scaling.kind == "linear" and hp.rope_freq_scale == 0.25
    cfg = json.loads((fixture_dir("llama") / "hf" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    hf = minfer.load(copy_hf_folder(tmp_path / "lin", "llama", config=cfg), n_ctx=16).hparams
    assert hf.rope_freq_scale == 0.25
    np.testing.assert_allclose(ref.rope_freqs(_rope_meta(hf)), ref.rope_freqs(_rope_meta(hp)))
    # llama.cpp reads a factor without a type as linear
    old = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path / "old.gguf",
                      kv={"llama.rope.scaling.factor": 2.0})
    assert minfer.load(old, n_ctx=16).hparams.rope_freq_scale == 0.5


def test_legacy_rope_scaling_key(tmp_path):
    """Older config.json files spell it ``rope_scaling`` with ``type`` and a top-level ``rope_theta``."""
    cfg = json.loads((variant_dir("llama", "llama3") / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    cfg["rope_scaling"] = params
    model = minfer.load(copy_hf_folder(tmp_path / "legacy", "llama", config=cfg), n_ctx=64)
    seq = fixture_sequences("llama")[2]
    want = np.load(variant_dir("llama", "llama3") / "logits_2.npy")
    assert float(np.abs(model.logits(seq) - want).max()) <= TOL


def test_unsupported_scaling_types_name_the_key(tmp_path):
    bad = derive_gguf(fixture_dir("qwen3") / "model-f32.gguf", tmp_path / "bad.gguf",
                      kv={"qwen3.rope.scaling.type": "longrope", "qwen3.rope.scaling.factor": 4.0})
    with pytest.raises(ModelError, match=r"qwen3\.rope\.scaling\.type 'longrope' is not supported"):
        minfer.load(bad, n_ctx=16)
    cfg = json.loads((fixture_dir("qwen3") / "hf" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
    with pytest.raises(ModelError, match=r"config\.json: rope_parameters\.rope_type 'dynamic' is not supported"):
        minfer.load(copy_hf_folder(tmp_path / "dyn", "qwen3", config=cfg), n_ctx=16)
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1e6, "factor": 2.0}
    with pytest.raises(FormatError, match=r"rope_parameters\.low_freq_factor is required"):
        minfer.load(copy_hf_folder(tmp_path / "l3", "qwen3", config=cfg), n_ctx=16)
    wrong = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path / "freqs.gguf",
                        tensors={"rope_freqs.weight": np.ones(5, np.float32)})
    with pytest.raises(ModelError, match=r"rope_freqs\.weight.*expected F32 \(8,\)"):
        minfer.load(wrong, n_ctx=16)


SCALED_METAS = [
    dict(freq_factors=(1.0, 1.3, 7.7, 8.0, 8.0, 8.0, 8.0, 8.0)),
    dict(freq_scale=0.25, ext_factor=1.0, corr_dims=(1.0, 5.0), mscale=1.1386294361),
    dict(freq_scale=0.5, freq_factors=(1.0, 2.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0), ext_factor=0.5, corr_dims=(2.0, 2.0)),
]


@pytest.mark.parametrize("style", [RopeStyle.NORMAL, RopeStyle.NEOX])
@pytest.mark.parametrize("scaled", SCALED_METAS)
def test_rope_table_matches_reference_exactly_with_scaling(style, scaled):
    rng = np.random.default_rng(3)
    fields = dict(freq_scale=1.0) | scaled
    meta = RopeMeta(n_head=3, head_dim=16, n_rot=16, freq_base=1e4, style=style, **fields)
    table = rope_kernels.RopeTable.from_meta(meta, n_pos=4)
    for positions in ([0], [5, 2, 900], list(range(40)), [-3, 7]):
        pos = np.array(positions, np.int32)
        x = rng.standard_normal((len(pos), 48)).astype(np.float32)
        expect, got = np.empty_like(x), np.empty_like(x)
        ref.rope(x, pos, meta, expect)
        table.apply(x, pos, 3, style is RopeStyle.NEOX, got)
        np.testing.assert_array_equal(got, expect)


def test_yarn_ramp_and_magnitude_by_hand():
    """YaRN on two pairs around the ramp: pair 0 (below corr_dims[0]) keeps its unscaled frequency, pair 7
    (above corr_dims[1]) is fully scaled, pair 3 is the linear mix; cos/sin carry the attention factor."""
    meta = RopeMeta(1, 16, 16, 1e4, 0.25, RopeStyle.NEOX, ext_factor=1.0, corr_dims=(1.0, 5.0), mscale=1.2)
    f = ref.rope_freqs(meta)
    base = 1e4 ** (-np.arange(8) / 8)
    assert f[0] == pytest.approx(base[0]) and f[7] == pytest.approx(base[7] / 4)
    r = 1 - (3 - 1) / (5 - 1)  # ramp at pair 3
    assert f[3] == pytest.approx(base[3] / 4 * (1 - r) + base[3] * r)
    x = np.zeros((1, 16), np.float32)
    x[0, 0] = 1.0
    out = np.empty_like(x)
    ref.rope(x, np.array([3]), meta, out)
    assert math.hypot(out[0, 0], out[0, 8]) == pytest.approx(1.2, rel=1e-6)


def test_context_shift_with_yarn_is_a_pure_rotation(tmp_path):
    """After a shift, layer 0's K rows equal a fresh pass over the kept tokens: the magnitude YaRN puts on
    cos/sin is applied once, not again by the re-rotation."""
    model = minfer.load(_variant_folder(tmp_path, "yarn"), n_ctx=64, threads=1)
    seq = fixture_sequences("qwen3")[2]
    model.runner.forward(seq[:30], range(30))
    model.runner.shift_context(0, n_keep=5, n_discard=12)
    kept = model.kv.tokens(0)
    k_shifted = model.kv.layers[0].k[:18].copy()
    model.logits(kept)
    np.testing.assert_allclose(k_shifted, model.kv.layers[0].k[:18], atol=1e-5)
