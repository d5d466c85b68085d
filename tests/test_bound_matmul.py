"""The bound kernel calls a plan's matmul and quantize nodes run after their first call
(``backend._bound``, ``quant_matmul.direct_call`` / ``direct_quantize``, ``kquant_matmul.direct_call``):
the same kernels on the same buffers, so the same bits as the checked entry points, reading the
buffers' current contents; other buffers go back through the checks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants

from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import quant_matmul as qm
from minfer.backends.cpu.backend import _bound
from minfer.errors import ModelError
from minfer.formats.quants import GGMLType
from minfer.formats.tensors import WeightTensor

N_OUT, N_IN = 40, 512
Q8_TYPES = [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q5_1]
K_TYPES = [GGMLType.Q4_K, GGMLType.Q6_K]


def weight(t: GGMLType) -> WeightTensor:
    rng = np.random.default_rng(int(t))
    if t in K_TYPES:  # random blocks with sane f16 scales (gguf-py does not quantize K-quants)
        bsz = {GGMLType.Q4_K: 144, GGMLType.Q6_K: 210}[t]
        raw = rng.integers(0, 256, (N_OUT, N_IN // 256, bsz), dtype=np.uint8)
        for off in {GGMLType.Q4_K: (0, 2), GGMLType.Q6_K: (208,)}[t]:
            raw[:, :, off : off + 2] = (rng.uniform(0.5, 2, (N_OUT, N_IN // 256)) * 1e-3).astype(np.float16)[
                ..., None
            ].view(np.uint8)
        return WeightTensor("w", t, (N_OUT, N_IN), raw.reshape(N_OUT, -1))
    w = rng.standard_normal((N_OUT, N_IN)).astype(np.float32) * 0.1
    if t == GGMLType.F16:
        return WeightTensor("w", t, (N_OUT, N_IN), w.astype(np.float16).view(np.uint8))
    return WeightTensor("w", t, (N_OUT, N_IN), quants.quantize(w, t).view(np.uint8).reshape(N_OUT, -1))


@pytest.mark.parametrize("n_tok", [1, 9])
@pytest.mark.parametrize("shared", [True, False], ids=["xq-shared", "xq-own"])
@pytest.mark.parametrize("t", [*Q8_TYPES, *K_TYPES, GGMLType.F16], ids=lambda t: t.name)
def test_bound_node_gives_the_checked_calls_bits_on_current_contents(t, shared, n_tok):
    mod = km if km.supports(t) else qm
    p = mod.prepare(weight(t))
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n_tok, N_IN)).astype(np.float32)
    out = np.empty((n_tok, N_OUT), np.float32)
    quantize = km.quantize_activations_q8_k if t in K_TYPES else qm.quantize_activations
    xq = quantize(x) if shared and t != GGMLType.F16 else None

    def general(out, x, w, xq=None):
        mod.matmul(x, w, out, xq)

    node = _bound(general, lambda out, x, w, xq=None: mod.direct_call(x, w, out, xq))
    args = (x, p, xq) if xq is not None else (x, p)
    for step in range(3):  # the first call binds; the others run bound, on new contents each time
        x[...] = rng.standard_normal(x.shape).astype(np.float32)
        if xq is not None:
            quantize(x, xq)
        node(None, out, *args)
        expected = np.empty_like(out)
        mod.matmul(x.copy(), p, expected, None if xq is None else quantize(x.copy()))
        np.testing.assert_array_equal(out, expected, err_msg=f"step {step}")


def test_bound_node_checks_other_buffers_again():
    p = qm.prepare(weight(GGMLType.Q4_1))
    x = np.ones((1, N_IN), np.float32)
    good, bad = np.empty((1, N_OUT), np.float32), np.empty((1, N_OUT + 1), np.float32)
    node = _bound(lambda out, x, w: qm.matmul(x, w, out), lambda out, x, w: qm.direct_call(x, w, out, None))
    node(None, good, x, p)
    node(None, good, x, p)
    with pytest.raises(ModelError, match="output must be float32"):
        node(None, bad, x, p)


def test_bound_quantize_matches_the_checked_one():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, N_IN)).astype(np.float32)
    out = qm.QuantizedActivations(2, N_IN)
    node = _bound(lambda out, x: qm.quantize_activations(x, out), lambda out, x: qm.direct_quantize(x, out))
    for _ in range(2):
        x[...] = rng.standard_normal(x.shape).astype(np.float32)
        node(None, out, x)
        ref = qm.quantize_activations(x.copy())
        np.testing.assert_array_equal(out.q, ref.q)
        np.testing.assert_array_equal(out.ds, ref.ds)


def test_no_direct_call_for_a_copying_call():
    p = qm.prepare(weight(GGMLType.Q4_1))
    x64 = np.ones((1, N_IN), np.float64)  # matmul converts it: a bound call would read the wrong buffer
    out = np.empty((1, N_OUT), np.float32)
    assert qm.direct_call(x64, p, out, None) is None
    assert qm.direct_call(np.ones((1, N_IN), np.float32), p, np.empty((1, 2 * N_OUT), np.float32)[:, ::2], None) is None
