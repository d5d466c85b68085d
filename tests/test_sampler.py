"""The sampler chain on synthetic logits: each step, llama.cpp's known answers, seeds, logprobs, bad parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.errors import BadRequestError, ModelError
from minfer.runtime.sampling import DEFAULT_SAMPLERS, Sampler, SamplingParams, token_logprobs

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 3.0, 0.0], dtype=np.float32)
# every truncation off: the steps under test are switched on one at a time
PLAIN = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)


def draws(n=4000, logits=LOGITS, **kw) -> np.ndarray:
    s = Sampler(SamplingParams(seed=0, **kw))
    return np.array([s.sample(logits) for _ in range(n)])


def softmax(x) -> np.ndarray:
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))
    return e / e.sum()


def dist(probs, history=(), token_text=None, **kw) -> dict[int, float]:
    """The distribution the draw would use, as llama.cpp's test-sampling.cpp sets it up (logits = log p)."""
    s = Sampler(SamplingParams(**{**PLAIN, **kw}), token_text=token_text)
    s.reset(history)
    with np.errstate(divide="ignore"):
        ids, p = s.distribution(np.log(np.asarray(probs, dtype=np.float32)))
    return {int(i): float(q) for i, q in zip(ids, p, strict=True)}


def assert_dist(got: dict[int, float], expected: dict[int, float]) -> None:
    assert set(got) == set(expected), (got, expected)
    for t, p in expected.items():
        assert got[t] == pytest.approx(p, abs=1e-5), (t, got, expected)


# -- the existing contract ----------------------------------------------------------------------------


def test_greedy_takes_first_maximum():
    assert Sampler(SamplingParams(temperature=0)).sample(LOGITS) == 1


def test_top_k_keeps_only_k_best():
    got = set(draws(n=1000, top_k=3, top_p=1.0, temperature=1.0))
    assert got == {1, 2, 4}  # the two 3.0s and 2.5
    assert set(draws(n=200, top_k=1, top_p=1.0)) == {1}  # ties broken by token id


def test_top_p_keeps_smallest_prefix_reaching_p():
    p = softmax(LOGITS)
    order = [1, 4, 2, 0, 5, 3]
    cum = np.cumsum(p[order])
    keep = set(order[: int(np.searchsorted(cum, 0.8) + 1)])
    assert set(draws(n=1500, top_k=0, top_p=0.8, temperature=1.0)) == keep


def test_temperature_one_matches_softmax_frequencies():
    d = draws(n=10000, **PLAIN)  # min_p (default 0.05) off too: nothing truncated
    freq = np.bincount(d, minlength=len(LOGITS)) / len(d)
    np.testing.assert_allclose(freq, softmax(LOGITS), atol=0.02)


def test_low_temperature_sharpens():
    hot = draws(n=2000, top_k=0, top_p=1.0, temperature=2.0)
    cold = draws(n=2000, top_k=0, top_p=1.0, temperature=0.2)
    assert np.isin(cold, [1, 4]).mean() > 0.95 > np.isin(hot, [1, 4]).mean()


def test_same_seed_same_draws_other_seed_differs():
    a = draws(n=50, temperature=1.0, top_k=0, top_p=1.0)
    b = draws(n=50, temperature=1.0, top_k=0, top_p=1.0)
    s = Sampler(SamplingParams(seed=1, temperature=1.0, top_k=0, top_p=1.0))
    c = np.array([s.sample(LOGITS) for _ in range(50)])
    assert np.array_equal(a, b) and not np.array_equal(a, c)


# -- defaults and order -------------------------------------------------------------------------------


def test_defaults_are_llama_cpp_common_sampler_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.typical_p) == (0.8, 40, 0.95, 0.05, 1.0)
    assert (p.repeat_penalty, p.repeat_last_n, p.frequency_penalty, p.presence_penalty) == (1.0, 64, 0.0, 0.0)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.0, 1.75, 2, 64)
    assert p.dry_sequence_breakers == ("\n", ":", '"', "*")
    assert (p.xtc_probability, p.xtc_threshold, p.mirostat, p.mirostat_tau, p.mirostat_eta) == (0.0, 0.1, 0, 5.0, 0.1)
    assert p.samplers == DEFAULT_SAMPLERS == (
        "penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
    # steps switched off by their parameter are left out of the chain
    assert Sampler(p).describe() == "logits -> top_k -> top_p -> min_p -> temperature -> dist"
    everything = SamplingParams(repeat_penalty=1.1, dry_multiplier=0.8, typical_p=0.9, xtc_probability=0.5,
                                logit_bias={1: 1.0})
    assert Sampler(everything, token_text=str).describe() == (
        "logits -> logit_bias -> penalties -> dry -> top_k -> typ_p -> top_p -> min_p -> xtc -> temperature -> dist")


def test_custom_order_and_aliases():
    s = Sampler(SamplingParams(samplers=["top_k", "min_p", "temperature"]))
    assert s.describe() == "logits -> top_k -> min_p -> temperature -> dist"
    assert SamplingParams(samplers="top-k;nucleus;typical;min-p;temp").samplers == (
        "top_k", "top_p", "typ_p", "min_p", "temperature")
    # the order matters: min_p on the raw logits keeps 3 tokens; after temperature 5 it keeps all 6
    x = np.array([4.0, 3.0, 2.0, -2.0, -3.0, -4.0], dtype=np.float32)
    before = Sampler(SamplingParams(**{**PLAIN, "min_p": 0.1, "temperature": 5.0}))
    after = Sampler(SamplingParams(**{**PLAIN, "min_p": 0.1, "temperature": 5.0}, samplers=["temperature", "min_p"]))
    assert len(before.distribution(x)[0]) == 3 and len(after.distribution(x)[0]) == 6
    # a chain without "temperature" samples at temperature 1, as llama.cpp does
    no_temp = Sampler(SamplingParams(**{**PLAIN, "temperature": 0.0}, samplers=[]))
    np.testing.assert_allclose(no_temp.distribution(LOGITS)[1], np.sort(softmax(LOGITS))[::-1], atol=1e-12)


def test_mirostat_chain_replaces_the_truncations():
    assert Sampler(SamplingParams(mirostat=1)).describe() == "logits -> temperature -> mirostat"
    assert (Sampler(SamplingParams(mirostat=2, logit_bias={0: -1.0})).describe()
            == "logits -> logit_bias -> temperature -> mirostat_v2")


# -- llama.cpp's known answers (tests/test-sampling.cpp) ---------------------------------------------


P4 = [0.1, 0.2, 0.3, 0.4]


def test_known_temperature():
    assert_dist(dist(P4), {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4})
    assert_dist(dist(P4, temperature=0.0), {3: 1.0})


@pytest.mark.parametrize("k,expected", [(1, {3: 1.0}), (3, {3: 0.44444, 2: 0.33333, 1: 0.22222}),
                                        (4, dict(enumerate(P4))), (0, dict(enumerate(P4)))])
def test_known_top_k(k, expected):
    assert_dist(dist(P4, top_k=k), expected)


@pytest.mark.parametrize("p,expected", [(0.7, {3: 0.571429, 2: 0.428571}),
                                        (0.8, {3: 0.44444, 2: 0.33333, 1: 0.22222}), (1.0, dict(enumerate(P4)))])
def test_known_top_p(p, expected):
    assert_dist(dist(P4, top_p=p), expected)


@pytest.mark.parametrize("p,expected", [
    (0.0, dict(enumerate(P4))), (0.24, dict(enumerate(P4))),
    (0.26, {1: 0.2 / 0.9, 2: 0.3 / 0.9, 3: 0.4 / 0.9}), (0.49, {1: 0.2 / 0.9, 2: 0.3 / 0.9, 3: 0.4 / 0.9}),
    (0.51, {2: 0.3 / 0.7, 3: 0.4 / 0.7}), (0.74, {2: 0.3 / 0.7, 3: 0.4 / 0.7}), (0.76, {3: 1.0}), (1.0, {3: 1.0}),
])
def test_known_min_p(p, expected):
    assert_dist(dist(P4, min_p=p), expected)


@pytest.mark.parametrize("t,expected", [
    (0.09, {3: 1.0}), (0.19, {2: 2 / 3, 3: 1 / 3}), (0.29, {1: 0.5, 2: 1 / 3, 3: 1 / 6}),
    (0.39, {0: 0.4, 1: 0.3, 2: 0.2, 3: 0.1}),  # only one token above the threshold: nothing removed
])
def test_known_xtc(t, expected):
    assert_dist(dist([0.4, 0.3, 0.2, 0.1], xtc_probability=1.0, xtc_threshold=t), expected)


def test_known_typical():
    assert_dist(dist([0.97, 0.01, 0.01, 0.01], typical_p=0.5), {0: 1.0})
    assert_dist(dist([0.4, 0.2, 0.2, 0.2], typical_p=0.5), {1: 1 / 3, 2: 1 / 3, 3: 1 / 3})


P5 = [0.2] * 5


@pytest.mark.parametrize("history,kw,expected", [
    ([0], dict(repeat_penalty=50.0), [0, 0.25, 0.25, 0.25, 0.25]),
    ([0, 1, 2], dict(repeat_penalty=50.0), [0, 0, 0, 0.5, 0.5]),
    ([0, 1, 2, 0, 0], dict(repeat_penalty=50.0), [0, 0, 0, 0.5, 0.5]),
    ([0], dict(frequency_penalty=5.0, presence_penalty=5.0), [0.000011, 0.249997, 0.249997, 0.249997, 0.249997]),
    ([0, 1, 2], dict(frequency_penalty=5.0, presence_penalty=5.0), [0.000023, 0.000023, 0.000023, 0.499966, 0.499966]),
    ([0, 1, 2, 0, 0], dict(frequency_penalty=5.0, presence_penalty=5.0), [0, 0.000023, 0.000023, 0.499977, 0.499977]),
])
def test_known_penalties(history, kw, expected):
    got = dist(P5, history=history, repeat_last_n=len(history), **kw)
    np.testing.assert_allclose([got[t] for t in range(5)], expected, atol=1e-5)


def letters(t: int) -> str:
    return "abcdefgh"[t]


@pytest.mark.parametrize("probs,history,mult,allowed,last_n,breaker_token,expected", [
    ([0.25] * 4, [0, 1], 1.0, 2, 4, None, [0.25] * 4),
    ([0.25] * 4, [0, 1, 2, 0, 1], 1.0, 2, 5, None, [0.296923, 0.296923, 0.109232, 0.296923]),
    (P5, [0, 1, 3, 4, 0, 1], 1.0, 2, 6, 3, P5),  # token 3 breaks the sequence: no repetition to extend
    (P5, [0, 1, 2, 0, 1], 2.0, 2, 5, None, [0.241818, 0.241818, 0.032727, 0.241818, 0.241818]),
    (P5, [0, 1, 2, 3, 4, 0, 1], 1.0, 4, 7, None, P5),
])
def test_known_dry(probs, history, mult, allowed, last_n, breaker_token, expected):
    # llama.cpp's test gives the breaker as a token; here token 3's text is the breaker "\n"
    def text(t: int) -> str:
        return "\n" if t == breaker_token else letters(t)

    got = dist(probs, history=history, token_text=text, dry_multiplier=mult, dry_base=1.1,
               dry_allowed_length=allowed, dry_penalty_last_n=last_n, dry_sequence_breakers=["\n"])
    np.testing.assert_allclose([got[t] for t in range(len(probs))], expected, atol=1e-5)


def queue_expectation(n_vocab: int, seq: str, top_k: int, top_p: float, min_p: float) -> tuple[int, int]:
    """Size and smallest id after the steps, by llama.cpp's test_sampler_queue arithmetic (logit = log id)."""
    size, min_id, max_id = n_vocab, 0, n_vocab - 1
    for s in seq:
        if s == "k":
            size = min(size, top_k)
            min_id = max(min_id, n_vocab - top_k)
        elif s == "p":
            divisor = n_vocab * (n_vocab - 1) // 2 - min_id * (min_id - 1) // 2
            target = math.ceil(np.float32(top_p) * np.float32(divisor))
            min_id, size, cum = n_vocab, 0, 0
            while True:
                min_id -= 1
                size += 1
                cum += min_id
                if cum >= target:
                    break
            if min_id == 1:
                min_id, size = 0, size + 1
        else:
            expected = max(math.ceil((1.0 - min_p) * n_vocab), 1)
            expected = min(expected, size)
            min_id = min(max(math.floor(min_p * n_vocab), 1, n_vocab - size), n_vocab - 1)
            size = expected
    assert max_id == n_vocab - 1
    return size, min_id


@pytest.mark.parametrize("seq", ["kp", "km", "pk", "pm", "mk", "kpm", "kmp", "pkm", "pmk", "mkp", "mpk"])
def test_known_sampler_queue(seq):
    n_vocab, top_k, top_p, min_p = 10000, 100, 0.8, 0.1
    names = {"k": "top_k", "p": "top_p", "m": "min_p"}
    s = Sampler(SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p, min_keep=1, temperature=1.0,
                               samplers=[names[c] for c in seq]))
    with np.errstate(divide="ignore"):
        ids, _ = s.distribution(np.log(np.arange(n_vocab, dtype=np.float32)))
    size, min_id = queue_expectation(n_vocab, seq, top_k, top_p, min_p)
    assert len(ids) == size and ids[0] == n_vocab - 1 and ids[-1] == min_id


# -- statistics of each step --------------------------------------------------------------------------

# a Zipf-like distribution over 200 tokens, shuffled so that token ids say nothing about rank
_rng = np.random.default_rng(7)
ZIPF = np.log(1.0 / np.arange(1, 201) ** 1.1).astype(np.float32)[_rng.permutation(200)]


def test_truncations_keep_what_they_should():
    p = softmax(ZIPF)
    order = np.argsort(-p, kind="stable")
    top_k = dist(np.exp(ZIPF), top_k=7)
    assert set(top_k) == set(order[:7].tolist())
    top_p = dist(np.exp(ZIPF), top_p=0.6)
    n = int(np.searchsorted(np.cumsum(p[order]), 0.6) + 1)
    assert set(top_p) == set(order[:n].tolist())
    min_p = dist(np.exp(ZIPF), min_p=0.2)
    assert set(min_p) == set(np.flatnonzero(p >= 0.2 * p.max()).tolist())
    # typical: the tokens whose surprise is closest to the entropy, until their mass passes p
    ent = -(p * np.log(p)).sum()
    by_typ = np.argsort(np.abs(-np.log(p) - ent), kind="stable")
    m = int(np.flatnonzero(np.cumsum(p[by_typ]) > 0.5)[0]) + 1
    typical = dist(np.exp(ZIPF), typical_p=0.5)
    assert set(typical) == set(by_typ[:m].tolist())
    assert order[0] not in typical  # the most likely token is too predictable to be typical here
    # draws stay inside the kept set, and frequencies follow the renormalised distribution
    d = draws(n=4000, logits=ZIPF, **{**PLAIN, "top_p": 0.6})
    assert set(d) <= set(top_p)
    freq = np.bincount(d, minlength=200)[list(top_p)] / len(d)
    np.testing.assert_allclose(freq, list(top_p.values()), atol=0.02)


def test_min_keep_is_respected():
    assert len(dist(np.exp(ZIPF), top_p=0.01, min_keep=5)) == 5
    assert len(dist(np.exp(ZIPF), min_p=0.99, min_keep=4)) == 4
    assert len(dist(np.exp(ZIPF), typical_p=0.01, min_keep=3)) == 3


def test_top_p_over_a_large_flat_vocabulary_matches_a_full_sort():
    # the partial probes (256, 2048, ...) must give the same set as sorting everything
    x = np.random.default_rng(3).standard_normal(50000).astype(np.float32)
    s = Sampler(SamplingParams(**{**PLAIN, "top_p": 0.9}))
    ids, _ = s.distribution(x)
    p = softmax(x)
    order = np.argsort(-p, kind="stable")
    n = int(np.searchsorted(np.cumsum(p[order]), 0.9) + 1)
    assert abs(len(ids) - n) <= 1 and set(ids[:-1].tolist()) <= set(order[:n].tolist())


def test_temperature_scales_the_logits():
    for t in (0.5, 1.7):
        d = draws(n=8000, logits=LOGITS, **{**PLAIN, "temperature": t})
        freq = np.bincount(d, minlength=6) / len(d)
        np.testing.assert_allclose(freq, softmax(LOGITS / t), atol=0.02)


def test_penalties_lower_repeated_tokens():
    x = np.array([2.0, 2.0, -1.0, -1.0], dtype=np.float32)
    s = Sampler(SamplingParams(**PLAIN, repeat_penalty=2.0))
    s.reset([0, 2])
    ids, p = s.distribution(x)
    got = dict(zip(ids.tolist(), p, strict=True))
    # positive logit halved (2 -> 1), negative doubled (-1 -> -2): both less likely, llama.cpp's fix
    np.testing.assert_allclose([got[t] for t in range(4)], softmax([1.0, 2.0, -2.0, -1.0]), atol=1e-12)
    # frequency counts occurrences in the window, presence counts once
    s = Sampler(SamplingParams(**PLAIN, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=3))
    s.reset([1, 1, 0, 1, 1])  # the window is the last 3: [0, 1, 1]
    ids, p = s.distribution(x)
    got = dict(zip(ids.tolist(), p, strict=True))
    np.testing.assert_allclose([got[t] for t in range(4)], softmax([2 - 0.5 - 0.25, 2 - 1.0 - 0.25, -1, -1]),
                               atol=1e-12)
    # accept() extends the window (sample() alone does not): greedy picks walk down the ranking
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=100.0))
    s.reset()
    y = np.array([4.0, 3.0, 2.0, 1.0], dtype=np.float32)
    assert s.sample(y) == s.sample(y) == 0
    for _ in range(3):
        s.accept(s.sample(y))
    assert s.history == (0, 1, 2)
    assert Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=0)).describe().count("penalties") == 0


def test_dry_penalises_extending_a_repeated_sequence():
    words = ["The", " cat", " sat", " on", " the", " mat", ".", "\n", ":"]
    x = np.zeros(len(words), dtype=np.float32)
    kw = dict(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=-1)
    s = Sampler(SamplingParams(**PLAIN, **kw), token_text=lambda t: words[t])
    s.reset([0, 1, 2, 3, 4, 5, 6, 0, 1, 2])  # "The cat sat on the mat. The cat sat" -> " on" repeats 3 tokens
    ids, p = s.distribution(x)
    got = dict(zip(ids.tolist(), p, strict=True))
    expect = np.zeros(len(words))
    expect[3] -= 0.8 * 1.75 ** (3 - 2)
    np.testing.assert_allclose([got[t] for t in range(len(words))], softmax(expect), atol=1e-12)
    # a longer repeat is penalised more (exponentially)
    s.reset([0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4])
    ids, p = s.distribution(x)
    got = dict(zip(ids.tolist(), p, strict=True))
    expect = np.zeros(len(words))
    expect[5] -= 0.8 * 1.75 ** (5 - 2)
    np.testing.assert_allclose([got[t] for t in range(len(words))], softmax(expect), atol=1e-12)
    # a sequence breaker inside the repeat stops it: only the tokens after the breaker count
    s.reset([0, 1, 2, 3, 7, 0, 1, 2, 3, 7, 0, 1])
    ids, p = s.distribution(x)
    got = dict(zip(ids.tolist(), p, strict=True))
    expect = np.zeros(len(words))
    expect[2] -= 0.8  # "The cat" (2 tokens since the "\n") repeats: " sat" gets multiplier * base^0
    np.testing.assert_allclose([got[t] for t in range(len(words))], softmax(expect), atol=1e-12)
    # a token that is a breaker by itself is never penalised: after " sat : sat" the token ":" would
    # extend the repeat " sat", but ":" is a breaker
    s = Sampler(SamplingParams(**PLAIN, **{**kw, "dry_allowed_length": 1}), token_text=lambda t: words[t])
    s.reset([2, 8, 2])
    ids, p = s.distribution(x)
    assert np.allclose(p, 1 / len(words))


def test_dry_breakers_spanning_tokens_are_matched_on_text():
    # the breaker "<br>" arrives as "<b" + "r>": the repeat before it does not count
    texts = ["x", "y", "z", "<b", "r>", "w"]
    kw = dict(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2, dry_penalty_last_n=-1)
    x = np.zeros(len(texts), dtype=np.float32)
    with_breaker = Sampler(SamplingParams(**PLAIN, **kw, dry_sequence_breakers=["<br>"]), token_text=texts.__getitem__)
    without = Sampler(SamplingParams(**PLAIN, **kw, dry_sequence_breakers=()))
    history = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    for s in (with_breaker, without):
        s.reset(history)
    got = dict(zip(*with_breaker.distribution(x), strict=True))
    expect = np.zeros(len(texts))
    expect[2] -= 1.0  # only "x y" since the breaker: 2 tokens, exponent 0
    np.testing.assert_allclose([got[t] for t in range(len(texts))], softmax(expect), atol=1e-12)
    got = dict(zip(*without.distribution(x), strict=True))
    expect = np.zeros(len(texts))
    expect[2] -= 2.0 ** (7 - 2)  # "x y z <b r> x y" repeats 7 tokens
    np.testing.assert_allclose([got[t] for t in range(len(texts))], softmax(expect), atol=1e-12)


def test_dry_needs_the_token_texts_for_its_breakers():
    with pytest.raises(BadRequestError, match="dry_sequence_breakers"):
        Sampler(SamplingParams(dry_multiplier=0.8))
    Sampler(SamplingParams(dry_multiplier=0.8, dry_sequence_breakers=()))  # no breakers: no texts needed


def test_xtc_removes_the_top_choices_with_its_probability():
    # tokens 0 and 1 are above the threshold: when XTC fires, 0 goes and 1 (the least likely of them) stays
    x = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    d = draws(n=5000, logits=x, **PLAIN, xtc_probability=0.5, xtc_threshold=0.2)
    freq = np.bincount(d, minlength=4) / len(d)
    fired = np.array([0.0, 0.3, 0.15, 0.05]) / 0.5
    np.testing.assert_allclose(freq, 0.5 * softmax(x) + 0.5 * fired, atol=0.02)
    # threshold above 0.5: at most one token can be above it, so nothing is ever removed
    assert "xtc" not in Sampler(SamplingParams(xtc_probability=1.0, xtc_threshold=0.6)).describe()


def test_mirostat_v2_tracks_mu():
    tau, eta = 3.0, 0.1
    s = Sampler(SamplingParams(mirostat=2, mirostat_tau=tau, mirostat_eta=eta, temperature=1.0, seed=5))
    assert s.mu == 2 * tau
    p = softmax(ZIPF)
    surprises = []
    for _ in range(1500):
        mu = s.mu
        t = s.sample(ZIPF)
        kept = p >= 2.0 ** -mu
        if not kept.any():
            kept = p == p.max()
        assert kept[t]  # never a token more surprising than mu
        surprise = -math.log2(p[t] / p[kept].sum())
        assert s.mu == pytest.approx(mu - eta * (surprise - tau), abs=1e-9)
        surprises.append(surprise)
    assert np.mean(surprises[200:]) == pytest.approx(tau, abs=0.15)  # the point of mirostat
    s.reset()
    assert s.mu == 2 * tau


def test_mirostat_v1_steers_surprise_to_tau():
    tau = 4.0
    x = (np.log(1.0 / np.arange(1, 2001) ** 1.2)).astype(np.float32)
    s = Sampler(SamplingParams(mirostat=1, mirostat_tau=tau, mirostat_eta=0.1, temperature=1.0, seed=2))
    p = softmax(x)
    mus, picks = [], []
    for _ in range(1500):
        mus.append(s.mu)
        picks.append(s.sample(x))
    assert s.mu != 2 * tau
    # surprise of the picks under the model's distribution averages near tau (truncation makes it a bit less)
    assert np.mean(-np.log2(p[picks[200:]])) == pytest.approx(tau, abs=0.6)
    t = Sampler(SamplingParams(mirostat=1, mirostat_tau=tau, mirostat_eta=0.1, temperature=1.0, seed=2))
    assert [t.sample(x) for _ in range(50)] == picks[:50]  # same seed, same picks (mu evolves the same)


# -- greedy, bias, seeds ------------------------------------------------------------------------------


def test_greedy_respects_bias_and_penalties_and_ignores_the_seed():
    x = np.array([1.0, 5.0, 5.0, 2.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0, seed=1)).sample(x) == 1
    assert Sampler(SamplingParams(temperature=0, logit_bias={1: -math.inf})).sample(x) == 2
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=10.0))
    s.reset([1, 2])
    assert s.sample(x) == 3


def test_greedy_fast_path_equals_the_chain():
    rng = np.random.default_rng(0)
    for i in range(40):
        x = rng.standard_normal(300).astype(np.float32) * 3
        x[rng.integers(0, 300, 3)] = x.max()  # ties on the maximum
        kw = dict(temperature=0.0, repeat_penalty=1.3, frequency_penalty=0.2, logit_bias={int(i): 2.0},
                  dry_multiplier=0.5, dry_sequence_breakers=())
        fast, slow = Sampler(SamplingParams(**kw)), Sampler(SamplingParams(**kw), route="steps")
        history = rng.integers(0, 300, 50).tolist()
        fast.reset(history)
        slow.reset(history)
        assert fast.route == "greedy" and fast.sample(x) == slow.sample(x)
    # typical-p or XTC can drop the best token: no shortcut then
    assert Sampler(SamplingParams(temperature=0, typical_p=0.5)).route == "steps"
    # a processor after a truncation ranks only the survivors: no shortcut either
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.1,
                                  samplers=["top_k", "penalties", "temperature"])).route == "steps"
    with pytest.raises(BadRequestError, match="route 'greedy' does not apply to the chain"):
        Sampler(SamplingParams(temperature=0, typical_p=0.5), route="greedy")
    with pytest.raises(BadRequestError, match="route must be one of auto, compiled, greedy, fused, steps; got 'x'"):
        Sampler(SamplingParams(), route="x")  # type: ignore[arg-type]


def test_logit_bias_bans_and_boosts():
    d = draws(n=3000, **PLAIN, logit_bias={1: -math.inf, 4: -math.inf, "3": 10.0})
    assert 1 not in d and 4 not in d and np.mean(d == 3) > 0.9
    with pytest.raises(BadRequestError, match="no token can be sampled"):
        Sampler(SamplingParams(logit_bias=dict.fromkeys(range(6), -math.inf))).sample(LOGITS)
    with pytest.raises(BadRequestError, match="logit_bias: token 99 is outside"):
        Sampler(SamplingParams(logit_bias={99: 1.0})).sample(LOGITS)


@pytest.mark.parametrize("kw", [
    {}, {"temperature": 0.0}, {"top_k": 0}, {"top_k": 0, "top_p": 1.0, "min_p": 0.0}, {"typical_p": 0.5},
    {"xtc_probability": 1.0, "xtc_threshold": 0.01}, {"mirostat": 1}, {"mirostat": 2},
    {"repeat_penalty": 1.5, "frequency_penalty": 1.0},
])
def test_masked_logits_only_allowed_tokens_come_out(kw):
    # a grammar constraint leaves most of the vocabulary at -inf before the sampler runs
    rng = np.random.default_rng(4)
    x = rng.standard_normal(5000).astype(np.float32)
    allowed = rng.choice(5000, 7, replace=False)
    masked = np.full_like(x, -np.inf)
    masked[allowed] = x[allowed]
    s = Sampler(SamplingParams(seed=1, **kw))
    s.reset(allowed[:3].tolist())
    with np.errstate(all="raise"):  # no NaN or division by zero on the way
        picks = {s.sample(masked) for _ in range(100)}
    assert picks <= set(allowed.tolist())
    with pytest.raises(BadRequestError, match="no token can be sampled"):
        s.sample(np.full_like(x, -np.inf))


def test_seed_reproducibility_with_every_random_step():
    kw = dict(seed=42, xtc_probability=0.5, xtc_threshold=0.05, temperature=1.2, top_k=0, min_p=0.0)
    a = Sampler(SamplingParams(**kw))
    first = [a.sample(ZIPF) for _ in range(200)]
    assert [Sampler(SamplingParams(**kw)).sample(ZIPF) for _ in range(1)] == first[:1]
    b = Sampler(SamplingParams(**kw))
    assert [b.sample(ZIPF) for _ in range(200)] == first
    a.reset()  # restores the random streams
    assert [a.sample(ZIPF) for _ in range(200)] == first
    c = Sampler(SamplingParams(**{**kw, "seed": 43}))
    assert [c.sample(ZIPF) for _ in range(200)] != first
    # no seed: a fresh one, reported so that the run can be replayed
    d = Sampler(SamplingParams(**{**kw, "seed": None}))
    again = Sampler(SamplingParams(**{**kw, "seed": d.seed}))
    assert [d.sample(ZIPF) for _ in range(50)] == [again.sample(ZIPF) for _ in range(50)]


def test_large_vocabulary_default_chain():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(49152) * 2.5).astype(np.float32)
    x[[17, 4242, 40000]] += 9.0
    s = Sampler(SamplingParams(seed=3))
    picks = {s.sample(x) for _ in range(200)}
    assert picks <= {17, 4242, 40000} | set(np.argsort(-x)[:40].tolist())
    assert Sampler(SamplingParams(temperature=0)).sample(x) == int(np.argmax(x))


# -- log-probabilities --------------------------------------------------------------------------------


def test_logprobs_are_the_models_log_softmax():
    x = np.array([0.5, 2.0, -1.0, 2.0, 1.5], dtype=np.float32)
    ref = np.log(softmax(x))
    s = Sampler(SamplingParams(temperature=0.3, logit_bias={0: 5.0}, seed=0))  # neither changes the logprobs
    token, lp = s.sample_with_logprobs(x, n_top=3)
    assert lp.token == token and lp.logprob == pytest.approx(ref[token], abs=1e-12)
    assert [t for t, _ in lp.top_logprobs] == [1, 3, 4]  # best first, ties by id
    np.testing.assert_allclose([v for _, v in lp.top_logprobs], ref[[1, 3, 4]], atol=1e-12)
    assert token_logprobs(x, 2, 0).top_logprobs == ()
    # float64 throughout: tiny probabilities keep their log exactly
    far = np.array([0.0, -300.0], dtype=np.float64)
    assert token_logprobs(far, 1).logprob == pytest.approx(-300.0, rel=1e-12)
    with pytest.raises(BadRequestError, match="n_top"):
        s.sample_with_logprobs(x, n_top=-1)
    with pytest.raises(BadRequestError, match="n_top"):
        s.sample_with_logprobs(x, n_top=6)


# -- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,name",
    [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 1.5}, "top_p"),
     ({"top_p": -0.1}, "top_p"), ({"seed": -3}, "seed"), ({"temperature": float("nan")}, "temperature"),
     ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
     ({"typical_p": 0.0}, "typical_p"), ({"typical_p": 2.0}, "typical_p"), ({"min_keep": -1}, "min_keep"),
     ({"repeat_penalty": 0.0}, "repeat_penalty"), ({"repeat_penalty": float("inf")}, "repeat_penalty"),
     ({"repeat_last_n": -2}, "repeat_last_n"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
     ({"presence_penalty": "1"}, "presence_penalty"), ({"dry_multiplier": -1.0}, "dry_multiplier"),
     ({"dry_base": 0.5}, "dry_base"), ({"dry_allowed_length": 0}, "dry_allowed_length"),
     ({"dry_penalty_last_n": -5}, "dry_penalty_last_n"), ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers"),
     ({"dry_sequence_breakers": ["\n", ""]}, "dry_sequence_breakers"), ({"xtc_probability": 1.1}, "xtc_probability"),
     ({"xtc_threshold": -0.1}, "xtc_threshold"), ({"mirostat": 3}, "mirostat"),
     ({"mirostat_tau": -1.0}, "mirostat_tau"),
     ({"mirostat_eta": float("inf")}, "mirostat_eta"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
     ({"logit_bias": {1: float("inf")}}, "logit_bias"), ({"logit_bias": [1, 2]}, "logit_bias"),
     ({"samplers": ["top_k", "magic"]}, "samplers"), ({"samplers": [1]}, "samplers")],
)
def test_bad_parameters_name_themselves(kw, name):
    with pytest.raises(BadRequestError, match=name) as e:
        SamplingParams(**kw)
    assert "\n" not in str(e.value)  # one line


def test_bad_inputs():
    s = Sampler(SamplingParams(seed=0))
    with pytest.raises(ModelError, match="NaN"):
        s.sample(np.array([0.0, np.nan], dtype=np.float32))
    with pytest.raises(BadRequestError, match="1-D"):
        s.sample(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(BadRequestError, match="token ids"):
        s.accept(-1)
    with pytest.raises(BadRequestError, match="token ids"):
        s.reset([0, "a"])
    p = Sampler(SamplingParams(repeat_penalty=1.2))
    p.reset([0, 100])
    with pytest.raises(BadRequestError, match="token 100 is outside"):
        p.sample(LOGITS)


def test_top_p_zero_keeps_only_the_best_token():
    # OpenAI clients may send top_p=0: the nucleus is then the single most likely token
    s = Sampler(SamplingParams(seed=3, top_k=0, top_p=0.0, min_p=0.0, temperature=1.0))
    assert {s.sample(LOGITS) for _ in range(50)} == {1}


@pytest.mark.parametrize("bias", [{0: -100.0, 2: -100.0, 4: -100.0}, {7: 50.0, 9: -math.inf}, {3: 0.0}])
def test_bias_and_top_k_in_one_pass_equal_the_two_steps(bias):
    """logit_bias then top_k runs as one pass over the vocabulary (no copy of it); the draws, with the
    rest of the default chain after it, are the same as running the two steps one after the other."""
    rng = np.random.default_rng(len(bias))
    kw = dict(temperature=0.8, logit_bias=bias, seed=5)
    fast, slow = Sampler(SamplingParams(**kw), route="fused"), Sampler(SamplingParams(**kw), route="steps")
    assert fast.describe() == slow.describe()
    for i in range(60):
        x = (rng.standard_normal(49152) * 3).astype(np.float32)
        if i % 3 == 0:
            x = np.round(x).astype(np.float32)  # ties across the cut
        if i % 3 == 1:
            x[rng.integers(0, 49152, 30)] = x.max() + 1  # the biased tokens among many equal best
        assert fast.sample(x) == slow.sample(x), i


@pytest.mark.parametrize("step", ["top_p", "min_p"])
def test_cuts_of_a_sorted_set_equal_the_general_path(step):
    """top_p and min_p cut a sorted candidate set as a prefix; the general path (a partition, a mask)
    keeps the same tokens in the same order."""
    from minfer.runtime.sampling.candidates import Candidates as _Candidates
    from minfer.runtime.sampling.filters import MinP as _MinP
    from minfer.runtime.sampling.filters import TopP as _TopP

    rng = np.random.default_rng(3)
    for i in range(200):
        x = (rng.standard_normal(500) * rng.uniform(0.1, 4)).astype(np.float32)
        if i % 4 == 0:
            x = np.round(x).astype(np.float32)
        p, min_keep = rng.choice([0.0, 0.05, 0.5, 0.9, 0.99, 1.0]), int(rng.choice([0, 1, 3, 60]))
        cut = (_TopP(p, min_keep) if step == "top_p" else _MinP(max(p, 1e-6), min_keep))
        fast, slow = _Candidates(x), _Candidates(x)
        for c in (fast, slow):
            c.keep(c.best(120), True)
        slow.sorted = False
        cut.apply(fast)
        cut.apply(slow)
        assert fast.ids.tolist() == slow.ids.tolist() and np.array_equal(fast.logits, slow.logits), (i, p, min_keep)


def test_steps_declare_what_they_may_do():
    """The greedy shortcut and the compiled chain read what each step declares: a step without a kind
    cannot be defined, and a new one is taken at its word, never as harmless by default."""
    from minfer.runtime.sampling.chain import _argmax_processors
    from minfer.runtime.sampling.compiled import CompiledChain
    from minfer.runtime.sampling.filters import Greedy, Temperature, TopK
    from minfer.runtime.sampling.pickers import Dist
    from minfer.runtime.sampling.step import Kind, State, Step

    with pytest.raises(TypeError, match="kind"):
        class Undeclared(Step):
            name = "undeclared"

    class Coin(Step):
        name = "coin"
        kind = Kind.MAY_DROP_BEST

    draw = Dist(State())
    assert _argmax_processors([TopK(40), Greedy(), draw]) == []
    assert _argmax_processors([TopK(40), Coin(), Greedy(), draw]) is None
    assert CompiledChain.of([TopK(40), Temperature(0.8), draw]) is not None
    assert CompiledChain.of([TopK(40), Coin(), Temperature(0.8), draw]) is None  # no compiled stage
