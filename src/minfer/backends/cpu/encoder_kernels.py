"""The compiled encoder ops (BERT): LayerNorm with gain and bias, the exact (erf) GELU, and the bidirectional
attention of each token to its own sequence (``reference.layer_norm``, ``gelu_erf``, ``encoder_attention`` are
their numpy namesakes).

No ``fastmath``, as every vector kernel here: each output element is one fixed sequence of IEEE operations,
written as loops that LLVM vectorizes across independent elements (never by reassociating a sum), so a
result depends on its own row (or sequence) alone, not on the pass it is in nor on the threads.

LayerNorm
    The reference's arithmetic: mean and biased variance (two passes, ``Σ (x - mean)²``) summed in float64,
    in four fixed lanes then ``(l0 + l1) + (l2 + l3)``; ``inv = f32(1 / sqrt(var + eps))`` in float64, then
    the float32 steps ``((x - f32(mean)) * inv) * gain + bias``. Only the float64 summation order differs from
    numpy's pairwise one (measured: the same float32 bits, at most 1 ulp in principle).
GELU (erf)
    ``0.5 x (1 + erf(x / sqrt 2))`` in float32 steps, erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7; the
    formula torch's vectorized CPU GELU uses) with ``elementwise.exp32``: within a few 1e-7 of the reference's
    float64 ``math.erf`` (a libm call per element, which made GELU a sixth of all-MiniLM's time). From
    ``PARALLEL_ROWS`` rows on the rows are shared among the threads.
Attention
    One unit per (sequence, query head): K's rows of that head transposed into ``[head_dim, n]`` so that the
    scores of ``BLOCK`` queries by 16 keys are eight-lane multiply-adds, ``s_j = Σ_d q_d k_jd`` in d order (a
    multiply and an add, never a fused one, so the bits do not depend on the CPU having FMA); then
    ``s * f32(scale)``, the row max subtracted, float32 exp (``elementwise.exp32``, within 1 ulp), a float64
    sum (four lanes in key order, then ``hsum_tree``), weights ``e * f32(1 / sum)``, and ``o = Σ_j w_j v_j``
    in key order (the same multiply-adds on V's columns). A token's output is computed by one unit in that
    order whatever the pass holds, so a sequence alone in a pass gives the bits it gives among others, at any
    thread count; it differs from the reference's BLAS products by float32 rounding only. Units are shared
    among the threads from ``PARALLEL_WORK`` multiply-adds on (a parallel region costs ~1.3 µs to start here;
    one short sequence's attention less).

    A sequence of ``LONG_SEQUENCE`` tokens or more (a vision tower's patches: 1024 a SmolVLM tile, 4096 a Gemma 3
    image) goes through the float GEMM of :mod:`~minfer.backends.cpu.float_gemm` instead: ``Q K^T`` and ``P V`` as
    FMA chains (in d order, in key order), the same row softmax between them. Measured on SigLIP so400m's shape
    (4096 tokens, 16 heads of 72), 2 threads: 2.2-2.4 s -> 0.7-0.95 s a layer; its outputs differ from the short
    kernel's by float32 rounding (the FMAs), and again do not depend on the pass or the threads.
The spans (each token's sequence's first row) are checked once per call in the kernel; a malformed array
raises the reference's ``ValueError``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from numba import njit, prange

from minfer.backends.cpu import float_gemm
from minfer.backends.cpu.elementwise import exp32
from minfer.backends.cpu.reference import SQRT_HALF
from minfer.backends.cpu.simd import (
    add_row_f64x4,
    hmax_f32x8,
    hsum_tree,
    load_row_f32x8,
    max_f32x8,
    muladd_f32x8,
    splat_f32x8,
    store_row_f32x8,
    zeros_f32x8,
    zeros_f64x4,
)

if TYPE_CHECKING:
    from minfer.graph.ir import AttnMeta

F32 = np.float32
U = np.uint64  # unsigned index (see _unit)
PARALLEL_ROWS = 16  # rows from which LayerNorm and GELU share them among the threads
PARALLEL_WORK = 1 << 16  # attention multiply-adds (scores and weighted sums) from which units run in parallel
BLOCK = 4  # queries that share each transposed K row and each V row while they are in L1
# sequences of at least this many tokens (a vision tower's patches) take the float GEMM (_long_sequence): the short
# kernel's multiply-adds run far below the FMA peak, which only matters where the attention is most of the work
LONG_SEQUENCE = 256
LONG_TILE = 128  # queries whose scores are kept at once ([LONG_TILE, n] float32)


# ---------------------------------------------------------------------------------------------------------
# LayerNorm


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _layer_norm_row(x, gain, bias, eps, out, r) -> None:  # pragma: no cover - compiled
    w = x.shape[1]
    w4 = w - w % 4
    s0 = s1 = s2 = s3 = 0.0
    for i in range(0, w4, 4):
        s0 += np.float64(x[r, i])
        s1 += np.float64(x[r, i + 1])
        s2 += np.float64(x[r, i + 2])
        s3 += np.float64(x[r, i + 3])
    s = (s0 + s1) + (s2 + s3)
    for i in range(w4, w):
        s += np.float64(x[r, i])
    mean = s / w
    s0 = s1 = s2 = s3 = 0.0
    for i in range(0, w4, 4):
        d0 = np.float64(x[r, i]) - mean
        d1 = np.float64(x[r, i + 1]) - mean
        d2 = np.float64(x[r, i + 2]) - mean
        d3 = np.float64(x[r, i + 3]) - mean
        s0 += d0 * d0
        s1 += d1 * d1
        s2 += d2 * d2
        s3 += d3 * d3
    s = (s0 + s1) + (s2 + s3)
    for i in range(w4, w):
        d = np.float64(x[r, i]) - mean
        s += d * d
    inv = F32(1.0 / math.sqrt(s / w + eps))
    m32 = F32(mean)
    for i in range(w):  # in place too: each element is read before it is written
        out[r, i] = ((x[r, i] - m32) * inv) * gain[i] + bias[i]


@njit(nogil=True, cache=True, error_model="numpy")
def _layer_norm_serial(x, gain, bias, eps, out) -> None:  # pragma: no cover - compiled
    for r in range(x.shape[0]):
        _layer_norm_row(x, gain, bias, eps, out, r)


@njit(nogil=True, cache=True, error_model="numpy", parallel=True)
def _layer_norm_parallel(x, gain, bias, eps, out) -> None:  # pragma: no cover - compiled
    for r in prange(x.shape[0]):
        _layer_norm_row(x, gain, bias, eps, out, r)


def layer_norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray, eps: float, out: np.ndarray) -> None:
    """``out = (x - mean) / sqrt(var + eps) * gain + bias`` per row of the 2-D float32 ``x``; ``out`` may be ``x``."""
    w = x.shape[-1]
    if x.ndim != 2 or out.shape != x.shape or gain.shape != (w,) or bias.shape != (w,):
        raise ValueError(f"layer_norm: x {x.shape} / out {out.shape} must be equal 2-D, gain {gain.shape} and "
                         f"bias {bias.shape} of {w} values")
    kernel = _layer_norm_parallel if x.shape[0] >= PARALLEL_ROWS else _layer_norm_serial
    kernel(x, gain, bias, float(eps), out)


# ---------------------------------------------------------------------------------------------------------
# GELU (erf)


# erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), in float32 steps: the formula of torch's vectorized
# Vectorized<float>::erf, which its CPU GELU runs; branch-free, so the loop vectorizes (math.erf, a libm call per
# element, made GELU a sixth of all-MiniLM's time)
_ERF_P = F32(0.3275911)
_ERF_A1, _ERF_A2, _ERF_A3 = F32(0.254829592), F32(-0.284496736), F32(1.421413741)
_ERF_A4, _ERF_A5 = F32(-1.453152027), F32(1.061405429)
_SQRT_HALF32 = F32(SQRT_HALF)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _gelu_erf_row(x, out, r) -> None:  # pragma: no cover - compiled
    for i in range(x.shape[1]):
        v = x[r, i]
        u = v * _SQRT_HALF32
        a = abs(u)
        t = F32(1.0) / (_ERF_P * a + F32(1.0))
        poly = (((_ERF_A5 * t + _ERF_A4) * t + _ERF_A3) * t + _ERF_A2) * t + _ERF_A1
        e = F32(1.0) - poly * t * exp32(-(u * u))
        e = -e if u < F32(0.0) else e
        out[r, i] = F32(0.5) * v * (F32(1.0) + e)


@njit(nogil=True, cache=True, error_model="numpy")
def _gelu_erf_serial(x, out) -> None:  # pragma: no cover - compiled
    for r in range(x.shape[0]):
        _gelu_erf_row(x, out, r)


@njit(nogil=True, cache=True, error_model="numpy", parallel=True)
def _gelu_erf_parallel(x, out) -> None:  # pragma: no cover - compiled
    for r in prange(x.shape[0]):
        _gelu_erf_row(x, out, r)


def gelu_erf(x: np.ndarray, out: np.ndarray) -> None:
    """``out = 0.5 x (1 + erf(x / sqrt 2))`` elementwise (float32, any shape, C-contiguous); ``out`` may be ``x``."""
    if out.shape != x.shape:
        raise ValueError(f"gelu_erf: shapes x {x.shape}, out {out.shape} must be equal")
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    o2 = out.reshape(-1, out.shape[-1]) if out.ndim != 2 else out
    kernel = _gelu_erf_parallel if x2.shape[0] >= PARALLEL_ROWS else _gelu_erf_serial
    kernel(x2, o2)


# ---------------------------------------------------------------------------------------------------------
# attention


@njit(nogil=True, cache=True, error_model="numpy")
def _sequence_starts(spans, starts) -> int:  # pragma: no cover - compiled
    """``starts[0..n_seq]``: each sequence's first row, then the pass's row count; returns ``n_seq``, or
    ``-1 - t`` for the first token ``t`` that starts a run without being its own first row."""
    n = spans.shape[0]
    t = 0
    n_seq = 0
    while t < n:
        start = spans[t]
        if start != t:
            return -1 - t
        starts[n_seq] = t
        n_seq += 1
        t += 1
        while t < n and spans[t] == start:
            t += 1
    starts[n_seq] = n
    return n_seq


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _weighted_v8(s, v, a, n, col, out, i0, i1, i2, i3, nb, oc) -> None:  # pragma: no cover - compiled
    """``out[i, oc:oc+8] = Σ_j s[r, j] v[a + j, col:col+8]`` for the block's rows, in key order."""
    o0 = o1 = o2 = o3 = zeros_f32x8()
    for j in range(n):
        vv = load_row_f32x8(v, a + j, col)
        o0 = muladd_f32x8(o0, splat_f32x8(s[0, U(j)]), vv)
        o1 = muladd_f32x8(o1, splat_f32x8(s[1, U(j)]), vv)
        o2 = muladd_f32x8(o2, splat_f32x8(s[2, U(j)]), vv)
        o3 = muladd_f32x8(o3, splat_f32x8(s[3, U(j)]), vv)
    _store4(out, oc, o0, o1, o2, o3, i0, i1, i2, i3, nb)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _store4(out, col, o0, o1, o2, o3, i0, i1, i2, i3, nb) -> None:  # pragma: no cover - compiled
    store_row_f32x8(out, i0, col, o0)
    if nb > 1:
        store_row_f32x8(out, i1, col, o1)
    if nb > 2:
        store_row_f32x8(out, i2, col, o2)
    if nb > 3:
        store_row_f32x8(out, i3, col, o3)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _softmax_row(s, r, n, scale) -> None:  # pragma: no cover - compiled
    """Row ``r`` of the scores ``s[r, :n]`` -> its weights, in place: ``* scale``, the row max subtracted, float32
    exp, a float64 sum in four lanes then ``hsum_tree``, ``* f32(1 / sum)``."""
    sr = s[U(r)]
    for j in range(n):
        sr[U(j)] = sr[U(j)] * scale
    m = sr[0]  # the largest score (the same whatever order it is found in)
    n8 = n - n % 8
    if n8:
        mv = load_row_f32x8(s, r, 0)
        for j in range(8, n8, 8):
            mv = max_f32x8(mv, load_row_f32x8(s, r, j))
        m = hmax_f32x8(mv)
    for j in range(n8, n):
        m = sr[U(j)] if sr[U(j)] > m else m
    for j in range(n):
        sr[U(j)] = exp32(sr[U(j)] - m)
    acc = zeros_f64x4()
    j = 0
    while j + 4 <= n:
        acc = add_row_f64x4(s, r, j, acc)
        j += 4
    total = hsum_tree(acc)
    while j < n:
        total += np.float64(sr[U(j)])
        j += 1
    w = F32(1.0 / total)
    for j in range(n):
        sr[U(j)] = sr[U(j)] * w


@njit(nogil=True, cache=True, error_model="numpy", parallel=True)
def _softmax_rows(s, n, scale) -> None:  # pragma: no cover - compiled
    for r in prange(s.shape[0]):
        _softmax_row(s, r, n, scale)


@njit(nogil=True, cache=True, error_model="numpy")
def _unit(q, k, v, a, b, h, group, dk, dv, scale, out) -> None:  # pragma: no cover - compiled
    """Query head ``h`` of the tokens ``a..b`` (one sequence) over the same tokens' keys and values.

    Scores: ``BLOCK`` queries by 16 keys in eight-lane registers, one multiply and one add per key and d (in
    d order, from 0), K^T's rows zero-padded to a multiple of 16 keys (the padding's scores are never read).
    Weighted sum: ``BLOCK`` queries by 16 (then 8) columns of V, in key order; columns past a multiple of 8
    one by one, the same operations. (Indices written ``U(...)`` are unsigned: numba then skips its
    negative-index wraparound, which would keep LLVM from vectorizing the softmax loops.)"""
    n = b - a
    n16 = (n + 15) // 16 * 16
    hk = h // group
    qc, kc, vc, oc = h * dk, hk * dk, hk * dv, h * dv
    kt = np.zeros((dk, n16), F32)
    for j in range(n):
        for d in range(dk):
            kt[U(d), U(j)] = k[U(a + j), U(kc + d)]
    s = np.empty((BLOCK, n16), F32)
    dv16, dv8 = dv - dv % 16, dv - dv % 8
    for i0 in range(a, b, BLOCK):
        nb = min(BLOCK, b - i0)
        # rows past the sequence's end repeat its last query (computed, never stored)
        i1, i2, i3 = min(i0 + 1, b - 1), min(i0 + 2, b - 1), min(i0 + 3, b - 1)
        for j0 in range(0, n16, 16):
            s0 = s1 = s2 = s3 = t0 = t1 = t2 = t3 = zeros_f32x8()
            for d in range(dk):
                ka, kb = load_row_f32x8(kt, d, j0), load_row_f32x8(kt, d, j0 + 8)
                x = splat_f32x8(q[U(i0), U(qc + d)])
                s0, t0 = muladd_f32x8(s0, x, ka), muladd_f32x8(t0, x, kb)
                x = splat_f32x8(q[U(i1), U(qc + d)])
                s1, t1 = muladd_f32x8(s1, x, ka), muladd_f32x8(t1, x, kb)
                x = splat_f32x8(q[U(i2), U(qc + d)])
                s2, t2 = muladd_f32x8(s2, x, ka), muladd_f32x8(t2, x, kb)
                x = splat_f32x8(q[U(i3), U(qc + d)])
                s3, t3 = muladd_f32x8(s3, x, ka), muladd_f32x8(t3, x, kb)
            _store4(s, j0, s0, s1, s2, s3, 0, 1, 2, 3, 4)
            _store4(s, j0 + 8, t0, t1, t2, t3, 0, 1, 2, 3, 4)
        for r in range(nb):
            _softmax_row(s, r, n, scale)
        for c0 in range(0, dv16, 16):
            o0 = o1 = o2 = o3 = p0 = p1 = p2 = p3 = zeros_f32x8()
            for j in range(n):
                va, vb = load_row_f32x8(v, a + j, vc + c0), load_row_f32x8(v, a + j, vc + c0 + 8)
                x = splat_f32x8(s[0, U(j)])
                o0, p0 = muladd_f32x8(o0, x, va), muladd_f32x8(p0, x, vb)
                x = splat_f32x8(s[1, U(j)])
                o1, p1 = muladd_f32x8(o1, x, va), muladd_f32x8(p1, x, vb)
                x = splat_f32x8(s[2, U(j)])
                o2, p2 = muladd_f32x8(o2, x, va), muladd_f32x8(p2, x, vb)
                x = splat_f32x8(s[3, U(j)])
                o3, p3 = muladd_f32x8(o3, x, va), muladd_f32x8(p3, x, vb)
            _store4(out, oc + c0, o0, o1, o2, o3, i0, i1, i2, i3, nb)
            _store4(out, oc + c0 + 8, p0, p1, p2, p3, i0, i1, i2, i3, nb)
        if dv8 > dv16:
            _weighted_v8(s, v, a, n, vc + dv16, out, i0, i1, i2, i3, nb, oc + dv16)
        for r in range(nb):
            for c in range(dv8, dv):
                x = F32(0.0)
                for j in range(n):
                    x += s[U(r), U(j)] * v[U(a + j), U(vc + c)]
                out[U(i0 + r), U(oc + c)] = x


@njit(nogil=True, cache=True, error_model="numpy")
def _attn_serial(q, k, v, starts, n_seq, n_head, group, dk, dv, scale, out) -> None:  # pragma: no cover
    for u in range(n_seq * n_head):
        s = u // n_head
        _unit(q, k, v, starts[s], starts[s + 1], u - s * n_head, group, dk, dv, scale, out)


@njit(nogil=True, cache=True, error_model="numpy", parallel=True)
def _attn_parallel(q, k, v, starts, n_seq, n_head, group, dk, dv, scale, out) -> None:  # pragma: no cover
    for u in prange(n_seq * n_head):
        s = u // n_head
        _unit(q, k, v, starts[s], starts[s + 1], u - s * n_head, group, dk, dv, scale, out)


def encoder_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, spans: np.ndarray, meta: AttnMeta,
                      out: np.ndarray) -> None:
    """Bidirectional GQA attention of every token to the tokens of its own sequence (``spans[t]``: the first
    row of t's sequence, each sequence's rows consecutive), 2-D float32 q/k/v/out; ``out`` must not overlap
    q, k or v."""
    n_head, n_head_kv, dk, dv = meta.n_head, meta.n_head_kv, meta.head_dim_k, meta.head_dim_v
    t = q.shape[0]
    if (n_head_kv < 1 or n_head % n_head_kv or q.shape != (t, n_head * dk) or k.shape != (t, n_head_kv * dk)
            or v.shape != (t, n_head_kv * dv) or out.shape != (t, n_head * dv) or spans.shape != (t,)
            or not q.dtype == k.dtype == v.dtype == out.dtype == F32):
        raise ValueError(f"encoder_attention: q {q.shape}, k {k.shape}, v {v.shape}, spans {spans.shape}, out "
                         f"{out.shape} (float32) do not fit {n_head} heads ({n_head_kv} kv heads) of {dk}/{dv}")
    starts = np.empty(t + 1, np.int64)
    n_seq = _sequence_starts(spans, starts)
    if n_seq < 0:
        bad = -1 - n_seq
        raise ValueError(f"token {bad} says its sequence starts at row {int(spans[bad])}: sequences must be "
                         "consecutive")
    lengths = np.diff(starts[: n_seq + 1])
    long = lengths >= LONG_SEQUENCE
    group, scale = n_head // n_head_kv, F32(meta.scale)
    # V and out are read and written eight floats at a time: their rows must be contiguous
    v = v if v.strides[1] == 4 else np.ascontiguousarray(v)
    o = out if out.strides[1] == 4 else np.empty(out.shape, F32)
    i = 0
    while i < n_seq:  # runs of consecutive short sequences, and long ones one by one
        j = i + 1
        while j < n_seq and long[j] == long[i]:
            j += 1
        if long[i]:
            for seq in range(i, j):
                _long_sequence(q, k, v, int(starts[seq]), int(starts[seq + 1]), n_head_kv, group, dk, dv, scale, o)
        else:
            run = lengths[i:j]
            work = n_head * (dk + dv) * int(run @ run)
            kernel = _attn_parallel if work >= PARALLEL_WORK and (j - i) * n_head > 1 else _attn_serial
            kernel(q, k, v, starts[i:j + 1], j - i, n_head, group, dk, dv, scale, o)
        i = j
    if o is not out:
        out[:] = o


def _long_sequence(q: np.ndarray, k: np.ndarray, v: np.ndarray, a: int, b: int, n_head_kv: int, group: int,
                   dk: int, dv: int, scale: np.float32, out: np.ndarray) -> None:
    """Rows ``a..b`` (one sequence of at least ``LONG_SEQUENCE`` tokens) through the float GEMM: per kv head, K and
    V^T repacked once into panels; per query head and tile of ``LONG_TILE`` queries, the scores ``Q K^T`` (each an
    FMA chain in d order), the row softmax of the short kernel (:func:`_softmax_row`), and ``P V`` (an FMA chain in
    key order). A token's operations do not depend on its tile, the pass or the threads."""
    n = b - a
    scores = np.empty((min(LONG_TILE, n), n), F32)
    values = np.empty((min(LONG_TILE, n), dv), F32)
    for hk in range(n_head_kv):
        k_panels = float_gemm.repack(k[a:b, hk * dk:(hk + 1) * dk])
        v_panels = float_gemm.repack(v[a:b, hk * dv:(hk + 1) * dv].T)
        for h in range(hk * group, (hk + 1) * group):
            qh = np.ascontiguousarray(q[a:b, h * dk:(h + 1) * dk])
            for t0 in range(0, n, LONG_TILE):
                t1 = min(t0 + LONG_TILE, n)
                s, o = scores[:t1 - t0], values[:t1 - t0]
                float_gemm.gemm(qh[t0:t1], k_panels, s)
                _softmax_rows(s, n, scale)
                float_gemm.gemm(s, v_panels, o)
                out[a + t0:a + t1, h * dv:(h + 1) * dv] = o


def warmup() -> None:
    """Compile (or load from the on-disk cache) every kernel for float32 2-D activations, int32 spans, and
    gains and biases both read-only (float32 in the file: a view of its mapping) and writable (dequantized)."""
    from minfer.graph.ir import AttnMeta

    x = np.ones((PARALLEL_ROWS, 8), F32)
    g = np.ones(8, F32)
    ro = np.ones(8, F32)
    ro.flags.writeable = False
    for rows in (x[:1], x):
        out = np.empty_like(rows)
        layer_norm(rows, g, g, 1e-12, out)
        layer_norm(rows, ro, ro, 1e-12, out)
        gelu_erf(rows, out)
    meta = AttnMeta(0, 2, 1, 4, 4, 0.5)
    for n in (2, 64):  # a serial call, a parallel one
        q, kv = np.ones((n, 8), F32), np.ones((n, 4), F32)
        encoder_attention(q, kv, kv, np.zeros(n, np.int32), meta, np.empty_like(q))
