"""``minfer serve --ray``: a local Ray cluster on loopback, 2 replicas x 1 thread of the default model,
one front (one module-scoped cluster for every test here: Ray's start is slow on 2 cores).

What it shows: the official openai client, streamed and not; 8 concurrent temperature-0 requests equal
their solo text; follow-ups sharing a ~300-token system prompt find it cached when routed by prefix
(and about half the time when sent to a replica at random); metrics per replica and summed; a stream
whose replica is SIGKILLed ends with an error event; a replica SIGKILLed during 16 requests loses none
of them and is replaced by Ray within 120 s. The cluster is stopped, every process it started gone.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
READY_TIMEOUT = 600.0  # a first start on a busy 2-core machine compiles kernels in both replicas
RECOVERY_SECONDS = 120.0
BASE_SYSTEM = (
    "You answer questions about the Northwind Trading Company's internal handbook. Be brief, accurate and "
    "polite. The handbook covers shipping policy, returns, warehouse safety, working hours, holidays, expense "
    "reports, travel booking, the code of conduct, data protection, customer complaints, supplier contracts, "
    "inventory counts, forklift certification, fire drills, first aid, the canteen, parking permits, remote "
    "work, equipment loans, training budgets, performance reviews, promotions, parental leave, sick leave, "
    "overtime pay, night shifts, uniforms, visitor badges, lost property, recycling, energy saving, IT "
    "support, password rules, phishing reports, laptop encryption, printer use, meeting rooms, the intranet, "
    "the newsletter, charity events, the sports club, the library, language courses, mentoring, the "
    "suggestion box, and the annual company picnic. When a question is outside the handbook, say so and "
    "point the employee to the human resources desk on the second floor, open from nine to five on weekdays. "
    "Never invent policy numbers. Quote section titles exactly when you cite them. Keep every answer under "
    "three sentences unless the employee asks for detail, and end with an offer to help further. If two "
    "sections disagree, the newer one applies; if an employee reports an accident, an injury or a safety "
    "hazard, tell them to call the site supervisor at once before anything else, and to fill in the incident "
    "form on the intranet within one working day."
)


def ray_processes() -> set[int]:
    """Pids of this machine's Ray processes (raylet, gcs_server, workers, replicas' engines)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"ray/core/src/ray" in cmd or b"ray::" in cmd or b"minfer.server.cluster.engine_process" in cmd \
                or b"site-packages/ray/" in cmd:
            out.add(int(entry.name))
    return out


def wait_ready(url: str, n: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    health: dict = {}
    while time.monotonic() < deadline:
        try:
            health = httpx.get(url + "/health", timeout=10).json()
            if sum(r["state"] == "ready" for r in health["replicas"]) >= n:
                return health
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"fewer than {n} ready replicas after {timeout:.0f} s: {health}")


@pytest.fixture(scope="module")
def cluster(smollm2_path: Path):
    before = ray_processes()
    server = ServerProcess(smollm2_path, ["--ray", "--replicas", "2", "--threads", "1", "--parallel", "4",
                                          "--ctx-size", "8192", "--host", "127.0.0.1", "--log-format", "off",
                                          "--api-key", KEY],
                           startup_timeout=READY_TIMEOUT)
    server.cmd = [c for c in server.cmd]
    with _started(server):
        wait_ready(server.url, 2, READY_TIMEOUT)
        yield server
    # the front stopped its replicas and the cluster it started: nothing of Ray is left running
    assert_no_ray_left(before)


def assert_no_ray_left(before: set[int]) -> None:
    """Waits for the Ray processes a stopped server started (not in ``before``) to end; kills any left, so as
    never to slow the rest of the suite, and says so."""
    deadline = time.monotonic() + 60
    while (left := ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:  # never leave them to slow the rest of the suite, but say so
        os.kill(pid, signal.SIGKILL)
    assert not left, f"Ray processes left running after the server stopped: {sorted(left)}"


class _started:
    """ServerProcess, waiting for the front's URL only (the replicas become ready later)."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server

    def __enter__(self) -> ServerProcess:
        s = self.server
        s.proc = subprocess.Popen(s.cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=s.env)
        found = threading.Event()

        def drain() -> None:
            import re

            assert s.proc is not None and s.proc.stderr is not None
            for line in s.proc.stderr:
                s.log.append(line)
                m = re.search(r"on (http://\S+) ", line)
                if m and not s.url:
                    s.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=drain, daemon=True).start()
        if not found.wait(READY_TIMEOUT) or not s.url:
            s.stop()
            raise RuntimeError("the Ray front did not start:\n" + "".join(s.log))
        return s

    def __exit__(self, *exc: object) -> None:
        s = self.server
        if s.proc is not None and s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            try:
                s.proc.wait(120)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()


def chat(url: str, messages: list[dict], max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=300)


def test_health_lists_the_replicas(cluster):
    health = httpx.get(cluster.url + "/health", timeout=10).json()
    assert health["status"] == "ok"
    assert len(health["replicas"]) == 2
    for r in health["replicas"]:
        assert r["state"] == "ready" and isinstance(r["pid"], int) and r["id"]
        assert r["url"].startswith("http://127.0.0.1:")  # the local cluster lives on loopback
        os.kill(r["pid"], 0)  # a real process of this machine


def test_the_openai_client_streamed_and_not(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key=KEY)
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(parts) == text
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    # errors are the single server's own: a bad field is a 400 with an OpenAI body
    r = httpx.post(cluster.url + "/v1/chat/completions", json={"messages": "nope"}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # and so is the API key: on the API, on the front's /metrics, and on the engines themselves
    r = httpx.post(cluster.url + "/v1/chat/completions", json={"messages": messages}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(cluster.url + "/metrics", timeout=30).status_code == 401
    engine = httpx.get(cluster.url + "/health", timeout=10).json()["replicas"][0]["url"]
    assert httpx.get(engine + "/v1/models", timeout=30).status_code == 401
    # ollama's client through the front: its NDJSON stream passes line by line, and is the same text
    import ollama

    oc = ollama.Client(host=cluster.url, headers=AUTH)
    options = {"temperature": 0, "num_predict": 16}
    streamed = list(oc.chat(model="smollm2", messages=messages, options=options, stream=True))
    assert len(streamed) > 2 and streamed[-1].done
    assert "".join(p.message.content for p in streamed) == text == oc.chat(model="smollm2", messages=messages,
                                                                           options=options).message.content


def test_8_concurrent_requests_equal_their_solo_text(cluster):
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def ask(p: str) -> str:
        r = chat(cluster.url, [{"role": "user", "content": p}], max_tokens=12)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    solo = [ask(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts))
    assert together == solo


def _system(i: int, tag: str) -> str:
    # distinct from the first token on: no two conversations share a prefix beyond the template's header
    return f"{tag} desk {i * 7919 % 1000}: " + BASE_SYSTEM


def _follow_up_hits(send, tag: str, n: int) -> list[int]:
    cached = []
    for i in range(n):
        system = {"role": "system", "content": _system(i, tag)}
        first = send([system, {"role": "user", "content": "What does the handbook cover?"}])
        assert first.status_code == 200, first.text
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        assert 290 <= prompt_tokens <= 420, prompt_tokens  # the ~300-token system prompt
        again = send([system, {"role": "user", "content": "Where is the human resources desk?"}])
        assert again.status_code == 200, again.text
        cached.append(again.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return cached


def test_follow_ups_sharing_a_system_prompt_find_it_cached(cluster, record_property):
    n = 10
    routed = _follow_up_hits(lambda m: chat(cluster.url, m, max_tokens=4), "Routed", n)
    routed_rate = sum(c > 200 for c in routed) / n
    # the same conversations sent to a replica chosen at random (what a prefix-blind balancer does)
    urls = [r["url"] for r in httpx.get(cluster.url + "/health", timeout=10).json()["replicas"]
            if r["state"] == "ready"]
    rng = random.Random(22)
    randomly = _follow_up_hits(lambda m: chat(rng.choice(urls), m, max_tokens=4), "Random", n)
    random_rate = sum(c > 200 for c in randomly) / n
    record_property("prefix_routed_hit_rate", routed_rate)
    record_property("random_routed_hit_rate", random_rate)
    print(f"\nfollow-ups with cached_tokens > 200: prefix routing {routed_rate:.0%} {routed}, "
          f"random routing {random_rate:.0%} {randomly}")
    assert routed_rate >= 0.8
    metrics = httpx.get(cluster.url + "/metrics", headers=AUTH, timeout=30).text
    hit_ratio = next(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("minfer_router_prefix_hit_ratio "))
    assert hit_ratio > 0
    assert 'minfer_router_decisions_total{kind="prefix"' in metrics


def test_metrics_are_per_replica_and_summed(cluster):
    assert chat(cluster.url, [{"role": "user", "content": "Hello"}], max_tokens=4).status_code == 200
    text = httpx.get(cluster.url + "/metrics", headers=AUTH, timeout=30).text
    ids = [r["id"] for r in httpx.get(cluster.url + "/health", timeout=10).json()["replicas"]
           if r["state"] == "ready"]
    values = {}
    for line in text.splitlines():
        if line.startswith("minfer_generated_tokens_total{"):
            values[line.split('replica="')[1].split('"')[0]] = float(line.split()[-1])
    assert set(ids) <= set(values) and "all" in values
    assert values["all"] == pytest.approx(sum(v for k, v in values.items() if k != "all"))
    assert values["all"] > 0


def _stream_until_killed(cluster) -> tuple[list[str], str]:
    body = {"messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
            "max_tokens": 2000, "temperature": 0.8, "stream": True,
            "logit_bias": {"2": -100}}  # (2: SmolLM2's <|im_end|>) the stream keeps going until killed
    lines: list[str] = []
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        replica = r.headers["x-minfer-replica"]
        pid = next(x["pid"] for x in httpx.get(cluster.url + "/health", timeout=10).json()["replicas"]
                   if x["id"] == replica)
        killed = False
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if not killed and sum(1 for x in lines if x.startswith("data: {")) >= 5:
                os.kill(pid, signal.SIGKILL)
                killed = True
    return lines, replica


def test_a_stream_on_a_killed_replica_ends_with_an_error_event(cluster):
    wait_ready(cluster.url, 2, RECOVERY_SECONDS)
    t0 = time.monotonic()
    lines, replica = _stream_until_killed(cluster)
    assert time.monotonic() - t0 < 120  # it ended: no hang
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "error" in events[-1], lines[-3:]
    assert events[-1]["error"]["code"] == "replica_died"
    assert lines[-1] == "data: [DONE]"
    health = httpx.get(cluster.url + "/health", timeout=10).json()
    assert any(r["id"] == replica and r["state"] == "dead" for r in health["replicas"]) or \
        all(r["id"] != replica for r in health["replicas"])


def test_a_replica_killed_during_16_requests_loses_none(cluster):
    wait_ready(cluster.url, 2, RECOVERY_SECONDS)  # (also: the replica the last test killed came back)
    prompts = [f"Count from {i} to {i + 20}, one number per line." for i in range(16)]
    results: list[httpx.Response | Exception] = [None] * 16  # type: ignore[list-item]
    n_tokens = 64  # long enough that the victim still holds its requests when the kill lands

    def ask(i: int) -> None:
        try:
            results[i] = chat(cluster.url, [{"role": "user", "content": prompts[i]}], max_tokens=n_tokens,
                              logit_bias={"2": -100})
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    # once both replicas hold requests, SIGKILL the busier one's engine
    deadline = time.monotonic() + 60
    victim = None
    while time.monotonic() < deadline and victim is None:
        replicas = httpx.get(cluster.url + "/health", timeout=10).json()["replicas"]
        busy = [r for r in replicas if r["state"] == "ready" and r["slots_running"] > 0]
        if len(busy) == 2:
            victim = max(busy, key=lambda r: r["in_flight"])
        else:
            time.sleep(0.2)
    assert victim is not None, "the requests never reached both replicas"
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(300)
    lost = [(i, r if isinstance(r, Exception) else r.status_code) for i, r in enumerate(results)
            if isinstance(r, Exception) or r.status_code != 200]
    assert not lost, lost
    assert all(r.json()["usage"]["completion_tokens"] == n_tokens for r in results)  # type: ignore[union-attr]
    retried = [line for line in httpx.get(cluster.url + "/metrics", headers=AUTH, timeout=30).text.splitlines()
               if line.startswith("minfer_router_retries_total{") and f'replica="{victim["id"]}"' in line]
    assert retried and float(retried[0].split()[-1]) >= 1
    wait_ready(cluster.url, 2, RECOVERY_SECONDS - (time.monotonic() - killed_at))


def test_the_plain_server_never_imports_ray():
    code = ("import sys, minfer.server, minfer.server.app, minfer.cli, minfer.cli.serve, "
            "minfer.server.cluster.front; assert 'ray' not in sys.modules, 'ray was imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_minfer_serve_without_ray_never_loads_it():
    model = Path(__file__).parent / "fixtures" / "llama" / "model-f32.gguf"
    with ServerProcess(model, ["--parallel", "1"]) as server:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert server.proc is not None
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
        assert "_raylet" not in maps and "/site-packages/ray/" not in maps


def test_an_encoder_on_ray_replicas_embeds_and_refuses_chat():
    """An encoder behind the Ray front: its requests have no prefix to route by (least loaded), each replica is
    the encoder's server, and the front passes its answers through."""
    import minfer

    model = Path(__file__).parent / "fixtures" / "bert"
    before = ray_processes()
    server = ServerProcess(model, ["--ray", "--replicas", "2", "--threads", "1", "--host", "127.0.0.1",
                                   "--log-format", "off"], startup_timeout=READY_TIMEOUT)
    try:
        with _started(server):
            wait_ready(server.url, 2, READY_TIMEOUT)
            texts = ["hello world", "The café served crème brûlée to Zoë."]
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda t: httpx.post(server.url + "/v1/embeddings", json={"input": t},
                                                             timeout=120), texts * 4))
            want = minfer.load(model).embed(texts)
            for k, r in enumerate(answers):
                assert r.status_code == 200, r.text
                assert r.json()["data"][0]["embedding"] == want[k % 2].tolist()
            r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                           timeout=60)
            assert r.status_code == 400 and "is an encoder" in r.json()["error"]["message"]
    finally:
        deadline = time.monotonic() + 60
        while (left := ray_processes() - before) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
