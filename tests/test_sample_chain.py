"""The compiled default chain (runtime/sampling/chain_kernel) against the sampler's steps in numpy: the same
tokens, the same random stream, the same probabilities; many rows in one call equal each row alone."""

import math

import numpy as np
import pytest

from minfer.errors import BadRequestError, ModelError
from minfer.runtime.sampling import Sampler, SamplingParams, chain_kernel, sample_batch
from minfer.runtime.sampling.candidates import Candidates as _Candidates

N_VOCAB = 49152
CHAINS = [
    {},  # the defaults: top_k 40, top_p 0.95, min_p 0.05, temperature 0.8
    {"logit_bias": {0: -100.0, 2: -100.0, 7: 5.0}},
    {"top_p": 1.0},
    {"min_p": 0.0},
    {"top_p": 1.0, "min_p": 0.0, "temperature": 0.3},
    {"top_p": 0.5, "min_p": 0.2, "temperature": 1.3, "min_keep": 3},
    {"top_k": 300, "top_p": 0.999, "min_p": 0.0001, "temperature": 3.0},  # sums past 128 terms
]


def sampler(seed: int = 5, numpy_steps: bool = False, **params) -> Sampler:
    s = Sampler(SamplingParams(seed=seed, **params), route="steps" if numpy_steps else "auto")
    assert numpy_steps or s.route == "compiled", params  # "steps": the chain's steps, one after the other
    return s


@pytest.mark.parametrize("params", CHAINS)
@pytest.mark.parametrize("scale", [1.0, 10.0, 40.0])  # flat to peaked: many candidates down to one
def test_compiled_chain_equals_the_steps(params, scale):
    rng = np.random.default_rng(int(scale))
    logits = (rng.standard_normal((60, N_VOCAB)) * scale).astype(np.float32)
    compiled, steps = sampler(**params), sampler(numpy_steps=True, **params)
    assert [compiled.sample(row) for row in logits] == [steps.sample(row) for row in logits]
    # a single candidate draws no number, as llama.cpp's dist: the streams are still in step
    assert compiled._state.rng.random() == steps._state.rng.random()


def _cumulative(logits: np.ndarray) -> np.ndarray:
    """The draw's ``cumsum(softmax(logits))`` with the C library's exp (numpy's on CPUs without AVX-512;
    with it numpy has its own, which may differ in the last bit)."""
    e = np.array([math.exp(v - logits.max()) for v in logits])
    return np.cumsum(e / e.sum())


@pytest.mark.parametrize("params", CHAINS)
def test_cumulative_probabilities_are_the_steps_bits(params):
    """The kernel keeps the candidates the steps keep, and its ``cum`` holds the floats the steps' draw
    searches (its softmax of the candidates after the temperature, then the running sum)."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((20, N_VOCAB)) * 4).astype(np.float32)
    s = sampler(**params)
    c = s.compiled_chain
    assert c is not None
    codes, counts, ids, cum = chain_kernel.truncate_rows(logits, np.arange(20), *c.arguments([c] * 20))
    assert not codes.any()
    for row, n, row_ids, row_cum in zip(logits, counts, ids, cum, strict=True):
        cand = _Candidates(row)
        for step in s._steps[:-1]:  # every step but the draw
            step.apply(cand)
        assert n == len(cand) and np.array_equal(row_ids[:n], cand.ids)
        if n > 1:
            assert np.array_equal(row_cum[:n], _cumulative(cand.logits))
            np.testing.assert_allclose(row_cum[:n], np.cumsum(cand.probs()), rtol=1e-15, atol=0)


def test_many_rows_in_one_call_equal_each_row_alone():
    rng = np.random.default_rng(0)
    params = [CHAINS[i % len(CHAINS)] for i in range(9)]
    together = [sampler(seed=i, **p) for i, p in enumerate(params)]
    alone = [sampler(seed=i, **p) for i, p in enumerate(params)]
    for _ in range(15):
        logits = (rng.standard_normal((9, N_VOCAB)) * 6).astype(np.float32)
        assert sample_batch(together, logits) == [s.sample(row) for s, row in zip(alone, logits, strict=True)]


def test_other_chains_are_left_to_the_steps():
    for params in ({"temperature": 0.0}, {"typical_p": 0.9}, {"repeat_penalty": 1.1}, {"mirostat": 2},
                   {"samplers": "top_k;temperature;top_p"}, {"top_k": 0}, {"xtc_probability": 0.5}):
        s = Sampler(SamplingParams(**params))
        assert s.route != "compiled" and s.compiled_chain is None, params
        with pytest.raises(BadRequestError, match="route 'compiled' does not apply to the chain logits -> "):
            Sampler(SamplingParams(**params), route="compiled")
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, N_VOCAB)) * 3).astype(np.float32)
    mixed = [sampler(), Sampler(SamplingParams(temperature=0.0)), sampler(top_k=500)]  # k too large to prune
    assert mixed[1].route == "greedy" and not mixed[2].compiled_chain.fits(N_VOCAB)
    # one entry for the batch: the rows its kernel cannot run go through their own sampler's numpy route
    assert sample_batch(mixed, logits) == [sampler().sample(logits[0]), int(np.argmax(logits[1])),
                                            sampler(numpy_steps=True, top_k=500).sample(logits[2])]


def test_bad_rows_are_left_to_the_steps_which_say_why():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((4, N_VOCAB)) * 3).astype(np.float32)
    logits[0, 123] = np.nan
    logits[1, 7] = np.inf
    logits[2] = -np.inf
    logits[3, 10:] = -np.inf  # ten drawable tokens, all banned by the bias below
    banned = {t: -np.inf for t in range(10)}
    samplers = [sampler(), sampler(), sampler(), sampler(logit_bias=banned)]
    got = sample_batch(samplers, logits)  # each row's error, from the steps' checks; the others go on
    assert [type(e) for e in got] == [ModelError, ModelError, BadRequestError, BadRequestError]
    assert "every logit is -inf" in str(got[2]) and "no token can be sampled" in str(got[3])
    assert samplers[0].draw_rng.random() == sampler().draw_rng.random()  # nothing drawn
    with pytest.raises(ModelError, match="NaN or \\+inf"):
        samplers[0].sample(logits[0])
    with pytest.raises(ModelError, match="NaN or \\+inf"):
        samplers[1].sample(logits[1])
    with pytest.raises(BadRequestError, match="every logit is -inf"):
        samplers[2].sample(logits[2])
    with pytest.raises(BadRequestError, match="no token can be sampled"):
        samplers[3].sample(logits[3])
    # -inf logits that leave something drawable: the slow check passes them
    logits[3, :10] = 0.0
    assert sample_batch([sampler()], logits[3:4])[0] in range(10)


def test_pairwise_sum_is_numpys():
    rng = np.random.default_rng(0)
    for n in [*range(1, 140), 255, 256, 257, 384]:
        a = np.exp(rng.standard_normal(n) * 5)
        assert chain_kernel._pairwise_sum(a, n) == a.sum(), n
