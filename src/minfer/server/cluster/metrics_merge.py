"""One ``/metrics`` for a set of servers: each one's Prometheus text with a label naming it added to every sample
(the Ray front's ``replica``, with a ``model`` label too when it serves several models; the several-model front's
``model``), each family's HELP and TYPE once, and for replicas their sum under ``replica="all"`` (one per model)
where a sum means something (counters, gauges of load and memory, histogram buckets; not start times or limits)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

NOT_SUMMED = frozenset({"process_start_time_seconds", "process_max_fds"})
ALL = "all"


def merge(texts: Mapping[str, str], label: str = "replica", total: str | None = ALL,
          extra_labels: Mapping[str, Mapping[str, str]] | None = None) -> str:
    """``texts``: each server's ``/metrics`` body by its id, which becomes its samples' ``label``; ``total``: the
    label value of the sums (None: no sums), which keep the other labels; ``extra_labels``: more labels for each
    server's samples (a replica's ``model``). A text that does not parse is left out (its server is skipped).
    Written by prometheus_client, as the servers write theirs (a counter's HELP and TYPE name its ``_total``)."""
    families: dict[str, Metric] = {}
    for server, text in sorted(texts.items()):
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        extra = dict((extra_labels or {}).get(server, {}))
        for family in parsed:
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, **extra, label: server}, s.value)
    if total is not None:
        for name, metric in families.items():
            if name not in NOT_SUMMED:
                _add_sums(metric, label, total)
    return generate_latest(_Families(families.values())).decode()


def _add_sums(metric: Metric, label: str, total: str) -> None:
    """Each sample summed over the servers, under ``label=total`` (not ``*_created``: a time, not an amount)."""
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for s in metric.samples:
        if not s.name.endswith("_created"):
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != label)))
            sums[key] = sums.get(key, 0.0) + s.value
    for (sample, labels), value in sums.items():
        metric.add_sample(sample, {**dict(labels), label: total}, value)


class _Families(Collector):
    """Ready families, for ``generate_latest``."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families
