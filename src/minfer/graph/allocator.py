"""Buffer allocation by liveness.

Every compute node's output gets a slot in a small pool of float32 buffers; a slot is released after the
last node that reads it has run, and reused by a later node that fits. The K/V regions are not in the
pool: they are persistent per layer (owned by the KV cache) and the ``kv_store``/``kv_load`` nodes map
straight onto them. Inputs get slots of their own, never shared.

In-place ops (``IN_PLACE``) take over their first operand's slot when that operand has no reader after
them: the residual adds, norms, RoPE and SwiGLU then run without a new buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minfer.graph.ir import Graph, Node, Op

UNPOOLED = (Op.WEIGHT, Op.KV_STORE, Op.KV_LOAD, Op.QUANTIZE)  # QUANTIZE: the backend's own buffer
# ops whose kernels may write their output over their first operand (elementwise, or row-local with the
# row read before it is written)
IN_PLACE = frozenset(
    {Op.ADD, Op.MUL, Op.RMS_NORM, Op.RMS_NORM_MUL, Op.ROPE, Op.SILU, Op.SWIGLU, Op.SCALE, Op.GELU, Op.GEGLU,
     Op.LORA}
)


@dataclass
class Allocation:
    slot_of: dict[int, int]  # node id -> pool slot
    in_place: set[int]  # nodes that write over their first operand's buffer
    slot_sizes: list[int]  # elements per slot
    input_ids: list[int]  # nodes with dedicated int32 buffers

    @property
    def pool_bytes(self) -> int:
        return 4 * sum(self.slot_sizes)


def allocate(graph: Graph) -> Allocation:
    last_use: dict[int, int] = {}
    for step, node in enumerate(graph.nodes):
        for i in node.inputs:
            last_use[i.id] = step
    for kept in (graph.output, *graph.extras.values()):
        last_use[kept.id] = len(graph.nodes)  # the outputs outlive the run

    slot_of: dict[int, int] = {}
    sizes: list[int] = []
    free: list[int] = []
    input_ids: list[int] = []
    in_place: set[int] = set()
    for step, node in enumerate(graph.nodes):
        if node.op is Op.INPUT:
            input_ids.append(node.id)
            continue
        if node.op in UNPOOLED:
            _release_dead_inputs(node, step, last_use, slot_of, free)
            continue
        first = node.inputs[0] if node.inputs else None
        if (
            node.op in IN_PLACE
            and first is not None
            and first.id in slot_of
            and first.shape == node.shape
            and last_use[first.id] == step
            and sum(i is first for i in node.inputs) == 1
        ):
            slot_of[node.id] = slot_of[first.id]
            in_place.add(node.id)
            _release_dead_inputs(node, step, last_use, slot_of, free, keep=first.id)
            continue
        need = math.prod(node.shape)
        # best fit among free slots; grow the smallest one when none fits
        fitting = [s for s in free if sizes[s] >= need]
        if fitting:
            slot = min(fitting, key=lambda s: sizes[s])
        elif free:
            slot = max(free, key=lambda s: sizes[s])
            sizes[slot] = need
        else:
            slot = len(sizes)
            sizes.append(need)
        if slot in free:
            free.remove(slot)
        slot_of[node.id] = slot
        _release_dead_inputs(node, step, last_use, slot_of, free)
    return Allocation(slot_of, in_place, sizes, input_ids)


def _release_dead_inputs(
    node: Node, step: int, last_use: dict[int, int], slot_of: dict[int, int], free: list[int], keep: int = -1
) -> None:
    """Operands whose last reader is ``node`` give their slots back (``keep``: the one it wrote over)."""
    for i in {x.id for x in node.inputs}:
        if i != keep and last_use.get(i) == step and i in slot_of and slot_of[i] not in free:
            free.append(slot_of[i])
