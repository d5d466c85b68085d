"""What the matmul families (float, quant, k-quant) share: their loops' tile sizes, the checks of their
operands and weights, and the store of an 8-token tile's sums."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

from minfer.backends.cpu.simd import hsum_folded
from minfer.errors import ModelError
from minfer.formats.quants import GGMLType
from minfer.formats.tensors import WeightTensor

GEMM_TOKENS = 8  # prefill tile: tokens sharing one unpacked weight block
GEMM_ROWS = 16  # prefill work item: weight rows owned by one worker per item
PREFETCH_ROWS = 16  # decode: how far ahead (in weight rows) to prefetch
PARALLEL_QUANTIZE_TOKENS = 16  # activation quantization: below this a parallel launch costs more than the work


def as_f32_2d(x: np.ndarray) -> np.ndarray:
    """``x`` as the kernels read activations: 2-D, float32, C-contiguous (a copy only when it is not)."""
    if x.ndim != 2:
        raise ValueError(f"activations must be 2D [n_tok, n_in], got shape {x.shape}")
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    return x


def check_operands(x: np.ndarray, w: WeightTensor, out: np.ndarray, n_in: int, n_out: int) -> int:
    """The number of tokens, after checking ``x [n_tok, n_in]`` and ``out`` float32 ``[n_tok, n_out]``
    against weight ``w``."""
    if x.ndim != 2 or x.shape[1] != n_in:
        raise ModelError(f"{w.name}: activations of shape {x.shape} do not match a weight of shape {w.shape}")
    n_tok = x.shape[0]
    if out.shape != (n_tok, n_out) or out.dtype != np.float32:
        raise ModelError(f"{w.name}: output must be float32 {(n_tok, n_out)}, got {out.dtype} {out.shape}")
    return n_tok


def weight_shape(w: WeightTensor, kernels: str, supported: Sequence[GGMLType], block: int = 1) -> tuple[int, int]:
    """``(n_out, n_in)`` of a matmul weight, after checking that it is 2-D, that ``supported`` (the types
    of the ``kernels`` named in the error) holds its type and that its rows are whole ``block``s."""
    t = w.ggml_type
    if t not in supported:
        names = ", ".join(s.name for s in supported)
        raise ModelError(f"{w.name}: no {kernels} matmul for ggml type {t.name} (supported: {names})")
    if len(w.shape) != 2:
        raise ModelError(f"{w.name}: a matmul weight must be 2D, got shape {w.shape}")
    n_out, n_in = w.shape
    if n_in % block:
        raise ModelError(f"{w.name}: rows of {n_in} values are not whole {t.name} blocks of {block}")
    return n_out, n_in


def weight_bytes(w: WeightTensor, row_bytes: int) -> np.ndarray:
    """The weight's raw bytes as one flat C-contiguous uint8 array, after checking there are ``row_bytes``
    per row."""
    data = w.data
    n_out = w.shape[0]
    if data.dtype != np.uint8 or data.size != n_out * row_bytes:
        raise ModelError(
            f"{w.name}: {data.size} bytes of data for a {w.ggml_type.name} tensor of shape {w.shape}, "
            f"expected {n_out * row_bytes}"
        )
    return np.ascontiguousarray(data).reshape(-1)


def read_only(flat: np.ndarray) -> np.ndarray:
    """A read-only view: weights are mmapped read-only, so one compiled flavor of a kernel serves all."""
    view = flat.view()
    view.flags.writeable = False
    return view


@njit(inline="always")
def store_tile(out, t0, r, a0, a1, a2, a3, a4, a5, a6, a7):
    """``out[t0 + c, r]`` = the horizontal sum of token c's accumulator, for the 8 tokens of a tile."""
    out[t0, r] = hsum_folded(a0)
    out[t0 + 1, r] = hsum_folded(a1)
    out[t0 + 2, r] = hsum_folded(a2)
    out[t0 + 3, r] = hsum_folded(a3)
    out[t0 + 4, r] = hsum_folded(a4)
    out[t0 + 5, r] = hsum_folded(a5)
    out[t0 + 6, r] = hsum_folded(a6)
    out[t0 + 7, r] = hsum_folded(a7)
