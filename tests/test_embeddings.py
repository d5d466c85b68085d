"""Embeddings against transformers: mean / cls / last pooling of the final-normed hidden states on every
tiny fixture (references by scripts/make_embedding_refs.py), batched against one by one, and embedding
requests sharing the engine's forward passes with generation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import ARCHS, derive_gguf, fixture_dir

import minfer
from minfer.errors import BadRequestError
from minfer.runtime.engine import EngineConfig
from minfer.runtime.requests import Embedded, EmbeddingRequest, Finished, GenerationRequest, Started, Token

REFS = json.loads((Path(__file__).parent / "data" / "embedding_refs.json").read_text())["models"]
COSINE_TOL = 1e-5


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module", params=ARCHS)
def fixture_model(request):
    return request.param, minfer.load(fixture_dir(request.param) / "model-f32.gguf", n_ctx=128)


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_pooling_matches_transformers(fixture_model, pooling):
    arch, model = fixture_model
    for case in REFS[arch]:
        assert model.tokenize(case["text"]) == case["ids"]  # the same tokens transformers embedded
        got = model.embed(case["text"], pooling=pooling)
        assert got.shape == (1, model.hparams.n_embd) and got.dtype == np.float32
        assert abs(np.linalg.norm(got[0].astype(np.float64)) - 1) < 1e-6
        assert cosine(got[0], case[pooling]) > 1 - COSINE_TOL, (arch, pooling, case["text"])


def test_pooling_choices_differ(fixture_model):
    """The reference vectors are far apart, so a wrong pooling cannot pass the comparison above."""
    arch, _ = fixture_model
    case = REFS[arch][0]
    assert cosine(case["mean"], case["last"]) < 0.99 and cosine(case["last"], case["cls"]) < 0.99


def test_unnormalized_and_per_token(fixture_model):
    arch, model = fixture_model
    case = REFS[arch][2]
    raw = model.embed([case["ids"]], pooling="last", normalize=False)[0]
    np.testing.assert_allclose(raw, case["last_raw"], atol=2e-5, rtol=1e-5)
    rows = model.embed(case["ids"], pooling="none")
    assert isinstance(rows, list) and rows[0].shape == (len(case["ids"]), model.hparams.n_embd)
    mean = rows[0].astype(np.float64).mean(axis=0)
    assert cosine(mean, case["mean"]) > 1 - COSINE_TOL
    np.testing.assert_array_equal(rows[0][-1], raw)  # per-token vectors are not normalised


def test_fixture_final_norm_rows(fixture_model):
    """pooling none gives the final norm's output row by row (the fixture's transformers dump)."""
    arch, model = fixture_model
    seq = json.loads((fixture_dir(arch) / "tokens.json").read_text())["sequences"][2]
    rows = model.embed([seq], pooling="none")[0]
    np.testing.assert_allclose(rows, np.load(fixture_dir(arch) / "final_norm.npy"), atol=2e-5)


def test_hf_folder_embeds_like_gguf():
    model = minfer.load(fixture_dir("qwen3") / "hf", n_ctx=128)
    for case in REFS["qwen3"]:
        assert cosine(model.embed(case["ids"])[0], case["mean"]) > 1 - COSINE_TOL


def test_inputs_and_errors():
    model = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=64)
    texts = [c["text"] for c in REFS["llama"]]
    ids = [c["ids"] for c in REFS["llama"]]
    by_text, by_ids = model.embed(texts), model.embed(ids)
    assert by_text.shape == (3, 64)
    np.testing.assert_array_equal(by_text, by_ids)
    np.testing.assert_array_equal(model.embed(ids[1]), by_ids[1:2])
    for bad, what in [([], "empty"), ("", "empty"), ([[1, 2], []], "input 1 is empty"), ([1.5], "neither"),
                      ([[0, 99999]], "outside the vocabulary")]:
        with pytest.raises(BadRequestError, match=what):
            model.embed(bad)
    with pytest.raises(BadRequestError, match="pooling must be one of"):
        model.embed("x", pooling="max")
    with pytest.raises(minfer.errors.ContextOverflowError):
        model.embed([[0] * 65])
    # the model still generates afterwards
    assert model.generate(texts[0], max_tokens=3, temperature=0)


def test_gguf_pooling_type_is_the_default(tmp_path):
    path = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path / "m.gguf", {"llama.pooling_type": 3})
    model = minfer.load(path, n_ctx=64)
    assert model.pooling == "last"
    case = REFS["llama"][0]
    assert cosine(model.embed(case["ids"])[0], case["last"]) > 1 - COSINE_TOL
    rank = derive_gguf(fixture_dir("llama") / "model-f32.gguf", tmp_path / "r.gguf", {"llama.pooling_type": 4})
    with pytest.raises(BadRequestError, match="pooling_type is 4"):
        minfer.load(rank, n_ctx=64).embed("x")
    assert minfer.load(rank, n_ctx=64).embed("x", pooling="mean").shape == (1, 64)


def padded_model(batch_size: int = 16, n_slots: int = 4):
    """A server-like engine: several slots, padded passes of at most ``batch_size`` tokens."""
    return minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=256,
                       engine_config=EngineConfig(n_slots=n_slots, batch_size=batch_size, end_of_context="length"))


def test_batched_equals_one_by_one():
    """Several embeddings at once on a padded engine (chunked prompts, shared passes) give the vectors
    of one at a time on the unpadded engine."""
    single = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=128)
    batched = padded_model()
    ids = [c["ids"] for c in REFS["llama"]] + [REFS["llama"][0]["ids"][:7]]
    for pooling in ("mean", "last", "cls"):
        one = np.stack([single.embed([x], pooling=pooling)[0] for x in ids])
        many = batched.engine.embed([EmbeddingRequest(x, pooling) for x in ids])
        for a, b in zip(one, many, strict=True):
            assert cosine(a, b) > 1 - 1e-6
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_embedding_shares_the_pass_with_generation():
    """One step evaluates a running sequence's decode token and an embedding's prompt together; the
    generation's tokens are those it gets alone."""
    model = padded_model(batch_size=64)
    engine = model.engine
    prompt = model.tokenize("The quick brown fox")
    alone = list(model.complete(prompt, max_tokens=6, temperature=0).tokens)

    events: list = []
    gen = GenerationRequest(prompt, model.sampler(temperature=0), 6, emit=events.append)
    engine.add(gen)
    engine.step()  # the prompt, and the first token
    passes: list[tuple[int, bool]] = []
    forward, forward_hidden = engine.runner.forward, engine.runner.forward_hidden

    def spy(*a, **k):
        passes.append((len(a[0]), False))
        return forward(*a, **k)

    def spy_hidden(*a, **k):
        passes.append((len(a[0]), True))
        return forward_hidden(*a, **k)

    engine.runner.forward, engine.runner.forward_hidden = spy, spy_hidden
    got: list = []
    case = REFS["llama"][2]
    engine.add(EmbeddingRequest(case["ids"], "mean", emit=got.append))
    n_tokens = lambda: sum(isinstance(e, Token) for e in events)  # noqa: E731
    before = n_tokens()
    engine.step()
    engine.step()
    # 1 decode token + 31 prompt tokens (a bucket of 32), then 1 + the other 8: each pass also decoded
    assert passes == [(32, True), (12, True)]
    assert n_tokens() == before + 2
    assert [type(e) for e in got] == [Started, Embedded]
    assert cosine(got[1].vector, case["mean"]) > 1 - COSINE_TOL
    assert got[1].stats.prompt_tokens == len(case["ids"])
    while engine.running:
        engine.step()
    tokens = [e.step.token for e in events if isinstance(e, Token) and e.step.token is not None]
    assert tokens == alone
    assert isinstance(events[-1], Finished)
    assert engine.slots.n_free == engine.slots.n_slots  # both slots released


def test_cancelled_embedding_frees_its_slot():
    model = padded_model(batch_size=8)
    engine = model.engine
    got: list = []
    r = EmbeddingRequest(REFS["llama"][2]["ids"], emit=got.append)
    engine.add(r)
    engine.step()  # the first 8 of 39 tokens
    r.cancel()
    engine.step()
    assert isinstance(got[-1], Finished) and got[-1].stats.finish_reason == "cancelled"
    assert engine.slots.n_free == engine.slots.n_slots and not engine.running


def test_embeddings_do_not_grow_a_warmed_up_server_engine():
    """The server takes its memory at start: the warm-up sizes the arena for passes that keep hidden states."""
    model = padded_model(batch_size=32)
    model.engine.warm_up()
    before = model.runner.arena.nbytes
    model.engine.embed([EmbeddingRequest(c["ids"], p) for c in REFS["llama"] for p in ("mean", "none")])
    assert model.runner.arena.grown == 0 and model.runner.arena.nbytes == before
