"""The compiled encoder kernels (``backends/cpu/encoder_kernels.py``) against their numpy references.

Tolerances, and why:
* LayerNorm: 1e-6 relative (measured: bit-identical): only the float64 sums are added in another order.
* GELU (erf): 1e-6 relative (measured: bit-identical): the same float64 expression, rounded once.
* attention: 1e-6 on O(1) data: the dot products and the weighted sum of V are float32 sums in another
  order than BLAS's, exp differs by up to 3 ulp.
And what the reference cannot say: a sequence's output bits do not depend on the pass it is in, nor on the
thread count.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

from minfer.backends.cpu import encoder_kernels as enc
from minfer.backends.cpu import reference as ref
from minfer.graph.ir import AttnMeta, Op

F32 = np.float32
MAX_THREADS = numba.config.NUMBA_NUM_THREADS


def at_threads(n: int, fn):
    old = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        return fn()
    finally:
        numba.set_num_threads(old)


@pytest.fixture
def rng():
    return np.random.default_rng(2024)


def _spans(lengths: list[int]) -> np.ndarray:
    starts = np.cumsum([0, *lengths[:-1]])
    return np.repeat(starts, lengths).astype(np.int32)


def _qkv(rng, t: int, meta: AttnMeta) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = rng.standard_normal((t, meta.n_head * meta.head_dim_k)).astype(F32)
    k = rng.standard_normal((t, meta.n_head_kv * meta.head_dim_k)).astype(F32)
    v = rng.standard_normal((t, meta.n_head_kv * meta.head_dim_v)).astype(F32)
    return q, k, v


def _attend(q, k, v, spans, meta) -> np.ndarray:
    out = np.full((q.shape[0], meta.n_head * meta.head_dim_v), np.nan, F32)
    enc.encoder_attention(q, k, v, spans, meta, out)
    return out


# --- LayerNorm ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 8), (1, 1), (3, 7), (5, 384), (enc.PARALLEL_ROWS + 3, 100), (40, 17)])
@pytest.mark.parametrize("eps", [1e-12, 1e-5])
def test_layer_norm_matches_reference(rng, shape, eps):
    x = (rng.standard_normal(shape) * 2 + 3).astype(F32)  # an offset mean: the variance is a difference
    gain = rng.standard_normal(shape[1]).astype(F32)
    bias = rng.standard_normal(shape[1]).astype(F32)
    want, got = np.empty_like(x), np.empty_like(x)
    ref.layer_norm(x, gain, bias, eps, want)
    enc.layer_norm(x, gain, bias, eps, got)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    gain.flags.writeable = bias.flags.writeable = False  # float32 in a file: a view of its read-only mapping
    inplace = x.copy()
    enc.layer_norm(inplace, gain, bias, eps, inplace)
    np.testing.assert_array_equal(inplace, got)


def test_layer_norm_rejects_shapes():
    x = np.ones((2, 8), F32)
    with pytest.raises(ValueError, match="layer_norm"):
        enc.layer_norm(x, np.ones(7, F32), np.ones(8, F32), 1e-5, np.empty_like(x))


# --- GELU (erf) ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (3, 13), (enc.PARALLEL_ROWS * 2 + 1, 37), (2, 1536)])
def test_gelu_erf_matches_reference(rng, shape):
    x = (rng.standard_normal(shape) * 4).astype(F32)
    if x.size >= 3:
        x.flat[:3] = [0.0, -12.0, 12.0]
    want, got = np.empty_like(x), np.empty_like(x)
    ref.gelu_erf(x, want)
    enc.gelu_erf(x, got)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    inplace = x.copy()
    enc.gelu_erf(inplace, inplace)
    np.testing.assert_array_equal(inplace, got)


# --- attention ----------------------------------------------------------------------------------------------

CASES = [
    # n_head, n_head_kv, head_dim_k, head_dim_v, sequence lengths
    (12, 12, 32, 32, [8, 256, 31, 1, 17, 64]),  # all-MiniLM-L6-v2's heads
    (4, 2, 16, 16, [1]),  # T = 1, GQA
    (6, 2, 20, 12, [5, 9, 3, 40]),  # widths past a multiple of 8 (V: the 8-wide columns and one by one)
    (4, 1, 8, 24, [7, 33]),  # V: 16 columns then 8
    (3, 3, 7, 5, [2, 3, 1]),  # every width below 8
    (4, 2, 72, 72, [300, 5, 257, 2]),  # SigLIP's head width; sequences from LONG_SEQUENCE take the float GEMM
]


@pytest.mark.parametrize("n_head,n_head_kv,dk,dv,lengths", CASES)
def test_encoder_attention_matches_reference(rng, n_head, n_head_kv, dk, dv, lengths):
    meta = AttnMeta(0, n_head, n_head_kv, dk, dv, dk**-0.5)
    spans = _spans(lengths)
    q, k, v = _qkv(rng, len(spans), meta)
    want = np.empty((len(spans), n_head * dv), F32)
    ref.encoder_attention(q, k, v, spans, meta, want)
    np.testing.assert_allclose(_attend(q, k, v, spans, meta), want, rtol=1e-6, atol=1e-6)


def test_large_scores_are_stable(rng):
    """Scores far from 0 (subtract the max) and all of one sign: no overflow, no 0/0."""
    meta = AttnMeta(0, 2, 2, 16, 16, 1.0)
    spans = _spans([9, 20])
    q, k, v = _qkv(rng, len(spans), meta)
    q *= 30
    want = np.empty((len(spans), 32), F32)
    ref.encoder_attention(q, k, v, spans, meta, want)
    got = _attend(q, k, v, spans, meta)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_sequence_alone_gives_the_bits_it_gives_in_a_bigger_pass(rng):
    meta = AttnMeta(0, 12, 4, 32, 32, 32**-0.5)
    lengths = [17, 3, 64, 1, 40, 128, 9, enc.LONG_SEQUENCE + 3, 2]  # (one long sequence: the GEMM path)
    spans = _spans(lengths)
    q, k, v = _qkv(rng, len(spans), meta)
    together = _attend(q, k, v, spans, meta)  # parallel (the whole pass is much work)
    a = 0
    for n in lengths:  # the short ones alone take the serial kernel
        alone = _attend(q[a : a + n].copy(), k[a : a + n].copy(), v[a : a + n].copy(), np.zeros(n, np.int32), meta)
        assert alone.tobytes() == together[a : a + n].tobytes(), n
        a += n


@pytest.mark.skipif(MAX_THREADS < 2, reason="needs two numba threads")
def test_encoder_kernels_give_the_same_bits_at_any_thread_count(rng):
    meta = AttnMeta(0, 12, 12, 32, 32, 32**-0.5)
    spans = _spans([32] * 20 + [7, 100, enc.LONG_SEQUENCE + 40])
    q, k, v = _qkv(rng, len(spans), meta)
    one = at_threads(1, lambda: _attend(q, k, v, spans, meta))
    two = at_threads(2, lambda: _attend(q, k, v, spans, meta))
    assert one.tobytes() == two.tobytes()
    x = rng.standard_normal((64, 384)).astype(F32)
    g, b = rng.standard_normal(384).astype(F32), rng.standard_normal(384).astype(F32)

    def both():
        ln, ge = np.empty_like(x), np.empty_like(x)
        enc.layer_norm(x, g, b, 1e-12, ln)
        enc.gelu_erf(x, ge)
        return ln, ge

    for a, c in zip(at_threads(1, both), at_threads(2, both), strict=True):
        assert a.tobytes() == c.tobytes()


def test_non_contiguous_operands(rng):
    """V and out read eight floats at a time: column slices (a fused QKV's) are copied, same results."""
    meta = AttnMeta(0, 4, 2, 8, 8, 0.3)
    spans = _spans([5, 11])
    q, k, v = _qkv(rng, len(spans), meta)
    want = _attend(q, k, v, spans, meta)
    qkv = np.concatenate([q, k, v], axis=1)
    out = np.zeros((len(spans), 64), F32)
    enc.encoder_attention(qkv[:, :32], qkv[:, 32:48], qkv[:, 48:], spans, meta, out[:, ::2])
    assert out[:, ::2].tobytes() == want.tobytes()


@pytest.mark.parametrize("spans", [[1, 1], [0, 0, 1], [0, 2, 2], [0, 1, 0], [0, 0, 5, 5], [-1]])
def test_malformed_spans_raise_the_reference_error(rng, spans):
    spans = np.array(spans, np.int32)
    meta = AttnMeta(0, 2, 2, 8, 8, 0.5)
    q, k, v = _qkv(rng, len(spans), meta)
    out = np.empty_like(q)
    with pytest.raises(ValueError) as want:
        ref.encoder_attention(q, k, v, spans, meta, out)
    with pytest.raises(ValueError) as got:
        enc.encoder_attention(q, k, v, spans, meta, out)
    assert str(got.value) == str(want.value)


def test_empty_pass():
    meta = AttnMeta(0, 2, 2, 8, 8, 0.5)
    q = np.empty((0, 16), F32)
    enc.encoder_attention(q, q, q, np.empty(0, np.int32), meta, np.empty_like(q))


def test_warmup_compiles_everything():
    enc.warmup()


# --- through the backend ------------------------------------------------------------------------------------


def test_an_encoder_graph_runs_the_same_on_both_kernel_sets(rng):
    from minfer.backends.cpu import kernel_jobs
    from minfer.backends.cpu.backend import REFERENCE_KERNELS, CPUBackend
    from minfer.formats.quants import GGMLType
    from minfer.formats.tensors import WeightTensor
    from minfer.graph.builder import GraphBuilder
    from minfer.graph.plan import Plan

    vocab, width, n_head, n_head_kv, hd = 50, 48, 4, 2, 12

    def weight(name: str, *shape: int) -> WeightTensor:
        a = (rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 1.0)).astype(F32)
        return WeightTensor(name, GGMLType.F32, shape, a.reshape(shape[0] if len(shape) > 1 else 1, -1).view(np.uint8))

    lengths = [5, 1, 12, 7]
    n = sum(lengths)
    b = GraphBuilder()
    tokens, spans = b.input("tokens", n), b.input("spans", n)
    x = b.get_rows(b.weight(weight("embd", vocab, width)), tokens)
    x = b.layer_norm(x, b.weight(weight("ln.gain", width)), b.weight(weight("ln.bias", width)), 1e-12)
    meta = AttnMeta(0, n_head, n_head_kv, hd, hd, hd**-0.5)
    q = b.matmul(x, b.weight(weight("q", n_head * hd, width)))
    k = b.matmul(x, b.weight(weight("k", n_head_kv * hd, width)))
    v = b.matmul(x, b.weight(weight("v", n_head_kv * hd, width)))
    a = b.encoder_attn(q, k, v, spans, meta)
    out = b.gelu_erf(b.matmul(a, b.weight(weight("o", width, n_head * hd))))
    graph = b.build(out)
    assert "encoder" in {j.name for j in kernel_jobs.jobs_for(graph.nodes)}
    assert "encoder" in {j.name for j in kernel_jobs.all_jobs(())}

    ids = rng.integers(0, vocab, n).astype(np.int32)
    results = {}
    for kernels in ("fast", "reference"):
        backend = CPUBackend(threads=2, kernels=kernels)
        plan = Plan(graph, backend, ())
        plan.inputs["tokens"][:] = ids
        plan.inputs["spans"][:] = _spans(lengths)
        with backend.running():
            results[kernels] = plan.run().copy()
        if kernels == "fast":  # the encoder nodes ran the compiled kernels
            ran = {s.node.op: s.fn for s in plan.steps}
            assert all(ran[op] is not REFERENCE_KERNELS[op] for op in (Op.LAYER_NORM, Op.GELU_ERF, Op.ENC_ATTN))
            plan.inputs["spans"][:] = [0, 0, 1, *([3] * (n - 3))]  # token 2 points into the first sequence
            with pytest.raises(ValueError, match="sequences must be consecutive"), backend.running():
                plan.run()
        backend.close()
    np.testing.assert_allclose(results["fast"], results["reference"], rtol=1e-5, atol=1e-5)
