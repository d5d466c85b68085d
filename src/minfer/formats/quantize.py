"""Load-time quantization of float weights (``--quantize q8_0|q4_k``), bit-equal to the reference quantizers.

* **Q8_0**: ``quants.quantize_q8_0_rows``, bit-identical to ``gguf.quants.quantize`` (the KV cache's
  quantizer; ``tests/test_quants.py``).
* **Q4_K**: the ``gguf`` package has no Q4_K quantizer, so this is llama.cpp's ``quantize_row_q4_K_ref``
  (ggml-quants.c: per 32-value sub-block ``make_qkx2_quants`` with weights ``sqrt(mean(x^2)) + |x|``, a
  20-step search of scale and min, then 6-bit sub-block scales/mins against f16 super-block ones), in
  float32 operation for operation. ``tests/test_quantize.py`` holds it bit-equal to llama.cpp's own C
  function (bytes committed by ``scripts/make_q4k_refs.py`` from ``llama-cpp-python``'s libggml-base).
* **Q5_0**: what llama.cpp falls back to for a Q4_K tensor whose rows are not a whole number of 256-value
  super-blocks (``tensor_type_fallback``): ``quantize_row_q5_0_ref`` as ``gguf.quants`` writes it, bit-identical
  to it (and to the C function except for the sign of d in an all-zero block that starts with -0.0). Rows
  that are not a whole number of 32-value blocks either way fall back to F16, as in llama.cpp.

Rows are independent, so the kernels run rows in parallel (numba ``prange``); each row's bytes are the
same at any thread count. Float16 / bfloat16 sources are widened to float32 a chunk of rows at a time
(exact), as llama.cpp's quantizer sees them.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from minfer.errors import BadRequestError
from minfer.formats.quants import (
    GGMLType,
    _f16_bits_to_f32,
    _f32_to_f16_bits,
    _quantize_row,
    dequantize_rows,
    row_nbytes,
)
from minfer.formats.tensors import WeightTensor

QUANTIZE_TYPES: dict[str, GGMLType] = {"q8_0": GGMLType.Q8_0, "q4_k": GGMLType.Q4_K}
QK_K = 256
Q4_K_BLOCK_BYTES = 144  # d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
Q5_0_BLOCK_BYTES = 22  # d (f16), 32 high bits, 16 bytes of nibbles
_CHUNK_VALUES = 1 << 22  # float32 scratch per conversion chunk: 16 MB

F32 = np.float32


def quantize_type(name: str) -> GGMLType:
    """The block type for a ``--quantize`` name."""
    t = QUANTIZE_TYPES.get(str(name).lower())
    if t is None:
        raise BadRequestError(f"unknown quantize type {name!r} (supported: {', '.join(QUANTIZE_TYPES)})")
    return t


def storage_type(target: GGMLType, n: int) -> GGMLType:
    """The type a row of ``n`` values gets for ``target``: llama.cpp's fallback when the blocks do not fit."""
    if target == GGMLType.Q4_K and n % QK_K:
        target = GGMLType.Q5_0
    if n % 32:
        return GGMLType.F16
    return target


# --------------------------------------------------------------------------------------------- kernels


@njit(inline="always", error_model="numpy")
def _nearest_int(v):
    """ggml's ``nearest_int``: round half to even (exact for |v| < 2**22, its domain)."""
    return np.int32(np.rint(np.float64(v)))


@njit(inline="always", error_model="numpy")
def _make_qkx2_quants(x, x0, nmax, weights, L, l0, Laux, rmin, rdelta, nstep):
    """``make_qkx2_quants(32, nmax, x + x0, weights, L + l0, &the_min, Laux, rmin, rdelta, nstep, false)``:
    returns (scale, the_min) in float32, every operation in the C source's order."""
    n = 32
    mn = x[x0]
    mx = x[x0]
    sum_w = weights[0]
    sum_x = sum_w * x[x0]
    for i in range(1, n):
        xi = x[x0 + i]
        if xi < mn:
            mn = xi
        if xi > mx:
            mx = xi
        w = weights[i]
        sum_w += w
        sum_x += w * xi
    if mn > F32(0.0):
        mn = F32(0.0)
    if mx == mn:
        for i in range(n):
            L[l0 + i] = 0
        return F32(0.0), -mn
    fnmax = F32(nmax)
    iscale = fnmax / (mx - mn)
    scale = F32(1.0) / iscale
    best_error = F32(0.0)
    for i in range(n):
        l = _nearest_int(iscale * (x[x0 + i] - mn))
        l = max(0, min(nmax, l))
        L[l0 + i] = l
        diff = scale * F32(l) + mn - x[x0 + i]
        diff = diff * diff
        best_error += weights[i] * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + fnmax) / (mx - mn)
        sum_l = F32(0.0)
        sum_l2 = F32(0.0)
        sum_xl = F32(0.0)
        for i in range(n):
            l = _nearest_int(iscale * (x[x0 + i] - mn))
            l = max(0, min(nmax, l))
            Laux[i] = l
            w = weights[i]
            fl = F32(l)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[x0 + i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > F32(0.0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > F32(0.0):
                this_min = F32(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = F32(0.0)
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[x0 + i]
                diff = diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[l0 + i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(inline="always", error_model="numpy")
def _q4_k_row(x, out):
    """``quantize_row_q4_K_ref`` of one row (a whole number of 256-value super-blocks) into ``out``."""
    L = np.empty(QK_K, np.int32)
    Laux = np.empty(32, np.int32)
    weights = np.empty(32, F32)
    mins = np.empty(8, F32)
    scales = np.empty(8, F32)
    for ib in range(x.shape[0] // QK_K):
        x0 = ib * QK_K
        o = ib * Q4_K_BLOCK_BYTES
        max_scale = F32(0.0)
        max_min = F32(0.0)
        for j in range(8):
            sum_x2 = F32(0.0)
            for l in range(32):
                v = x[x0 + 32 * j + l]
                sum_x2 += v * v
            av_x = np.sqrt(sum_x2 / F32(32.0))
            for l in range(32):
                weights[l] = av_x + abs(x[x0 + 32 * j + l])
            sc, mn = _make_qkx2_quants(x, x0 + 32 * j, 15, weights, L, 32 * j, Laux, F32(-1.0), F32(0.1), 20)
            scales[j] = sc
            mins[j] = mn
            if sc > max_scale:
                max_scale = sc
            if mn > max_min:
                max_min = mn
        inv_scale = F32(63.0) / max_scale if max_scale > F32(0.0) else F32(0.0)
        inv_min = F32(63.0) / max_min if max_min > F32(0.0) else F32(0.0)
        for k in range(12):
            out[o + 4 + k] = 0
        for j in range(8):
            ls = min(63, _nearest_int(inv_scale * scales[j]) & 0xFF)
            lm = min(63, _nearest_int(inv_min * mins[j]) & 0xFF)
            if j < 4:
                out[o + 4 + j] = ls
                out[o + 4 + j + 4] = lm
            else:
                out[o + 4 + j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
                out[o + 4 + j - 4] |= (ls >> 4) << 6
                out[o + 4 + j] |= (lm >> 4) << 6
        hd = _f32_to_f16_bits(max_scale / F32(63.0))
        hm = _f32_to_f16_bits(max_min / F32(63.0))
        out[o] = hd & 0xFF
        out[o + 1] = hd >> 8
        out[o + 2] = hm & 0xFF
        out[o + 3] = hm >> 8
        d_all = _f16_bits_to_f32(hd)
        m_all = _f16_bits_to_f32(hm)
        for j in range(8):
            q = out[o + 4 :]
            if j < 4:
                sc = np.int32(q[j] & 63)
                m = np.int32(q[j + 4] & 63)
            else:
                sc = np.int32((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4))
                m = np.int32((q[j + 4] >> 4) | ((q[j] >> 6) << 4))
            d = d_all * F32(sc)
            if d == F32(0.0):
                continue
            dm = m_all * F32(m)
            for ii in range(32):
                l = _nearest_int((x[x0 + 32 * j + ii] + dm) / d)
                L[32 * j + ii] = max(0, min(15, l))
        for j in range(0, QK_K, 64):
            qo = o + 16 + j // 2
            for l in range(32):
                out[qo + l] = L[j + l] | (L[j + l + 32] << 4)


@njit(inline="always", error_model="numpy")
def _q5_0_row(x, out):
    """``quantize_row_q5_0_ref`` of one row (a whole number of 32-value blocks) into ``out``."""
    for ib in range(x.shape[0] // 32):
        x0 = ib * 32
        o = ib * Q5_0_BLOCK_BYTES
        # the first value of largest magnitude, as gguf's argmax picks it (in an all-zero block that is the
        # first zero, whose sign reaches d; llama.cpp's C starts from +0 instead: the only difference)
        mx = x[x0]
        amax = abs(mx)
        for j in range(1, 32):
            v = x[x0 + j]
            if amax < abs(v):
                amax = abs(v)
                mx = v
        d = mx / F32(-16.0)
        inv = F32(1.0) / d if d != F32(0.0) else F32(0.0)
        h = _f32_to_f16_bits(d)
        out[o] = h & 0xFF
        out[o + 1] = h >> 8
        qh = np.uint32(0)
        for j in range(16):
            a = np.int32(x[x0 + j] * inv + F32(16.5))  # truncation toward zero, as the C cast to int8
            b = np.int32(x[x0 + 16 + j] * inv + F32(16.5))
            a = min(31, a)
            b = min(31, b)
            out[o + 6 + j] = (a & 0x0F) | ((b & 0x0F) << 4)
            qh |= np.uint32((a & 0x10) >> 4) << np.uint32(j)
            qh |= np.uint32((b & 0x10) >> 4) << np.uint32(j + 16)
        for k in range(4):
            out[o + 2 + k] = (qh >> np.uint32(8 * k)) & np.uint32(0xFF)


@njit(parallel=True, cache=True, error_model="numpy")
def _quantize_rows_parallel(x, out, kind):
    for r in prange(x.shape[0]):
        if kind == 0:
            _quantize_row(x[r], out[r], 32)
        elif kind == 1:
            _q4_k_row(x[r], out[r])
        else:
            _q5_0_row(x[r], out[r])


_KIND = {GGMLType.Q8_0: 0, GGMLType.Q4_K: 1, GGMLType.Q5_0: 2}


def quantize_rows(x: np.ndarray, qtype: GGMLType, out: np.ndarray | None = None) -> np.ndarray:
    """Quantize float32 ``x[rows, n]`` to ``qtype`` blocks (Q8_0, Q4_K or Q5_0): ``uint8[rows, row_bytes]``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or qtype not in _KIND:
        raise ValueError(f"quantize_rows: 2-D float rows to Q8_0/Q4_K/Q5_0, got {x.shape} to {qtype.name}")
    width = row_nbytes(qtype, x.shape[1])  # a ModelError when the rows are not whole blocks
    if out is None:
        out = np.empty((x.shape[0], width), np.uint8)
    if out.shape != (x.shape[0], width) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"quantize_rows: out must be uint8 {(x.shape[0], width)}, got {out.dtype} {out.shape}")
    if x.shape[0]:
        _quantize_rows_parallel(x, out, _KIND[qtype])
    return out


def quantize_tensor(t: WeightTensor, target: GGMLType, threads: int | None = None) -> WeightTensor:
    """A float (F32/F16/BF16) matrix quantized to ``target`` (or its fallback, see :func:`storage_type`),
    in new memory; any other tensor is returned as it is."""
    if len(t.shape) != 2 or t.ggml_type not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        return t
    n_rows, n = t.shape
    qtype = storage_type(target, n)
    if qtype == GGMLType.F16:
        if t.ggml_type == GGMLType.F16:
            return t
        data = dequantize_rows(t.data, t.ggml_type, n).astype(np.float16).view(np.uint8)
        return WeightTensor(t.name, GGMLType.F16, t.shape, data.reshape(n_rows, -1))
    out = np.empty((n_rows, row_nbytes(qtype, n)), np.uint8)
    previous = numba.get_num_threads()
    if threads is not None:
        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    try:
        step = max(1, _CHUNK_VALUES // n)
        for r0 in range(0, n_rows, step):
            r1 = min(n_rows, r0 + step)
            rows = dequantize_rows(t.data[r0:r1], t.ggml_type, n)  # a view for F32, widened for F16/BF16
            quantize_rows(rows, qtype, out[r0:r1])
    finally:
        numba.set_num_threads(previous)
    return WeightTensor(t.name, qtype, t.shape, out)
