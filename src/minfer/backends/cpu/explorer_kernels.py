"""The :class:`~minfer.graph.ir.Backend` methods the trace explorer calls outside a plan (a norm's gain,
the logit lens's matmul, a hand-made head's attention), for the CPU backend.

They are the reference functions the kernels are checked against, except the attention, which is the
kernel set's own (what the engine would compute for those inputs).
"""

from __future__ import annotations

import numpy as np

from minfer.backends.cpu import reference as ref
from minfer.formats.tensors import WeightTensor
from minfer.graph.ir import AttnMeta


class ExplorerKernels:
    """Mixed into :class:`~minfer.backends.cpu.backend.CPUBackend` (its ``kernels``: the kernel set)."""

    kernels: str

    def dequantize(self, tensor: WeightTensor) -> np.ndarray:
        """The whole tensor as float32 in its numpy shape."""
        return ref.dequantize_tensor(tensor)

    def float_matmul(self, x: np.ndarray, w: WeightTensor | np.ndarray, out: np.ndarray) -> None:
        """``out = x @ W^T``, W dequantized chunk by chunk (never whole), ``x`` as given."""
        ref.matmul(x, w, out)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, meta: AttnMeta,
                  out: np.ndarray) -> None:
        """The attention of this kernel set: the numba kernel for ``fast`` (the numpy one for soft-capped
        scores, as in a plan), the numpy one for the reference sets."""
        if self.kernels != "fast" or meta.softcap > 0:
            ref.attention(q, k, v, positions, meta, out)
            return
        from minfer.backends.cpu import attention  # numba-compiled: loaded by the fast set only

        attention.attention(q, k, v, positions, meta.n_head, meta.n_head_kv, meta.head_dim_k, meta.head_dim_v,
                            meta.scale, out, meta.window)
