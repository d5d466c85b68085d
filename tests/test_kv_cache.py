"""KV cache cell types and sequences on the tiny fixtures."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ARCHS, fixture_dir, fixture_logits, fixture_sequences, load_json

import minfer
from minfer.errors import BadRequestError, ContextOverflowError
from minfer.runtime.requests import GenerationRequest
from minfer.runtime.sampling import Sampler, SamplingParams


def _greedy(model, ref):
    steps = model.engine.run(GenerationRequest(ref["prompt_ids"], Sampler(SamplingParams(temperature=0)),
                     max_tokens=len(ref["generated_ids"]), stop_ids=frozenset()))
    return [s.token for s in steps if s.token is not None]


@pytest.mark.parametrize("arch", ARCHS)
def test_f16_cells_within_1e_2_of_f32(arch):
    """DESIGN.md: an f16 KV cache stays within 1e-2 of the f32 logits, with the same greedy tokens."""
    f32 = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, cache_type="f32")
    f16 = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, cache_type="f16")
    for seq in fixture_sequences(arch):
        diff = float(np.abs(f16.logits(seq) - f32.logits(seq)).max())
        assert diff <= 1e-2, f"{arch} f16: max |dlogit| = {diff:.3g}"
    ref = load_json(fixture_dir(arch) / "greedy.json")
    assert _greedy(f16, ref) == ref["generated_ids"]


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_cells_are_exactly_a_q8_0_round_trip(arch):
    """q8_0 cells hold exactly what the gguf package's Q8_0 quantize -> dequantize gives for each K/V row:
    the same logits as an f32 cache fed round-tripped rows. On these fixtures that round trip alone moves
    logits by 0.04-0.12 against f32 cells (above DESIGN.md's 5e-2, reported on the issue), so the greedy
    tokens are checked teacher-forced at every step whose top-2 margin is clear of that (> 0.25); a free
    greedy run diverges at near-ties (llama: step 13, margin 0.034)."""
    import gguf

    import minfer.backends.cpu.reference as ref_ops

    def round_trip(x):
        t = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(x), t), t).reshape(x.shape)

    q8 = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, cache_type="q8_0", kernels="reference")
    seqs = fixture_sequences(arch)
    got = [q8.logits(seq) for seq in seqs]
    store = ref_ops.kv_store
    try:
        ref_ops.kv_store = lambda k, v, pos, K, V, layer: store(round_trip(k), round_trip(v), pos, K, V, layer)
        sim = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, kernels="reference")
        for g, seq in zip(got, seqs, strict=True):
            np.testing.assert_array_equal(g, sim.logits(seq))
    finally:
        ref_ops.kv_store = store
    ref = load_json(fixture_dir(arch) / "greedy.json")
    fast = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, cache_type="q8_0")
    ids = ref["prompt_ids"] + ref["generated_ids"]
    logits = fast.logits(ids)[len(ref["prompt_ids"]) - 1 : -1]
    checked = 0
    for i, (tok, margin) in enumerate(zip(ref["generated_ids"], ref["top1_minus_top2"], strict=True)):
        if margin > 0.25:
            checked += 1
            assert int(np.argmax(logits[i])) == tok, f"{arch} step {i} (margin {margin:.3f})"
    assert checked >= 5


def test_bytes_per_position_by_type():
    sizes = {ct: minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=64, cache_type=ct).kv_bytes_per_position
             for ct in ("f32", "f16", "q8_0")}
    assert sizes["f16"] * 2 == sizes["f32"]
    assert sizes["f32"] / sizes["q8_0"] == pytest.approx(128 / 34)  # 3.76x


def test_unknown_cache_type_lists_the_valid_ones(monkeypatch):
    with pytest.raises(BadRequestError, match="unknown KV cache type 'q4'.*f32, f16, q8_0"):
        minfer.load(fixture_dir("llama") / "model-f32.gguf", cache_type="q4")
    monkeypatch.setenv("MINFER_CACHE_TYPE", "f16")
    assert minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=16).cache_type == "f16"
    # the explicit argument wins over the environment
    assert minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=16, cache_type="q8_0").cache_type == "q8_0"


@pytest.mark.parametrize("cache_type", ["f32", "q8_0"])
def test_sequences_in_one_batch_equal_each_alone(cache_type):
    """Two sequences prefilled in one forward pass give the logits each gets alone."""
    from minfer.runtime.forward import ForwardRunner
    from minfer.runtime.kv_cache import KVCache

    model = minfer.load(fixture_dir("qwen3") / "model-f32.gguf", n_ctx=64, threads=1, cache_type=cache_type)
    a, b = fixture_sequences("qwen3")[1], fixture_sequences("qwen3")[2][:20]
    kv = KVCache(model.hparams, 128, cache_type=cache_type, n_seq=2)
    runner = ForwardRunner(model.transformer, model.backend, kv)
    both = runner.forward(a + b, list(range(len(a))) + list(range(len(b))), seq_ids=[0] * len(a) + [1] * len(b))
    np.testing.assert_allclose(both[: len(a)], model.logits(a), atol=1e-5)
    np.testing.assert_allclose(both[len(a) :], model.logits(b), atol=1e-5)
    # a decode step of each sequence in one batch: still each one's own continuation
    step = runner.forward([5, 9], [len(a), len(b)], seq_ids=[0, 1])
    np.testing.assert_allclose(step[0], model.logits([*a, 5])[-1], atol=1e-5)
    np.testing.assert_allclose(step[1], model.logits([*b, 9])[-1], atol=1e-5)
    assert kv.tokens(0) == [*a, 5] and kv.tokens(1) == [*b, 9]


def test_copy_prefix_remove_and_clear():
    from minfer.runtime.forward import ForwardRunner
    from minfer.runtime.kv_cache import KVCache

    model = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=64, threads=1)
    seq = fixture_sequences("llama")[2]
    kv = KVCache(model.hparams, 64, n_seq=2)
    runner = ForwardRunner(model.transformer, model.backend, kv)
    runner.forward(seq[:20], range(20), seq_ids=0)
    kv.copy_prefix(0, 1, 12)  # sequence 1 reuses the first 12 positions, then diverges
    assert kv.tokens(1) == seq[:12]
    tail = runner.forward(seq[12:20], range(12, 20), seq_ids=1)
    np.testing.assert_allclose(tail, fixture_logits("llama", 2)[12:20], atol=1e-4)
    kv.remove(1)
    assert kv.tokens(1) == [] and kv.tokens(0) == seq[:20]
    kv.clear()
    assert kv.tokens(0) == []
    with pytest.raises(BadRequestError, match="holds 0 positions"):
        kv.copy_prefix(0, 1, 5)




def test_a_shared_prefix_is_held_once_and_copied_on_write():
    """Prefix reuse references the blocks that hold the prefix: no rows are copied and the blocks are
    counted once; the first write into a shared block gives the writer a copy of that block alone, the
    other sequence's cells stay as they were, and each sequence's logits are its solo run's, bit for bit.
    Blocks go back to the pool when no sequence holds them."""
    from minfer.backends.cpu.attention import ROW_MAP_BLOCK
    from minfer.runtime.forward import ForwardRunner
    from minfer.runtime.kv_cache import KV_BLOCK, KVCache

    model = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=256, threads=1)
    seq = (fixture_sequences("llama")[2] * 8)[:100]
    solo = model.logits(seq)
    kv = KVCache(model.hparams, 384, n_seq=3)
    runner = ForwardRunner(model.transformer, model.backend, kv)
    runner.forward(seq[:70], range(70), seq_ids=0)
    assert (kv.blocks_in_use, kv.blocks_shared) == (3, 0)  # 70 positions: blocks of 32, 32 and 6
    before = kv.read(0, 70)
    kv.copy_prefix(0, 1, 70)
    assert kv.blocks(1) == kv.blocks(0) and (kv.blocks_in_use, kv.blocks_shared) == (3, 3)
    kv.copy_prefix(0, 2, 40)  # inside block 1: sequence 2 shares blocks 0 and 1
    assert kv.blocks(2) == kv.blocks(0)[:2] and (kv.blocks_in_use, kv.blocks_shared) == (3, 3)
    tail = runner.forward(seq[70:100], range(70, 100), seq_ids=1)  # writes into block 2: copied, then block 3
    assert kv.blocks(1)[:2] == kv.blocks(0)[:2] and kv.blocks(1)[2] != kv.blocks(0)[2]
    assert (kv.blocks_in_use, kv.blocks_shared) == (5, 2)
    assert tail.view(np.uint32).tolist() == solo[70:100].view(np.uint32).tolist()
    mid = runner.forward(seq[40:50], range(40, 50), seq_ids=2)  # writes into block 1: sequence 2's own copy
    assert mid.view(np.uint32).tolist() == solo[40:50].view(np.uint32).tolist()
    assert kv.blocks(2)[0] == kv.blocks(0)[0] and kv.blocks(2)[1] not in kv.blocks(0)
    for (k0, v0), (k1, v1) in zip(before, kv.read(0, 70), strict=True):  # sequence 0's cells untouched
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
    again = runner.forward(seq[70:72], range(70, 72), seq_ids=0)  # and it still continues as its solo run
    assert again.view(np.uint32).tolist() == solo[70:72].view(np.uint32).tolist()
    kv.remove(0)
    assert kv.tokens(1) == seq and kv.blocks_shared == 1  # block 0: sequences 1 and 2
    kv.clear()
    assert (kv.blocks_in_use, kv.blocks_shared) == (0, 0)
    assert not kv.row_map.any()  # every position maps to the null block again
    assert KV_BLOCK % ROW_MAP_BLOCK == 0  # the fast attention takes each block's keys as one run


def test_a_context_shift_of_a_sharing_sequence_leaves_the_other_alone():
    from minfer.runtime.forward import ForwardRunner
    from minfer.runtime.kv_cache import KVCache

    model = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=64, threads=1)
    seq = fixture_sequences("llama")[2][:30]
    kv = KVCache(model.hparams, 128, n_seq=2)
    runner = ForwardRunner(model.transformer, model.backend, kv)
    runner.forward(seq, range(30), seq_ids=0)
    before = kv.read(0, 30)
    kv.copy_prefix(0, 1, 30)
    runner.shift_context(1, n_keep=5, n_discard=12)
    assert kv.tokens(1) == seq[:5] + seq[17:30] and kv.tokens(0) == seq
    for (k0, v0), (k1, v1) in zip(before, kv.read(0, 30), strict=True):
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(v0, v1)
    assert kv.blocks_shared == 0 and kv.blocks_in_use == 2


def test_commit_takes_the_memory_at_creation():
    """A lazy cache (the default) costs resident memory only as positions are written; ``commit=True``
    (the batch server's cache) takes all of it at creation, so serving does not grow it. Measured in a
    fresh interpreter: in this one, memory freed by earlier tests is already resident."""
    import subprocess
    import sys

    script = f"""
import json
from dataclasses import replace
import minfer
from minfer.runtime.kv_cache import slots_kv_cache
from minfer.runtime.kv_cache import KVCache

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

hp = replace(minfer.load({str(fixture_dir("llama") / "model-f32.gguf")!r}, n_ctx=16).hparams, n_layer=4)
n_ctx = 96 * 2**20 // (4 * 2 * hp.n_layer * max(hp.k_width, hp.v_width))  # regions of ~96 MiB in all
grown = {{}}
for name, make in (("lazy", lambda: KVCache(hp, n_ctx)), ("committed", lambda: KVCache(hp, n_ctx, commit=True)),
                   ("server", lambda: slots_kv_cache(hp, n_ctx // 2, 2, scratch=True))):  # 2 slots + scratch: ~72 MiB
    before = resident_mib()
    cache = make()
    grown[name] = resident_mib() - before
    assert not cache.layers[0].k.any()  # zeroed either way
    del cache
print(json.dumps(grown))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    grown = json.loads(out.stdout.strip().splitlines()[-1])
    assert grown["lazy"] < 8, grown
    assert grown["committed"] > 80, grown
    assert grown["server"] > 60, grown

@pytest.mark.parametrize("cache_type", ["f32", "f16", "q8_0"])
def test_committed_regions_share_one_mapping_without_overlap(cache_type):
    """A committed cache's regions are views into one mapping (asked for huge pages): each has the lazy
    cache's shape and type, starts zeroed and on a cache line, and a write to one leaves every other as
    it was; the logits of a forward pass are the lazy cache's, bit for bit."""
    from minfer.runtime.forward import ForwardRunner
    from minfer.runtime.kv_cache import KVCache

    model = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=64)
    lazy, committed = (KVCache(model.hparams, 96, cache_type, n_seq=3, commit=c) for c in (False, True))
    regions = [r for layer in committed.layers for r in (layer.k, layer.v)]
    for a, b in zip(regions, [r for layer in lazy.layers for r in (layer.k, layer.v)], strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and a.flags.c_contiguous and a.ctypes.data % 64 == 0
        assert not a.any()
    regions[1][...] = 1
    assert regions[1].all() and not any(r.any() for i, r in enumerate(regions) if i != 1)
    regions[1][...] = 0
    seq = fixture_sequences("llama")[2][:12]
    got = [ForwardRunner(model.transformer, model.backend, kv).forward(seq, range(12), seq_ids=1)
           for kv in (lazy, committed)]
    assert got[0].view(np.uint32).tolist() == got[1].view(np.uint32).tolist()


def test_position_beyond_a_sequence_is_refused_before_writing():
    from minfer.runtime.forward import ForwardRunner
    from minfer.runtime.kv_cache import KVCache

    model = minfer.load(fixture_dir("llama") / "model-f32.gguf", n_ctx=64)
    kv = KVCache(model.hparams, 64, n_seq=2)  # 32 positions each
    runner = ForwardRunner(model.transformer, model.backend, kv)
    with pytest.raises(ContextOverflowError, match="position 32 .* context of 32 tokens per sequence"):
        runner.forward([1, 2], [31, 32], seq_ids=1)
    assert not kv.layers[0].k.any()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])  # both RoPE layouts; sliding-window layers
@pytest.mark.parametrize("cache_type", ["f32", "q8_0"])
def test_context_shift_keeps_generating(arch, cache_type):
    model = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=32, cache_type=cache_type)
    prompt = fixture_sequences(arch)[1]
    steps = model.engine.run(GenerationRequest(prompt, Sampler(SamplingParams(temperature=0)),
                     max_tokens=96, stop_ids=frozenset(), context_shift=True, n_keep=4))
    assert len([s for s in steps if s.token is not None]) == 96  # 3 x n_ctx, no error
    assert model.kv.tokens(0)[:4] == prompt[:4]  # the kept prefix survives every shift


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_shift_re_rotates_k_rows_to_their_new_positions(arch):
    """Layer 0's K and V rows depend only on the token and its position: after a shift they must equal
    what a fresh pass over the kept tokens writes (deeper layers legitimately differ: their rows were
    computed while the dropped tokens were still visible, which is why a context shift is approximate)."""
    model = minfer.load(fixture_dir(arch) / "model-f32.gguf", n_ctx=64, threads=1)
    seq = fixture_sequences(arch)[2]
    model.runner.forward(seq[:30], range(30))
    model.runner.shift_context(0, n_keep=5, n_discard=12)
    kept = model.kv.tokens(0)
    assert kept == seq[:5] + seq[17:30]
    k_shifted, v_shifted = model.kv.read(0, 18)[0]
    model.logits(kept)
    k_fresh, v_fresh = model.kv.read(0, 18)[0]
    np.testing.assert_allclose(k_shifted, k_fresh, atol=1e-5)
    np.testing.assert_array_equal(v_shifted, v_fresh)


def test_gemma3_shift_rotates_each_layer_with_its_own_rope():
    """Gemma 3's sliding-window layers rotate with base 1e4, its global layer (5) with 1e6 and linear
    scaling x8: a context shift re-rotates every layer's K rows with that layer's own frequencies."""
    from minfer.backends.cpu.reference import rope
    from minfer.graph.ir import RopeMeta, RopeStyle

    model = minfer.load(fixture_dir("gemma3") / "model-f32.gguf", n_ctx=64, threads=1)
    hp = model.hparams
    raw = np.random.default_rng(5).standard_normal((30, hp.k_width)).astype(np.float32)

    def rotated(il, rows, positions):
        meta = RopeMeta(hp.n_head_kv, hp.head_dim_k, hp.n_rot, *hp.layer_rope(il), RopeStyle.NEOX)
        k = raw[rows].copy()
        rope(k, np.asarray(positions), meta, k)
        return k

    zeros = np.zeros((30, hp.v_width), np.float32)
    model.kv.write(0, [(rotated(il, slice(0, 30), range(30)), zeros) for il in range(hp.n_layer)])
    model.kv.record(0, np.arange(30), np.arange(30))
    model.runner.shift_context(0, n_keep=5, n_discard=12)
    for il, (k, _) in enumerate(model.kv.read(0, 18)):
        want = np.concatenate([rotated(il, slice(0, 5), range(5)), rotated(il, slice(17, 30), range(5, 18))])
        np.testing.assert_allclose(k, want, atol=1e-5, err_msg=f"layer {il}")
    # the two kinds of layer really rotate differently
    assert float(np.abs(rotated(0, slice(17, 30), range(5, 18)) - rotated(5, slice(17, 30), range(5, 18))).max()) > 0.1


@pytest.mark.parametrize("cache_type", ["f32", "f16", "q8_0"])
def test_gemma3_sliding_layers_read_only_their_window(cache_type):
    """Past the window, a sliding-window layer's attention reads (and, for q8_0 cells, dequantizes) only
    the rows from the oldest visible one on, rounded down to a multiple of 256 positions; the global layer
    reads them all. Decoding token by token still gives the bits of a prefill, and the reference kernels
    (which read a float32 copy of f16 cells) agree with the fast ones."""
    from minfer.backends.cpu.attention import ATTN_KEY_CHUNK
    from minfer.backends.cpu.backend import WINDOW_ROW_ALIGN

    assert WINDOW_ROW_ALIGN == ATTN_KEY_CHUNK
    path = fixture_dir("gemma3") / "model-f32.gguf"
    seq = np.random.default_rng(3).integers(7, 384, 600).tolist()
    model = minfer.load(path, n_ctx=640, cache_type=cache_type, threads=1)
    full = model.logits(seq)
    reads: dict[int, list[tuple[int, int]]] = {0: [], 5: []}
    for il, seen in reads.items():
        layer = model.kv.layers[il]
        read = layer.cells
        layer.cells = lambda a, b, read=read, seen=seen: (seen.append((a, b)), read(a, b))[1]
    runner = model.runner
    runner.forward(seq[:580], range(580))
    rows = [runner.forward([seq[p]], [p]) for p in range(580, 600)]
    np.testing.assert_array_equal(np.concatenate(rows), full[580:])
    # a single sequence's prefill runs the decode attention kernel over the cells (one kernel compiled,
    # not two): its first token is at position 0, so the sliding layer reads every row too
    prefill = [(0, 580)]
    assert reads[0] == prefill + [(512, p + 1) for p in range(580, 600)]  # p - 5 rounded down to 256
    assert reads[5] == prefill + [(0, p + 1) for p in range(580, 600)]
    reference = minfer.load(path, n_ctx=640, cache_type=cache_type, kernels="reference").logits(seq)
    # f16 / q8_0 cells: the two kernel sets' K/V differ in the last bits, which can round a value to a
    # neighbouring f16 or 8-bit step (measured 1.1e-3 and 0.018 over 600 positions): DESIGN.md's bounds
    bound = {"f32": 1e-4, "f16": 1e-2, "q8_0": 5e-2}[cache_type]
    assert float(np.abs(reference - full).max()) <= bound
