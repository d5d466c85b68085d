"""Speculative decoding (prompt lookup and a draft model): the output of plain decoding at temperature 0,
the target's distribution when sampling, and its errors."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections import Counter

import numpy as np
import pytest
from conftest import fixture_dir
from scipy.stats import chisquare

import minfer
import minfer.errors
from minfer.errors import BadRequestError, ModelError
from minfer.runtime.sequence import Continuation, GenerationStats
from minfer.runtime.speculative import verify
from minfer.runtime.speculative.draft import Draft
from minfer.runtime.speculative.lookup import lookup_draft

LLAMA = fixture_dir("llama") / "model-f32.gguf"
LLAMA_Q8 = fixture_dir("llama") / "model-q8_0.gguf"


@pytest.fixture(scope="module")
def llama():
    return minfer.load(LLAMA)


def drafting_pays(model: minfer.Model) -> minfer.Model:
    """``model`` with fixed pass costs: a pass of any size as cheap as a one-token pass, a draft model's
    token a tenth of one. The drafts that these tests check are then made whatever the machine's timings
    (measured on a tiny fixture, a draft of the target's own size never pays, so none would be made)."""
    from minfer.runtime.speculative.policy import PassCosts

    model.engine.scheduler.pass_costs = PassCosts(prior_slope=0.0, measure=False)
    if model.engine.draft is not None:
        model.engine.draft.costs = PassCosts(measure=False)
    return model


# --- prompt lookup ----------------------------------------------------------------------------------


def test_lookup_takes_the_longest_ngram_and_its_most_recent_occurrence():
    h = np.array([1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3])
    # the trigram 1 2 3 occurred at 0: what followed it
    assert lookup_draft(h, 4, 3, 1) == ([9, 9, 2, 3], 3)
    # bigrams only: 2 3 last occurred at 5, followed by 7 8 1 2
    assert lookup_draft(h, 4, 2, 1) == ([7, 8, 1, 2], 2)
    assert lookup_draft(h, 2, 2, 2) == ([7, 8], 2)
    # no earlier 5: nothing
    assert lookup_draft(np.array([1, 2, 5]), 4, 3, 1) == ([], 0)
    # a run of one token drafts itself (the occurrence may end right before the last token)
    assert lookup_draft(np.array([4, 4]), 3, 3, 1) == ([4], 1)


# --- the output distribution -----------------------------------------------------------------------

N_SAMPLES = 20_000
CONTEXT = [0, 17, 93, 41, 250, 41]
# a chain whose support is small enough for a chi-square over the first two tokens, with a penalty, so
# that the second token's distribution depends on the first through the history as well as the logits
PARAMS = dict(temperature=0.9, top_k=6, top_p=1.0, min_p=0.0, repeat_penalty=1.3)


class Target:
    """The llama fixture's logits after CONTEXT + a few tokens (cached), and the chain's distribution."""

    def __init__(self, model) -> None:
        self.model = model
        self._rows: dict[tuple[int, ...], np.ndarray] = {}

    def row(self, *tokens: int) -> np.ndarray:
        key = tuple(tokens)
        if key not in self._rows:
            self._rows[key] = self.model.logits(CONTEXT + list(tokens))[-1]
        return self._rows[key].copy()

    def p(self, *tokens: int) -> dict[int, float]:
        """The chain's distribution of the token after CONTEXT + tokens (the history holds them)."""
        s = self.model.sampler(**PARAMS)
        s.reset(CONTEXT)
        for t in tokens:
            s.accept(t)
        ids, probs = s.distribution(self.row(*tokens))
        return dict(zip(ids.tolist(), probs.tolist(), strict=True))

    def joint(self) -> dict[tuple[int, int], float]:
        return {(a, b): pa * pb for a, pa in self.p().items() for b, pb in self.p(a).items()}


def continuation(model, sampler, seed: int) -> Continuation:
    """A fresh sequence after CONTEXT whose draws come from ``seed`` (one sampler reused: building one per
    sample would dominate the test's time)."""
    sampler.seed = seed
    out = Continuation(model.tokenizer, sampler, 2, GenerationStats(), stop_ids=frozenset())
    out.start(CONTEXT)  # resets the history and the random streams
    return out


def two_tokens_speculative(target: Target, out: Continuation, draft: Draft) -> tuple[int, int]:
    """The first two tokens when the first pass verifies ``draft`` (2 tokens), as the engine runs it:
    ``Continuation.verify`` over the rows after the next token and each draft token; a token left to
    take after a rejection comes from the next (plain) pass."""
    d0, d1 = draft.tokens
    steps, _ = out.verify(np.stack([target.row(), target.row(d0), target.row(d0, d1)]), draft)
    tokens = [s.token for s in steps][:2]
    if len(tokens) == 1:
        tokens.append(out.step(target.row(tokens[0])).token)
    return tokens[0], tokens[1]


def chi_square(counts: Counter, expected: dict, n: int) -> tuple[float, float]:
    """Pearson's chi-square of ``counts`` against ``expected`` probabilities (cells expecting fewer than 5
    draws pooled into one), and its p-value (scipy); an outcome the target cannot give is (inf, 0)."""
    if not set(counts) <= set(expected):
        return float("inf"), 0.0
    big = [c for c, p in expected.items() if p * n >= 5]
    small = [c for c in expected if c not in big]
    obs = [counts[c] for c in big] + ([sum(counts[c] for c in small)] if small else [])
    exp = [expected[c] * n for c in big] + ([sum(expected[c] for c in small) * n] if small else [])
    exp = np.array(exp) * (n / sum(exp))  # the float sum of the probabilities is 1 only to rounding
    stat, p = chisquare(obs, exp)
    return float(stat), float(p)


@pytest.fixture(scope="module")
def target(llama):
    return Target(llama)


def lookup_draft_of(target: Target) -> Draft:
    """A point-mass draft: the second most likely first token, then the most likely after it."""
    first = sorted(target.p().items(), key=lambda kv: -kv[1])
    d0 = first[1][0]
    d1 = max(target.p(d0).items(), key=lambda kv: kv[1])[0]
    return Draft([d0, d1])


def draft_model_sampler(target: Target, seed: int):
    """A draft 'model' whose distribution differs from the target's: the fixture's raw softmax at a higher
    temperature over its 10 best tokens (some outside the target's 6), drawn from as a draft model is."""
    rng = np.random.default_rng(seed)

    cache: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def q_of(*tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if tokens not in cache:
            row = target.row(*tokens)
            ids = np.argsort(-row)[:10]
            w = np.exp((row[ids] - row[ids].max()) / 2.0)
            cache[tokens] = ids, w / w.sum(), np.cumsum(w / w.sum())
        return cache[tokens]

    def pick(q: tuple[np.ndarray, np.ndarray, np.ndarray]) -> int:
        return int(q[0][min(int(np.searchsorted(q[2], rng.random() * q[2][-1], side="right")), len(q[0]) - 1)])

    def draw() -> Draft:
        q0 = q_of()
        d0 = pick(q0)
        q1 = q_of(d0)
        return Draft([d0, pick(q1)], [q0[:2], q1[:2]])

    return draw


def run_samples(target: Target, how: str) -> Counter:
    model = target.model
    counts: Counter = Counter()
    fixed = lookup_draft_of(target)
    draw = draft_model_sampler(target, 1234)
    sampler = model.sampler(**PARAMS)
    for i in range(N_SAMPLES):
        out = continuation(model, sampler, i)
        if how == "plain":
            t0 = out.step(target.row()).token
            counts[t0, out.step(target.row(t0)).token] += 1
        elif how == "lookup":
            counts[two_tokens_speculative(target, out, fixed)] += 1
        else:
            counts[two_tokens_speculative(target, out, draw())] += 1
    return counts


@pytest.mark.parametrize("how", ["plain", "lookup", "draft"])
def test_speculative_samples_follow_the_target_distribution(target, how):
    expected = target.joint()
    counts = run_samples(target, how)
    assert set(counts) <= set(expected), f"outcomes the target cannot give: {set(counts) - set(expected)}"
    stat, p = chi_square(counts, expected, N_SAMPLES)
    print(f"{how}: chi-square {stat:.2f} over {len(expected)} cells (pooled below 5 expected), p = {p:.4f}")
    assert p > 0.01


def test_a_broken_acceptance_rule_fails_the_same_test(target, monkeypatch):
    """Keeping every draft token (no rejection) gives the draft's distribution, and the test sees it."""
    monkeypatch.setattr(verify, "accept_or_resample", lambda p, draft, q, rng: (draft, True))
    expected = target.joint()
    for how in ("lookup", "draft"):
        stat, p = chi_square(run_samples(target, how), expected, N_SAMPLES)
        print(f"always accept ({how}): chi-square {stat:.2f}, p = {p:.3g}")
        assert p < 1e-6


# --- temperature 0: the text of plain decoding -------------------------------------------------------

# prompts of the fixtures' tokens: repetitive ones (lookup finds drafts), and ones that are not
FIXTURE_PROMPTS = [
    [0, *range(5, 40)] * 2,
    [0, 7, 8, 9, 7, 8, 9, 7, 8],
    [0, 100, 200, 300],
    [0, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12],
    [0, 300, 301, 302, 303, 304, 305, 300, 301],
]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_greedy_text_with_lookup_and_draft_is_the_text_without(arch):
    path = fixture_dir(arch) / "model-f32.gguf"
    plain = minfer.load(path)
    lookup = drafting_pays(minfer.load(path, lookup=True, speculative={"draft_max": 4}))
    # a draft model of the same weights in Q8_0 (when the fixture has it) agrees often, never always
    draft_path = fixture_dir(arch) / "model-q8_0.gguf"
    drafted = drafting_pays(minfer.load(path, draft=draft_path if draft_path.exists() else path,
                                        speculative={"draft_p_min": 0.0, "draft_max": 5}))
    totals = Counter()
    for ids in FIXTURE_PROMPTS:
        want = plain.complete(ids, 48, temperature=0, repeat_penalty=1.1)
        for name, model in (("lookup", lookup), ("draft", drafted)):
            got = model.complete(ids, 48, temperature=0, repeat_penalty=1.1)
            assert got.tokens == want.tokens, (name, ids)
            assert got.finish_reason == want.finish_reason
            totals[name, "drafted"] += got.stats.drafted_tokens
            totals[name, "accepted"] += got.stats.accepted_tokens
            assert got.stats.target_passes < want.stats.target_passes or got.stats.accepted_tokens == 0
    print(dict(totals))
    # the paths were exercised: drafts were verified, some kept and some replaced
    assert totals["draft", "accepted"] > 0 and totals["lookup", "drafted"] > 0


def test_verifying_passes_take_a_few_sizes_all_prepared_before_the_first_token():
    """A model loaded with lookup prepares the decode and verifying shapes; a run that drafts builds no
    plan after its first token, and every pass after the prompt evaluates one of those sizes."""
    from minfer.runtime.speculative.state import verify_size, verify_sizes

    assert verify_sizes(8) == [2, 4, 8, 9] and verify_sizes(4) == [2, 4, 5] and verify_sizes(1) == [2]
    assert verify_sizes(2) == [2, 3] and [verify_size(n, 8) for n in (2, 3, 5, 8, 9)] == [2, 4, 8, 8, 9]
    model = drafting_pays(minfer.load(LLAMA, lookup=True, speculative={"draft_max": 8}))
    runner = model.runner
    prepared = set(runner._plans)
    assert {(1, 1), (2, 2), (4, 4), (8, 8), (9, 9)} <= prepared
    shapes = []
    run = runner._run

    def spy(tokens, positions, output_rows, seq_ids, hidden, images=()):
        shapes.append((len(tokens), len(tokens) if output_rows is None else len(output_rows)))
        return run(tokens, positions, output_rows, seq_ids, hidden, images)

    runner._run = spy
    ids = [0, *range(5, 40)] * 2
    stream = iter(model.stream(ids, max_tokens=40, temperature=0))
    next(stream)
    built = runner.plans_built
    rest = list(stream)
    assert runner.plans_built == built and rest
    assert model.last_stats.accepted_tokens > 0
    assert shapes[0] == (len(ids), 1) and set(shapes[1:]) <= {(1, 1), (2, 2), (4, 4), (8, 8), (9, 9)}
    assert any(n > 2 for n, _ in shapes[1:]), (shapes, model.last_stats)
    assert model.complete(ids, 40, temperature=0).tokens == minfer.load(LLAMA).complete(ids, 40, temperature=0).tokens


def test_a_draft_models_sequence_whose_drafts_are_rarely_kept_stops_drafting_for_a_while():
    """A draft model's drafts grow while the target keeps them; drafts it rejects shrink them to none, and
    drafting resumes after a pause, once that evidence has faded; a retry rejected again pauses longer."""
    from minfer.runtime.sampling import Sampler, SamplingParams
    from minfer.runtime.speculative import SpeculativeSettings
    from minfer.runtime.speculative.state import SequenceSpeculation

    def cost(d):  # SmolLM2-135M drafting for a 1.7B shape, 2 threads (bench/draft_pair.py)
        return {0: 1.0, 1: 1.18, 2: 1.31, 3: 1.31}.get(d, 1.79) + 0.11 * d

    def spec():
        return SequenceSpeculation(SpeculativeSettings(mode="draft"), [1, 2, 3], Sampler(SamplingParams()))

    good = spec()
    first = good.draft_length(100, cost)
    assert first >= 1
    for _ in range(6):
        good.verified(good.draft_length(100, cost), 8)  # kept whole
    assert good.draft_length(100, cost) > first
    assert good.draft_length(2, cost) == 2  # within the room left
    poor = spec()
    rejected = 0
    while (k := poor.draft_length(100, cost)) > 0:  # a steadier prior than lookup's: a few rejections
        poor.verified(k, 0)
        rejected += 1
        assert rejected <= 12
    assert rejected >= 3

    def steps_to_resume():
        steps = 1
        while not (k := poor.draft_length(100, cost)):
            steps += 1
            assert steps < 400
        return steps, k

    first_wait, k = steps_to_resume()
    assert first_wait >= 16
    while k:  # the retry is rejected too: the next pause is twice as long
        poor.verified(k, 0)
        k = poor.draft_length(100, cost)
    assert steps_to_resume()[0] >= 32


def test_draft_length_maximizes_expected_tokens_per_pass_cost():
    from minfer.runtime.speculative.policy import PassCosts, best_length, expected_tokens

    assert expected_tokens(0.5, 0) == 1.0 and expected_tokens(0.5, 2) == 1.75 and expected_tokens(1.0, 8) == 9.0

    def prior(n):
        return 1 + 0.15 * (n - 1)

    def exact(n):
        return n

    def alone(d):
        return prior(1 + d)

    assert best_length(0.1, 8, alone) == 0  # 1.1 tokens for 1.15 passes: a plain decode is better
    assert best_length(0.2, 8, alone) == 1  # 1.2 / 1.15
    assert best_length(0.99, 8, alone) == 8
    assert best_length(0.99, 3, alone) == 3  # only what the match holds
    assert best_length(0.99, 0, alone) == 0
    # 9 tokens cost much more than 8 (SmolLM2: 2.43 against 2.14): a 3-gram match fills the pass of 8
    smollm2 = {1: 1.0, 2: 1.21, 3: 1.39, 4: 1.51, 5: 1.7, 6: 1.85, 7: 2.0, 8: 2.14, 9: 2.43}
    assert best_length(0.95, 8, lambda d: smollm2[1 + d]) == 7
    # padded to 2, 4, 8: a draft of 2 costs what one of 3 does, so it is never better
    padded = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 8: 8, 9: 9}
    assert best_length(0.7, 8, lambda d: prior(padded[1 + d])) in (1, 3)
    # drafting costs too: the same acceptance drafts shorter
    assert best_length(0.7, 8, lambda d: prior(1 + d) + 0.3 * d) < best_length(0.7, 8, alone)
    # beside three other decodes a draft competes with the whole pass's rate (4 tokens for 1.51 passes):
    # a one-token draft kept 30% of the time pays alone, not there; one kept 95% of the time pays in both
    assert best_length(0.3, 1, lambda d: smollm2[1 + d]) == 1
    assert best_length(0.3, 1, lambda d: smollm2[4 + d], others=3) == 0
    assert best_length(0.95, 5, lambda d: smollm2[4 + d], others=3) == 4

    costs = PassCosts()
    assert costs.relative(1) == 1.0 and costs.relative(5) == prior(5)  # the prior until measured
    # each size's first pass binds its plan (not counted); of the next three the fastest stands, so one
    # slow pass (a host's hiccup) does not price a size out of ever being drafted for again
    for n, seconds in ((1, 0.050), (1, 0.004), (1, 0.005), (4, 0.050), (4, 0.090), (4, 0.006)):
        costs.record(n, seconds)
    assert costs.relative(4) == prior(4) and costs.seconds(4) is None  # two and three passes: not yet
    costs.record(1, 0.004)
    assert costs.relative(4) == prior(4)
    costs.record(4, 0.007)
    assert costs.relative(4) == 1.5
    costs.record(4, 0.060)  # a pass slowed by something else moves the estimate a little
    assert 1.5 < costs.relative(4) < 3
    costs.record(1, 0.009)
    costs.record(4, 0.003)  # never below a one-token pass
    assert costs.relative(4) >= 1.0

    now = [0.0]
    costs = PassCosts(clock=lambda: now[0])
    for n, seconds in ((1, 0.05), (1, 0.004), (1, 0.004), (1, 0.004), (4, 0.05), (4, 0.02), (4, 0.02), (4, 0.02)):
        costs.record(n, seconds)
    assert costs.relative(4) == 5.0  # priced out of drafting, so no pass of 4 runs to correct it ...
    now[0] = 11.0
    costs.record(1, 0.004)
    assert costs.relative(4) == prior(4)  # ... until it has not run for 10 s: measured afresh
    for _ in range(3):
        costs.record(4, 0.006)
    assert costs.relative(4) == 1.5


def test_prompt_lookup_drafts_what_its_matches_earn():
    """A sequence whose 1-gram drafts are rejected stops drafting from 1-gram matches, keeps drafting
    from 3-gram ones, and tries 1-gram matches again once the evidence has faded."""
    from minfer.runtime.sampling import Sampler, SamplingParams
    from minfer.runtime.speculative import SpeculativeSettings
    from minfer.runtime.speculative.policy import PassCosts
    from minfer.runtime.speculative.state import SequenceSpeculation

    prompt = list(range(10, 40))
    spec = SequenceSpeculation(SpeculativeSettings(mode="lookup"), prompt, Sampler(SamplingParams()))
    costs = PassCosts()

    def cost(d):
        return costs.relative(1 + d)

    first = spec.lookup([15], 100, cost)  # 15 matched a 1-gram: one token drafted at the prior
    assert first is not None and first.tokens == [16] and spec.matched == 1
    spec.verified(1, 0)
    assert spec.lookup([15, 99, 15], 100, cost) is None  # rejected: 1-gram drafts do not pay
    strong = spec.lookup([15, 99, 15, 20, 21, 22], 100, cost)  # a 3-gram match: a long draft
    assert strong is not None and strong.tokens[:3] == [23, 24, 25] and len(strong.tokens) >= 3
    assert spec.matched == 3
    spec.verified(len(strong.tokens), len(strong.tokens))
    steps = 0
    while spec.lookup([15, 99, 15, 20, 21, 22, 7, 15], 100, cost) is None:
        steps += 1
        assert steps < 100
    assert steps >= 10  # 1-gram matches again, after a while


def test_a_batch_where_drafts_do_not_pay_runs_plain():
    """Beside other decodes a draft competes with the whole pass's rate. With passes that cost
    1 + 0.1 (n - 1) one-token passes, a lone sequence's 1-gram lookup drafts pay (at the prior 20% per
    token, a one-token draft gives 1.2 tokens for 1.1) while eight sequences' do not (8 tokens for 1.7
    passes, 8.2 for 1.8 with a draft); where passes cost the same at any size the eight draft too."""
    from minfer.runtime.engine import EngineConfig, build_engine
    from minfer.runtime.engine_loop import EngineLoop
    from minfer.runtime.requests import Finished, GenerationRequest
    from minfer.runtime.speculative import SpeculativeSettings
    from minfer.runtime.speculative.policy import PassCosts

    model = minfer.load(LLAMA)
    engine = build_engine(model.transformer, model.backend, model.tokenizer, 8 * 128, model.cache_type,
                          EngineConfig(n_slots=8, batch_size=128, end_of_context="length"),
                          speculative=SpeculativeSettings(mode="lookup"))
    loop = EngineLoop(engine)
    loop.start()
    prompt = [0, *range(5, 40)] * 2  # the fixture's continuation has 1-gram matches in it, no longer ones

    def drafted(n: int, slope: float) -> int:
        engine.scheduler.pass_costs = PassCosts(prior_slope=slope, measure=False)
        finished: list[Finished] = []
        done = threading.Semaphore(0)

        def emit(ev) -> None:
            if isinstance(ev, Finished):
                finished.append(ev)
                done.release()
        loop.submit([GenerationRequest(prompt, model.sampler(temperature=0.0), 40, emit) for _ in range(n)])
        for _ in range(n):
            assert done.acquire(timeout=120)
        return sum(ev.stats.drafted_tokens for ev in finished)

    try:
        assert drafted(1, 0.1) > 0
        assert drafted(8, 0.1) == 0
        assert drafted(8, 0.0) > 0
    finally:
        loop.stop()


# --- bad input ---------------------------------------------------------------------------------------


def test_a_draft_with_another_vocabulary_is_refused_naming_the_first_differing_token():
    with pytest.raises(ModelError, match=r"draft model .*gemma3.*at token 0: '<pad>' in the draft, '<\|bos\|>'"):
        minfer.load(LLAMA, draft=fixture_dir("gemma3") / "model-f32.gguf")
    # the same first 512 pieces but more of them: the first token only one side has
    with pytest.raises(ModelError, match=r"at token 512: only the draft has it"):
        minfer.load(LLAMA, draft=fixture_dir("qwen2") / "model-f32.gguf")


def test_bad_speculative_settings_are_refused(llama, tmp_path):
    with pytest.raises(BadRequestError, match="draft_max must be an integer >= 1, got 0"):
        minfer.load(LLAMA, lookup=True, speculative={"draft_max": 0})
    with pytest.raises(BadRequestError, match="draft_max 256 does not fit in the context of 256"):
        minfer.load(LLAMA, lookup=True, speculative={"draft_max": 256})
    with pytest.raises(BadRequestError, match="needs a draft model"):
        llama.generate([0, 5, 6], 4, speculative="draft")
    with pytest.raises(BadRequestError, match="unknown field 'k'"):
        llama.generate([0, 5, 6], 4, speculative={"k": 2})
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(LLAMA.read_bytes()[:1000])
    with pytest.raises(minfer.errors.FormatError, match=r"^draft model: .*cut.gguf: truncated GGUF file"):
        minfer.load(LLAMA, draft=truncated)


def minfer_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minfer", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("flags, fragment", [
    (["--draft-max", "0", "--lookup"], "--draft-max must be an integer >= 1, got 0"),
    (["--lookup", "--draft-max", "300"], "does not fit in the context of 256"),
    (["--draft", str(fixture_dir("gemma3") / "model-f32.gguf")], "its vocabulary differs from the target's at token 0"),
    (["--draft", "/nonexistent/draft.gguf"], "draft model: /nonexistent/draft.gguf: no such file"),
    (["--lookup", "--draft", str(LLAMA_Q8)], "use one of --lookup and --draft"),
])
def test_cli_bad_speculative_flags_give_one_line(flags, fragment):
    r = minfer_cli("run", str(LLAMA), "hello", "-n", "4", *flags)
    assert r.returncode == 1
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("minfer: error: ") and fragment in lines[0], lines[0]


def test_cli_summary_reports_acceptance_and_tokens_per_pass():
    plain = minfer_cli("run", str(LLAMA), "a b c a b c a b c a b", "-n", "24", "--temp", "0")
    r = minfer_cli("run", str(LLAMA), "a b c a b c a b c a b", "-n", "24", "--temp", "0", "--draft", str(LLAMA),
                   "--draft-p-min", "0")
    assert r.returncode == 0 and plain.returncode == 0, r.stderr
    assert r.stdout == plain.stdout
    summary = r.stderr.strip().splitlines()[-1]
    # the plain line's form is kept, the speculative part follows "generated N tokens (X t/s)"
    assert re.search(r"generated 24 tokens \([0-9.]+ t/s\), draft: (\d+)/(\d+) drafted tokens accepted "
                     r"\(\d+%\), [0-9.]+ tokens per target pass, ", summary), summary
    assert "drafted" not in plain.stderr


def test_cli_run_and_chat_keep_the_loaded_model_out_of_the_collectors_walks():
    """``minfer run`` and ``chat`` freeze what they loaded (gc.freeze): a full collection walking it cost a
    verifying pass of SmolLM2 48 ms on top of its 11 (:func:`minfer.api.keep_for_process`)."""
    probe = ("import atexit, gc, sys; "
             "atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr)); "
             "from minfer.cli import main; sys.argv[0] = 'minfer'; sys.exit(main())")
    gemma = str(fixture_dir("gemma3") / "model-f32.gguf")  # it has a chat template
    for args in (["run", str(LLAMA), "hello", "-n", "2"], ["chat", gemma, "-n", "2"]):
        r = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=300,
                           input="hi\n")
        assert r.returncode == 0, r.stderr
        frozen = int(re.search(r"frozen (\d+)", r.stderr).group(1))
        assert frozen > 10_000, (args[0], frozen)  # the model's objects, not a handful


# --- SmolLM2 ------------------------------------------------------------------------------------------

SMOLLM2_PROMPTS = [
    "Repeat exactly: The quick brown fox jumps over the lazy dog, and the dog does not move at all.",
    "Write a short poem about the sea.",
    "List the days of the week.",
    "Correct the spelling: Teh wether is realy nice todday and we are goign to the beech.",
    "What is the capital of Japan?",
    "Count from one to fifteen in words.",
    "Explain what a compiler does in two sentences.",
    "Repeat this list: apples, pears, plums, cherries, grapes, lemons.",
    "Translate to French: I like to read books in the evening.",
    "def add(a, b):\n    return a + b\n\nRewrite this Python function with type hints.",
]


@pytest.mark.slow
def test_smollm2_greedy_text_with_lookup_and_draft_is_the_text_without(smollm2_path):
    plain = minfer.load(smollm2_path, n_ctx=1024, threads=2)
    lookup = drafting_pays(minfer.load(smollm2_path, n_ctx=1024, threads=2, lookup=True))
    # the same file drafting for itself: the mechanism, not a speed-up (see the README)
    drafted = drafting_pays(minfer.load(smollm2_path, n_ctx=1024, threads=2, draft=smollm2_path,
                                        speculative={"draft_max": 4}))
    accepted = Counter()
    for q in SMOLLM2_PROMPTS:
        messages = [{"role": "user", "content": q}]
        want = plain.chat(messages, max_tokens=48, temperature=0)
        for name, model in (("lookup", lookup), ("draft", drafted)):
            assert model.chat(messages, max_tokens=48, temperature=0) == want, (name, q)
            accepted[name] += model.last_stats.accepted_tokens
    assert accepted["lookup"] > 0 and accepted["draft"] > 0, accepted


def test_stops_grammar_logprobs_and_max_tokens_behave_as_without(llama):
    """Drafts that run past a stop string, max_tokens or the end of a grammar are cut where plain decoding
    stops; logprobs are the model's at each kept token; the grammar masks draft and target."""
    drafted = drafting_pays(minfer.load(LLAMA, draft=LLAMA, speculative={"draft_p_min": 0.0, "draft_max": 6}))
    lookup = drafting_pays(minfer.load(LLAMA, lookup=True))
    ids = [0, *range(5, 30)] * 2
    text = llama.generate(ids, 30, temperature=0)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cases = [
        dict(max_tokens=7),
        dict(max_tokens=30, stop=[stop]),
        dict(max_tokens=12, logprobs=3),
        dict(max_tokens=20, grammar='root ::= [a-z ]+ "." | "x"'),
        dict(max_tokens=20, grammar='root ::= ([a-z]+ " ")+', repeat_penalty=1.2),
    ]
    for case in cases:
        case = dict(case)
        n = case.pop("max_tokens")
        want = llama.complete(ids, n, temperature=0, **case)
        for model in (drafted, lookup):
            got = model.complete(ids, n, temperature=0, **case)
            assert (got.text, got.tokens, got.finish_reason) == (want.text, want.tokens, want.finish_reason), case
            assert got.logprobs == want.logprobs
            assert got.stats.generated_tokens == want.stats.generated_tokens
    assert drafted.last_stats.accepted_tokens > 0
    # the cache keeps only kept tokens: a later prompt sharing them reuses them and nothing stale
    done = drafted.complete(ids, 20, temperature=0)
    held = drafted.kv.tokens(0)
    assert held == (ids + done.tokens)[: len(held)]
