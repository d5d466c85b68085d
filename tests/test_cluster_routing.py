"""The Ray front's parts that need no cluster: block hashes, the prefix router, merged metrics, the stream
error events, the autoscaling policy, and routing keys from the model's own template and tokenizer."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from minfer.server.cluster.autoscale import LOAD_METRIC, LoadPolicy, desired_replicas
from minfer.server.cluster.front import stream_error
from minfer.server.cluster.metrics_merge import merge
from minfer.server.cluster.prefix import BLOCK_TOKENS, PrefixRouter, ReplicaLoad, block_hashes


def test_block_hashes_chain_over_full_blocks():
    a = list(range(5 * BLOCK_TOKENS + 3))
    b = a[: 3 * BLOCK_TOKENS] + [99999] * (2 * BLOCK_TOKENS)
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 5 and len(hb) == 5  # the partial block is not hashed
    assert ha[:3] == hb[:3] and ha[3] != hb[3] and ha[4] != hb[4]  # chained: a difference carries on
    assert block_hashes(a[:BLOCK_TOKENS - 1]) == []
    assert block_hashes([1] * BLOCK_TOKENS) != block_hashes([2] * BLOCK_TOKENS)


def loads(**in_flight: int) -> dict[str, ReplicaLoad]:
    return {name: ReplicaLoad(n, 4) for name, n in in_flight.items()}


def test_the_router_follows_the_longest_known_prefix():
    router = PrefixRouter(queue_threshold=2)
    system = block_hashes(list(range(10 * BLOCK_TOKENS)))
    first = router.choose(system[:6], loads(a=0, b=0))
    assert first.kind == "least_loaded"
    other = first.replica
    again = router.choose(system, loads(a=1, b=1))  # shares 6 blocks with the first
    assert (again.replica, again.kind, again.matched_blocks) == (other, "prefix", 6)
    fresh = router.choose(block_hashes([7] * 4 * BLOCK_TOKENS), {other: ReplicaLoad(3, 4), "x": ReplicaLoad(0, 4)})
    assert fresh.kind == "least_loaded" and fresh.replica == "x"


def test_a_saturated_holder_is_passed_over_for_the_least_loaded():
    router = PrefixRouter(queue_threshold=2)
    key = block_hashes(list(range(4 * BLOCK_TOKENS)))
    holder = router.choose(key, loads(a=0, b=0)).replica
    other = "b" if holder == "a" else "a"
    busy = {holder: ReplicaLoad(4 + 2, 4), other: ReplicaLoad(3, 4)}  # 2 waiting: at the threshold, still it
    assert router.choose(key, busy).replica == holder
    busier = {holder: ReplicaLoad(4 + 3, 4), other: ReplicaLoad(3, 4)}
    d = router.choose(key, busier)
    assert (d.replica, d.kind) == (other, "saturated")
    assert router.choose(key, loads(a=0, b=0)).replica == other  # the prefix now lives there too, most recently
    # no queue, but a whole replica's slots busier than an idle one: the idle one takes it
    d = router.choose(key, {other: ReplicaLoad(4, 4), holder: ReplicaLoad(0, 4)})
    assert (d.replica, d.kind) == (holder, "saturated")


def test_a_short_shared_prefix_does_not_pull_requests_to_one_replica():
    router = PrefixRouter()
    header = list(range(3 * BLOCK_TOKENS))  # a template's header and default system prompt: 3 blocks
    picks = [router.choose(block_hashes(header + [1000 + i] * 2 * BLOCK_TOKENS), loads(a=0, b=0)) for i in range(4)]
    assert [d.kind for d in picks] == ["least_loaded"] * 4
    assert {d.replica for d in picks} == {"a", "b"}


def test_idle_replicas_take_turns_and_dead_ones_are_forgotten():
    router = PrefixRouter()
    picks = [router.choose([], loads(a=0, b=0, c=0)).replica for _ in range(6)]
    assert sorted(picks[:3]) == ["a", "b", "c"] and picks[3:] == picks[:3]
    key = block_hashes(list(range(4 * BLOCK_TOKENS)))
    holder = router.choose(key, loads(a=0, b=0)).replica
    router.forget(holder)
    assert router.choose(key, loads(a=0, b=0)).kind == "least_loaded"
    assert router.choose(key, {}) is None


def test_random_policy_ignores_prefixes():
    router = PrefixRouter("random", seed=1)
    key = block_hashes(list(range(2 * BLOCK_TOKENS)))
    picks = {router.choose(key, loads(a=0, b=0)).replica for _ in range(40)}
    assert picks == {"a", "b"}
    with pytest.raises(ValueError, match="routing policy"):
        PrefixRouter("sticky")


def _registry_text(value: float, reason: str = "stop") -> str:
    reg = CollectorRegistry()
    Counter("minfer_generated_tokens", "tokens generated", registry=reg).inc(value)
    Counter("minfer_sequences_finished", "sequences", ["reason"], registry=reg).labels(reason).inc(value)
    return generate_latest(reg).decode()


def test_merged_metrics_label_each_replica_and_sum_them():
    text = merge({"r1": _registry_text(3), "r2": _registry_text(4)})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("minfer_generated_tokens_total", (("replica", "r1"),))] == 3
    assert samples[("minfer_generated_tokens_total", (("replica", "all"),))] == 7
    assert samples[("minfer_sequences_finished_total", (("reason", "stop"), ("replica", "all")))] == 7
    assert not any(name.endswith("_created") and dict(labels).get("replica") == "all" for name, labels in samples)


def test_stream_errors_take_each_endpoints_shape():
    chat = stream_error("/v1/chat/completions", "r1")
    assert chat.endswith(b"data: [DONE]\n\n")
    body = json.loads(chat.split(b"\n\n")[0][6:])
    assert body["error"]["code"] == "replica_died" and "r1" in body["error"]["message"]
    assert stream_error("/completions", "r1").endswith(b"data: [DONE]\n\n")  # the /v1-less alias
    assert not stream_error("/completion", "r1").endswith(b"[DONE]\n\n")  # llama-server's native stream
    anthropic = stream_error("/v1/messages", "r1")
    assert anthropic.startswith(b"event: error\n") and b'"overloaded_error"' in anthropic
    assert stream_error("/v1/responses", "r1").startswith(b"event: error\n")
    ollama = stream_error("/api/chat", "r1")  # ollama's NDJSON: a last {"error": "..."} line
    assert ollama.endswith(b"\n") and "r1" in json.loads(ollama)["error"]


def test_the_autoscaling_policy_follows_the_load():
    assert desired_replicas(load=0, target=4, current=1, low=1, high=4) == 1
    assert desired_replicas(load=9, target=4, current=1, low=1, high=4) == 3
    assert desired_replicas(load=40, target=4, current=2, low=1, high=4) == 4
    assert desired_replicas(load=0, target=4, current=4, low=1, high=4) == 3  # down one at a time
    # what Serve's controller calls: the replicas' reported loads summed (measured: 12 requests on one
    # replica of 4 slots made Serve add the second of --autoscale 1:2)
    from types import SimpleNamespace

    ctx = SimpleNamespace(aggregated_metrics={LOAD_METRIC: {"r1": 12.0}}, current_num_replicas=1,
                          capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=2, policy_state={})
    assert LoadPolicy(target=4)(ctx) == (2, {})


@pytest.mark.slow
def test_routing_keys_share_the_system_prompt_of_a_conversation(smollm2_path):
    from minfer.api import load
    from minfer.server.cluster.routing_key import PromptKeys

    keys = PromptKeys.from_model(smollm2_path)
    system = {"role": "system", "content": "You are a careful assistant for the museum's visitors. " * 12}
    first = json.dumps({"messages": [system, {"role": "user", "content": "When do you open?"}]}).encode()
    later = json.dumps({"messages": [system, {"role": "user", "content": "When do you open?"},
                                     {"role": "assistant", "content": "At nine."},
                                     {"role": "user", "content": "And close?"}]}).encode()
    k1, k2 = keys.key("/v1/chat/completions", first), keys.key("/chat/completions", later)
    assert len(k1) >= 4 and k2[: len(k1) - 1] == k1[:-1]
    # the blocks are the replica's own tokens: the rendered prompt as the engine tokenizes it
    model = load(smollm2_path, n_ctx=512)
    ids = model.tokenize(model.plan_chat(json.loads(first)["messages"]).prompt, add_special=False)
    assert k1 == block_hashes(ids)
    # and they are the names a replica's prompt cache gives the blocks it holds (no adapters)
    from minfer.runtime.prompt_cache import block_names
    assert k1 == block_names(ids, len(k1), b"")
    other = json.dumps({"messages": [{"role": "system", "content": "Another desk. " * 30},
                                     {"role": "user", "content": "When do you open?"}]}).encode()
    assert keys.key("/v1/chat/completions", other)[0] != k1[0]
    assert keys.key("/v1/completions", json.dumps({"prompt": "word " * 100}).encode())
    assert keys.key("/v1/chat/completions", b"{not json") == []
    assert keys.key("/v1/messages", json.dumps({"system": system["content"], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "When do you open?"}]}]}).encode())[:3] == k1[:3]
