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
    page = httpx.get(url + "/")  # the chat page comes from this server: no key asked for, no model woken
    assert page.status_code == 200 and '<meta name="minfer-key" content="">' in page.text
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


def test_keep_alive_flag_and_ollama_unload_requests() -> None:
    """``--keep-alive -1`` (ollama's OLLAMA_KEEP_ALIVE): one model that never sleeps by itself but unloads on
    ollama's unload request (no prompt or no messages, keep_alive 0), without loading first, answered with
    ``done_reason`` "unload" as ollama's; the load requests answer "load"; a request's keep_alive 0 unloads the model
    once answered, and the next request (without one) gets the server's default back (never)."""
    import ollama

    with ServerProcess(MODEL, ["--keep-alive", "-1", "--ctx-size", "256"], health_timeout=300) as s:
        client = ollama.Client(host=s.url)
        options = {"temperature": 0, "num_predict": 8}
        text = client.generate(model="m", prompt="The quick brown fox", raw=True, options=options).response
        time.sleep(IDLE)
        assert not is_sleeping(s.url) and len(children(s.proc.pid)) == 1
        assert client.ps().models[0].expires_at.year > 2200  # nothing unloads it by itself
        assert "unloaded on request only" in "".join(s.log)

        unloaded = client.generate(model="m", keep_alive=0)
        assert (unloaded.done, unloaded.done_reason, unloaded.response) == (True, "unload", "")
        wait_asleep(s.url, timeout=30)  # at once, or (as ollama's) once the requests still counted on it end
        assert children(s.proc.pid) == []
        again = client.chat(model="m", messages=[], keep_alive=0)  # asleep already: nothing is loaded for it
        assert again.done_reason == "unload" and again.message.role == "assistant"
        assert is_sleeping(s.url) and children(s.proc.pid) == []

        loaded = client.chat(model="m", messages=[])  # ollama's load request wakes it
        assert (loaded.done, loaded.done_reason) == (True, "load") and not is_sleeping(s.url)
        assert client.generate(model="m", prompt="The quick brown fox", raw=True, options=options,
                               keep_alive=0).response == text
        wait_asleep(s.url, timeout=30)  # keep_alive 0 on a generation: unloaded once it was answered
        assert client.generate(model="m", prompt="The quick brown fox", raw=True, options=options).response == text
        time.sleep(IDLE)
        assert not is_sleeping(s.url)  # no keep_alive: the server's default again (never)


def test_keep_alive_flag_errors() -> None:
    import subprocess
    import sys

    for flags, said in ((["--keep-alive", "soon"], "--keep-alive must be a number of seconds or a duration"),
                        (["--keep-alive", "5m", "--sleep-idle-seconds", "3"], "give one")):
        r = subprocess.run([sys.executable, "-m", "minfer", "serve", str(MODEL), *flags], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode != 0 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
