"""Fast numba RMSNorm, with or without the gain multiply fused in.

The vector kernels' contract (what the reference computes, in place or not, errors checked in the
kernel) and their threads (serial, ``nogil``) are described in :mod:`~minfer.backends.cpu.elementwise`.

Numerics (what ``tests/test_vec_kernels.py`` holds): float64 sum of squares (products of float32 are exact
in float64), then the reference's float32 steps ``1/sqrt(f32(mean) + eps)``, ``x * scale``, ``* gain``.
Only the float64 summation order differs from numpy's; measured: identical results, at most 1 ulp in
principle.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from minfer.backends.cpu.simd import F32, U, hsum_tree, load_row_f32x8, sumsq_f64x8, zeros_f64x8


@njit(cache=True, error_model="numpy")
def _rms_norm_group(x, r, c0, gain, has_gain, eps32, width, inplace, out):
    """Normalize ``x[r, c0:c0+width]`` into ``out`` (or into x when ``inplace``).

    Sum of squares in float64, 8 lanes (lane l takes i = l mod 8 in order) then the fixed tree, then a
    scalar tail. (Indices written ``U(...)`` are unsigned: numba then skips its negative-index wraparound,
    which would otherwise keep LLVM from vectorizing loops that start at an offset.)
    """
    acc = zeros_f64x8()
    i = 0
    while i + 8 <= width:
        acc = sumsq_f64x8(acc, load_row_f32x8(x, r, c0 + i))
        i += 8
    ss = hsum_tree(acc)
    while i < width:
        v = np.float64(x[r, U(c0 + i)])
        ss += v * v
        i += 1
    # the reference's float32 steps, each rounded where numpy rounds: f32(mean), + eps, sqrt, 1 / .
    # sqrt and 1/ are done in float64 and rounded to float32 after each one: that equals the float32
    # operation exactly (double rounding is innocuous for + - * / sqrt when 53 >= 2 * 24 + 2)
    ms = F32(ss / width)
    root = F32(np.sqrt(np.float64(ms + eps32)))
    scale = F32(1.0 / np.float64(root))
    # separate in-place loops: with out and x the same array LLVM's overlap check would fall back to scalar
    if has_gain:
        if inplace:
            for i in range(width):
                x[r, U(c0 + i)] = (x[r, U(c0 + i)] * scale) * gain[i]
        else:
            for i in range(width):
                out[r, U(c0 + i)] = (x[r, U(c0 + i)] * scale) * gain[i]
    elif inplace:
        for i in range(width):
            x[r, U(c0 + i)] = x[r, U(c0 + i)] * scale
    else:
        for i in range(width):
            out[r, U(c0 + i)] = x[r, U(c0 + i)] * scale


@njit(cache=True, error_model="numpy", nogil=True)
def _rms_norm_kernel(x, gain, has_gain, eps, width, out):
    """Returns -1 when done, -2 when the shapes do not fit, -3 when x's rows are not contiguous (nothing
    written then). ``out`` is either ``x`` itself or an array that does not overlap it."""
    rows, cols = x.shape
    if width < 1 or cols % width or out.shape[0] != rows or out.shape[1] != cols:
        return -2
    if has_gain and gain.shape[0] != width:
        return -2
    if x.strides[1] != 4:
        return -3  # the sum of squares loads 8 consecutive floats of a row
    eps32 = F32(eps)
    n_groups = cols // width
    inplace = x.ctypes.data == out.ctypes.data
    for r in range(rows):
        for g in range(n_groups):
            _rms_norm_group(x, r, g * width, gain, has_gain, eps32, width, inplace, out)
    return -1


_NO_GAIN = np.zeros(1, F32)
# read-only, as a float32 gain read from a GGUF is (a view of the read-only mapping): plain RMSNorm then
# shares the fused kernel's compiled specialization instead of needing one of its own
_NO_GAIN.flags.writeable = False


def _rms_norm_error(name: str, code: int, x: np.ndarray, gain: np.ndarray | None, width: int, out: np.ndarray):
    if code == -3:
        return ValueError(f"{name}: x must have contiguous rows (inner stride 4 bytes)")
    want = "" if gain is None else f", gain {gain.shape} of {width} values"
    return ValueError(f"{name}: x {x.shape} / out {out.shape} must be equal, rows a multiple of {width}{want}")


def rms_norm(x: np.ndarray, eps: float, width: int, out: np.ndarray) -> None:
    """``out = x / sqrt(mean(x^2) + eps)`` over every group of ``width`` values; ``out`` may be ``x``."""
    code = _rms_norm_kernel(x, _NO_GAIN, False, eps, width, out)
    if code != -1:
        raise _rms_norm_error("rms_norm", code, x, None, width, out)


def rms_norm_mul(x: np.ndarray, gain: np.ndarray, eps: float, width: int, out: np.ndarray) -> None:
    """RMSNorm fused with the gain multiply (``gain`` has ``width`` values); ``out`` may be ``x``."""
    code = _rms_norm_kernel(x, gain, True, eps, width, out)
    if code != -1:
        raise _rms_norm_error("rms_norm_mul", code, x, gain, width, out)


def warmup() -> None:
    """Compile (or load from the on-disk cache) the signatures the engine uses: float32 C-contiguous 2-D
    activations, a 1-D float32 gain."""
    x = np.ones((2, 16), F32)
    out = np.empty_like(x)
    rms_norm(x, 1e-5, 16, out)
    rms_norm_mul(x, x[0], 1e-5, 16, out)
