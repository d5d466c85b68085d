"""Attention with key ends: token t reads its sequence's keys ``window_start(pos[t]) .. key_ends[t]``.

Gemma 3 lets an image's tokens attend to each other both ways: an image token at position p of an image
spanning positions s..e sees keys up to e (the rest of the rule, the sliding window's start, follows p).
The compiled kernels (one sequence, a batch mixing sequences, a decode step split by keys, f32 and f16
cells, through a paged row map) are held to the numpy reference and to a float64 softmax written here,
within float32 rounding (1e-5 absolute on O(1) data, as ``tests/test_vec_kernels.py``); with
``key_ends == positions`` to the bits of the call without key ends; and the backend's ATTN node (f32, f16
and q8_0 caches, the fast and reference kernel sets) through a plan built by ``GraphBuilder.attn``.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from minfer.backends.cpu import attention
from minfer.backends.cpu import reference as ref
from minfer.errors import ContextOverflowError
from minfer.graph.ir import AttnMeta, KVMeta, Op

F32 = np.float32
THREADS = tuple(dict.fromkeys((1, min(2, numba.config.NUMBA_NUM_THREADS))))
ATOL = 1e-5

# (positions, image spans (first, last position)): an image in the middle of a prompt (and one across the
# 256-key chunk), an image at a prompt's end, a prefill chunk continuing a sequence
SCENARIOS = {
    "middle": (list(range(300)), [(100, 163), (250, 270)]),
    "end": (list(range(80)), [(40, 79)]),
    "continuing": (list(range(50, 130)), [(60, 90)]),
}


@pytest.fixture
def rng():
    return np.random.default_rng(2024)


def at_threads(n: int, fn):
    old = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        return fn()
    finally:
        numba.set_num_threads(old)


def key_ends_for(positions: np.ndarray, spans) -> np.ndarray:
    """Each token's last key position: its own, or its image's last one."""
    ends = positions.copy()
    for s, e in spans:
        ends[(positions >= s) & (positions <= e)] = e
    return ends


def direct_attention(q, k, v, pos, ends, n_head, n_head_kv, hdk, hdv, scale, window=0) -> np.ndarray:
    """float64 softmax attention, token by token: token t's query heads read keys lo..ends[t] of ``k``/``v``
    (float32 rows), lo = 0 or, in a sliding-window layer, pos[t] - window + 1."""
    group = n_head // n_head_kv
    out = np.empty((len(pos), n_head * hdv), np.float64)
    for t in range(len(pos)):
        p, e = int(pos[t]), int(ends[t])
        lo = max(0, p - window + 1) if window > 0 else 0
        kk = k[lo : e + 1].astype(np.float64).reshape(e + 1 - lo, n_head_kv, hdk)
        vv = v[lo : e + 1].astype(np.float64).reshape(e + 1 - lo, n_head_kv, hdv)
        qq = q[t].astype(np.float64).reshape(n_head_kv, group, hdk)
        s = np.einsum("ngd,jnd->ngj", qq, kk) * scale
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        out[t] = np.einsum("ngj,jnd->ngd", w, vv).reshape(-1)
    return out


def _case(rng, n_head, n_head_kv, hd, positions, ends, n_ctx, window=0, cells=F32):
    """q and K/V regions (in ``cells``) holding data where some token reads, NaN and 1e30 elsewhere (after
    the last key end; before the first sliding window): garbage that must never be read."""
    pos = np.asarray(positions, np.int32)
    q = rng.standard_normal((len(pos), n_head * hd)).astype(F32)
    k = rng.standard_normal((n_ctx, n_head_kv * hd)).astype(F32)
    v = rng.standard_normal((n_ctx, n_head_kv * hd)).astype(F32)
    end = int(ends.max()) + 1
    start = max(0, int(pos.min()) - window + 1) if window > 0 else 0
    for a, b in ((end, n_ctx), (0, start)):
        k[a:b:2], v[a:b:2] = np.nan, np.nan
        k[a + 1 : b : 2], v[a + 1 : b : 2] = 1e30, -1e30
    with np.errstate(over="ignore"):  # 1e30 turns into inf in f16 cells: still never read
        return q, k.astype(cells), v.astype(cells), pos


def _fast(q, k, v, pos, geometry, window=0, row_map=None, key_ends=None) -> np.ndarray:
    out = np.full((len(pos), geometry[0] * geometry[3]), np.nan, F32)
    attention.attention(q, k, v, pos, *geometry, out, window, row_map, key_ends)
    return out


def _reference(q, k, v, pos, geometry, window=0, key_ends=None) -> np.ndarray:
    out = np.empty((len(pos), geometry[0] * geometry[3]), F32)
    ref.attention(q, k.astype(F32), v.astype(F32), pos, AttnMeta(0, *geometry, window), out, key_ends)
    return out


# ------------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("window", [0, 80])
@pytest.mark.parametrize("cells", [F32, np.float16])
@pytest.mark.parametrize(("n_head", "n_head_kv", "hd"), [(6, 2, 32), (4, 1, 72)])
def test_kernel_matches_reference_and_direct_softmax(rng, scenario, window, cells, n_head, n_head_kv, hd):
    positions, spans = SCENARIOS[scenario]
    pos = np.asarray(positions, np.int32)
    ends = key_ends_for(pos, spans)
    q, k, v, pos = _case(rng, n_head, n_head_kv, hd, pos, ends, int(ends.max()) + 9, window, cells)
    geometry = (n_head, n_head_kv, hd, hd, 1 / math.sqrt(hd))
    runs = [at_threads(n, lambda: _fast(q, k, v, pos, geometry, window, key_ends=ends)) for n in THREADS]
    got = runs[0]
    for other in runs[1:]:
        np.testing.assert_array_equal(other, got)  # the thread count changes no bit
    assert np.isfinite(got).all()  # the garbage after the key ends (and before the window) never leaks
    expect = _reference(q, k, v, pos, geometry, window, ends)
    np.testing.assert_allclose(got, expect, rtol=0, atol=ATOL)
    k32, v32 = k.astype(F32), v.astype(F32)
    direct = direct_attention(q, k32, v32, pos, ends, *geometry, window)
    np.testing.assert_allclose(got, direct, rtol=0, atol=ATOL)
    np.testing.assert_allclose(expect, direct, rtol=0, atol=ATOL)
    # the image tokens before their image's last one see keys a causal mask hides: their rows differ
    image = ends > pos
    causal = _fast(q, k, v, pos, geometry, window)
    assert not np.allclose(got[image], causal[image], atol=1e-3)
    np.testing.assert_array_equal(got[~image], causal[~image])  # a text token's row is the causal one's


@pytest.mark.parametrize("window", [0, 80])
def test_a_token_alone_gives_its_prefill_rows_bits(rng, window):
    """One token's call (a decode step, split by keys when its window starts at row 0) reads keys up to its
    key end and gives the bits of its row in the whole prompt's call, at any thread count."""
    n_head, n_head_kv, hd = 6, 2, 64
    positions, spans = SCENARIOS["middle"]
    pos = np.asarray(positions, np.int32)
    ends = key_ends_for(pos, spans)
    q, k, v, pos = _case(rng, n_head, n_head_kv, hd, pos, ends, 320, window)
    geometry = (n_head, n_head_kv, hd, hd, 0.125)
    prefill = _fast(q, k, v, pos, geometry, window, key_ends=ends)
    for t in (0, 100, 127, 128, 162, 163, 250, 255, 256, 270, 299):
        for n in THREADS:
            one = at_threads(n, lambda t=t: _fast(q[t : t + 1], k, v, pos[t : t + 1], geometry, window,
                                                  key_ends=ends[t : t + 1]))
            np.testing.assert_array_equal(one[0], prefill[t], err_msg=f"token {t}")
        if window == 0:  # the split by keys called directly, told of 1 to 16 threads
            for n_threads in (1, 3, 16):
                split = np.full_like(prefill[:1], np.nan)
                code = attention._attention_split_by_keys(
                    q[t : t + 1], k, v, np.arange(len(k), dtype=np.int32), pos[t : t + 1], *geometry, n_threads,
                    split, ends[t : t + 1],
                )
                assert code == -1
                np.testing.assert_array_equal(split[0], prefill[t], err_msg=f"token {t}, {n_threads} threads")


@pytest.mark.parametrize("window", [0, 40, 300])
def test_key_ends_equal_to_the_positions_change_no_bit(rng, window):
    """``key_ends = positions`` is causal attention: the same bits as the call without key ends, in every
    path (prefill, decode, a batch mixing sequences, the reference)."""
    n_head, n_head_kv, hd = 6, 2, 32
    pos = np.arange(290, dtype=np.int32)
    q, k, v, pos = _case(rng, n_head, n_head_kv, hd, pos, pos, 300, window)
    geometry = (n_head, n_head_kv, hd, hd, 1 / math.sqrt(hd))
    same = pos.copy()
    np.testing.assert_array_equal(_fast(q, k, v, pos, geometry, window, key_ends=same),
                                  _fast(q, k, v, pos, geometry, window))
    for t in (0, 255, 289):
        np.testing.assert_array_equal(
            _fast(q[t : t + 1], k, v, pos[t : t + 1], geometry, window, key_ends=same[t : t + 1]),
            _fast(q[t : t + 1], k, v, pos[t : t + 1], geometry, window),
        )
    np.testing.assert_array_equal(_reference(q, k, v, pos, geometry, window, same),
                                  _reference(q, k, v, pos, geometry, window))
    # two sequences side by side
    k2, v2 = np.concatenate([k, k[::-1]]), np.concatenate([v, v[::-1]])
    rows = np.concatenate([pos, pos + len(k)]).astype(np.int32)
    q2, pos2 = np.concatenate([q, q[::-1]]), np.concatenate([pos, pos]).astype(np.int32)
    a, b = (np.empty((len(rows), n_head * hd), F32) for _ in range(2))
    attention.attention_rows(q2, k2, v2, pos2, rows, *geometry, a, window, None, pos2.copy())
    attention.attention_rows(q2, k2, v2, pos2, rows, *geometry, b, window)
    np.testing.assert_array_equal(a, b)


def _scatter_blocks(rng, regions, n_seq, cap, block=32):
    """Regions ``[n_seq * cap, width]`` moved into blocks of ``block`` rows in a shuffled order in a pool
    with NaN between them, as the paged KV cache places them: (the pooled regions, virtual row -> pool row)."""
    per_seq = -(-cap // block)
    order = rng.permutation(n_seq * per_seq + 3) + 1
    row_map = np.empty(n_seq * cap, np.int32)
    for s in range(n_seq):
        for b in range(per_seq):
            n = min(block, cap - b * block)
            start = int(order[s * per_seq + b]) * block
            row_map[s * cap + b * block : s * cap + b * block + n] = np.arange(start, start + n)
    pooled = []
    for region in regions:
        p = np.full(((len(order) + 1) * block, region.shape[1]), np.nan, region.dtype)
        p[row_map] = region
        pooled.append(p)
    return pooled, row_map


@pytest.mark.parametrize("cells", [F32, np.float16])
@pytest.mark.parametrize("window", [0, 80])
def test_a_batch_mixing_sequences_through_a_row_map(rng, cells, window):
    """One ``attention_rows`` call over a batch of three sequences of a paged cache (an image in the middle
    of one prompt, an image at the end of another, a text decode step): each token gets the bits of its
    sequence attended alone, and the float64 softmax's values."""
    n_head, n_head_kv, hd = 6, 2, 32
    cap = 320
    batch = [  # (sequence, positions, image spans)
        (0, list(range(0, 300)), [(100, 163), (250, 270)]),
        (1, list(range(20, 90)), [(50, 89)]),
        (2, [150], []),
    ]
    seq = np.concatenate([[s] * len(p) for s, p, _ in batch])
    pos = np.concatenate([p for _, p, _ in batch]).astype(np.int32)
    ends = np.concatenate([key_ends_for(np.asarray(p, np.int32), sp) for _, p, sp in batch]).astype(np.int32)
    rows = (seq * cap + pos).astype(np.int32)
    k = rng.standard_normal((3 * cap, n_head_kv * hd)).astype(F32)
    v = rng.standard_normal((3 * cap, n_head_kv * hd)).astype(F32)
    for s in range(3):  # rows after a sequence's last key end hold garbage
        last = int(ends[seq == s].max())
        k[s * cap + last + 1 : (s + 1) * cap], v[s * cap + last + 1 : (s + 1) * cap] = np.nan, 1e30
    with np.errstate(over="ignore"):
        k, v = k.astype(cells), v.astype(cells)
    (k_pool, v_pool), row_map = _scatter_blocks(rng, [k, v], 3, cap)
    q = rng.standard_normal((len(pos), n_head * hd)).astype(F32)
    geometry = (n_head, n_head_kv, hd, hd, 1 / math.sqrt(hd))
    for n in THREADS:
        got = np.full((len(pos), n_head * hd), np.nan, F32)
        at_threads(n, lambda got=got: attention.attention_rows(q, k_pool, v_pool, pos, rows, *geometry, got, window,
                                                               row_map, ends))
        for s in range(3):
            idx = np.flatnonzero(seq == s)
            ks, vs = k[s * cap : (s + 1) * cap], v[s * cap : (s + 1) * cap]
            alone = _fast(q[idx], ks, vs, pos[idx], geometry, window, key_ends=ends[idx])
            np.testing.assert_array_equal(got[idx], alone, err_msg=f"sequence {s} at {n} threads")
            direct = direct_attention(q[idx], ks.astype(F32), vs.astype(F32), pos[idx], ends[idx], *geometry, window)
            np.testing.assert_allclose(got[idx], direct, rtol=0, atol=ATOL)
    # told of 64 threads, the kernel splits each kv group's heads over units: still the same bits
    split = np.full_like(got, np.nan)
    k_cells, v_cells = attention._kv_cells(k_pool, v_pool)
    code = attention._attn_rows_kernel(q, k_cells, v_cells, row_map, pos, rows, *geometry, 64, window, split, ends)
    assert code == -1
    np.testing.assert_array_equal(split, got)


def test_key_end_errors(rng):
    q, k, v, pos = _case(rng, 4, 2, 8, [3, 5], np.array([3, 5]), 8)
    geometry = (4, 2, 8, 8, 1.0)
    out = np.empty((2, 32), F32)
    with pytest.raises(ValueError, match="token 1's key end 4 is before its position 5"):
        attention.attention(q, k, v, pos, *geometry, out, key_ends=np.array([3, 4], np.int32))
    with pytest.raises(ValueError, match="token 0's key end 2 is before its position 3"):
        attention.attention(q[:1], k, v, pos[:1], *geometry, out[:1], key_ends=np.array([2], np.int32))
    with pytest.raises(ValueError, match="token 0's key end -1 is before its position 3"):
        attention.attention(q[:1], k, v, pos[:1], *geometry, out[:1], key_ends=np.array([-1], np.int32))
    with pytest.raises(ContextOverflowError, match="key end 8 \\(token 1, position 5\\) is outside"):
        attention.attention(q, k, v, pos, *geometry, out, key_ends=np.array([3, 8], np.int32))
    with pytest.raises(ContextOverflowError, match="key end 9 \\(token 0, position 3\\) is outside"):
        attention.attention(q[:1], k, v, pos[:1], *geometry, out[:1], key_ends=np.array([9], np.int32))
    with pytest.raises(ValueError, match="do not fit"):
        attention.attention(q, k, v, pos, *geometry, out, key_ends=np.array([5], np.int32))
    with pytest.raises(ValueError, match="token 1's key end 4 is before its position 5"):
        ref.attention(q, k, v, pos, AttnMeta(0, *geometry), out, np.array([3, 4], np.int32))
    # a batch mixing sequences: sequence 1 starts at row 4 of 8, so its position 2 may read up to position 3
    rows = np.array([3, 6], np.int32)
    pos2 = np.array([3, 2], np.int32)
    attention.attention_rows(q, k, v, pos2, rows, *geometry, out, 0, None, np.array([3, 3], np.int32))
    with pytest.raises(ContextOverflowError, match="key end 4 \\(token 1, position 2\\) is outside the KV regions "
                                                   "of 4 positions"):
        attention.attention_rows(q, k, v, pos2, rows, *geometry, out, 0, None, np.array([3, 4], np.int32))
    with pytest.raises(ValueError, match="token 1's key end 1 is before its position 2"):
        attention.attention_rows(q, k, v, pos2, rows, *geometry, out, 0, None, np.array([3, 1], np.int32))


# ------------------------------------------------------------------------------------------ the graph


def _hparams(n_head: int, n_head_kv: int, hd: int):
    from minfer.models.hparams import HParams

    return HParams("test", 16, 512, n_head * hd, 1, n_head, n_head_kv, 4, hd, hd, hd, 10000.0, 1.0, 1e-6,
                   1 / math.sqrt(hd))


def _table(rng, name: str, n: int, width: int):
    from minfer.formats.quants import GGMLType
    from minfer.formats.tensors import WeightTensor

    a = rng.standard_normal((n, width)).astype(F32)
    return a, WeightTensor(name, GGMLType.F32, (n, width), a.view(np.uint8))


def _attn_graph(n: int, n_head: int, n_head_kv: int, hd: int, n_ctx: int, tables, window: int, key_ends: bool):
    """tokens -> q, k, v rows of three tables (token i's rows: i-th of each, exact) -> the layer's KV store
    -> attention, with a ``key_ends`` input or without."""
    from minfer.graph.builder import GraphBuilder

    b = GraphBuilder()
    tokens, positions, rows = b.input("tokens", n), b.input("positions", n), b.input("rows", n)
    q, k, v = (b.get_rows(b.weight(t), tokens) for t in tables)
    meta = KVMeta(0, n_head_kv * hd, n_head_kv * hd)
    kv = b.kv_load(b.kv_store(k, v, rows, meta, n_ctx))
    ends = b.input("key_ends", n) if key_ends else None
    out = b.attn(q, kv, positions, rows, AttnMeta(0, n_head, n_head_kv, hd, hd, 1 / math.sqrt(hd), window),
                 key_ends=ends)
    assert out.op is Op.ATTN and len(out.inputs) == (5 if key_ends else 4)
    return b.build(out)


@pytest.mark.parametrize("cache_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("window", [0, 48])
@pytest.mark.parametrize("n_seq", [1, 2])
def test_an_attn_node_with_key_ends_through_a_plan(rng, cache_type, window, n_seq):
    """The ATTN node of ``GraphBuilder.attn(..., key_ends=...)`` in a plan over a paged KV cache: a prompt
    pass (an image in the middle of sequence 0's prompt, one at the end of sequence 1's) then a decode step
    of each sequence; the fast and the reference kernel sets agree with the float64 softmax over the K/V
    the cache holds; and the same plan given ``key_ends = positions`` gives the bits of the graph without
    key ends."""
    from minfer.backends.cpu.backend import CPUBackend
    from minfer.graph.plan import Plan
    from minfer.runtime.kv_cache import KVCache

    n_head, n_head_kv, hd, cap = 4, 2, 32, 128
    prompts = [(list(range(0, 70)), [(20, 51)]), (list(range(0, 40)), [(8, 39)])][:n_seq]
    steps = []  # (seq ids, positions, key ends) of each pass
    seq = np.concatenate([[s] * len(p) for s, (p, _) in enumerate(prompts)])
    pos = np.concatenate([p for p, _ in prompts]).astype(np.int32)
    ends = np.concatenate([key_ends_for(np.asarray(p, np.int32), sp) for p, sp in prompts]).astype(np.int32)
    steps.append((seq, pos, ends))
    last = np.array([len(p) for p, _ in prompts], np.int32)
    steps.append((np.arange(n_seq), last, last.copy()))
    n_tok = sum(len(s[0]) for s in steps)
    tables = [_table(rng, name, n_tok, n_head * hd if name == "q" else n_head_kv * hd) for name in "qkv"]
    results = {}
    for kernels in ("fast", "reference"):
        backend = CPUBackend(threads=2, kernels=kernels)
        kv = KVCache(_hparams(n_head, n_head_kv, hd), n_seq * cap, cache_type, n_seq=n_seq)
        first = 0
        outs = []
        for seq, pos, ends in steps:
            n = len(pos)
            graph = _attn_graph(n, n_head, n_head_kv, hd, n_seq * cap, [t for _, t in tables], window, True)
            plan = Plan(graph, backend, kv.layers)
            ids = np.arange(first, first + n, dtype=np.int32)
            plan.inputs["tokens"][:] = ids
            plan.inputs["positions"][:] = pos
            plan.inputs["rows"][:] = kv.rows(pos, seq)
            plan.inputs["key_ends"][:] = ends
            with backend.running():
                got = plan.run().copy()
            outs.append(got)
            assert np.isfinite(got).all()
            # the float64 softmax over the K/V rows as the cache holds them (f16 / q8_0 rounded)
            q = tables[0][0][ids]
            for s in range(n_seq):
                idx = np.flatnonzero(seq == s)
                k, v = (np.array(a) for a in kv.layers[0].window(s * cap, s * cap + int(ends[idx].max()) + 1))
                direct = direct_attention(q[idx], k, v, pos[idx], ends[idx], n_head, n_head_kv, hd, hd,
                                          1 / math.sqrt(hd), window)
                np.testing.assert_allclose(got[idx], direct, rtol=0, atol=ATOL, err_msg=f"{kernels}, sequence {s}")
            if kernels == "fast":  # key ends = positions: the bits of the graph without key ends
                plan.inputs["key_ends"][:] = pos
                with backend.running():
                    causal_ends = plan.run().copy()
                plain = Plan(_attn_graph(n, n_head, n_head_kv, hd, n_seq * cap, [t for _, t in tables], window,
                                         False), backend, kv.layers)
                for name in ("tokens", "positions", "rows"):
                    plain.inputs[name][:] = plan.inputs[name]
                with backend.running():
                    np.testing.assert_array_equal(plain.run(), causal_ends)
                image = ends > pos
                if image.any():
                    assert not np.allclose(causal_ends[image], got[image], atol=1e-3)
            first += n
        results[kernels] = outs
        backend.close()
    for fast, reference in zip(results["fast"], results["reference"], strict=True):
        np.testing.assert_allclose(fast, reference, rtol=0, atol=ATOL)
