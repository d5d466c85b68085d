"""Graph IR, builder, fusion, allocator and printing on the tiny fixture models."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import fixture_dir

from minfer.backends.cpu.backend import CPUBackend
from minfer.graph import printing
from minfer.graph.allocator import IN_PLACE, UNPOOLED, allocate
from minfer.graph.fusion import fuse
from minfer.graph.ir import Op
from minfer.graph.plan import Plan
from minfer.models.model import TransformerModel
from minfer.runtime.kv_cache import KVCache


@pytest.fixture(scope="module")
def qwen3():
    return TransformerModel.from_path(fixture_dir("qwen3") / "model-f32.gguf")


def test_layer_recipe_order(qwen3):
    g = qwen3.build_graph(5, 5, 64)
    ops = [n.op for n in g.nodes if n.layer == 0]
    # QK-norm before RoPE, store before load before attention
    assert ops.index(Op.RMS_NORM) < ops.index(Op.MATMUL) < ops.index(Op.ROPE)
    names = [n.name for n in g.nodes]
    assert names.index("blk.0.q_norm") < names.index("blk.0.q_rope")
    assert names.index("blk.0.kv_store") < names.index("blk.0.kv_load") < names.index("blk.0.attn")
    assert g.output.shape == (5, qwen3.hparams.n_vocab)
    # q is 4 heads x 32 = 128 wide while n_embd is 64 (decoupled head dim)
    assert next(n for n in g.nodes if n.name == "blk.0.q").shape == (5, 128)


def test_output_rows_select_before_last_ffn(qwen3):
    g = qwen3.build_graph(6, 1, 64)
    assert g.output.shape == (1, qwen3.hparams.n_vocab)
    last_ffn = next(n for n in g.nodes if n.name == "blk.2.ffn_gate")
    assert last_ffn.shape[0] == 1
    first_ffn = next(n for n in g.nodes if n.name == "blk.0.ffn_gate")
    assert first_ffn.shape[0] == 6


def test_fusion_rewrites_pairs_and_keeps_results(qwen3):
    g = qwen3.build_graph(4, 4, 16)
    fused = fuse(g)
    count = lambda graph, op: sum(n.op is op for n in graph.nodes)  # noqa: E731
    n_layer = qwen3.hparams.n_layer
    # attn_norm, ffn_norm, q_norm, k_norm per layer + output_norm
    assert count(fused, Op.RMS_NORM_MUL) == 4 * n_layer + 1
    assert count(fused, Op.SWIGLU) == n_layer
    assert count(fused, Op.RMS_NORM) == 0 and count(fused, Op.SILU) == 0
    assert [n.id for n in fused.nodes] == list(range(len(fused.nodes)))
    results = []
    for graph in (g, fused):
        kv = KVCache(qwen3.hparams, 16)
        plan = Plan(graph, CPUBackend(), kv.layers)
        plan.inputs["tokens"][:] = [0, 5, 9, 3]
        plan.inputs["positions"][:] = [0, 1, 2, 3]
        plan.inputs["rows"][:] = kv.rows(np.arange(4))  # (their blocks taken, as the runner does)
        results.append(plan.run().copy())
    np.testing.assert_allclose(results[0], results[1], atol=1e-6)


def test_allocator_reuses_buffers_without_clobbering_live_values(qwen3):
    g = fuse(qwen3.build_graph(8, 8, 32))
    alloc = allocate(g)
    pooled = [n for n in g.nodes if n.op not in UNPOOLED and n.op is not Op.INPUT]
    assert len(alloc.slot_sizes) < len(pooled) / 5  # real reuse
    # the working set is a handful of buffers, whatever the depth: a layer's values die within it
    assert len(alloc.slot_sizes) <= 8
    # liveness: a slot is never handed to a node while a value in it still has a reader ahead
    last_use = {}
    for step, n in enumerate(g.nodes):
        for i in n.inputs:
            last_use[i.id] = step
    last_use[g.output.id] = len(g.nodes)
    holder: dict[int, int] = {}  # slot -> node id holding a live value
    for step, n in enumerate(g.nodes):
        slot = alloc.slot_of.get(n.id)
        if slot is None:
            continue
        prev = holder.get(slot)
        if prev is not None:
            assert last_use.get(prev, -1) <= step, f"slot {slot} reused by %{n.id} while %{prev} is live"
        holder[slot] = n.id
    # a node writes over an operand's slot only when it is a declared in-place op on its first operand
    for n in g.nodes:
        if n.id not in alloc.slot_of:
            continue
        shared = [i for i in n.inputs if alloc.slot_of.get(i.id) == alloc.slot_of[n.id]]
        if n.id in alloc.in_place:
            assert n.op in IN_PLACE and shared == [n.inputs[0]]
        else:
            assert shared == []
    # the residual adds run in place
    assert all(n.id in alloc.in_place for n in g.nodes if n.name.endswith("ffn_residual"))


def test_kv_regions_are_persistent_not_pooled(qwen3):
    kv = KVCache(qwen3.hparams, 16)
    plan = Plan(fuse(qwen3.build_graph(2, 2, 16)), CPUBackend(), kv.layers)
    stores = [s for s in plan.steps if s.node.op is Op.KV_STORE]
    assert len(stores) == qwen3.hparams.n_layer
    for s in stores:
        assert s.out is kv.layers[s.node.meta.layer]


def test_printing_formats(qwen3):
    g = fuse(qwen3.build_graph(1, 1, 16))
    text = printing.to_text(g, layers={0})
    assert "rope(" in text and "blk.0.attn" in text and "blk.1." not in text
    dot = printing.to_dot(g)
    assert dot.startswith("digraph") and dot.rstrip().endswith("}") and "->" in dot
    data = json.loads(printing.to_json(g))
    assert len(data["nodes"]) == len(g.nodes) and data["output"] == g.output.id


def test_matmuls_reading_one_activation_share_its_quantization():
    model = TransformerModel.from_path(fixture_dir("llama") / "model-q8_0.gguf")
    g = fuse(model.build_graph(3, 3, 16), quantized_input=lambda w: True)
    quantize = [n for n in g.nodes if n.op is Op.QUANTIZE]
    assert len(quantize) == 2 * model.hparams.n_layer  # attn_norm -> q/k/v, ffn_norm -> gate/up
    for q in quantize:
        readers = [n for n in g.nodes if q in n.inputs]
        assert len(readers) in (2, 3) and all(r.op is Op.MATMUL and r.inputs[0] is q.inputs[0] for r in readers)
        assert g.nodes.index(q) < min(g.nodes.index(r) for r in readers)
    # the fast backend gives the same bits with and without sharing
    backend = CPUBackend(kernels="fast")
    outs = []
    for graph in (fuse(model.build_graph(3, 3, 16)), fuse(model.build_graph(3, 3, 16), backend.quantized_input)):
        kv = KVCache(model.hparams, 16)
        plan = Plan(graph, backend, kv.layers)
        plan.inputs["tokens"][:] = [0, 7, 9]
        plan.inputs["positions"][:] = [0, 1, 2]
        plan.inputs["rows"][:] = kv.rows(np.arange(3))  # (their blocks taken, as the runner does)
        with backend.running():
            outs.append(plan.run().copy())
    assert np.array_equal(outs[0], outs[1])


def test_plans_of_one_runner_share_their_buffers():
    """A runner's plans take their activation slots and quantized activations from one arena: a smaller
    plan built after the largest one adds no memory and shares its arrays, and interleaving shapes gives
    the same logits as plans with buffers of their own."""
    from minfer.runtime.forward import ForwardRunner

    model = TransformerModel.from_path(fixture_dir("llama") / "model-q8_0.gguf")
    backend = CPUBackend(kernels="fast")
    runner = ForwardRunner(model, backend, KVCache(model.hparams, 64, n_seq=2))
    big = runner.plan(12, 12)
    size = runner.arena.nbytes
    small = runner.plan(3, 1)
    assert runner.arena.nbytes == size and runner.arena.grown == 0
    assert all(any(np.shares_memory(a, b) for b in big.pool) for a in small.pool)
    quantized = [v for v in small.views.values() if type(v).__name__ == "QuantizedActivations"]
    assert quantized and any(np.shares_memory(q._q, v._q) for q in quantized for v in big.views.values()
                             if type(v).__name__ == "QuantizedActivations")
    seq = list(range(5, 17))
    first = runner.forward(seq, range(12), seq_ids=0)
    tail = runner.forward(seq[:3], range(3), output_rows=[2], seq_ids=1)  # the small plan overwrites the arena
    again = runner.forward(seq, range(12), seq_ids=0)
    alone = ForwardRunner(model, backend, KVCache(model.hparams, 64, n_seq=2))
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first, alone.forward(seq, range(12), seq_ids=0))
    np.testing.assert_array_equal(tail[0], first[2])
    # a larger shape grows the arena; the plans built before are dropped (they hold the old arrays, here
    # more than a quarter of the arena)
    runner.plan(20, 20)
    assert runner.arena.grown > 0 and list(runner._plans) == [(20, 20)]


def test_a_prompt_that_grows_the_arena_keeps_the_small_plans():
    """The decode plan built before a long prompt survives the arena's growth (it keeps its own small
    arrays, and stays correct), so no plan is built between the prompt's tokens and the next ones; a
    growth that would leave much memory with the old plans drops them."""
    from minfer.runtime.forward import ForwardRunner

    model = TransformerModel.from_path(fixture_dir("llama") / "model-q8_0.gguf")
    backend = CPUBackend(kernels="fast")
    runner = ForwardRunner(model, backend, KVCache(model.hparams, 256))
    decode = runner.plan(1, 1)
    built = runner.plans_built
    seq = [int(t) for t in np.random.default_rng(0).integers(1, 500, 201)]
    runner.forward(seq[:200], range(200), output_rows=[199])
    assert runner.arena.grown > 0 and runner.plans_built == built + 1
    assert runner.plan(1, 1) is decode and runner.plans_built == built + 1
    # its logits are those of a runner that never saw the long prompt's plan
    got = runner.forward(seq[200:], [200])
    alone = ForwardRunner(model, backend, KVCache(model.hparams, 256))
    alone.forward(seq[:200], range(200), output_rows=[199])
    alone._plans.clear()
    np.testing.assert_array_equal(got, alone.forward(seq[200:], [200]))
