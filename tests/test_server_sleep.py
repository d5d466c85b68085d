"""``minfer serve MODEL --sleep-idle-seconds S``, as llama-server's: once idle S seconds the model is released
(its process exits, and with it the weights and the KV cache); ``/health``, ``/props`` (``"is_sleeping": true``),
``/v1/models`` and ``/metrics`` answer without waking it; the next generation request wakes it (the model loads
again) and is answered as before it slept; ``/metrics`` totals run on across the sleep."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from conftest import fixture_dir

from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = fixture_dir("llama") / "model-f32.gguf"
IDLE = 2.0
REQUEST = {"prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0}


def is_sleeping(url: str) -> bool:
    r = httpx.get(url + "/props", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["is_sleeping"]


def wait_asleep(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not is_sleeping(url):
        assert time.monotonic() < deadline, "the server never went to sleep"
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name}")


def completion(url: str) -> dict:
    r = httpx.post(url + "/v1/completions", json=REQUEST, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def server():
    with ServerProcess(MODEL, ["--sleep-idle-seconds", str(IDLE), "--ctx-size", "256", "--slots"],
                       health_timeout=300) as s:
        yield s


def test_sleeps_when_idle_and_wakes_on_the_next_request(server) -> None:
    url = server.url
    awake = completion(url)
    assert not is_sleeping(url)
    model_card = httpx.get(url + "/v1/models").json()
    wait_asleep(url)
    # the model's process is gone, and this server holds what it held before the model loaded (logged at start)
    assert children(server.proc.pid) == []
    logged = float(re.search(r"this process holds (\d+) MiB", "".join(server.log)).group(1))
    assert rss_mib(server.proc.pid) < logged + 50
    # probes answer without waking it
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/v1/models").json() == model_card
    metrics = httpx.get(url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["Process-Start-Time-Unix"].isdigit()
    assert metric(url, "llamacpp:requests_processing") == 0
    assert is_sleeping(url) and children(server.proc.pid) == []
    # the next request wakes it, and is answered as before it slept (temperature 0)
    woken = completion(url)
    assert woken["choices"][0]["text"] == awake["choices"][0]["text"]
    assert not is_sleeping(url)
    assert len(children(server.proc.pid)) == 1


def test_totals_survive_sleeping(server) -> None:
    url = server.url
    wait_asleep(url)
    before = metric(url, "llamacpp:tokens_predicted_total")
    assert before > 0  # what ran before it slept
    completion(url)
    assert metric(url, "llamacpp:tokens_predicted_total") == before + REQUEST["max_tokens"]
    wait_asleep(url)
    assert metric(url, "llamacpp:tokens_predicted_total") == before + REQUEST["max_tokens"]


def test_native_routes_wake_it(server) -> None:
    url = server.url
    wait_asleep(url)
    r = httpx.post(url + "/completion", json={"prompt": "Hello", "n_predict": 4, "temperature": 0}, timeout=300)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
    slots = httpx.get(url + "/slots", timeout=300)
    assert slots.status_code == 200 and len(slots.json()) >= 1
    props = httpx.get(url + "/props").json()
    assert props["is_sleeping"] is False and props["total_slots"] >= 1


def test_no_metrics_while_sleeping() -> None:
    with ServerProcess(MODEL, ["--sleep-idle-seconds", "0.5", "--ctx-size", "256", "--no-metrics"],
                       health_timeout=300) as s:
        assert httpx.get(s.url + "/metrics").status_code == 501
        wait_asleep(s.url)
        r = httpx.get(s.url + "/metrics")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
