"""The thread governor: fewer threads while another process takes a core, back when it has gone.

The passes' times here are made up (a quiet 2-thread pass 10 ms, 1 thread 18 ms; a loaded 2-thread pass
85 ms, as measured on 2 vCPUs with one core spinning elsewhere), so each decision is checked exactly."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.backends.cpu import thread_governor as tg
from minfer.backends.cpu.thread_governor import ThreadGovernor

DECODE = (1, 1, False)


class Machine:
    """Pass times by thread count, loaded or not, and a clock that the passes advance."""

    def __init__(self) -> None:
        self.now = 0.0
        self.loaded = False

    def clock(self) -> float:
        return self.now

    def seconds(self, threads: int) -> float:
        if self.loaded:
            return 0.085 if threads == 2 else 0.019
        return 0.010 if threads == 2 else 0.018

    def run(self, gov: ThreadGovernor, passes: int, key=DECODE) -> list[int]:
        used = []
        for _ in range(passes):
            n = gov.threads(key)
            s = self.seconds(n)
            self.now += s
            gov.record(key, n, s)
            used.append(n)
        return used


def test_a_quiet_machine_keeps_every_thread_after_one_short_try_of_fewer():
    m = Machine()
    gov = ThreadGovernor(2, clock=m.clock)
    used = m.run(gov, 200)
    # the first window sets the level, one probe of 1 thread loses, and nothing else changes
    assert used[: tg.WINDOW] == [2] * tg.WINDOW
    assert used[tg.WINDOW : tg.WINDOW + tg.PROBE_PASSES] == [1] * tg.PROBE_PASSES
    assert set(used[tg.WINDOW + tg.PROBE_PASSES :]) == {2}
    assert gov.switches == 0


def test_load_that_appears_moves_the_pass_to_one_thread_and_back_when_it_goes():
    m = Machine()
    gov = ThreadGovernor(2, clock=m.clock)
    m.run(gov, 40)
    m.loaded = True
    used = m.run(gov, 40)
    assert used[-20:] == [1] * 20 and gov.switches == 1
    # while loaded, tries of 2 threads lose and come ever less often (the wait doubles)
    tries = [i for i, n in enumerate(m.run(gov, 3000)) if n == 2]
    starts = [i for j, i in enumerate(tries) if j == 0 or tries[j - 1] != i - 1]
    gaps = np.diff(starts)
    assert len(starts) >= 3 and (gaps[1:] > gaps[:-1]).all()
    assert gov.switches == 1
    m.loaded = False
    m.now += tg.UP_MAX_S
    used = m.run(gov, 40)
    assert used[-20:] == [2] * 20 and gov.switches == 2


def test_a_machine_loaded_from_the_start_is_found_by_the_first_try():
    m = Machine()
    m.loaded = True
    gov = ThreadGovernor(2, clock=m.clock)
    used = m.run(gov, 40)
    assert used[-20:] == [1] * 20 and gov.switches == 1


def test_each_kind_of_pass_has_its_own_count_and_one_thread_has_no_governor():
    m = Machine()
    gov = ThreadGovernor(2, clock=m.clock)
    m.loaded = True
    m.run(gov, 40, key=DECODE)
    assert gov.threads(DECODE) == 1 and gov.threads((512, 1, False)) == 2
    assert ThreadGovernor(1).threads(DECODE) == 1


@pytest.mark.parametrize("adaptive", [None, "1", "0"])
def test_the_backend_runs_a_pass_on_the_governors_count_and_tells_it_the_time(monkeypatch, adaptive):
    import numba

    from minfer.backends.cpu.backend import CPUBackend

    if adaptive is None:  # on by default
        monkeypatch.delenv("MINFER_ADAPTIVE_THREADS", raising=False)
    else:
        monkeypatch.setenv("MINFER_ADAPTIVE_THREADS", adaptive)
    backend = CPUBackend(threads=2)
    if adaptive == "0":
        assert backend.governor is None
        return
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has one thread here")
    gov = backend.governor
    with backend.running(DECODE):
        assert numba.get_num_threads() == 2
    k = gov._kinds[DECODE]
    assert len(k.recent) == 1 and k.recent[0] > 0
    k.threads = 1  # as after a switch
    with backend.running(DECODE):
        assert numba.get_num_threads() == 1
    with backend.running():  # a pass of no kind: every thread, nothing recorded
        assert numba.get_num_threads() == 2
    with pytest.raises(RuntimeError), backend.running(DECODE):
        raise RuntimeError("a failed pass is not a time")
    assert len(k.recent) == 2
