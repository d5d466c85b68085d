"""One ``/metrics`` for a set of replicas: each replica's Prometheus text with a ``replica`` label added
to every sample (and a ``model`` label with several models), and their sum under ``replica="all"`` (one per
model) where a sum means something (counters, gauges of load and memory, histogram buckets; not start times
or limits)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

NOT_SUMMED = frozenset({"process_start_time_seconds", "process_max_fds"})
ALL = "all"


def merge(texts: Mapping[str, str], labels: Mapping[str, Mapping[str, str]] | None = None) -> str:
    """``texts``: each replica's ``/metrics`` body by replica id; ``labels``: more labels for each replica's
    samples (its ``model``, with several), which its ``replica="all"`` sum keeps."""
    families: dict[str, tuple[str, str, list[tuple[str, dict[str, str], float]]]] = {}
    for replica, text in sorted(texts.items()):
        extra = dict((labels or {}).get(replica, {}))
        for family in text_string_to_metric_families(text):
            entry = families.setdefault(family.name, (family.type, family.documentation, []))
            for s in family.samples:
                entry[2].append((s.name, {**s.labels, **extra, "replica": replica}, s.value))
    out: list[str] = []
    for name, (kind, doc, samples) in families.items():
        out.append(f"# HELP {name} {_escape_help(doc)}")
        out.append(f"# TYPE {name} {kind}")
        sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for sample, labels, value in samples:
            out.append(_line(sample, labels, value))
            if name not in NOT_SUMMED and not sample.endswith("_created"):
                key = (sample, tuple(sorted((k, v) for k, v in labels.items() if k != "replica")))
                sums[key] = sums.get(key, 0.0) + value
        for (sample, labels), value in sums.items():
            out.append(_line(sample, {**dict(labels), "replica": ALL}, value))
    return "\n".join(out) + "\n" if out else ""


def _line(name: str, labels: dict[str, str], value: float) -> str:
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{body}}} {_number(value)}"


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")
