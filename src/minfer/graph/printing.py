"""Graph views for people and tools: plain text, Graphviz DOT and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from typing import Any

from minfer.graph.ir import Graph, Node, Op


def _meta_dict(node: Node) -> dict[str, Any]:
    if node.meta is None or not is_dataclass(node.meta):
        return {}
    return {k: (str(v) if not isinstance(v, int | float | str) else v) for k, v in asdict(node.meta).items()}


def _operand(n: Node) -> str:
    return n.name if n.op in (Op.WEIGHT, Op.INPUT) else f"%{n.id}"


def to_text(graph: Graph, layers: set[int] | None = None) -> str:
    """One line per compute node: ``%id = op(operands) shape name {meta}``; weights listed by name."""
    lines = [f"# {len(graph.compute_nodes())} compute nodes, inputs: "
             + ", ".join(f"{k}{list(v.shape)}" for k, v in graph.inputs.items())]
    for n in graph.compute_nodes():
        if layers is not None and n.layer is not None and n.layer not in layers:
            continue
        meta = _meta_dict(n)
        meta_s = " {" + ", ".join(f"{k}={v}" for k, v in meta.items()) + "}" if meta else ""
        args = ", ".join(_operand(i) for i in n.inputs)
        lines.append(f"%{n.id} = {n.op}({args}) -> {list(n.shape)} {n.name}{meta_s}")
    lines.append(f"# output: %{graph.output.id} {graph.output.name}")
    return "\n".join(lines)


def to_dot(graph: Graph, layers: set[int] | None = None) -> str:
    keep = [n for n in graph.nodes if layers is None or n.layer is None or n.layer in layers]
    ids = {n.id for n in keep}
    out = ["digraph minfer {", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10];']
    for n in keep:
        if n.op is Op.WEIGHT:
            style = 'shape=note, style=filled, fillcolor="#eeeeee"'
        elif n.op is Op.INPUT:
            style = 'shape=invhouse, style=filled, fillcolor="#cde6ff"'
        elif n.op in (Op.KV_STORE, Op.KV_LOAD):
            style = 'shape=cylinder, style=filled, fillcolor="#ffe7b3"'
        else:
            style = "shape=box"
        label = f"{n.op}\\n{n.name}\\n{list(n.shape)}" if n.op is not Op.WEIGHT else f"{n.name}\\n{list(n.shape)}"
        out.append(f'  n{n.id} [label="{label}", {style}];')
    for n in keep:
        for i in n.inputs:
            if i.id in ids:
                out.append(f"  n{i.id} -> n{n.id};")
    out.append("}")
    return "\n".join(out)


def to_json(graph: Graph) -> str:
    nodes = [
        {
            "id": n.id,
            "op": str(n.op),
            "name": n.name,
            "layer": n.layer,
            "shape": list(n.shape),
            "dtype": n.dtype,
            "inputs": [i.id for i in n.inputs],
            "meta": _meta_dict(n),
            **({"type": n.source.ggml_type.name} if n.op is Op.WEIGHT and hasattr(n.source, "ggml_type") else {}),
        }
        for n in graph.nodes
    ]
    return json.dumps({"nodes": nodes, "inputs": {k: v.id for k, v in graph.inputs.items()},
                       "output": graph.output.id}, indent=1)
