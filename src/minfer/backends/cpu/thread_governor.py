"""The thread count of each kind of forward pass, following the load of the machine.

Every kernel ends in a barrier, so a pass on N threads runs at the pace of the slowest. When another
process takes one of the cores, the thread that shares that core is descheduled for whole time slices
while its partner waits: on 2 vCPUs with one core spinning elsewhere, 2-thread decode fell from 13.3 to
1.6 tokens/s (1.7B Q4_K_M) and from 160 to 5 (SmolLM2-135M). One thread fewer then runs at the speed of
the cores that are free. The results do not depend on the thread count (every kernel computes the same
bits on 1 or N threads), so the count may change between any two passes.

Per kind of pass (its token and output counts: decode steps are compared with decode steps), the governor
keeps the recent times at the current count. Once the first ``WINDOW`` passes have set a level (the
machine may be loaded from the start), and whenever the recent times grow past ``SLOWER`` times the level it last
confirmed, it tries one thread fewer for ``PROBE_PASSES`` passes and keeps that count if it is faster by
``GAIN``. From a reduced count it tries one thread more now and then (``UP_EVERY_S``, doubled after each
try that loses, up to ``UP_MAX_S``): the load may have gone.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable

WINDOW = 8  # recent passes whose median is the current level
SLOWER = 1.5  # a level this much above the confirmed one starts a probe with one thread fewer
GAIN = 0.9  # a probed count is kept when its median is below this fraction of the current one
PROBE_PASSES = 3
UP_EVERY_S = 2.0  # first wait before trying one thread more, doubled after each try that loses
UP_MAX_S = 60.0


class _Kind:
    """What the governor knows of one kind of pass."""

    __slots__ = ("threads", "recent", "confirmed", "probe", "probe_times", "up_wait", "next_up")

    def __init__(self, threads: int, now: float) -> None:
        self.threads = threads
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.confirmed: float | None = None  # the level (median seconds) last confirmed at ``threads``
        self.probe = 0  # the count being tried (0: none)
        self.probe_times: list[float] = []
        self.up_wait = UP_EVERY_S
        self.next_up = now + UP_EVERY_S


class ThreadGovernor:
    """The thread count for each kind of pass (any hashable key), learnt from the passes' times."""

    def __init__(self, max_threads: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.max_threads = max(1, max_threads)
        self._clock = clock
        self._kinds: dict[Hashable, _Kind] = {}
        self.switches = 0  # how many times a kind of pass changed its count (for tests and the bench)

    def threads(self, key: Hashable) -> int:
        """How many threads the next pass of this kind runs on."""
        k = self._kinds.get(key)
        if k is None:
            return self.max_threads
        return k.probe or k.threads

    def record(self, key: Hashable, threads: int, seconds: float) -> None:
        """A pass of this kind took ``seconds`` on ``threads`` threads."""
        now = self._clock()
        k = self._kinds.get(key)
        if k is None:
            k = self._kinds[key] = _Kind(self.max_threads, now)
        if k.probe:
            if threads == k.probe:
                k.probe_times.append(seconds)
                if len(k.probe_times) == PROBE_PASSES:
                    self._decide(k, now)
            return
        if threads != k.threads:
            return
        k.recent.append(seconds)
        if len(k.recent) < WINDOW:
            return
        level = statistics.median(k.recent)
        if k.confirmed is None:  # the first level may already be a loaded one: try one thread fewer once
            k.confirmed = level
            if k.threads > 1:
                self._start(k, k.threads - 1)
        elif k.threads > 1 and level > SLOWER * k.confirmed:
            self._start(k, k.threads - 1)
        elif k.threads < self.max_threads and now >= k.next_up:
            self._start(k, k.threads + 1)

    def _start(self, k: _Kind, threads: int) -> None:
        k.probe, k.probe_times = threads, []

    def _decide(self, k: _Kind, now: float) -> None:
        tried = statistics.median(k.probe_times)
        level = statistics.median(k.recent)
        up = k.probe > k.threads
        if tried < GAIN * level:
            k.threads = k.probe
            k.recent.clear()
            k.recent.extend(k.probe_times)
            k.confirmed = tried
            k.up_wait = UP_EVERY_S
            self.switches += 1
        else:
            k.confirmed = level  # this count is still the better one: its present level is the new norm
            if up:
                k.up_wait = min(2 * k.up_wait, UP_MAX_S)
        k.next_up = now + k.up_wait
        k.probe, k.probe_times = 0, []
