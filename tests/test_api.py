"""The Python API on the tiny fixtures: generation loop, streaming, stop conditions, errors."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import fixture_dir, fixture_logits, fixture_sequences

import minfer
from minfer.errors import BadRequestError, ContextOverflowError


@pytest.fixture(scope="module")
def model():
    return minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=48)


def test_stream_equals_non_stream(model):
    whole = model.generate("The capital of France is", max_tokens=12, temperature=0)
    pieces = list(model.generate("The capital of France is", max_tokens=12, temperature=0, stream=True))
    assert "".join(pieces) == whole and len(pieces) > 1


def test_max_tokens_and_stats(model):
    model.generate([0, 5, 9], max_tokens=5, temperature=0)
    s = model.last_stats
    assert (s.prompt_tokens, s.generated_tokens, s.finish_reason) == (3, 5, "length")


def test_generation_past_the_context_is_a_clear_error(model):
    from minfer.runtime.requests import GenerationRequest
    from minfer.runtime.sampling import Sampler, SamplingParams
    from minfer.runtime.sequence import GenerationStats

    prompt = fixture_sequences("qwen3")[2]  # 33 of 48 positions
    stats = GenerationStats()
    steps = model.engine.run(GenerationRequest(prompt, Sampler(SamplingParams(temperature=0)),
                     max_tokens=100, stats=stats, stop_ids=frozenset()))
    got = []
    with pytest.raises(ContextOverflowError, match="position 48, n_ctx is 48"):
        for s in steps:
            got.append(s)
    # positions 33..47 were evaluated; the token sampled from position 47's logits was still produced
    assert stats.generated_tokens == 48 - len(prompt) + 1 == len(got)


def test_a_prompt_sharing_the_cached_prefix_reuses_it(model):
    seq = fixture_sequences("qwen3")[2]
    full = model.complete(seq, max_tokens=4, temperature=0)
    evaluated = []
    forward = model.runner.forward
    model.runner.forward = lambda tokens, positions, *a, **k: evaluated.append(list(positions)) or forward(
        tokens, positions, *a, **k)
    try:
        again = model.complete(seq, max_tokens=4, temperature=0)
    finally:
        model.runner.forward = forward
    assert again.tokens == full.tokens
    assert evaluated[0] == [len(seq) - 1]  # only the last prompt token was evaluated again


def test_logits_of_fresh_sequence_ignore_previous_calls(model):
    seq = fixture_sequences("qwen3")[1]
    model.generate("Hello", max_tokens=4, temperature=0)
    np.testing.assert_allclose(model.logits(seq), fixture_logits("qwen3", 1), atol=1e-4)


def test_token_ids_and_text_prompts_agree(model):
    ids = model.tokenize("Hello, world!")
    assert model.generate(ids, max_tokens=6, temperature=0) == model.generate("Hello, world!", max_tokens=6,
                                                                              temperature=0)


def test_tokenize_detokenize_round_trip(model):
    text = "Hello, world! 123"
    assert model.detokenize(model.tokenize(text, add_special=False)) == text


def test_errors(model):
    with pytest.raises(ContextOverflowError, match="more than the context of 48"):
        model.generate(list(range(3, 60)), max_tokens=1)
    with pytest.raises(ContextOverflowError):
        model.logits(list(range(3, 60)))
    with pytest.raises(BadRequestError, match="empty"):
        model.generate([], max_tokens=1)
    with pytest.raises(BadRequestError, match="max_tokens"):
        model.generate("hi", max_tokens=-1)
    with pytest.raises(BadRequestError, match="outside the vocabulary"):
        model.logits([0, 99999])
    with pytest.raises(BadRequestError, match="n_ctx"):
        minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=0)
    with pytest.raises(BadRequestError, match="threads"):
        minfer.load(fixture_dir("qwen3") / "model-f32.gguf", threads=0)


def test_eos_stops_generation(model):
    """Force the end-of-generation token: a logit bias-like check through the sampler."""
    eos = model.tokenizer.eos_id
    assert eos in model.tokenizer.eog_ids
    from minfer.runtime.requests import GenerationRequest
    from minfer.runtime.sampling import Sampler, SamplingParams

    class AlwaysEOS(Sampler):
        def sample(self, logits):
            return eos

    steps = list(model.engine.run(GenerationRequest([0, 5], AlwaysEOS(SamplingParams(temperature=0)), 10)))
    assert steps == []
