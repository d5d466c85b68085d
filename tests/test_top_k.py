"""The compiled top-k (the sampler's cut of a whole vocabulary) against its numpy definition."""

import numpy as np
import pytest

from minfer.runtime.sampling.candidates import Candidates as _Candidates
from minfer.runtime.sampling.top_k_kernel import (
    BLOCK,
    prunes_well,
    top_k_biased,
    top_k_biased_reference,
    top_k_positions,
    top_k_positions_reference,
)

SIZES = [BLOCK * 40, BLOCK * 40 + 1, 49152, 49152 + 37, 151936]


@pytest.mark.parametrize(("n", "k"), [(n, k) for n in SIZES for k in (1, 2, 40, 100) if k * BLOCK <= n] + [(500, 30)])
def test_top_k_equals_the_reference(n, k):
    # (500, 30): too few blocks to prune anything, handed to the reference
    rng = np.random.default_rng(n + k)
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    assert np.array_equal(top_k_positions(x, k), top_k_positions_reference(x, k))


def test_ties_go_to_the_lower_position_and_signed_zeros_are_equal():
    rng = np.random.default_rng(0)
    x = np.round(rng.standard_normal(49152)).astype(np.float32)  # a handful of distinct values: many ties
    x[::5] = -0.0
    x[3::5] = 0.0
    for k in (1, 40, 300):
        got = top_k_positions(x, k)
        assert np.array_equal(got, top_k_positions_reference(x, k))
        assert np.all(np.diff(x[got]) <= 0)
    zeros = np.where(np.arange(8192) % 2, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    assert np.array_equal(top_k_positions(zeros, 40), np.arange(40))  # all equal: the first 40 positions


def test_infinities_and_a_single_survivor():
    x = np.full(49152, -np.inf, np.float32)
    x[[7, 40000]] = [1.0, np.inf]
    assert top_k_positions(x, 40)[:2].tolist() == [40000, 7]
    assert np.array_equal(top_k_positions(x, 40), top_k_positions_reference(x, 40))


@pytest.mark.parametrize("finite", [[5], [5, 900, 30000], list(range(100, 190))])
def test_a_grammar_mask_leaves_fewer_finite_blocks_than_k(finite):
    """Fewer than k blocks with a finite value: every finite one, then the lowest -inf positions."""
    rng = np.random.default_rng(len(finite))
    x = np.full(49152, -np.inf, np.float32)
    x[finite] = np.round(rng.standard_normal(len(finite)), 1)
    for k in (1, 3, 40, 100):
        assert np.array_equal(top_k_positions(x, k), top_k_positions_reference(x, k)), k


def test_many_values_tied_at_the_bound():
    x = np.zeros(49152, np.float32)
    x[[3, 77, 4000]] = [1.0, 2.0, 3.0]  # every other value ties at the bound: all of them are candidates
    assert top_k_positions(x, 40).tolist() == [4000, 77, 3, 0, 1, 2, *range(4, 38)]


def test_the_winners_all_in_one_block_and_spread_out():
    x = np.zeros(49152, np.float32)
    x[BLOCK * 10 : BLOCK * 10 + 40] = np.arange(40, 0, -1)  # every winner inside one block
    assert top_k_positions(x, 40).tolist() == list(range(BLOCK * 10, BLOCK * 10 + 40))
    y = np.zeros(49152, np.float32)
    y[::1000] = 1.0 + np.arange(len(y[::1000]))  # one winner per block, far apart
    assert np.array_equal(top_k_positions(y, 40), top_k_positions_reference(y, 40))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="float32"):
        top_k_positions(np.zeros(100), 3)
    with pytest.raises(ValueError, match="k must be in 1..100"):
        top_k_positions(np.zeros(100, np.float32), 0)


@pytest.mark.parametrize("k", [40, 384, 385, 2000])  # the kernel up to 384 of 49152, a partition beyond
def test_the_sampler_cut_keeps_its_order_either_way(k):
    assert prunes_well(49152, 384) and not prunes_well(49152, 385)
    rng = np.random.default_rng(3)
    x = np.round(rng.standard_normal(49152) * 3, 1).astype(np.float32)
    best = _Candidates(x).best(k)
    assert np.array_equal(best, np.lexsort((np.arange(len(x)), -x))[:k])


@pytest.mark.parametrize("case", ["random", "ties", "masked", "ban_the_best", "boost_from_the_tail", "negative_zero"])
def test_biased_top_k_equals_biasing_a_copy(case):
    """top_k_biased never copies the vocabulary; it must rank exactly as top-k of a biased copy, for a
    bias that pulls a token out of the top, pushes one in from the tail, bans (-inf) or ties."""
    rng = np.random.default_rng(hash(case) % 2**32)
    n = 49152
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    tokens = np.array([0, 2, 4], np.int64)
    values = np.array([-100.0, -100.0, -100.0])
    if case == "ties":
        x = np.round(x).astype(np.float32)
        tokens, values = np.array([11, 9000, 48000], np.int64), np.array([0.5, 1.0, -0.25])
    elif case == "masked":
        x[:] = -np.inf
        x[[5, 700, 30000]] = [1.0, 2.0, 3.0]
        tokens, values = np.array([700, 1], np.int64), np.array([-np.inf, 2.5])
    elif case == "ban_the_best":
        best = top_k_positions_reference(x, 5)
        tokens, values = best.astype(np.int64), np.full(5, -np.inf)
    elif case == "boost_from_the_tail":
        worst = np.argsort(x)[:3]
        tokens, values = worst.astype(np.int64), np.array([30.0, 25.0, 1e300])  # 1e300 rounds to +inf in float32
    elif case == "negative_zero":
        x[:] = -1.0
        x[100:200] = -0.0
        x[150] = 0.0
        tokens, values = np.array([150, 120], np.int64), np.array([0.0, 1.0])
    for k in (1, 40, 100):
        pos, val = top_k_biased(x, k, tokens, values)
        ref_pos, ref_val = top_k_biased_reference(x, k, tokens, values)
        assert pos.tolist() == ref_pos.tolist(), (case, k)
        assert val.view(np.uint32).tolist() == ref_val.view(np.uint32).tolist(), (case, k)
