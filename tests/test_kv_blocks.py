"""The unified block KV cache under an engine, on the tiny fixtures: one pool of ``n_ctx`` positions for
every slot, a long request beside short ones, a shared prefix held once, and preemption when the pool is
too small for the load (every request still ends with its solo tokens)."""

from __future__ import annotations

import pytest
from conftest import drive, fixture_dir, fixture_sequences, tokens_of

import minfer
from minfer.runtime.engine import EngineConfig, build_engine
from minfer.runtime.kv_cache import KV_BLOCK
from minfer.runtime.requests import EngineHooks, Finished, GenerationRequest, Started

ARCH = "llama"


@pytest.fixture(scope="module")
def model():
    return minfer.load(fixture_dir(ARCH) / "model-f32.gguf", n_ctx=256, threads=2)


def engine_of(model, n_slots: int, n_ctx: int, batch_size: int | None = 16):
    config = EngineConfig(n_slots=n_slots, batch_size=batch_size, end_of_context="length")
    return build_engine(model.transformer, model.backend, model.tokenizer, n_ctx, model.cache_type, config)


def solo(model, prompt, max_tokens) -> list[int]:
    model.kv.clear()
    return model.complete(prompt, max_tokens=max_tokens, temperature=0).tokens


def prompt_of(n: int, shift: int = 0) -> list[int]:
    base = fixture_sequences(ARCH)[2]
    return [base[(i + shift) % len(base)] for i in range(n)]


def greedy(model, prompt, max_tokens):
    return GenerationRequest(prompt, model.sampler(temperature=0), max_tokens, stop_ids=frozenset())


def test_a_long_request_runs_beside_short_ones(model):
    """4 slots sharing 256 positions: a 180-token prompt (beyond a quarter of the context, once refused)
    runs while three short ones stream; each gets its solo tokens."""
    engine = engine_of(model, n_slots=4, n_ctx=256)
    prompts = [prompt_of(180), prompt_of(9, 3), prompt_of(12, 7), prompt_of(5, 11)]
    events = drive(engine, [greedy(model, p, 12) for p in prompts])
    for p, got in zip(prompts, events, strict=True):
        assert isinstance(got[-1], Finished)
        assert tokens_of(got) == solo(model, p, 12)
    assert engine.scheduler.n_preempted == 0


def test_eight_requests_sharing_a_1000_token_system_prompt_hold_it_once():
    """8 requests starting with the 1,000-token prompt a finished request left in its slot: each references
    that slot's blocks (31 full blocks, no rows copied) and writes its own from the block holding position
    1,000 on (a copy of that shared partial block, then its own). The blocks in use, and the KV bytes,
    are the arithmetic's; the tokens are each one's solo ones."""
    big = minfer.load(fixture_dir(ARCH) / "model-f32.gguf", n_ctx=1280, threads=2)
    engine = engine_of(big, n_slots=9, n_ctx=9 * 1100, batch_size=128)  # the 8 prompts in one pass
    system = prompt_of(1000)
    first = system + prompt_of(8, 40)
    drive(engine, [greedy(big, first, 4)])
    kv = engine.kv
    held_by_first = kv.blocks_in_use - 1  # the padding's block aside
    assert held_by_first == -(-(len(first) + 3) // KV_BLOCK)  # its prompt and the 3 tokens evaluated after it
    prompts = [system + prompt_of(8, 20 + 7 * i) for i in range(8)]
    seen = []
    events = drive(engine, [greedy(big, p, 6) for p in prompts],
                   lambda engine: seen.append((engine.kv.blocks_in_use, engine.kv.blocks_shared)))
    shared = len(system) // KV_BLOCK  # 31 full blocks held once by 9 sequences
    own = -(-(len(prompts[0])) // KV_BLOCK) - shared  # each new one's blocks from position 992 on: 1
    assert seen[0] == (held_by_first + 8 * own + 1, shared)
    per_block = KV_BLOCK * kv.bytes_per_position
    assert seen[0][0] * per_block == (held_by_first + 8 * (shared + own) + 1) * per_block - 8 * shared * per_block
    for p, got in zip(prompts, events, strict=True):
        big.kv.clear()
        assert tokens_of(got) == big.complete(p, max_tokens=6, temperature=0).tokens


@pytest.mark.parametrize(("batch_size", "cache_ram"), [(16, 0), (None, 0), (16, 64 << 20)])
def test_a_pool_too_small_for_the_load_preempts_and_every_request_ends_as_alone(model, batch_size, cache_ram):
    """4 slots sharing 96 positions (3 blocks), 4 requests of ~50 positions each: sequences are preempted
    (their blocks freed, the youngest first) and evaluated again when blocks are free; every request ends
    with its solo greedy tokens, and the preemptions are counted (engine, request stats, hooks). With
    --cache-ram a preempted sequence's full blocks wait there and come back when it resumes."""
    config = EngineConfig(n_slots=4, batch_size=batch_size, end_of_context="length", cache_ram=cache_ram)
    engine = build_engine(model.transformer, model.backend, model.tokenizer, 96, model.cache_type, config)
    counted = []
    engine.hooks = EngineHooks(on_preempted=lambda: counted.append(1))
    prompts = [prompt_of(20 + 3 * i, 5 * i) for i in range(4)]
    max_tokens = 30
    events = drive(engine, [greedy(model, p, max_tokens) for p in prompts])
    preempted = [got[-1].stats.preempted for got in events]
    assert engine.scheduler.n_preempted == len(counted) == sum(preempted) > 0
    for p, got in zip(prompts, events, strict=True):
        assert isinstance(got[-1], Finished) and got[-1].stats.finish_reason == "length"
        assert tokens_of(got) == solo(model, p, max_tokens)
    assert engine.kv.blocks_in_use <= engine.kv.n_blocks - 1
    cache = engine.scheduler.slots.prompt_cache
    assert cache is None or cache.restored > 0


@pytest.mark.slow
def test_a_server_under_too_much_load_preempts_counts_it_and_answers_as_alone():
    """A real server whose 4 slots share 96 positions, sent 4 concurrent requests of ~50 positions each:
    every answer equals the one the same request gets alone, and /metrics and /health count the
    preemptions."""
    import concurrent.futures

    import httpx

    from minfer.testing.server_process import ServerProcess

    prompts = [prompt_of(20 + 3 * i, 5 * i) for i in range(4)]

    def complete(url: str, prompt: list[int]) -> list[int]:
        body = {"prompt": prompt, "n_predict": 30, "temperature": 0, "ignore_eos": True, "return_tokens": True}
        r = httpx.post(url + "/completion", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    path = fixture_dir(ARCH) / "model-f32.gguf"
    with ServerProcess(path, ["--parallel", "4", "--ctx-size", "96", "--batch-size", "16"]) as s:
        alone = [complete(s.url, p) for p in prompts]
        assert "minfer_sequences_preempted_total 0.0" in httpx.get(s.url + "/metrics").text
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: complete(s.url, p), prompts))
        metrics = httpx.get(s.url + "/metrics").text
        health = httpx.get(s.url + "/health").json()
    assert together == alone and all(len(t) == 30 for t in alone)
    preempted = next(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("minfer_sequences_preempted_total"))
    assert preempted > 0 and health["preempted"] == preempted
    assert health["kv_blocks_total"] == 96 // KV_BLOCK + 1  # and the padding's block


def test_block_names_chain_the_prefix():
    from minfer.runtime.prompt_cache import block_names

    tokens = prompt_of(100)
    names = block_names(tokens, 3, b"")
    assert len(set(names)) == 3 and names == block_names(tokens + [1, 2], 3, b"")
    changed = list(tokens)
    changed[40] += 1  # in block 1: block 0 keeps its name, every later one changes
    other = block_names(changed, 3, b"")
    assert other[0] == names[0] and other[1] != names[1] and other[2] != names[2]
    assert block_names(tokens, 3, b"lora")[0] != names[0]  # another root (adapter scales): other names


def test_the_prompt_cache_keeps_the_least_recently_used_within_its_bytes():
    import numpy as np

    from minfer.runtime.prompt_cache import PromptCache

    cells = [(np.zeros((KV_BLOCK, 4), np.float32), np.zeros((KV_BLOCK, 4), np.float32))]  # 1 KiB a block
    cache = PromptCache(3 * 1024)
    for name in (b"a", b"b", b"c"):
        cache.put(name, cells)
    assert cache.get(b"a") is cells  # now the most recently used
    cache.put(b"d", cells)
    assert b"b" not in cache and {b"a", b"c", b"d"} == {n for n in (b"a", b"b", b"c", b"d") if n in cache}
    assert cache.nbytes == 3 * 1024 and len(cache) == 3
    PromptCache(512).put(b"x", cells)  # larger than the whole cache: not kept, no error


@pytest.mark.parametrize("cache_ram", [0, 64 << 20])
def test_a_prompt_whose_slot_was_overwritten_comes_back_from_the_prompt_cache(model, cache_ram):
    """2 slots: a 70-token prompt finishes, two other prompts overwrite both slots, then the first prompt
    comes again. With --cache-ram its two full blocks come back from host memory (64 tokens cached, not
    evaluated); without, none. Its tokens are the solo ones either way."""
    config = EngineConfig(n_slots=2, batch_size=16, end_of_context="length", cache_ram=cache_ram)
    engine = build_engine(model.transformer, model.backend, model.tokenizer, 256, model.cache_type, config)
    first = prompt_of(70)
    drive(engine, [greedy(model, first, 4)])
    drive(engine, [greedy(model, prompt_of(60, 13), 4), greedy(model, prompt_of(60, 17), 4)])
    assert all(first[:64] != engine.kv.tokens(s)[:64] for s in range(2))  # no slot holds it any more
    events = drive(engine, [greedy(model, first, 6)])
    cached = next(e.cached_tokens for e in events[0] if isinstance(e, Started))
    assert cached == (64 if cache_ram else 0)
    assert tokens_of(events[0]) == solo(model, first, 6)
    cache = engine.scheduler.slots.prompt_cache
    assert (cache.restored if cache is not None else 0) == (2 if cache_ram else 0)


@pytest.mark.slow
def test_a_server_with_cache_ram_gives_an_evicted_prompt_its_blocks_back():
    """One slot: a prompt whose cells another request overwrote gets its two full blocks back from
    --cache-ram (64 tokens cached) and the same tokens as its cold run."""
    import httpx

    from minfer.testing.server_process import ServerProcess

    def complete(url: str, prompt: list[int]) -> dict:
        body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True}
        r = httpx.post(url + "/completion", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    first = prompt_of(70)
    path = fixture_dir(ARCH) / "model-f32.gguf"
    with ServerProcess(path, ["--parallel", "1", "--ctx-size", "256", "--cache-ram", "64"]) as s:
        cold = complete(s.url, first)
        complete(s.url, prompt_of(60, 13))
        again = complete(s.url, first)
        metrics = httpx.get(s.url + "/metrics").text
    assert (cold["tokens_cached"], again["tokens_cached"]) == (0, 64) and again["tokens"] == cold["tokens"]
    assert "minfer_prompt_cache_blocks_restored 2.0" in metrics


def test_disk_blocks_come_back_only_when_they_check_out(tmp_path):
    """--cache-disk's files: a block comes back as it was written (in its stored type), from a later
    process too; the oldest files go when the folder is full; a damaged file, or one written for other
    weights, is never used (deleted, counted)."""
    import numpy as np

    from minfer.runtime.prompt_cache import DiskBlocks

    rng = np.random.default_rng(0)
    cells = [(rng.standard_normal((KV_BLOCK, 8)).astype(np.float32), rng.integers(0, 255, (KV_BLOCK, 34), np.uint8))
             for _ in range(2)]
    disk = DiskBlocks(tmp_path, 10 << 20, "model-a")
    disk.put(b"n1", cells)
    again = DiskBlocks(tmp_path, 10 << 20, "model-a").get(b"n1")
    assert again is not None and all(np.array_equal(a, b) for pa, pb in zip(again, cells, strict=True)
                                     for a, b in zip(pa, pb, strict=True))
    assert again[0][1].dtype == np.uint8 and DiskBlocks(tmp_path, 10 << 20, "model-b").get(b"n1") is None
    size = disk.nbytes
    small = DiskBlocks(tmp_path / "small", 2 * size, "model-a")
    for name in (b"n2", b"n3", b"n4"):
        small.put(name, cells)
    assert b"n2" not in small and b"n3" in small and b"n4" in small and small.nbytes == 2 * size
    path = next((tmp_path / "small").glob("*" + b"n3".hex() + ".kvb"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # one flipped bit
    path.write_bytes(bytes(data))
    assert small.get(b"n3") is None and small.rejected == 1 and not path.exists()
    # a file of other weights renamed to this model's name for the block: its header says otherwise
    DiskBlocks(tmp_path / "other", 10 << 20, "model-b").put(b"n4", cells)
    src = next((tmp_path / "other").glob("*.kvb"))
    target = next((tmp_path / "small").glob("*" + b"n4".hex() + ".kvb"))
    src.replace(target)
    assert small.get(b"n4") is None and small.rejected == 2


def test_a_prompt_comes_back_from_cache_disk_after_a_restart(model, tmp_path):
    """--cache-disk alone: a prompt's full blocks, lost when another prompt takes its only slot, come back
    from the folder; a new engine (a restarted server) on the same folder finds them too. The tokens are
    the solo ones."""
    def engine():
        config = EngineConfig(n_slots=1, batch_size=16, end_of_context="length", cache_disk=str(tmp_path))
        return build_engine(model.transformer, model.backend, model.tokenizer, 256, model.cache_type, config)

    first = prompt_of(70)
    one = engine()
    drive(one, [greedy(model, first, 4)])
    drive(one, [greedy(model, prompt_of(60, 13), 4)])
    events = drive(one, [greedy(model, first, 6)])
    assert next(e.cached_tokens for e in events[0] if isinstance(e, Started)) == 64
    assert tokens_of(events[0]) == solo(model, first, 6)
    events = drive(engine(), [greedy(model, first, 6)])
    assert next(e.cached_tokens for e in events[0] if isinstance(e, Started)) == 64
    assert tokens_of(events[0]) == solo(model, first, 6)
