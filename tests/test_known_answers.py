"""The seeds' worked examples as known-answer tests of the reference ops.

Where the book's prose rounds or slips, the expected values here are computed from its own formulas
(noted at each test); the 2x2 example of the learning page is exact to the digits it prints.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.backends.cpu import reference as ref
from minfer.errors import ContextOverflowError
from minfer.graph.ir import AttnMeta, RopeMeta, RopeStyle


def test_rms_norm_of_1_2_3_4():
    x = np.array([[1, 2, 3, 4]], dtype=np.float32)
    out = np.empty_like(x)
    ref.rms_norm(x, eps=0.0, width=4, out=out)
    # mean(x^2) = 7.5, scale = 1/sqrt(7.5) = 0.365...
    np.testing.assert_allclose(out[0], [0.365148, 0.730297, 1.095445, 1.460593], atol=1e-6)
    np.testing.assert_allclose(out[0], x[0] / math.sqrt(7.5), rtol=2.5e-7)  # within an f32 ulp


def test_rms_norm_accumulates_in_float64():
    # 1e4-scale values: an f32 running sum of squares would drift; the result must match f64 math
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 4096)) * 1e4).astype(np.float32)
    out = np.empty_like(x)
    ref.rms_norm(x, 1e-5, 4096, out)
    expect = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, expect, rtol=2e-7)


@pytest.mark.parametrize("style", [RopeStyle.NORMAL, RopeStyle.NEOX])
def test_rope_worked_example(style):
    # hd = 4, base = 1e4, token at pos = 2. freq_i = 1 / base^(2i/hd) = [1, 1e-2]. (The book's prose
    # says [1, 1e-1] and "10x slower"; its own formula, which HF and llama.cpp use, gives 1e-2.)
    meta = RopeMeta(n_head=1, head_dim=4, n_rot=4, freq_base=1e4, freq_scale=1.0, style=style)
    np.testing.assert_allclose(ref.rope_freqs(meta), [1.0, 1e-2])
    x = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)
    out = np.empty_like(x)
    ref.rope(x, np.array([2]), meta, out)
    pairs = [(0, 1), (2, 3)] if style is RopeStyle.NORMAL else [(0, 2), (1, 3)]
    for (i0, i1), angle in zip(pairs, [2.0, 0.02], strict=True):
        x0, x1 = x[0, i0], x[0, i1]
        assert out[0, i0] == pytest.approx(x0 * math.cos(angle) - x1 * math.sin(angle), abs=1e-6)
        assert out[0, i1] == pytest.approx(x0 * math.sin(angle) + x1 * math.cos(angle), abs=1e-6)


def test_rope_relative_property():
    # q at m and k at n: the dot product depends only on m - n
    meta = RopeMeta(n_head=1, head_dim=8, n_rot=8, freq_base=1e4, freq_scale=1.0, style=RopeStyle.NEOX)
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 1, 8)).astype(np.float32)

    def rotated_dot(m, n):
        qo, ko = np.empty_like(q), np.empty_like(k)
        ref.rope(q, np.array([m]), meta, qo)
        ref.rope(k, np.array([n]), meta, ko)
        return float(qo[0] @ ko[0])

    assert rotated_dot(5, 2) == pytest.approx(rotated_dot(13, 10), abs=1e-5)


def _one_head(hd: int, n_ctx: int) -> tuple[AttnMeta, np.ndarray, np.ndarray]:
    meta = AttnMeta(layer=0, n_head=1, n_head_kv=1, head_dim_k=hd, head_dim_v=hd, scale=1 / math.sqrt(hd))
    return meta, np.zeros((n_ctx, hd), np.float32), np.zeros((n_ctx, hd), np.float32)


def _attend(meta, K, V, q, pos):
    out = np.empty((len(pos), meta.n_head * meta.head_dim_v), np.float32)
    ref.attention(np.asarray(q, np.float32), K, V, np.asarray(pos), meta, out)
    return out


def test_attention_prefill_example():
    # the Rust chapter's example: hd_kv = 4, scale 0.5, region sized for 3, query at pos 1
    meta, K, V = _one_head(4, 3)
    k = np.array([[1, 0, 0, 0], [0, 1, 0, 0]], np.float32)
    v = np.array([[1, 2, 0, 0], [3, 4, 0, 0]], np.float32)
    ref.kv_store(k, v, np.array([0, 1]), K, V, layer=0)
    out = _attend(meta, K, V, [[1, 1, 0, 0]], [1])
    np.testing.assert_allclose(out[0], [2.0, 3.0, 0.0, 0.0], atol=1e-6)
    # q = [1,0,0,0]: scores [0.5, 0] after scale -> softmax [0.6225, 0.3775] (the prose's [0.73, 0.27]
    # is softmax of the unscaled scores)
    w0 = 1 / (1 + math.exp(-0.5))
    out = _attend(meta, K, V, [[1, 0, 0, 0]], [1])
    np.testing.assert_allclose(out[0], w0 * v[0] + (1 - w0) * v[1], atol=1e-6)


def test_attention_decode_step_example():
    meta, K, V = _one_head(4, 3)
    ref.kv_store(np.array([[1, 0, 0, 0], [0, 1, 0, 0]], np.float32),
                 np.array([[1, 2, 0, 0], [3, 4, 0, 0]], np.float32), np.array([0, 1]), K, V, layer=0)
    # decode: one new row at position 2, the window grows to 3
    ref.kv_store(np.array([[1, 1, 0, 0]], np.float32), np.array([[5, 0, 0, 0]], np.float32), np.array([2]), K, V, 0)
    out = _attend(meta, K, V, [[0, 1, 1, 0]], [2])
    e = np.exp([0.0, 0.5, 0.5])
    w = e / e.sum()  # [0.2327, 0.3837, 0.3837] (the prose rounds to [0.27, 0.37, 0.37])
    np.testing.assert_allclose(out[0], w[0] * V[0] + w[1] * V[1] + w[2] * V[2], atol=1e-6)
    np.testing.assert_allclose(out[0], [3.301906, 2.0, 0, 0], atol=1e-5)


def test_learning_page_2x2_causal_example():
    meta, K, V = _one_head(2, 2)
    q = np.eye(2, dtype=np.float32)
    ref.kv_store(q, np.array([[10, 0], [0, 20]], np.float32), np.array([0, 1]), K, V, layer=0)
    out = _attend(meta, K, V, q, [0, 1])
    np.testing.assert_allclose(out, [[10, 0], [3.3023846, 13.395231]], rtol=1e-6)
    scores = (q @ K.T) * np.float32(1 / math.sqrt(2))
    scores[0, 1] = -np.inf
    weights = ref.softmax_rows(scores)
    np.testing.assert_allclose(weights, [[1, 0], [0.33023846, 0.66976154]], rtol=1e-6)
    assert weights[0, 1] == 0.0  # masked weight exactly zero, never NaN


def test_masked_rows_never_leak_or_nan():
    # garbage (inf/nan) in a cache row beyond the window must not reach the output
    meta, K, V = _one_head(2, 4)
    ref.kv_store(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), np.array([0, 1]), K, V, 0)
    K[3], V[3] = 1e30, 1e30
    out = _attend(meta, K, V, [[1, 1], [1, 1]], [0, 1])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.ones((2, 2)))


def test_gqa_head_mapping():
    # 4 query heads share 2 kv heads: head h reads kv head h // 2; distinct queries give distinct outputs
    meta = AttnMeta(layer=0, n_head=4, n_head_kv=2, head_dim_k=2, head_dim_v=2, scale=1.0)
    K = np.zeros((2, 4), np.float32)
    V = np.zeros((2, 4), np.float32)
    ref.kv_store(np.array([[1, 0, 0, 1], [0, 1, 1, 0]], np.float32),
                 np.array([[1, 0, 5, 0], [0, 1, 0, 5]], np.float32), np.array([0, 1]), K, V, 0)
    q = np.array([[9, 0, 0, 9, 9, 0, 0, 9]], np.float32)
    out = _attend(meta, K, V, q, [1]).reshape(4, 2)
    np.testing.assert_allclose(out[0], [1, 0], atol=1e-3)  # kv head 0, matches key 0
    np.testing.assert_allclose(out[1], [0, 1], atol=1e-3)  # kv head 0, matches key 1
    np.testing.assert_allclose(out[2], [0, 5], atol=1e-3)  # kv head 1, matches key 1
    np.testing.assert_allclose(out[3], [5, 0], atol=1e-3)  # kv head 1, matches key 0


def test_kv_store_refuses_position_outside_context():
    K = np.zeros((4, 2), np.float32)
    V = np.zeros((4, 2), np.float32)
    with pytest.raises(ContextOverflowError, match="position 4"):
        ref.kv_store(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32), np.array([3, 4]), K, V, 0)
    # nothing was written: the check runs before any row moves
    assert not K.any()
