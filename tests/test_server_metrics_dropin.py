"""``/metrics`` as llama-server's (tools/server: server_task_result_metrics::to_metrics): its ``llamacpp:*`` names,
the ``Process-Start-Time-Unix`` header (whole seconds since the epoch), a generation rate without the first token
(``llamacpp:predicted_tokens_seconds``: decode steps over their time, averaged since the last scrape), idle slots
shown as idle; ``--metrics`` accepted as a no-op and ``--no-metrics`` answering llama-server's 501."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import fixture_dir

from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = fixture_dir("llama") / "model-f32.gguf"


def sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics:\n{text}")


@pytest.fixture(scope="module")
def server():
    started = time.time()
    with ServerProcess(MODEL, ["--metrics", "--ctx-size", "256", "--parallel", "2"]) as s:
        s.started = started
        yield s


def test_process_start_time_header(server) -> None:
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    value = r.headers["Process-Start-Time-Unix"]
    assert value.isdigit()  # llama-server: std::to_string of whole seconds
    assert int(server.started) - 1 <= int(value) <= time.time()


def test_counters_and_idle_slots(server) -> None:
    before = httpx.get(server.url + "/metrics").text
    r = httpx.post(server.url + "/completion", json={"prompt": "The quick brown fox", "n_predict": 12,
                                                     "temperature": 0, "ignore_eos": True, "cache_prompt": False},
                   timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    after = httpx.get(server.url + "/metrics").text
    grown = {name: sample(after, name) - sample(before, name)
             for name in ("llamacpp:tokens_predicted_total", "llamacpp:prompt_tokens_total",
                          "llamacpp:prompt_tokens_cached_total", "llamacpp:n_decode_total")}
    assert grown["llamacpp:tokens_predicted_total"] == 12
    assert grown["llamacpp:prompt_tokens_cached_total"] == body["timings"]["cache_n"]
    assert grown["llamacpp:prompt_tokens_total"] == body["timings"]["prompt_n"]
    assert grown["llamacpp:n_decode_total"] >= 12  # the prompt's pass and 11 decode steps at least
    # nothing runs now: the slots show as idle
    assert sample(after, "llamacpp:requests_processing") == 0
    assert sample(after, "llamacpp:requests_deferred") == 0


def test_generation_rate_excludes_the_first_token(server) -> None:
    httpx.get(server.url + "/metrics")  # the rate is averaged since the last scrape: start a window
    r = httpx.post(server.url + "/completion", json={"prompt": "Once upon a time", "n_predict": 16,
                                                     "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    timings = r.json()["timings"]
    rate = sample(httpx.get(server.url + "/metrics").text, "llamacpp:predicted_tokens_seconds")
    # llama-server: steps (tokens after the first, which the prompt's pass gave) over the generation time
    expected = (timings["predicted_n"] - 1) / (timings["predicted_ms"] / 1000)
    assert rate == pytest.approx(expected, rel=1e-6)
    assert rate < timings["predicted_n"] / (timings["predicted_ms"] / 1000)
    # a scrape started a new window, in which nothing ran
    assert sample(httpx.get(server.url + "/metrics").text, "llamacpp:predicted_tokens_seconds") == 0


def test_no_metrics_answers_llama_servers_501() -> None:
    with ServerProcess(MODEL, ["--no-metrics", "--ctx-size", "256"]) as s:
        r = httpx.get(s.url + "/metrics")
        assert r.status_code == 501
        # llama-server started without --metrics, word for word
        assert r.json() == {"error": {"code": 501, "type": "not_supported_error", "message":
                                      "This server does not support metrics endpoint. Start it with `--metrics`"}}
        assert httpx.get(s.url + "/health").status_code == 200


@pytest.mark.parametrize("where", [[str(MODEL), str(MODEL)], [str(MODEL), "--ray"]])
def test_no_metrics_refused_where_a_front_serves_metrics(where: list[str]) -> None:
    """The several-model and Ray fronts answer /metrics themselves: --no-metrics is refused there, by name."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "minfer", "serve", *where, "--no-metrics", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--no-metrics" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
