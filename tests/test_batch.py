"""Continuous batching (minfer.runtime.engine driven by minfer.runtime.engine_loop) on the tiny fixtures:
what one batch gives equals what each sequence gives alone, prefix reuse, chunked prefill, cancellation,
the bounded queue."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import fixture_dir, fixture_sequences

import minfer
from minfer.errors import ContextOverflowError
from minfer.runtime.batching import batch_buckets
from minfer.runtime.engine import EngineConfig, build_engine
from minfer.runtime.engine_loop import EngineLoop, QueueFullError, ShuttingDownError
from minfer.runtime.forward import ForwardRunner
from minfer.runtime.kv_cache import slots_kv_cache
from minfer.runtime.requests import EngineHooks, Failed, Finished, GenerationRequest, Started, Token

ARCH = "qwen2"


class Collector:
    """Events of several requests, and a way to wait for all of them to end."""

    def __init__(self, n: int) -> None:
        self.events: list[list] = [[] for _ in range(n)]
        self._left = n
        self._done = threading.Event()
        self._lock = threading.Lock()

    def emit(self, i: int):
        def push(ev) -> None:
            self.events[i].append(ev)
            if isinstance(ev, Finished | Failed):
                with self._lock:
                    self._left -= 1
                    if self._left == 0:
                        self._done.set()

        return push

    def wait(self, timeout: float = 60) -> None:
        assert self._done.wait(timeout), "requests did not finish"

    def tokens(self, i: int) -> list[int]:
        return [e.step.token for e in self.events[i] if isinstance(e, Token) and e.step.token is not None]

    def final(self, i: int):
        return self.events[i][-1]


@pytest.fixture(scope="module")
def model():
    return minfer.load(fixture_dir(ARCH) / "model-f32.gguf", n_ctx=64, threads=2)


def make_scheduler(model, n_seq: int, n_ctx: int | None = None, batch_size: int = 512, max_queue: int = 16):
    config = EngineConfig(n_slots=n_seq, batch_size=batch_size, end_of_context="length", max_plans=32)
    engine = build_engine(model.transformer, model.backend, model.tokenizer, n_ctx or 64 * n_seq, model.cache_type,
                          config)
    sched = EngineLoop(engine, max_queue=max_queue)
    sched.start()
    return sched


def run_all(sched, model, prompts, max_tokens=12, **sampling) -> Collector:
    c = Collector(len(prompts))
    sampling = {"temperature": 0.0, **sampling}
    reqs = [GenerationRequest(p, model.sampler(**sampling), max_tokens, c.emit(i)) for i, p in enumerate(prompts)]
    sched.submit(reqs)
    c.wait()
    return c


def prompts_of(n: int) -> list[list[int]]:
    seqs = fixture_sequences(ARCH)
    rng = np.random.default_rng(0)
    base = seqs[2]
    return [base[: 3 + int(rng.integers(0, 28))] for _ in range(n)]


def alone(model, prompt, max_tokens=12, **sampling) -> list[int]:
    sampling = {"temperature": 0.0, **sampling}
    model.kv.clear()
    return model.complete(prompt, max_tokens, **sampling).tokens


@pytest.mark.parametrize("batch_size", [512, 7])
def test_eight_sequences_in_one_batch_equal_each_alone(model, batch_size):
    """Greedy and seeded sampling: every sequence gets exactly the tokens it gets alone, whether the
    prompts are prefilled whole or in chunks of 7 tokens next to the decodes."""
    prompts = prompts_of(8)
    sched = make_scheduler(model, n_seq=8, batch_size=batch_size)
    try:
        greedy = run_all(sched, model, prompts)
        seeded = run_all(sched, model, prompts, temperature=0.9, seed=7)
    finally:
        sched.stop()
    for i, p in enumerate(prompts):
        assert greedy.tokens(i) == alone(model, p)
        assert seeded.tokens(i) == alone(model, p, temperature=0.9, seed=7)
        assert isinstance(greedy.final(i), Finished) and greedy.final(i).stats.finish_reason == "length"


def test_f16_cells_in_one_batch_equal_each_alone():
    """An f16 cache: the batch's attention reads the half-precision cells themselves (one call for every
    sequence), a sequence alone reads them one window at a time; both give the same tokens."""
    f16 = minfer.load(fixture_dir(ARCH) / "model-f32.gguf", n_ctx=64, threads=2, cache_type="f16")
    prompts = prompts_of(6)
    sched = make_scheduler(f16, n_seq=6, batch_size=7)
    try:
        assert sched.kv.layers[0].k.dtype == np.float16
        greedy = run_all(sched, f16, prompts)
    finally:
        sched.stop()
    for i, p in enumerate(prompts):
        assert greedy.tokens(i) == alone(f16, p)


def test_more_requests_than_slots_wait_their_turn(model):
    prompts = prompts_of(6)
    sched = make_scheduler(model, n_seq=2)
    try:
        c = run_all(sched, model, prompts)
    finally:
        sched.stop()
    for i, p in enumerate(prompts):
        assert c.tokens(i) == alone(model, p)


def test_a_shared_prefix_is_reused_and_gives_the_same_tokens(model):
    seq = fixture_sequences(ARCH)[2]
    first, second = seq[:30], seq[:20] + seq[25:33]
    sched = make_scheduler(model, n_seq=2)
    try:
        a = run_all(sched, model, [first])
        b = run_all(sched, model, [second])
        again = run_all(sched, model, [first])
    finally:
        sched.stop()
    assert a.events[0][0] == Started(0)
    assert b.events[0][0] == Started(20)
    assert b.final(0).cached_tokens == 20
    assert again.events[0][0].cached_tokens == 29  # all but the last prompt token, whose logits are needed
    assert b.tokens(0) == alone(model, second)
    assert again.tokens(0) == a.tokens(0)


def test_prefix_is_copied_from_a_busy_slot(model):
    """A request whose prefix sits in another (running or free) slot gets those rows copied."""
    seq = fixture_sequences(ARCH)[2]
    sched = make_scheduler(model, n_seq=3)
    try:
        run_all(sched, model, [seq[:25]])
        c = run_all(sched, model, [seq[:18] + [5, 6, 7], seq[:10] + [9, 9]])
    finally:
        sched.stop()
    cached = sorted(c.final(i).cached_tokens for i in range(2))
    assert cached == [10, 18]
    assert c.tokens(0) == alone(model, seq[:18] + [5, 6, 7])
    assert c.tokens(1) == alone(model, seq[:10] + [9, 9])


def test_cancel_frees_the_slot_and_others_go_on(model):
    prompts = prompts_of(2)
    sched = make_scheduler(model, n_seq=2)
    c = Collector(2)
    first_token = threading.Event()

    def cancel_after_first(ev) -> None:
        c.emit(0)(ev)
        if isinstance(ev, Token):
            first_token.set()

    slow = GenerationRequest(prompts[0], model.sampler(temperature=0), 200, cancel_after_first)
    other = GenerationRequest(prompts[1], model.sampler(temperature=0), 12, c.emit(1))
    try:
        sched.submit([slow, other])
        assert first_token.wait(30)
        slow.cancel()
        c.wait()
        assert sched.load() == (0, 0)
        assert sched.cells_in_use() == 0
    finally:
        sched.stop()
    assert c.final(0).stats.finish_reason == "cancelled"
    assert len(c.tokens(0)) < 200
    assert c.tokens(1) == alone(model, prompts[1])


def test_queue_limit_refuses_with_queue_full(model):
    sched = make_scheduler(model, n_seq=1, max_queue=1)
    c = Collector(3)
    reqs = [GenerationRequest(p, model.sampler(temperature=0), 40, c.emit(i)) for i, p in enumerate(prompts_of(3))]
    try:
        sched.submit(reqs[:2])  # one runs (or is about to), one waits
        with pytest.raises(QueueFullError, match="queue limit 1"):
            sched.submit(reqs[2:])
    finally:
        sched.stop()
    assert all(isinstance(c.final(i), Finished) for i in range(2))


def test_a_prompt_may_use_the_whole_context_and_no_more(model):
    """4 slots sharing 64 positions: a prompt of 40 (more than a quarter) runs and gives its solo tokens; one
    longer than the whole context is refused."""
    sched = make_scheduler(model, n_seq=4, n_ctx=64)
    prompt = (fixture_sequences(ARCH)[2] * 2)[:40]
    try:
        with pytest.raises(ContextOverflowError, match="65 tokens, more than the context of 64$"):
            sched.submit([GenerationRequest(list(range(3, 68)), model.sampler(), 4, lambda ev: None)])
        c = run_all(sched, model, [prompt], max_tokens=12)
    finally:
        sched.stop()
    assert c.tokens(0) == alone(model, prompt)


def test_generation_ends_with_length_when_the_context_is_full(model):
    sched = make_scheduler(model, n_seq=4, n_ctx=64)
    prompt = fixture_sequences(ARCH)[2][:10]
    try:
        c = run_all(sched, model, [prompt], max_tokens=None)
    finally:
        sched.stop()
    # 64 positions: 10 prompt tokens, then 55 tokens (the last one never needs a cache row)
    assert len(c.tokens(0)) + sum(1 for e in c.events[0] if isinstance(e, Token) and e.step.token is None) <= 55
    assert c.final(0).stats.generated_tokens == 55
    assert c.final(0).stats.finish_reason == "length"


def test_stopped_scheduler_refuses_new_requests(model):
    sched = make_scheduler(model, n_seq=1)
    sched.stop()
    with pytest.raises(ShuttingDownError):
        sched.submit([GenerationRequest([3, 4], model.sampler(), 2, lambda ev: None)])


def test_a_failing_request_fails_alone(model):
    """A constraint that breaks mid-run fails its own request; the batch goes on."""

    class Broken:
        def mask_logits(self, logits):
            raise RuntimeError("broken grammar")

    prompts = prompts_of(2)
    sched = make_scheduler(model, n_seq=2)
    c = Collector(2)
    try:
        sched.submit([GenerationRequest(prompts[0], model.sampler(temperature=0), 8, c.emit(0), constraint=Broken()),
                      GenerationRequest(prompts[1], model.sampler(temperature=0), 8, c.emit(1))])
        c.wait()
    finally:
        sched.stop()
    assert isinstance(c.final(0), Failed) and "broken grammar" in str(c.final(0).error)
    assert c.tokens(1) == alone(model, prompts[1], max_tokens=8)


def test_batches_are_padded_to_a_few_shapes(model):
    """Mixed prefill + decode steps use bucketed token counts: only a handful of plans get built."""
    sched = make_scheduler(model, n_seq=4, batch_size=64)
    try:
        rng = np.random.default_rng(1)
        seq = fixture_sequences(ARCH)[2]
        for _ in range(3):
            prompts = [seq[: int(rng.integers(3, 33))] for _ in range(4)]
            c = run_all(sched, model, prompts, max_tokens=5)
            for i, p in enumerate(prompts):
                assert c.tokens(i) == alone(model, p, max_tokens=5)
        shapes = list(sched.runner._plans)
    finally:
        sched.stop()
    buckets = set(batch_buckets(64))
    assert all(n in buckets and o in buckets for n, o in shapes)
    assert batch_buckets(512) == [1, 2, 3, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]



def test_after_events_follows_each_steps_events(model):
    """The hook a server flushes its buffered events with runs on the scheduler thread after the events
    of the iteration: every event has been emitted before some after_events call."""
    from dataclasses import replace

    sched = make_scheduler(model, n_seq=2)
    log: list[str] = []
    c = Collector(2)

    def emit(i: int):
        push = c.emit(i)
        return lambda ev: (log.append(type(ev).__name__), push(ev))

    sched.metrics = replace(sched.metrics, after_events=lambda: log.append("flush"))
    try:
        seq = fixture_sequences(ARCH)[1]
        sched.submit([GenerationRequest(seq[:7], model.sampler(temperature=0.0), 4, emit(0)),
                      GenerationRequest(seq[:9], model.sampler(temperature=0.0), 4, emit(1))])
        c.wait()
    finally:
        sched.stop()  # returns once the loop has ended: the iteration that emitted Finished flushed
    assert log.count("Token") == 8 and log.count("Finished") == 2
    assert log[-1] == "flush"
    # one flush per iteration, not per event: two sequences' tokens share an iteration
    assert log.count("flush") < log.count("Token")

def test_as_many_chosen_output_rows_as_tokens_are_honoured(model):
    """A forward call whose output_rows select n of n rows in another order (or repeated) gets those rows."""
    seq = fixture_sequences(ARCH)[2][:6]
    kv = slots_kv_cache(model.hparams, 128, 2, scratch=True)
    runner = ForwardRunner(model.transformer, model.backend, kv)
    full = runner.forward(seq, range(6))
    picked = runner.forward(seq, range(6), output_rows=[5, 5, 0, 1, 2, 3])
    np.testing.assert_array_equal(picked, full[[5, 5, 0, 1, 2, 3]])


def test_prompt_chunks_end_a_pass_on_a_bucket_rather_than_pad_it(model):
    """136 prompt tokens arriving together: the first pass takes 128 (a bucket) instead of padding 136 to
    192; the 8 left over go first in the next pass; no token is evaluated twice, and every sequence
    still gets the tokens it gets alone."""
    seq = fixture_sequences(ARCH)[2]
    prompts = [seq[i : i + 17] for i in range(8)]  # 8 x 17 = 136 tokens
    sched = make_scheduler(model, n_seq=8, n_ctx=8 * 64)
    steps: list[int] = []
    sched.metrics = EngineHooks(on_step=lambda n_tokens, n_seq, seconds: steps.append(n_tokens))
    try:
        c = run_all(sched, model, prompts, max_tokens=4)
    finally:
        sched.stop()
    assert steps[0] == 128
    assert sum(steps) == 136 + 8 * 3  # every prompt token once, then three decodes per sequence
    for i, p in enumerate(prompts):
        assert c.tokens(i) == alone(model, p, max_tokens=4)
