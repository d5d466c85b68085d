"""Ray Serve's autoscaling policy for ``minfer serve --ray --autoscale MIN:MAX``.

Requests reach the engines through the front, not through Serve's handles, so Serve's own count of
ongoing requests stays at zero; each replica reports its engine's running + waiting sequences instead
(``MinferReplica.record_autoscaling_stats``), and this policy wants enough replicas for that load at
``target`` sequences each (the policy's ``target`` keyword: the replicas' ``--parallel``).
No Ray import: Serve's controller imports this module by name.
"""

from __future__ import annotations

import math
from typing import Any

LOAD_METRIC = "minfer_load"


def desired_replicas(load: float, target: float, current: int, low: int, high: int) -> int:
    """Replicas for ``load`` sequences at ``target`` each, within [low, high]; an idle set keeps its size
    down to ``low`` one replica at a time."""
    want = math.ceil(load / max(target, 1e-9)) if load > 0 else low
    if want < current:
        want = current - 1  # shrink slowly: a replica is minutes of model load and warm-up away
    return max(low, min(high, want))


class LoadPolicy:
    """Serve's policy (a class: Serve makes one with ``policy_kwargs`` and calls it with each
    ``AutoscalingContext``; Serve pickles this module by value, so it imports nothing of minfer)."""

    def __init__(self, target: float = 4.0) -> None:
        self.target = target

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        per_replica = (ctx.aggregated_metrics or {}).get(LOAD_METRIC, {})
        load = float(sum(per_replica.values()))
        n = desired_replicas(load, self.target, ctx.current_num_replicas, ctx.capacity_adjusted_min_replicas,
                             ctx.capacity_adjusted_max_replicas)
        return n, ctx.policy_state
