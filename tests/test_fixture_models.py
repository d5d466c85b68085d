"""Tiny random-weight llama / qwen2 / qwen3 models against HF transformers' fp32 references.

DESIGN.md's contract: max |logit - reference| <= 1e-4 at every position, from GGUF F32, with the f32
KV cache, at 1 and 2 threads; the same greedy continuation. The Q8_0 GGUF is held to the float64
reference forward over its dequantized weights (see tests/fixtures/README.md).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ARCHS, fixture_dir, fixture_logits, fixture_sequences, load_json

import minfer

TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
def test_f32_logits_match_transformers(arch, threads):
    model = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, threads=threads)
    for k, seq in enumerate(fixture_sequences(arch)):
        got = model.logits(seq)
        want = fixture_logits(arch, k)
        assert got.shape == want.shape
        diff = float(np.abs(got - want).max())
        assert diff <= TOL, f"{arch} sequence {k}: max |dlogit| = {diff:.3g}"


def test_thread_count_does_not_change_results(arch):
    seq = fixture_sequences(arch)[2]
    a = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, threads=1).logits(seq)
    b = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, threads=2).logits(seq)
    assert np.array_equal(a, b)


def test_q8_0_logits_match_float64_reference(arch):
    model = minfer.load(fixture_dir(arch) / "model-q8_0.gguf", n_ctx=64)
    for k, seq in enumerate(fixture_sequences(arch)):
        diff = float(np.abs(model.logits(seq) - fixture_logits(arch, k, q8_0=True)).max())
        assert diff <= TOL, f"{arch} q8_0 sequence {k}: max |dlogit| = {diff:.3g}"


@pytest.mark.parametrize("variant,ref_dir", [("model-f32.gguf", ""), ("model-q8_0.gguf", "q8_0_ref/")])
def test_greedy_continuation_matches(arch, variant, ref_dir):
    ref = load_json(fixture_dir(arch) / f"{ref_dir}greedy.json")
    model = minfer.load(fixture_dir(arch) / variant, n_ctx=64)
    from minfer.runtime.generate import generate
    from minfer.runtime.sampler import Sampler, SamplingParams

    # EOS does not stop, as in the reference
    steps = generate(model.runner, model.tokenizer, ref["prompt_ids"], Sampler(SamplingParams(temperature=0)),
                     max_tokens=len(ref["generated_ids"]), stop_ids=frozenset())
    assert [s.token for s in steps if s.token is not None] == ref["generated_ids"]


def test_incremental_decode_equals_full_prefill(arch):
    """Prefill a prefix, then feed tokens one at a time at their positions: same logits as one pass."""
    model = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, threads=1)
    seq = fixture_sequences(arch)[2]
    full = model.logits(seq)
    runner = model.runner
    rows = [runner.forward(seq[:10], range(10))]
    for p in range(10, len(seq)):
        rows.append(runner.forward([seq[p]], [p]))
    stepwise = np.concatenate(rows)
    assert float(np.abs(stepwise - full).max()) <= 1e-5
    np.testing.assert_allclose(stepwise, fixture_logits(arch, 2), atol=TOL)


def test_hparams_from_metadata():
    hp = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=16).hparams
    assert (hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.n_layer) == (64, 4, 2, 32, 3)
    assert hp.rope_freq_base == 1e6 and hp.attn_scale == pytest.approx(32**-0.5)
    qwen2 = minfer.load(fixture_dir("qwen2") / "model-f32.gguf", n_ctx=16)
    assert qwen2.transformer.tied_output and qwen2.hparams.head_dim_k == 16
