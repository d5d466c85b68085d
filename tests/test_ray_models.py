"""``minfer serve A B --ray``: several models on a local Ray cluster (loopback), one replica x 1 thread of each
of two tiny fixture models, one front (one module-scoped cluster for every test here).

What it shows: each model's temperature-0 completion equals the Python API's; one openai client switches models
by name; an unknown name is a 404 naming both; ``/v1/models`` lists both, ``/health`` groups the replicas by
model and ``/metrics`` labels each replica's samples with its model; ``--models-max`` and
``--sleep-idle-seconds`` are refused with ``--ray``. The cluster is stopped, every process it started gone.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import TWO_MODELS
from test_ray_serve import READY_TIMEOUT, _started, assert_no_ray_left, ray_processes, wait_ready

from minfer.cli import main
from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODELS = TWO_MODELS
PROMPT = "The quick brown fox"



@pytest.fixture(scope="module")
def cluster(models_dir: Path):
    before = ray_processes()
    server = ServerProcess(models_dir / "llama.gguf", [str(models_dir / "gemma3.gguf"), "--ray", "--replicas", "1",
                                                       "--threads", "1", "--parallel", "2", "--ctx-size", "256",
                                                       "--host", "127.0.0.1", "--log-format", "off"],
                           startup_timeout=READY_TIMEOUT)
    with _started(server):
        wait_ready(server.url, 2, READY_TIMEOUT)
        yield server
    assert_no_ray_left(before)


@pytest.fixture(scope="module")
def solo() -> dict[str, str]:
    """Each model's text from the Python API (what its one-model server answers)."""
    import minfer

    return {name: minfer.load(path).complete(PROMPT, 12, temperature=0).text for name, path in MODELS.items()}


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 12,
                                                     "temperature": 0}, timeout=300)


def test_each_model_answers_as_it_does_alone(cluster, solo):
    assert solo["llama"] != solo["gemma3"]  # else routing to the wrong model would pass unseen
    for name in MODELS:
        for asked in (name, f"{name}:latest", f"{name}.gguf"):
            r = complete(cluster.url, asked)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == solo[name]
            assert r.json()["model"] == name  # each replica serves its model under its name


def test_the_openai_client_switches_models_by_name(cluster, solo):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key="none")
    for name in ("gemma3", "llama", "gemma3"):
        answer = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0)
        assert answer.choices[0].text == solo[name]
    assert sorted(m.id for m in client.models.list()) == ["gemma3", "llama"]


def test_an_unknown_model_is_a_404_naming_both(cluster):
    r = complete(cluster.url, "mistral")
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and "gemma3" in error["message"] and "llama" in error["message"]


def test_ollama_s_listings_and_the_router_routes_cover_every_model(cluster):
    import ollama

    from minfer.pull import sha256_file

    client = ollama.Client(host=cluster.url)
    tags = {m.model: m.digest for m in client.list().models}
    assert tags == {f"{name}:latest": sha256_file(path) for name, path in MODELS.items()}
    assert {m.model for m in client.ps().models} == set(tags)  # every replica holds its model
    assert httpx.post(cluster.url + "/models/load", json={"model": "gemma3"}).json() == {"success": True}
    r = httpx.post(cluster.url + "/models/unload", json={"model": "gemma3"})
    assert r.status_code == 400 and "--ray" in r.json()["error"]["message"]
    assert httpx.post(cluster.url + "/models/load", json={"model": "mistral"}).status_code == 404


def test_models_health_and_metrics_are_per_model(cluster, record_property):
    listed = httpx.get(cluster.url + "/models", timeout=10).json()["data"]
    assert {m["id"]: m["status"]["value"] for m in listed} == {"llama": "loaded", "gemma3": "loaded"}
    health = httpx.get(cluster.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and set(health["models"]) == set(MODELS)
    for name, group in health["models"].items():
        assert group["status"] == "ok" and len(group["replicas"]) == 1
        assert group["replicas"][0]["model"] == name
    for name in MODELS:
        assert complete(cluster.url, name).status_code == 200
    text = httpx.get(cluster.url + "/metrics", timeout=30).text
    for name, group in health["models"].items():
        rid = group["replicas"][0]["id"]
        samples = [line for line in text.splitlines() if line.startswith("minfer_generated_tokens_total{")
                   and f'model="{name}"' in line and f'replica="{rid}"' in line]
        assert samples and float(samples[0].split()[-1]) > 0, text
    # resident memory of each engine and of the Ray replica actor that started it, for docs/scaling.md
    replicas = set()
    for name, group in health["models"].items():
        engine = group["replicas"][0]["pid"]
        actor = int(_status(engine)["PPid"])
        replicas |= {engine, actor}
        for who, pid in (("engine", engine), ("actor", actor)):
            record_property(f"{name}_{who}_rss_mib", _rss_mib(pid))
            print(f"\n{name} replica {who} (pid {pid}) RSS: {_rss_mib(pid):.0f} MiB")
    ray_own = sum(_rss_mib(pid) for pid in ray_processes() - replicas)
    print(f"Ray's own processes (GCS, raylet, Serve's controller, ...) RSS in all: {ray_own:.0f} MiB")


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def _rss_mib(pid: int) -> float:
    try:
        return int(_status(pid).get("VmRSS", "0 kB").split()[0]) / 1024
    except OSError:  # (a Ray worker that ended meanwhile)
        return 0.0


@pytest.mark.parametrize("flag", [["--models-max", "2"], ["--sleep-idle-seconds", "60"], ["--keep-alive", "5m"]])
def test_on_demand_loading_flags_are_refused_with_ray(models_dir, flag, capsys):
    code = main(["serve", str(models_dir / "llama.gguf"), str(models_dir / "gemma3.gguf"), "--ray", *flag])
    assert code == 1
    err = capsys.readouterr().err
    assert flag[0] in err and "--ray" in err and len(err.strip().splitlines()) == 1
