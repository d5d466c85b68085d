"""The sampler on synthetic logits: greedy, top-k, top-p, temperature, seeds, parameter checks."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.errors import BadRequestError
from minfer.runtime.sampler import Sampler, SamplingParams

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 3.0, 0.0], dtype=np.float32)


def draws(n=4000, **kw) -> np.ndarray:
    s = Sampler(SamplingParams(seed=0, **kw))
    return np.array([s.sample(LOGITS) for _ in range(n)])


def test_greedy_takes_first_maximum():
    assert Sampler(SamplingParams(temperature=0)).sample(LOGITS) == 1


def test_top_k_keeps_only_k_best():
    got = set(draws(top_k=3, top_p=1.0, temperature=1.0))
    assert got == {1, 2, 4}  # the two 3.0s and 2.5
    assert set(draws(n=200, top_k=1, top_p=1.0)) == {1}  # ties broken by token id


def test_top_p_keeps_smallest_prefix_reaching_p():
    p = np.exp(LOGITS - LOGITS.max())
    p /= p.sum()
    order = [1, 4, 2, 0, 5, 3]
    cum = np.cumsum(p[order])
    keep = set(order[: int(np.searchsorted(cum, 0.8) + 1)])
    assert set(draws(top_k=0, top_p=0.8, temperature=1.0)) == keep


def test_temperature_one_matches_softmax_frequencies():
    d = draws(n=20000, top_k=0, top_p=1.0, temperature=1.0)
    p = np.exp(LOGITS - LOGITS.max())
    p /= p.sum()
    freq = np.bincount(d, minlength=len(LOGITS)) / len(d)
    np.testing.assert_allclose(freq, p, atol=0.015)


def test_low_temperature_sharpens():
    hot = draws(top_k=0, top_p=1.0, temperature=2.0)
    cold = draws(top_k=0, top_p=1.0, temperature=0.2)
    assert np.isin(cold, [1, 4]).mean() > 0.95 > np.isin(hot, [1, 4]).mean()


def test_same_seed_same_draws_other_seed_differs():
    a = draws(n=50, temperature=1.0, top_k=0, top_p=1.0)
    b = draws(n=50, temperature=1.0, top_k=0, top_p=1.0)
    s = Sampler(SamplingParams(seed=1, temperature=1.0, top_k=0, top_p=1.0))
    c = np.array([s.sample(LOGITS) for _ in range(50)])
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize(
    "kw,name",
    [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 1.5}, "top_p"),
     ({"top_p": 0.0}, "top_p"), ({"seed": -3}, "seed"), ({"temperature": float("nan")}, "temperature")],
)
def test_bad_parameters_name_themselves(kw, name):
    with pytest.raises(BadRequestError, match=name):
        SamplingParams(**kw)
