"""The engine step on the tiny fixtures: what the API's one-slot engine and a padded many-slot engine
give are the same tokens, with constraints, logprobs, stop strings and context shift written once."""

from __future__ import annotations

import pytest
from conftest import drive, fixture_dir, fixture_sequences, tokens_of

import minfer
from minfer.errors import BadRequestError, ContextOverflowError
from minfer.runtime.engine import EngineConfig, build_engine
from minfer.runtime.requests import Finished, GenerationRequest, Token

ARCH = "llama"


@pytest.fixture(scope="module")
def model():
    return minfer.load(fixture_dir(ARCH) / "model-f32.gguf", n_ctx=64, threads=2)


def engine_of(model, n_slots: int, batch_size: int | None = 16, n_ctx: int = 64):
    config = EngineConfig(n_slots=n_slots, batch_size=batch_size)
    return build_engine(model.transformer, model.backend, model.tokenizer, n_ctx * n_slots, model.cache_type, config)


def test_one_step_serves_every_sequence_with_the_api_tokens(model):
    """Three sequences, each with its own sampling, stop string and logprobs, stepped together in a padded
    engine (chunked prompts beside decodes): each gets the tokens, text and logprobs it gets alone."""
    seqs = fixture_sequences(ARCH)
    cases = [
        (seqs[2][:20], {"temperature": 0}, {}),
        (seqs[2][:9], {"temperature": 0.9, "seed": 7}, {"logprobs": 2}),
        (seqs[1], {"temperature": 0.8, "seed": 3, "top_k": 5}, {}),
    ]
    engine = engine_of(model, n_slots=3, batch_size=8)
    requests = [GenerationRequest(p, model.sampler(**s), 10, **extra) for p, s, extra in cases]
    events = drive(engine, requests)
    for (prompt, sampling, extra), got in zip(cases, events, strict=True):
        model.kv.clear()
        alone = model.complete(prompt, max_tokens=10, **sampling, **extra)
        assert tokens_of(got) == alone.tokens
        lps = [e.step.logprob for e in got if isinstance(e, Token) and e.step.logprob is not None]
        assert [lp.token for lp in lps] == [lp.token for lp in alone.logprobs]
        assert isinstance(got[-1], Finished)


def test_context_shift_in_a_padded_engine_equals_the_api(model):
    """Context shift is a slot's, whichever path drives it: the server's engine shifts as the API does."""
    prompt = fixture_sequences(ARCH)[1]
    small = minfer.load(fixture_dir(ARCH) / "model-f32.gguf", n_ctx=32, threads=2)

    def request():  # 80 tokens from 7 in 32 positions: three shifts
        return GenerationRequest(prompt, small.sampler(temperature=0), 80, stop_ids=frozenset(), context_shift=True,
                                 n_keep=4)

    alone = [s.token for s in small.engine.run(request()) if s.token is not None]
    # 2 slots of a unified cache of 32 positions in all: the one running sequence may fill all 32, as the API's
    events = drive(engine_of(small, n_slots=2, batch_size=8, n_ctx=16), [request()])
    assert len(alone) == 80
    assert tokens_of(events[0]) == alone


def test_a_stream_left_unfinished_frees_its_slot(model):
    prompt = fixture_sequences(ARCH)[1]
    stream = model.stream(prompt, max_tokens=30, temperature=0)
    next(stream)
    assert len(model.engine.running) == 1
    stream.close()
    assert model.engine.running == []
    # and a stream simply abandoned is ended by the next call
    abandoned = model.stream(prompt, max_tokens=30, temperature=0)
    next(abandoned)
    assert model.complete(prompt, max_tokens=5, temperature=0).tokens == model.complete(
        prompt, max_tokens=5, temperature=0).tokens
    assert model.engine.running == []


def test_the_api_raises_at_the_end_of_its_context_and_a_server_engine_stops(model):
    prompt = fixture_sequences(ARCH)[2]  # 33 tokens
    with pytest.raises(ContextOverflowError, match="position 64, n_ctx is 64"):
        list(model.engine.run(GenerationRequest(prompt, model.sampler(temperature=0), 100, stop_ids=frozenset())))
    # 2 slots sharing 64 positions: the one running sequence may use them all
    server = build_engine(model.transformer, model.backend, model.tokenizer, 64, model.cache_type,
                          EngineConfig(n_slots=2, batch_size=16, end_of_context="length"))
    events = drive(server, [GenerationRequest(prompt, model.sampler(temperature=0), 100, stop_ids=frozenset())])
    assert events[0][-1].stats.finish_reason == "length"
    assert len(tokens_of(events[0])) == 64 - len(prompt) + 1


def test_bad_requests_are_refused_before_they_take_a_slot(model):
    engine = engine_of(model, n_slots=2)
    with pytest.raises(BadRequestError, match="empty"):
        engine.add(GenerationRequest([], model.sampler(), 4))
    with pytest.raises(BadRequestError, match="token id 99999 at index 1"):
        engine.add(GenerationRequest([1, 99999], model.sampler(), 4))
    with pytest.raises(ContextOverflowError, match="137 tokens, more than the context of 128$"):
        engine.add(GenerationRequest(list(range(3, 140)), model.sampler(), 4))
    assert engine.n_free == 2
