"""CPU backend: maps each graph op to its kernel and prepares weights for them.

Kernels take ``(node, out, *operands)`` in the order the node's inputs were built; the K/V operand of
``kv_store``/``kv_load``/``attn`` is the layer's ``(k_region, v_region)`` pair.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from minfer.backends.cpu import reference as ref
from minfer.formats.gguf_file import GGUFTensor
from minfer.formats.quants import GGMLType
from minfer.graph.ir import Node, Op


def _get_rows(node: Node, out, table, ids) -> None:
    ref.get_rows(table, ids, out)


def _rms_norm(node: Node, out, x) -> None:
    ref.rms_norm(x, node.meta.eps, node.meta.width, out)


def _rms_norm_mul(node: Node, out, x, gain) -> None:
    ref.rms_norm_mul(x, gain, node.meta.eps, node.meta.width, out)


def _mul(node: Node, out, x, y) -> None:
    ref.mul(x, y, out)


def _add(node: Node, out, x, y) -> None:
    ref.add(x, y, out)


def _rope(node: Node, out, x, positions) -> None:
    ref.rope(x, positions, node.meta, out)


def _kv_store(node: Node, regions, k, v, positions) -> None:
    ref.kv_store(k, v, positions, regions[0], regions[1], node.meta.layer)


def _kv_load(node: Node, regions, store) -> None:
    """A view: the load's operand already is the layer's regions."""


def _attn(node: Node, out, q, regions, positions) -> None:
    ref.attention(q, regions[0], regions[1], positions, node.meta, out)


def _silu(node: Node, out, x) -> None:
    ref.silu(x, out)


def _swiglu(node: Node, out, gate, up) -> None:
    ref.swiglu(gate, up, out)


KERNELS: dict[Op, Callable[..., None]] = {
    Op.GET_ROWS: _get_rows,
    Op.RMS_NORM: _rms_norm,
    Op.RMS_NORM_MUL: _rms_norm_mul,
    Op.MUL: _mul,
    Op.ADD: _add,
    Op.ROPE: _rope,
    Op.KV_STORE: _kv_store,
    Op.KV_LOAD: _kv_load,
    Op.ATTN: _attn,
    Op.SILU: _silu,
    Op.SWIGLU: _swiglu,
}


class CPUBackend:
    """The numpy reference backend.

    Matmuls are split into fixed row chunks (``reference.matmul_row_chunks``) that ``threads`` workers
    share; BLAS itself runs single-threaded while a plan executes, so results are bit-identical at any
    thread count (OpenBLAS's own threading changes rounding with the thread count).
    """

    name = "cpu-reference"

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="minfer") if threads > 1 else None
        self._blas = ThreadpoolController()

    def running(self) -> AbstractContextManager[Any]:
        """Context in which plans execute: BLAS limited to one thread."""
        return self._blas.limit(limits=1, user_api="blas")

    def prepare_weight(self, tensor: GGUFTensor) -> Any:
        # F32 tensors and every 1-D tensor (norm gains, biases) are used as float32 arrays; a 1-D tensor
        # in another type is small, so it is dequantized once. Quantized matrices stay raw blocks.
        if tensor.ggml_type == GGMLType.F32 or len(tensor.shape) == 1:
            return np.ascontiguousarray(ref.dequantize_tensor(tensor))
        return tensor

    def kernel(self, node: Node) -> Callable[..., None]:
        if node.op is Op.MATMUL:
            return self._matmul
        return KERNELS[node.op]

    def _matmul(self, node: Node, out, x, w) -> None:
        chunks = ref.matmul_row_chunks(w.shape)
        if self._pool is None or len(chunks) == 1:
            for r0, r1 in chunks:
                ref.matmul_chunk(x, w, out, r0, r1)
        else:
            # numpy releases the GIL inside matmul and dequantization, so the chunks run in parallel
            list(self._pool.map(lambda c: ref.matmul_chunk(x, w, out, c[0], c[1]), chunks))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
