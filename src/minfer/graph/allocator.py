"""Buffer allocation by liveness.

Every compute node's output gets a slot in a small pool of float32 buffers; a slot is released after the
last node that reads it has run, and reused by a later node that fits. The K/V regions are not in the
pool: they are persistent per layer (owned by the KV cache) and the ``kv_store``/``kv_load`` nodes map
straight onto them. Inputs get slots of their own, never shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minfer.graph.ir import Graph, Op

UNPOOLED = (Op.WEIGHT, Op.KV_STORE, Op.KV_LOAD)


@dataclass
class Allocation:
    slot_of: dict[int, int]  # node id -> pool slot
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
    last_use[graph.output.id] = len(graph.nodes)  # the output outlives the run

    slot_of: dict[int, int] = {}
    sizes: list[int] = []
    free: list[int] = []
    input_ids: list[int] = []
    for step, node in enumerate(graph.nodes):
        if node.op is Op.INPUT:
            input_ids.append(node.id)
            continue
        if node.op in UNPOOLED:
            continue
        need = int(np.prod(node.shape))
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
        # inputs whose last reader is this node give their slots back after it ran
        for i in {x.id for x in node.inputs}:
            if last_use.get(i) == step and i in slot_of:
                free.append(slot_of[i])
    return Allocation(slot_of, sizes, input_ids)
