"""The encoders' float GEMM (``backends/cpu/float_gemm.py``) against a float64 product, its bits alone and in a
pass, at 1 and 2 threads, both tile heights (8 rows: AVX-512's; 4 rows: AVX2's; both run on any CPU, as portable
LLVM vectors), and the backend picking it only for whole-sequence matmuls."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from minfer.backends.cpu import float_gemm as fg
from minfer.backends.cpu.backend import CPUBackend
from minfer.formats.block_types import GGMLType
from minfer.formats.tensors import WeightTensor
from minfer.graph.builder import GraphBuilder
from minfer.graph.plan import Plan

F32 = np.float32


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def _check(x, w, out):
    want = x.astype(np.float64) @ w.astype(np.float64).T
    # float32 accumulation of n_in products: a few ulp of the sum of |products| per element
    bound = 4 * np.finfo(F32).eps * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T) * x.shape[1]
    assert (np.abs(out - want) <= bound + 1e-30).all()


@pytest.mark.parametrize("rows", [8, 4])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 37, 50), (16, 384, 384), (21, 64, 96), (9, 100, 33)])
def test_gemm_matches_a_float64_product(rng, rows, shape):
    n, k, m = shape
    x = rng.standard_normal((n, k)).astype(F32)
    w = rng.standard_normal((m, k)).astype(F32)
    out = np.full((n, m), np.nan, F32)
    fg._gemm_serial(x, fg.repack(w), out, rows)
    _check(x, w, out)
    par = np.full((n, m), np.nan, F32)
    fg._gemm_parallel(x, fg.repack(w), par, rows, 3)
    np.testing.assert_array_equal(par, out)


@pytest.mark.parametrize("rows", [8, 4])
def test_a_row_has_the_same_bits_alone_in_a_pass_and_at_any_thread_count(rng, rows):
    x = rng.standard_normal((45, 96)).astype(F32)
    w = rng.standard_normal((70, 96)).astype(F32)
    panels = fg.repack(w)
    whole = np.empty((45, 70), F32)
    fg._gemm_parallel(x, panels, whole, rows, 2)
    for r in (0, 7, 8, 44):
        alone = np.empty((1, 70), F32)
        fg._gemm_serial(x[r:r + 1].copy(), panels, alone, rows)
        np.testing.assert_array_equal(alone[0], whole[r])
    previous = numba.get_num_threads()
    try:
        for threads in (1, 2):
            numba.set_num_threads(threads)
            again = np.empty_like(whole)
            fg.gemm(x, panels, again)
            if rows == fg.ROWS:
                np.testing.assert_array_equal(again, whole)
    finally:
        numba.set_num_threads(previous)


def test_bad_shapes_are_refused(rng):
    with pytest.raises(ValueError, match="do not fit"):
        fg.gemm(np.ones((2, 3), F32), fg.repack(np.ones((4, 5), F32)), np.empty((2, 4), F32))


@pytest.mark.parametrize("ggml_type", [GGMLType.F32, GGMLType.F16])
def test_the_backend_uses_it_for_whole_sequences_only(rng, ggml_type, monkeypatch):
    calls = []
    real = fg.gemm
    monkeypatch.setattr(fg, "gemm", lambda *a: calls.append(1) or real(*a))
    w = rng.standard_normal((40, 24)).astype(F32)
    stored = w.astype(np.float16) if ggml_type == GGMLType.F16 else w
    tensor = WeightTensor("w", ggml_type, (40, 24), stored.view(np.uint8).reshape(40, -1))
    results = {}
    for whole in (True, False):
        b = GraphBuilder()
        x = b.input("x", 6)  # token ids into an identity table: the activations are the table's rows
        table = rng.standard_normal((10, 24)).astype(F32) if not results else results["table"]
        results["table"] = table
        t = WeightTensor("table", GGMLType.F32, (10, 24), table.view(np.uint8).reshape(10, -1))
        y = b.matmul(b.get_rows(b.weight(t), x), b.weight(tensor), whole_sequences=whole)
        plan = Plan(b.build(y), CPUBackend(kernels="fast"), ())
        plan.inputs["x"][:] = [0, 3, 9, 1, 1, 4]
        calls.clear()
        results[whole] = plan.run().copy()
        assert bool(calls) == whole
    act = table[[0, 3, 9, 1, 1, 4]]
    _check(act, stored.astype(F32), results[True])
    np.testing.assert_allclose(results[True], results[False], rtol=0, atol=1e-4)
