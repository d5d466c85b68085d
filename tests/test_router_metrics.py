"""The several-model front's own /metrics (each loaded model's samples labelled with its name, the front's gauges),
/health's per-model detail, and /api/tags' and /api/ps' digests (each the one its model's own server gives)."""

from __future__ import annotations

import re

import httpx
import ollama
import pytest
from conftest import TWO_MODELS
from prometheus_client.parser import text_string_to_metric_families

from minfer.pull import sha256_file
from minfer.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODELS = TWO_MODELS
PREDICTED = "llamacpp:tokens_predicted_total"
FRONT_FAMILIES = {"minfer_models_configured", "minfer_models_loaded", "minfer_model_loaded",
                  "minfer_model_requests_active", "minfer_model_load_seconds", "minfer_model_loads"}



@pytest.fixture(scope="module")
def front(models_dir):
    """Both fixture models behind one front, each having answered one completion (lengths 3 and 5)."""
    with ServerProcess(f"--models-dir={models_dir}", ["--models-max", "2", "--ctx-size", "256"]) as s:
        for name, n in (("llama", 3), ("gemma3", 5)):
            r = httpx.post(s.url + "/completion", timeout=300,  # llama-server's: n tokens, EOS or not
                           json={"model": name, "prompt": "Hello", "n_predict": n, "temperature": 0,
                                 "ignore_eos": True})
            assert r.status_code == 200, r.text
        yield s


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_label_each_models_samples_with_its_own_values(front):
    r = httpx.get(front.url + "/metrics", timeout=60)
    assert r.status_code == 200
    merged = samples(r.text)  # the whole text parses
    own = {name: httpx.get(front.url + "/metrics", params={"model": name}, timeout=60) for name in MODELS}
    assert r.headers["content-type"] == own["llama"].headers["content-type"]
    for name, n in (("llama", 3), ("gemma3", 5)):
        assert own[name].status_code == 200
        alone = samples(own[name].text)
        assert all(dict(labels).get("model") == name for _, labels in alone)  # ?model=: its own, labelled
        assert merged[(PREDICTED, (("model", name),))] == alone[(PREDICTED, (("model", name),))] == n
        assert merged[("minfer_model_loaded", (("model", name),))] == 1
        assert merged[("minfer_model_loads_total", (("model", name),))] == 1
        assert merged[("minfer_model_load_seconds", (("model", name),))] > 0
    assert merged[("minfer_models_configured", ())] == 2 and merged[("minfer_models_loaded", ())] == 2
    # every model sample carries its model; each family's HELP and TYPE come once
    families = list(text_string_to_metric_families(r.text))
    assert all("model" in s.labels for f in families if f.name not in FRONT_FAMILIES for s in f.samples)
    for kind in ("HELP", "TYPE"):
        names = [line.split()[2] for line in r.text.splitlines() if line.startswith(f"# {kind} ")]
        assert len(names) == len(set(names)) and "llamacpp:tokens_predicted_total" in names
    labels = {s.labels.get("model") for f in families for s in f.samples if f.name == "minfer_requests"}
    assert labels == {"llama", "gemma3"}  # a labelled family's samples keep their own labels beside model
    assert httpx.get(front.url + "/metrics", params={"model": "nope"}, timeout=60).status_code == 404


def test_health_lists_each_models_state(front):
    health = httpx.get(front.url + "/health", timeout=60).json()
    assert health["status"] == "ok" and health["models"] == {"llama": "loaded", "gemma3": "loaded"}
    assert health["models_detail"] == [{"model": "gemma3", "status": "loaded", "active": 0},  # --models-dir's order
                                       {"model": "llama", "status": "loaded", "active": 0}]


def test_tags_and_ps_digests_are_the_models_own(front, models_dir):
    client = ollama.Client(host=front.url)
    tags = {m.model: m.digest for m in client.list().models}
    assert set(tags) == {"llama:latest", "gemma3:latest"}
    assert all(re.fullmatch(r"[0-9a-f]{64}", d or "") for d in tags.values())
    assert {m.model: m.digest for m in client.ps().models} == tags
    assert tags["gemma3:latest"] == sha256_file(MODELS["gemma3"])
    with ServerProcess(models_dir / "llama.gguf", ["--ctx-size", "256"]) as solo:  # llama's one-model server
        own = ollama.Client(host=solo.url).list().models
    assert [(m.model, m.digest) for m in own] == [("llama:latest", tags["llama:latest"])]


def test_an_unloaded_model_shows_in_the_front_gauges_only(front):
    """Last (it unloads gemma3): an unloaded model's counters went with its process."""
    assert httpx.post(front.url + "/models/unload", json={"model": "gemma3"}, timeout=300).json() == {"success": True}
    merged = samples(httpx.get(front.url + "/metrics", timeout=60).text)
    assert (PREDICTED, (("model", "llama"),)) in merged
    assert not any(dict(labels).get("model") == "gemma3" for name, labels in merged
                   if not name.startswith(("minfer_model_", "minfer_models_")))
    assert merged[("minfer_model_loaded", (("model", "gemma3"),))] == 0
    assert merged[("minfer_model_loaded", (("model", "llama"),))] == 1
    assert merged[("minfer_models_loaded", ())] == 1
    assert merged[("minfer_model_loads_total", (("model", "gemma3"),))] == 1  # a count of loads, kept
    # ?model= of an unloaded model is a probe: a 503 saying so, and the model stays unloaded
    r = httpx.get(front.url + "/metrics", params={"model": "gemma3"}, timeout=60)
    assert r.status_code == 503 and "not loaded" in r.json()["error"]["message"]
    assert httpx.get(front.url + "/health", timeout=60).json()["models"]["gemma3"] == "unloaded"
