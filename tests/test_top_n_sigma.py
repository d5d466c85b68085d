"""top-n-sigma (llama.cpp's ``llama_sampler_top_n_sigma``) against its definition, and through every way in:
the Python API, ``minfer run`` and the server, on the tiny llama fixture."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import httpx
import numpy as np
import pytest
from conftest import fixture_dir

import minfer
from minfer.errors import BadRequestError
from minfer.runtime.sampling import Sampler, SamplingParams
from minfer.server.errors import ApiError
from minfer.server.protocols.openai import parse_chat, parse_completion
from minfer.testing.server_process import ServerProcess

TINY = fixture_dir("llama") / "model-f32.gguf"
PLAIN = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)  # every other truncation off
PROMPT = "Once upon a time"
# so small an n keeps only the best logit: a draw at any temperature is then the greedy pick
ONLY_THE_BEST = 1e-6


def kept_by_definition(logits: np.ndarray, n: float) -> set[int]:
    """The tokens whose logit is at least max - n * sigma, sigma the standard deviation of the finite
    logits; n <= 0 keeps them all."""
    x = np.asarray(logits, dtype=np.float64)
    if n <= 0:
        return set(range(len(x)))
    finite = x[np.isfinite(x)]
    return set(np.flatnonzero(x >= finite.max() - n * finite.std()).tolist())


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))
    return e / e.sum()


def random_logits(rng: np.random.Generator, n_vocab: int, masked: float) -> np.ndarray:
    x = (rng.standard_normal(n_vocab) * rng.uniform(0.5, 5)).astype(np.float32)
    x[rng.random(n_vocab) < masked] = -np.inf  # a grammar mask, bans
    x[rng.integers(n_vocab)] = rng.uniform(0, 20)  # a finite maximum, however much is masked
    return x


@pytest.mark.parametrize("n", [-1.0, 0.0, 0.3, 1.0, 2.0, 3.5])
@pytest.mark.parametrize(("n_vocab", "masked"), [(50, 0.0), (1000, 0.5), (49152, 0.0), (49152, 0.99)])
def test_keeps_what_the_definition_keeps(n, n_vocab, masked):
    rng = np.random.default_rng(n_vocab + int(10 * n) + int(100 * masked))
    sampler = Sampler(SamplingParams(**PLAIN, top_n_sigma=n))
    for _ in range(5):
        x = random_logits(rng, n_vocab, masked)
        ids, probs = sampler.distribution(x)
        assert set(ids.tolist()) == kept_by_definition(x, n)
        np.testing.assert_allclose(probs, softmax(x[ids]), rtol=1e-12, atol=0)


def test_sigma_is_taken_over_the_candidates_left():
    """After top_k (a sorted candidate set) sigma is that of the k left, as in llama.cpp's chain."""
    rng = np.random.default_rng(0)
    sampler = Sampler(SamplingParams(**{**PLAIN, "top_k": 200}, top_n_sigma=1.0, samplers="top_k;top-n-sigma"))
    assert sampler.describe() == "logits -> top_k -> top_n_sigma -> dist"
    for _ in range(10):
        x = random_logits(rng, 5000, 0.2)
        best = np.lexsort((np.arange(len(x)), -x))[:200]
        ids, _ = sampler.distribution(x)
        assert set(ids.tolist()) == {int(best[i]) for i in kept_by_definition(x[best], 1.0)}


def test_its_place_in_the_default_chain_and_off_by_default():
    assert SamplingParams().top_n_sigma == -1.0  # llama.cpp's default: off
    assert "top_n_sigma" not in Sampler(SamplingParams(top_n_sigma=0.0)).describe()
    on = SamplingParams(top_n_sigma=1.5)
    assert on.samplers == ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
    assert Sampler(on).describe() == "logits -> top_n_sigma -> top_k -> top_p -> min_p -> temperature -> dist"
    assert replace(SamplingParams(), top_n_sigma=1.5).samplers == on.samplers  # the default order, given
    # an explicit order without it leaves it out, as in llama.cpp
    assert Sampler(SamplingParams(top_n_sigma=1.5, samplers="top_k;temperature")).describe() == (
        "logits -> top_k -> temperature -> dist")


def test_greedy_takes_the_shortcut_and_the_default_chain_runs_in_numpy():
    rng = np.random.default_rng(1)
    fast = Sampler(SamplingParams(temperature=0, top_n_sigma=0.5, repeat_penalty=1.3))
    slow = Sampler(SamplingParams(temperature=0, top_n_sigma=0.5, repeat_penalty=1.3), route="steps")
    assert fast.route == "greedy"  # it always keeps the best token
    for _ in range(20):
        x = random_logits(rng, 3000, 0.3)
        history = rng.integers(0, 3000, 30).tolist()
        fast.reset(history)
        slow.reset(history)
        assert fast.sample(x) == slow.sample(x)
    # the compiled chain has no top-n-sigma: the steps run it, and the draws stay inside its cut
    s = Sampler(SamplingParams(seed=4, top_n_sigma=1.0))
    assert s.route == "steps" and s.compiled_chain is None
    x = random_logits(rng, 49152, 0.0)
    assert {s.sample(x) for _ in range(100)} <= kept_by_definition(x, 1.0)
    again = Sampler(SamplingParams(seed=4, top_n_sigma=1.0))
    s.reset()
    assert [s.sample(x) for _ in range(30)] == [again.sample(x) for _ in range(30)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1", True, None])
def test_bad_values_name_the_field(bad):
    with pytest.raises(BadRequestError, match="top_n_sigma") as e:
        SamplingParams(top_n_sigma=bad)
    assert "\n" not in str(e.value)


def test_request_bodies_carry_it():
    assert parse_completion({"prompt": "hi", "top_n_sigma": 1.5}).params.sampling == {"top_n_sigma": 1.5}
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "top_n_sigma": 1})
    assert chat.params.sampling == {"top_n_sigma": 1.0}
    with pytest.raises(ApiError, match="top_n_sigma") as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "top_n_sigma": "wide"})
    assert e.value.param == "top_n_sigma" and e.value.status == 400


# -- through the API, the command line and a server ----------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return minfer.load(TINY, n_ctx=128)


def test_python_api(tiny):
    greedy = tiny.generate(PROMPT, max_tokens=8, temperature=0)
    assert tiny.generate(PROMPT, max_tokens=8, temperature=1.5, seed=3, top_n_sigma=ONLY_THE_BEST) == greedy
    assert "top_n_sigma" in tiny.sampler(top_n_sigma=2.0).describe()
    with pytest.raises(BadRequestError, match="top_n_sigma"):
        tiny.generate(PROMPT, max_tokens=2, top_n_sigma="wide")


def minfer_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minfer", "run", str(TINY), PROMPT, "-n", "8", "-q", *args],
                          capture_output=True, text=True, timeout=300)


def test_command_line():
    greedy = minfer_run("--temp", "0")
    cut = minfer_run("--temp", "1.5", "--seed", "3", "--top-n-sigma", str(ONLY_THE_BEST))
    assert greedy.returncode == 0 and cut.returncode == 0, cut.stderr
    assert cut.stdout == greedy.stdout and greedy.stdout.strip()
    bad = minfer_run("--top-n-sigma", "nan")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "top_n_sigma" in bad.stderr


@pytest.mark.slow
def test_server_requests():
    with ServerProcess(TINY, ["--parallel", "2", "--ctx-size", "256"]) as server:
        url = server.url
        body = {"prompt": PROMPT, "max_tokens": 8}
        greedy = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}, timeout=60)
        cut = httpx.post(url + "/v1/completions", timeout=60,
                         json={**body, "temperature": 1.5, "seed": 3, "top_n_sigma": ONLY_THE_BEST})
        assert greedy.status_code == cut.status_code == 200, cut.text
        assert cut.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
        for path, request in (("/v1/completions", body),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(url + path, json={**request, "top_n_sigma": "wide"}, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "top_n_sigma" and "top_n_sigma" in err["message"]
