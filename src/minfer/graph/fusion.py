"""Fusion pass: rewrite op pairs that a backend runs better as one op.

* ``rms_norm`` followed by a ``mul`` with a weight (the norm gain) -> ``rms_norm_mul``
* ``silu(gate)`` followed by a ``mul`` with ``up`` -> ``swiglu``
* ``gelu(gate)`` followed by a ``mul`` with ``up`` -> ``geglu``

A pair is fused only when the first node has no other consumer, so no intermediate anyone reads is lost.
The rewritten graph keeps build order (the fused node takes the second node's place).

With ``quantized_input(weight)`` (a backend whose matmuls quantize their activations for some weight
types), matmuls that read the same activation (q/k/v; gate/up) share one ``quantize`` node, placed just
before the first of them: the activation is quantized once instead of once per matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from minfer.graph.ir import Graph, Node, Op


def fuse(graph: Graph, quantized_input: Callable[[Any], bool] | None = None) -> Graph:
    consumers = graph.consumers()
    replaced: dict[int, Node] = {}  # old node id -> node that now stands for it
    dropped: set[int] = set()
    new_nodes: list[Node] = []

    kept_ids = {graph.output.id, *(n.id for n in graph.extras.values())}

    def sole_consumer(n: Node) -> bool:
        return len(consumers[n.id]) == 1 and n.id not in kept_ids

    for node in graph.nodes:
        inputs = tuple(replaced.get(i.id, i) for i in node.inputs)
        fused: Node | None = None
        if node.op is Op.MUL:
            a, w = node.inputs
            if a.op is Op.RMS_NORM and w.op is Op.WEIGHT and sole_consumer(a):
                fused = replace(node, op=Op.RMS_NORM_MUL, inputs=(inputs[0].inputs[0], inputs[1]), meta=a.meta)
            elif a.op is Op.SILU and sole_consumer(a) and w.op is not Op.WEIGHT:
                fused = replace(node, op=Op.SWIGLU, inputs=(inputs[0].inputs[0], inputs[1]))
            elif a.op is Op.GELU and sole_consumer(a) and w.op is not Op.WEIGHT:
                fused = replace(node, op=Op.GEGLU, inputs=(inputs[0].inputs[0], inputs[1]))
            if fused is not None:
                dropped.add(a.id)
        new = fused or (_rewired(node, node.id, inputs) if inputs != node.inputs else node)
        replaced[node.id] = new
        new_nodes.append(new)

    kept = [n for n in new_nodes if n.id not in dropped]
    fused_graph = Graph(kept, graph.inputs, replaced[graph.output.id],
                        {k: replaced[v.id] for k, v in graph.extras.items()})
    if quantized_input is not None:
        fused_graph = _share_quantized_inputs(fused_graph, quantized_input)
    return _renumber(fused_graph)


def _share_quantized_inputs(graph: Graph, quantized_input: Callable[[Any], bool]) -> Graph:
    readers: dict[int, list[Node]] = {}
    for n in graph.nodes:
        if n.op is Op.MATMUL and quantized_input(n.inputs[1].source):
            readers.setdefault(n.inputs[0].id, []).append(n)
    shared = {x: ms for x, ms in readers.items() if len(ms) > 1}
    if not shared:
        return graph
    next_id = max(n.id for n in graph.nodes) + 1
    nodes: list[Node] = []
    quantized: dict[int, Node] = {}  # activation id -> its quantize node
    for n in graph.nodes:
        if n.op is Op.MATMUL and n.inputs[0].id in shared and n in shared[n.inputs[0].id]:
            x = n.inputs[0]
            q = quantized.get(x.id)
            if q is None:
                q = Node(next_id, Op.QUANTIZE, (x,), x.shape, dtype="q8", name=f"{x.name}.q8", layer=x.layer)
                next_id += 1
                quantized[x.id] = q
                nodes.append(q)
            n = replace(n, inputs=(*n.inputs, q))
        nodes.append(n)
    by_id = {n.id: n for n in nodes}
    return Graph(nodes, graph.inputs, by_id[graph.output.id], {k: by_id[v.id] for k, v in graph.extras.items()})


def _rewired(n: Node, node_id: int, inputs: tuple[Node, ...]) -> Node:
    """``n`` with another id and inputs: ``dataclasses.replace`` without its checks (a plan's graph has
    ~1,000 nodes and is rebuilt per batch shape: replace took a third of the fusion pass)."""
    return Node(node_id, n.op, inputs, n.shape, n.dtype, n.meta, n.name, n.layer, n.source)


def _renumber(graph: Graph) -> Graph:
    """Give nodes consecutive ids in build order, rewiring inputs to the renumbered nodes."""
    mapping: dict[int, Node] = {}
    nodes: list[Node] = []
    for i, n in enumerate(graph.nodes):
        new = _rewired(n, i, tuple(mapping[x.id] for x in n.inputs))
        mapping[n.id] = new
        nodes.append(new)
    inputs = {k: mapping[v.id] for k, v in graph.inputs.items()}
    return Graph(nodes, inputs, mapping[graph.output.id], {k: mapping[v.id] for k, v in graph.extras.items()})
