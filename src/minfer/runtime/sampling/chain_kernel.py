"""The sampler's default chain, compiled: ``[logit_bias ->] top_k -> [top_p ->] [min_p ->] temperature``
for many rows of logits in one parallel call, the draw left to the caller.

A server step samples every running sequence from its row of logits. Step by step in numpy that took
~160 µs per row here (most of it the calls' overhead on 40 candidates), one row after the other while
the second core waited; compiled, the rows share the threads.

:func:`truncate_rows` computes, for each row, what the sampler's steps compute (``minfer.runtime.
sampling``), the same float operations in the same order: the checks of the logits, the biased top-k
(:mod:`.top_k`), top-p and min-p on the sorted candidates, the temperature, and the cumulative
probabilities the draw searches. numpy's float64 ``exp`` and ``sum`` are matched: ``exp`` is the C
library's (numpy has its own only on AVX-512 CPUs, within an ulp of it there), the sum is numpy's
pairwise summation. The result per row is then ``(n, ids, cum)``: the caller draws ``r`` in ``[0, 1)``
and takes ``ids[min(searchsorted(cum[:n], r * cum[n-1], "right"), n - 1)]`` when ``n > 1``, ``ids[0]``
(no draw) when ``n == 1``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from minfer.runtime.sampling.top_k_kernel import BLOCK, biased_kernel, prunes_well, top_k_kernel

# codes truncate_rows reports per row (0 = sampled)
LOGITS_BROKEN = 1  # a NaN or +inf logit
ALL_MASKED = 2  # every logit is -inf
NOTHING_DRAWABLE = 3  # every candidate is -inf after the bias


@njit(cache=True, nogil=True)
def _pairwise_sum(a, n):
    """numpy's pairwise float64 sum of ``a[:n]`` (``add.reduce``): 8 accumulators up to 128 values, halves
    (rounded down to a multiple of 8) above."""
    if n < 8:
        s = 0.0
        for i in range(n):
            s += a[i]
        return s
    if n <= 128:
        r0, r1, r2, r3, r4, r5, r6, r7 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
        i = 8
        while i < n - n % 8:
            r0 += a[i]
            r1 += a[i + 1]
            r2 += a[i + 2]
            r3 += a[i + 3]
            r4 += a[i + 4]
            r5 += a[i + 5]
            r6 += a[i + 6]
            r7 += a[i + 7]
            i += 8
        s = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            s += a[i]
            i += 1
        return s
    half = n // 2
    half -= half % 8
    return _pairwise_sum(a, half) + _pairwise_sum(a[half:], n - half)


@njit(cache=True, nogil=True)
def _softmax_cumsum(v, n, e, cum):
    """``cum[:n] = cumsum(softmax(v[:n]))`` as the sampler's ``softmax`` then ``np.cumsum`` compute it."""
    m = v[0]
    for i in range(1, n):
        m = max(m, v[i])
    for i in range(n):
        e[i] = np.exp(v[i] - m)
    s = _pairwise_sum(e, n)
    acc = 0.0
    for i in range(n):
        acc = e[i] / s if i == 0 else acc + e[i] / s
        cum[i] = acc


# only reassociation: the sum must still see NaN and infinities
@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _any_not_finite(x):
    """Whether x holds a NaN or an infinity (x * 0 is NaN exactly for those), in one vectorized pass."""
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += x[i] * np.float32(0.0)
    return s != s


@njit(cache=True, nogil=True)
def _check(x):
    """0, or why the sampler's ``checked_logits`` refuses ``x``: a NaN or +inf, or nothing above -inf."""
    if not _any_not_finite(x):
        return 0
    finite = False
    for i in range(x.shape[0]):  # NaN and +inf fail `< inf`; one value above -inf makes a row drawable
        v = x[i]
        if not v < np.inf:
            return LOGITS_BROKEN
        finite |= v > -np.inf
    return 0 if finite else ALL_MASKED


@njit(cache=True, nogil=True)
def _truncate_row(x, k, tokens, values, top_p, use_min_p, log_min_p, min_keep, temperature, ids, cum):
    """One row; returns (code, n)."""
    code = _check(x)
    if code:
        return code, 0
    top = np.empty(k + tokens.shape[0], np.int64)
    top_k_kernel(x, k + tokens.shape[0], top)
    vals32 = np.empty(k, np.float32)
    biased_kernel(x, top, tokens, values, k, ids, vals32)
    if vals32[0] == -np.inf:
        return NOTHING_DRAWABLE, 0
    v = vals32.astype(np.float64)
    e = np.empty(k, np.float64)
    n = k
    if top_p < 1.0:
        _softmax_cumsum(v, n, e, cum)
        last = n  # searchsorted(cum, top_p), side left
        for i in range(n):
            if cum[i] >= top_p:
                last = i
                break
        last = max(last, min_keep - 1)
        if last < n:
            n = last + 1
    if use_min_p:
        kept = 0
        bound = v[0] + log_min_p
        for i in range(n):
            if v[i] >= bound:
                kept += 1
        n = max(kept, min(min_keep, n))
    for i in range(n):
        v[i] = v[i] / temperature
    if n > 1:
        _softmax_cumsum(v, n, e, cum)
    return 0, n


@njit(cache=True, nogil=True, parallel=True)
def _truncate_rows(logits, rows, ks, bias_start, bias_tokens, bias_values, top_p, use_min_p, log_min_p, min_keep,
                   temperature, codes, counts, ids, cum):
    for j in prange(rows.shape[0]):
        b0, b1 = bias_start[j], bias_start[j + 1]
        code, n = _truncate_row(logits[rows[j]], ks[j], bias_tokens[b0:b1], bias_values[b0:b1], top_p[j],
                                use_min_p[j], log_min_p[j], min_keep[j], temperature[j], ids[j], cum[j])
        codes[j] = code
        counts[j] = n


@njit(cache=True, nogil=True)
def _truncate_one(logits, rows, ks, bias_start, bias_tokens, bias_values, top_p, use_min_p, log_min_p, min_keep,
                  temperature, codes, counts, ids, cum):
    """``_truncate_rows`` for one row (a lone sequence's step): the same per-row function, without the
    parallel loop, whose compilation costs about as much as everything it calls."""
    b0, b1 = bias_start[0], bias_start[1]
    code, n = _truncate_row(logits[rows[0]], ks[0], bias_tokens[b0:b1], bias_values[b0:b1], top_p[0],
                            use_min_p[0], log_min_p[0], min_keep[0], temperature[0], ids[0], cum[0])
    codes[0] = code
    counts[0] = n


def compiles(n_vocab: int, k: int, n_bias: int) -> bool:
    """Whether :func:`truncate_rows` takes a top-k of ``k`` after ``n_bias`` biased tokens over ``n_vocab``
    logits: the compiled top-k's bound must prune (see ``top_k.prunes_well``)."""
    return 1 <= k < n_vocab and prunes_well(n_vocab, k + n_bias)


def truncate_rows(
    logits: np.ndarray,
    rows: np.ndarray,
    ks: np.ndarray,
    bias_start: np.ndarray,
    bias_tokens: np.ndarray,
    bias_values: np.ndarray,
    top_p: np.ndarray,
    use_min_p: np.ndarray,
    log_min_p: np.ndarray,
    min_keep: np.ndarray,
    temperature: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Row ``rows[j]`` of the float32 ``logits [n_rows, n_vocab]`` through the chain of sampler ``j``: top-k
    ``ks[j]`` after the bias ``bias_tokens/values[bias_start[j]:bias_start[j + 1]]`` (distinct tokens in
    range), then top-p ``top_p[j]`` (1.0: none), min-p (where ``use_min_p[j]``; its log in ``log_min_p[j]``)
    with ``min_keep[j]``, then ``temperature[j]`` (> 0). Each ``ks[j]`` must pass :func:`compiles`.

    Returns ``(codes, counts, ids, cum)``: per row 0 or the failure (``LOGITS_BROKEN``, ``ALL_MASKED``,
    ``NOTHING_DRAWABLE``), the candidates left ``n``, their ids best first and cumulative probabilities
    (rows of width ``max(ks)``; only the first ``n`` hold anything, ``cum`` only where ``n > 1``)."""
    width = int(ks.max())
    m = rows.shape[0]
    codes = np.zeros(m, np.int64)
    counts = np.zeros(m, np.int64)
    ids = np.zeros((m, width), np.int64)
    cum = np.zeros((m, width), np.float64)
    kernel = _truncate_one if m == 1 else _truncate_rows
    kernel(logits, rows, ks, bias_start, bias_tokens, bias_values, top_p, use_min_p, log_min_p, min_keep,
           temperature, codes, counts, ids, cum)
    return codes, counts, ids, cum


def warmup() -> None:
    """Compile (or load from numba's cache) the kernels: one row, and a batch of rows."""
    warmup_rows(1)
    warmup_rows(2)


def warmup_rows(m: int) -> None:
    """Compile (or load) the kernel :func:`truncate_rows` runs for ``m`` rows (1: the lone sequence's)."""
    x = np.arange(4 * BLOCK, dtype=np.float32)[None, :].repeat(m, axis=0)
    one = np.ones(m)
    truncate_rows(x, np.arange(m, dtype=np.int64), np.ones(m, np.int64), np.zeros(m + 1, np.int64),
                  np.zeros(0, np.int64), np.zeros(0), 0.5 * one, np.ones(m, np.bool_), -one, np.ones(m, np.int64), one)
