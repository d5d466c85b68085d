"""Prometheus metrics of one server, in a registry of its own (no process-wide state): minfer's own
(``minfer_*``) and llama-server's (``llamacpp:*``, the names and meanings of its ``--metrics`` endpoint)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.utils import floatToGoString

from minfer.runtime.requests import EngineHooks
from minfer.runtime.sequence import GenerationStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class RateWindow:
    """Work done since the last scrape, read as a rate (llama-server's ``*_tokens_seconds`` gauges are averaged
    over the window between two scrapes). Written on the engine's thread, read on the event loop's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._units = 0
        self._seconds = 0.0

    def add(self, units: int, seconds: float) -> None:
        with self._lock:
            self._units += units
            self._seconds += seconds

    def take_rate(self) -> float:
        """Units per second over the window, which then starts again (0 when nothing ran)."""
        with self._lock:
            rate = self._units / self._seconds if self._seconds > 0 else 0.0
            self._units, self._seconds = 0, 0.0
        return rate


class ServerMetrics:
    def __init__(
        self,
        load: Callable[[], tuple[int, int]],
        cells_in_use: Callable[[], int],
        cells_total: int,
        plans_built: Callable[[], int],
        kv_blocks: Callable[[], tuple[int, int]] = lambda: (0, 0),
        kv_blocks_total: int = 0,
        prompt_cache: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0),
    ) -> None:
        self.registry = CollectorRegistry()
        self.start_time = time.time()  # llama-server's Process-Start-Time-Unix header
        reg = self.registry
        self._llamacpp_metrics(load)
        ProcessCollector(registry=reg)  # process_resident_memory_bytes, cpu seconds, open fds
        self.requests = Counter("minfer_requests", "HTTP requests answered", ["endpoint", "status"], registry=reg)
        self.prompt_tokens = Counter("minfer_prompt_tokens", "prompt tokens of finished sequences", registry=reg)
        self.cached_tokens = Counter("minfer_prompt_tokens_cached",
                                     "prompt tokens reused from the KV cache instead of evaluated", registry=reg)
        self.generated_tokens = Counter("minfer_generated_tokens", "tokens generated", registry=reg)
        self.finished = Counter("minfer_sequences_finished", "sequences finished, by reason", ["reason"], registry=reg)
        running = Gauge("minfer_requests_running", "sequences holding a slot", registry=reg)
        running.set_function(lambda: load()[0])
        waiting = Gauge("minfer_queue_depth", "sequences waiting for a slot", registry=reg)
        waiting.set_function(lambda: load()[1])
        used = Gauge("minfer_kv_cells_used", "KV cache positions held by running sequences", registry=reg)
        used.set_function(cells_in_use)
        total = Gauge("minfer_kv_cells_total", "KV cache positions (all slots)", registry=reg)
        total.set(cells_total)
        blocks_used = Gauge("minfer_kv_blocks_used", "KV cache blocks holding some sequence's positions (running "
                            "or cached for reuse; a shared block counted once)", registry=reg)
        blocks_used.set_function(lambda: kv_blocks()[0])
        blocks_shared = Gauge("minfer_kv_blocks_shared", "KV cache blocks held by more than one sequence (a "
                              "shared prefix)", registry=reg)
        blocks_shared.set_function(lambda: kv_blocks()[1])
        blocks_total = Gauge("minfer_kv_blocks_total", "KV cache blocks in the pool", registry=reg)
        blocks_total.set(kv_blocks_total)
        cache_bytes = Gauge("minfer_prompt_cache_bytes", "host memory held by KV blocks that left the cache "
                            "(--cache-ram)", registry=reg)
        cache_bytes.set_function(lambda: prompt_cache()[0])
        cache_blocks = Gauge("minfer_prompt_cache_blocks", "KV blocks held in host memory (--cache-ram)", registry=reg)
        cache_blocks.set_function(lambda: prompt_cache()[1])
        restored = Gauge("minfer_prompt_cache_blocks_restored", "KV blocks given back to a prompt from host memory "
                         "since the start (--cache-ram)", registry=reg)
        restored.set_function(lambda: prompt_cache()[2])
        self.preempted = Counter("minfer_sequences_preempted", "times a running sequence's KV blocks were freed "
                                 "for others (its tokens evaluated again when blocks were free)", registry=reg)
        plans = Gauge("minfer_plans_built", "forward-pass plans built since the start (each costs 10-50 ms; "
                      "the batch shapes' plans are built at start)", registry=reg)
        plans.set_function(plans_built)
        self.ttft = Histogram("minfer_time_to_first_token_seconds", "from request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("minfer_inter_token_latency_seconds", "between two tokens of one sequence",
                             buckets=GAP_BUCKETS, registry=reg)
        self.batch_tokens = Histogram("minfer_batch_tokens", "tokens evaluated per forward pass",
                                      buckets=BATCH_BUCKETS, registry=reg)
        self.forward_seconds = Counter("minfer_forward_seconds", "time spent in forward passes", registry=reg)
        self.drafted = Counter("minfer_speculative_drafted_tokens", "draft tokens verified by the target",
                               registry=reg)
        self.accepted = Counter("minfer_speculative_accepted_tokens", "draft tokens the target kept", registry=reg)
        self.target_passes = Counter("minfer_target_passes",
                                     "target passes that sampled a finished sequence, summed over sequences "
                                     "(generated_tokens / target_passes: tokens per pass)", registry=reg)

    def _llamacpp_metrics(self, load: Callable[[], tuple[int, int]]) -> None:
        """llama-server's ``/metrics`` (tools/server: server_task_result_metrics::to_metrics), same names and
        meanings, so its dashboards and alerts read this server unchanged."""
        reg = self.registry
        self.ll_prompt_tokens = Counter("llamacpp:prompt_tokens", "Number of prompt tokens processed, excluding "
                                        "cached tokens", registry=reg)
        self.ll_prompt_cached = Counter("llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from the "
                                        "cache", registry=reg)
        self.ll_prompt_seconds = Counter("llamacpp:prompt_seconds", "Total time spent processing prompts",
                                         registry=reg)
        self.ll_predicted = Counter("llamacpp:tokens_predicted", "Number of generation tokens processed",
                                    registry=reg)
        self.ll_predicted_seconds = Counter("llamacpp:tokens_predicted_seconds", "Total time spent generating "
                                            "tokens", registry=reg)
        self.ll_decodes = Counter("llamacpp:n_decode", "Total number of forward passes", registry=reg)
        self._busy_slots = 0  # sequences sampled, summed over forward passes
        self._decodes = 0
        self.prompt_rate = RateWindow()
        self.predict_rate = RateWindow()
        Gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s",
              registry=reg).set_function(self.prompt_rate.take_rate)
        # the first generated token comes out of the prompt's pass: the rate counts decode steps only
        Gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s",
              registry=reg).set_function(self.predict_rate.take_rate)
        Gauge("llamacpp:requests_processing", "Number of requests processing",
              registry=reg).set_function(lambda: load()[0])
        Gauge("llamacpp:requests_deferred", "Number of requests deferred",
              registry=reg).set_function(lambda: load()[1])
        Gauge("llamacpp:n_busy_slots_per_decode", "Average number of busy slots per forward pass",
              registry=reg).set_function(lambda: self._busy_slots / max(self._decodes, 1))

    def batch_hooks(self) -> EngineHooks:
        return EngineHooks(
            on_first_token=self.ttft.observe,
            on_token_gap=self.itl.observe,
            on_finished=self._finished,
            on_step=self._step,
            on_verified=self._verified,
            on_preempted=self.preempted.inc,
        )

    def _verified(self, drafted: int, accepted: int) -> None:
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)

    def _finished(self, stats: GenerationStats, cached: int) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(cached)
        self.generated_tokens.inc(stats.generated_tokens)
        self.target_passes.inc(stats.target_passes)
        self.finished.labels(stats.finish_reason or "unknown").inc()
        evaluated = max(stats.prompt_tokens - cached, 0)
        self.ll_prompt_tokens.inc(evaluated)
        self.ll_prompt_cached.inc(cached)
        self.ll_prompt_seconds.inc(stats.prefill_seconds)
        self.prompt_rate.add(evaluated, stats.prefill_seconds)
        self.ll_predicted.inc(stats.generated_tokens)
        self.ll_predicted_seconds.inc(stats.decode_seconds)
        self.predict_rate.add(max(stats.generated_tokens - 1, 0), stats.decode_seconds)

    def _step(self, n_tokens: int, n_sequences: int, seconds: float) -> None:
        self.batch_tokens.observe(n_tokens)
        self.forward_seconds.inc(seconds)
        self.ll_decodes.inc()
        self._decodes += 1
        self._busy_slots += n_sequences

    def render(self) -> bytes:
        return generate_latest(self.registry)


_ADDITIVE_TYPES = ("counter", "histogram", "summary")  # whose samples are totals since the start


def add_carried_totals(text: str, carried: Mapping[str, float]) -> tuple[str, dict[str, float]]:
    """Prometheus ``text`` with ``carried`` (sample line key -> value: ``name{labels}``) added to its counters',
    histograms' and summaries' samples, and those samples' sums: a server whose model process was replaced (it
    slept) reports totals since its own start, as llama-server's survive its sleeps. Gauges and ``*_created``
    stay as they are."""
    lines: list[str] = []
    totals: dict[str, float] = {}
    kind = ""
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            kind = parts[3] if len(parts) > 3 else ""
        elif line and not line.startswith("#") and kind in _ADDITIVE_TYPES:
            key, _, value = line.rpartition(" ")
            if key and not key.split("{", 1)[0].endswith("_created"):
                total = float(value) + carried.get(key, 0.0)
                totals[key] = total
                line = f"{key} {floatToGoString(total)}"
        lines.append(line)
    return "\n".join(lines) + "\n", totals
