"""The families added after the first five: Granite, Phi-3, Gemma 2 and the mixtures of experts
Qwen3-MoE, Qwen2-MoE (with a shared expert) and Mixtral, each a tiny random-weight fixture made by
``scripts/make_family_fixtures.py``.

DESIGN.md's contract for each: max |logit - transformers' fp32 logit| <= 1e-4 at every position, from GGUF F32
and from the HF folder, at 1 and 2 threads (bit-identical between them). For the experts: a decode step reads
the chosen experts' weights only, a prefill equals its tokens decoded one by one, the trace shows the routing,
and a file whose expert count disagrees with its tensors, or that asks for more experts per token than it has,
is refused at load time naming both.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FAMILY_ARCHS, copy_hf_folder, derive_gguf, fixture_dir, fixture_logits, fixture_sequences

import minfer
from minfer.errors import MinferError
from minfer.formats.quants import GGMLType

TOL = 1e-4
MOE_ARCHS = ["qwen3moe", "qwen2moe", "mixtral"]


def _max_diff(model, arch: str) -> float:
    return max(float(np.abs(model.logits(s) - fixture_logits(arch, k)).max())
               for k, s in enumerate(fixture_sequences(arch)))


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
@pytest.mark.parametrize("source", ["model-f32.gguf", "hf"])
@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_logits_match_transformers_at_1_and_2_threads(arch, source, kernels):
    got = {}
    for threads in (1, 2):
        model = minfer.load(fixture_dir(arch) / source, n_ctx=64, threads=threads, kernels=kernels)
        diff = _max_diff(model, arch)
        assert diff <= TOL, f"{arch} {source} {kernels} threads={threads}: max |dlogit| = {diff:.3g}"
        got[threads] = model.logits(fixture_sequences(arch)[2])
    np.testing.assert_array_equal(got[1], got[2])


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_hf_folder_equals_its_gguf_conversion(arch):
    hf = minfer.load(fixture_dir(arch) / "hf", n_ctx=64)
    gg = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64)
    for k in ("n_expert", "n_expert_used", "n_ff_exp", "n_ff_shexp", "expert_weights_norm", "embd_scale",
              "residual_scale",
              "logit_scale", "attn_softcap", "final_softcap", "sliding_window", "swa_layers", "n_rot"):
        assert getattr(hf.hparams, k) == getattr(gg.hparams, k), k
    assert hf.hparams.attn_scale == pytest.approx(gg.hparams.attn_scale, rel=1e-7)
    seq = fixture_sequences(arch)[2]
    assert float(np.abs(hf.logits(seq) - gg.logits(seq)).max()) <= 2e-5


def test_granite_multipliers():
    for source in ("model-f32.gguf", "hf"):
        hp = minfer.load(fixture_dir("granite") / source, n_ctx=16).hparams
        assert (hp.embd_scale, hp.residual_scale, hp.logit_scale) == (3.0, 0.5, 2.5)
        assert hp.attn_scale == pytest.approx(0.15)  # not 1/sqrt(head_dim) = 0.354


def test_gemma2_layout():
    for source in ("model-f32.gguf", "hf"):
        hp = minfer.load(fixture_dir("gemma2") / source, n_ctx=16).hparams
        assert [hp.layer_window(il) for il in range(4)] == [6, 0, 6, 0]
        assert (hp.attn_softcap, hp.final_softcap) == (5.0, 3.0)
        assert hp.attn_scale == pytest.approx(16 ** -0.5)


def test_gemma2_softcaps_matter():
    """Each soft-capping moves these logits far beyond the contract (so the 1e-4 agreement tests both)."""
    import dataclasses

    seq = fixture_sequences("gemma2")[2]
    want = fixture_logits("gemma2", 2)
    for field in ("attn_softcap", "final_softcap"):
        model = minfer.load(fixture_dir("gemma2") / "model-f32.gguf", n_ctx=64)
        model.transformer.hparams = dataclasses.replace(model.transformer.hparams, **{field: 0.0})
        model.runner._plans.clear()
        assert float(np.abs(model.logits(seq) - want).max()) > 0.05, field


def test_phi3_long_factors_beyond_the_original_context():
    """LongRoPE: the short factors in a context up to the original 64 positions, the long ones beyond (the 80-token
    reference is transformers' with its long factors); the choice moves the logits."""
    tokens = json.loads((fixture_dir("phi3") / "tokens.json").read_text())
    for source in ("model-f32.gguf", "hf"):
        hp = minfer.load(fixture_dir("phi3") / source, n_ctx=16).hparams
        assert hp.rope_scaling.kind == "longrope" and hp.rope_scaling.n_ctx_orig == 64
        assert hp.rope_scaling.mscale == pytest.approx((1 + np.log(4) / np.log(64)) ** 0.5, rel=1e-6)
        long_ctx = minfer.load(fixture_dir("phi3") / source, n_ctx=128)
        diff = float(np.abs(long_ctx.logits(tokens["long_sequence"]) - np.load(fixture_dir("phi3") /
                                                                                "logits_long.npy")).max())
        assert diff <= TOL, f"phi3 {source} long sequence: {diff:.3g}"
        # the same 33 tokens in a long context use the long factors: not transformers' short-factor logits
        seq = fixture_sequences("phi3")[2]
        assert float(np.abs(long_ctx.logits(seq) - fixture_logits("phi3", 2)).max()) > 0.05


# --- mixtures of experts ----------------------------------------------------------------------------------


def _shared_bytes(tensors) -> int:
    return sum(tensors[f"blk.0.ffn_{k}_shexp.weight"].nbytes for k in ("gate", "up", "down", "gate_inp")
               if f"blk.0.ffn_{k}_shexp.weight" in tensors)


def _routes(trace_path):
    """Per call and layer, the experts and weights the trace recorded."""
    out = {}
    for line in trace_path.read_text().splitlines():
        r = json.loads(line)
        if r.get("op") == "moe_route":
            out.setdefault(r["call"], {})[r["layer"]] = (r["experts"], r["expert_weights"])
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_trace_shows_the_routing_transformers_chose(arch, tmp_path):
    path = tmp_path / "trace.jsonl"
    model = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, trace=path)
    model.logits(fixture_sequences(arch)[2])
    model.tracer.close()
    routes = _routes(path)[0]
    ref = json.loads((fixture_dir(arch) / "routing.json").read_text())["experts"]
    hp = model.hparams
    for il in range(hp.n_layer):
        experts, weights = routes[il]
        assert experts == ref[il], f"layer {il}"
        w = np.asarray(weights)
        assert w.shape == (len(ref[il]), hp.n_expert_used) and (np.diff(w, axis=1) <= 0).all()
        if hp.expert_weights_norm:  # Qwen3-MoE and Mixtral renormalize the chosen weights, Qwen2-MoE does not
            np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=1e-6)
        else:
            assert (w.sum(axis=1) < 0.999).all()


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_decode_reads_only_the_chosen_experts(arch, kernels, tmp_path):
    """The kernel's byte counter equals the chosen experts' bytes in a decode step; and for a one-token forward,
    poisoning every expert it did not choose with NaN (a file whose other experts cannot be read without spoiling
    the logits) changes nothing."""
    seq = fixture_sequences(arch)[1][:3]
    path = tmp_path / "trace.jsonl"
    model = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, trace=path, kernels=kernels)
    runner, reads = model.runner, model.runner.backend.expert_reads
    runner.forward(seq[:2], range(2))
    reads.reset()
    runner.forward(seq[2:], [2])
    hp, tensors = model.hparams, model.transformer.tensors
    per_expert = sum(tensors[f"blk.0.ffn_{k}_exps.weight"].experts[0].nbytes for k in ("gate", "up", "down"))
    shared = _shared_bytes(tensors)  # Qwen2-MoE's shared expert: every token reads it
    assert reads.bytes == hp.n_layer * (hp.n_expert_used * per_expert + shared)
    assert reads.experts == 3 * hp.n_layer * hp.n_expert_used
    assert per_expert * hp.n_expert_used < sum(tensors[f"blk.0.ffn_{k}_exps.weight"].nbytes for k in ("gate", "up",
                                                                                                     "down"))
    # one token alone (position 0: nothing cached that other experts could have made)
    want = runner.forward(seq[:1], [0])
    model.tracer.close()
    alone = _routes(path)[2]
    chosen = {il: set(alone[il][0][0]) for il in range(hp.n_layer)}

    def poison(name, arr):
        if name.endswith("_exps.weight"):
            il = int(name.split(".")[1])
            for e in range(arr.shape[0]):
                if e not in chosen[il]:
                    arr = arr.copy()
                    arr[e] = np.nan
        return arr, None

    poisoned = derive_gguf(fixture_dir(arch) / "model-f32.gguf", tmp_path / "poisoned.gguf", transform=poison)
    got = minfer.load(poisoned, n_ctx=64, kernels=kernels).runner.forward(seq[:1], [0])
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_of_64_tokens_equals_64_decodes(arch, threads, tmp_path):
    """The prefill groups its tokens by expert: each expert some token chose is read once per layer (the byte
    counter equals the distinct chosen experts' bytes, from the trace's routing); a decode step runs the same
    float operations per row: bit-equal."""
    rng = np.random.default_rng(5)
    seq = [0] + rng.integers(3, 512, 63).tolist()
    path = tmp_path / "trace.jsonl"
    model = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, threads=threads, trace=path)
    runner, reads = model.runner, model.runner.backend.expert_reads
    reads.reset()
    full = runner.forward(seq, range(64))
    model.tracer.close()
    hp, tensors = model.hparams, model.transformer.tensors
    per_expert = sum(tensors[f"blk.0.ffn_{k}_exps.weight"].experts[0].nbytes for k in ("gate", "up", "down"))
    distinct = sum(len({e for row in experts for e in row}) for experts, _ in _routes(path)[0].values())
    shared = hp.n_layer * _shared_bytes(tensors)
    assert reads.bytes - shared == distinct * per_expert < 64 * hp.n_layer * hp.n_expert_used * per_expert
    model = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, threads=threads)
    rows = [model.runner.forward([t], [p]) for p, t in enumerate(seq)]
    np.testing.assert_array_equal(np.concatenate(rows), full)


def test_expert_count_disagreeing_with_the_tensors_is_refused(tmp_path):
    bad = derive_gguf(fixture_dir("qwen3moe") / "model-f32.gguf", tmp_path / "bad.gguf",
                      kv={"qwen3moe.expert_count": 6})
    with pytest.raises(MinferError, match=r"blk\.0\.ffn_gate_inp\.weight.* holds 8 experts but qwen3moe\.expert_count "
                                          r"is 6"):
        minfer.load(bad, n_ctx=16)


def test_top_k_above_the_expert_count_is_refused(tmp_path):
    bad = derive_gguf(fixture_dir("mixtral") / "model-f32.gguf", tmp_path / "bad.gguf",
                      kv={"llama.expert_used_count": 5})
    with pytest.raises(MinferError, match=r"llama\.expert_used_count 5 must be between 1 and llama\.expert_count 4"):
        minfer.load(bad, n_ctx=16)
    cfg = json.loads((fixture_dir("qwen3moe") / "hf" / "config.json").read_text())
    folder = copy_hf_folder(tmp_path / "hf", "qwen3moe", {**cfg, "num_experts_per_tok": 9})
    with pytest.raises(MinferError, match=r"num_experts_per_tok 9 is above num_\w*experts 8"):
        minfer.load(folder, n_ctx=16)


def test_hf_expert_count_disagreeing_with_the_folder_is_refused(tmp_path):
    cfg = json.loads((fixture_dir("mixtral") / "hf" / "config.json").read_text())
    folder = copy_hf_folder(tmp_path / "hf", "mixtral", {**cfg, "num_local_experts": 3, "num_experts_per_tok": 2})
    with pytest.raises(MinferError, match=r"tensor 'model\.layers\.0\.block_sparse_moe\.gate\.weight' holds 4 experts "
                                          r"but .*config\.json: num_local_experts is 3"):
        minfer.load(folder, n_ctx=16)


def test_inspect_names_the_features():
    from minfer.tools.model_summary import summarize

    def features(arch):
        return summarize(minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=16).transformer)["features"]

    assert "mixture of experts (8 experts of width 32, 2 per token, weights renormalized)" in features("qwen3moe")
    assert "soft-capping (attention 5, logits 3)" in features("gemma2")
    assert "residual x 0.5, logits / 2.5" in features("granite")
    assert "rope scaling (longrope)" in features("phi3")
    assert "mixture of experts (8 experts of width 32, 2 per token, shared expert of width 48)" in features("qwen2moe")


@pytest.mark.parametrize("source", ["model-f32.gguf", "hf"])
def test_quantize_at_load_quantizes_each_expert(source):
    """``quantize="q8_0"`` reaches the experts (one Q8_0 matrix each); the logits stay close to fp32's."""
    from minfer.formats.tensors import ExpertTensors

    model = minfer.load(fixture_dir("qwen3moe") / source, n_ctx=64, quantize="q8_0")
    stacks = [t for t in model.transformer.tensors.values() if isinstance(t, ExpertTensors)]
    assert stacks and all(e.ggml_type is GGMLType.Q8_0 for s in stacks for e in s.experts)
    seq = fixture_sequences("qwen3moe")[2]
    want = fixture_logits("qwen3moe", 2)
    assert float(np.linalg.norm(model.logits(seq) - want) / np.linalg.norm(want)) < 0.05
