"""Fast ``out = x @ W^T`` on raw GGML blocks: numba kernels that never build the f32 weight matrix.

Supported weight types: Q8_0, Q4_0, Q4_1 (integer path, here) and F32, F16, BF16 (float path, whose
kernels are :mod:`~minfer.backends.cpu.float_matmul`'s): :func:`matmul` is the entry point for all of them.
Q5_0, Q5_1 and the K-quants are :mod:`~minfer.backends.cpu.kquant_matmul`'s.

Integer path (what llama.cpp does in ``ggml_vec_dot_q4_0_q8_0`` / ``q4_1_q8_1`` / ``q8_0_q8_0``)
    The activations are quantized once per call (or once for several matmuls sharing an input, see
    :func:`quantize_activations`) to blocks of 32 int8 with a float32 scale: ``d = amax / 127``,
    ``q = roundf(x * (1/d))`` exactly like ``quantize_row_q8_0_ref``/``q8_1_ref``, and the block sum
    ``d * Σq`` that Q4_1's offset needs. Unlike llama.cpp we keep ``d`` and ``d * Σq`` in float32 rather
    than rounding them to f16 (free here, and slightly more accurate). A weight block against an
    activation block is then an integer dot product, kept in eight int32 lanes:

    * Q4_1 (``w = d_w * n + m``, ``n`` in 0..15): ``d_w d_x Σ n a + m (d_x Σ a)``;
    * Q4_0 (``w = d_w (n - 8)``): ``d_w d_x Σ (n - 8) a``, the ``-8 Σ a`` folded in as integers;
    * Q8_0 (``w = d_w q``): ``d_w d_x Σ q a``.

    Q4_0 and Q4_1 weights in whole groups of eight rows (every real model's) run on :mod:`block32_rows8`'s
    repacked copy (its 512-bit pairs: SmolLM2-135M's 576x1536 and 1536x576 at 512 tokens 1.4x the
    eight-row kernel here, which now serves Q4_1 rows in other shapes). Q4_0's other shapes take the
    row-by-row kernels here: the eight int32 lanes are converted to float and
    accumulated with one fused multiply-add per block (scale ``d_w * d_x``); the row's result is a
    fixed-order horizontal sum of the eight lanes.
    Q4_1 and Q8_0 run on copies repacked at load into groups of eight rows (see ``_q4_1_rows8``,
    ``_q8_0_rows8``): a block's integer sum is exact, and each row does ``acc = fma(float(Σ n a), d_w d_x,
    acc)`` block after block (Q4_1 then ``acc = fma(m, d_x Σa, acc)``).

Determinism
    Every output element is produced by one worker running one fixed sequence of float operations, and
    that sequence does not depend on the thread count, on the tile an element falls in, nor on how many
    tokens are in the call: a token's row of output is bit-identical whether it is computed alone
    (GEMV) or inside a prompt (GEMM), at any thread count. Tests hold both.

How the loops are shaped (measured, see ``bench/matmul_bench.py``)
    numba cannot express SIMD integer dot products by itself (its integers widen to int64 and LLVM then
    leaves the loop scalar), so the block-level operations are small LLVM intrinsics
    (:mod:`~minfer.backends.cpu.simd`): SIMD vector *values* that numba code carries in ordinary local
    variables. On x86 with AVX2 they lower to the same instructions as llama.cpp's AVX2 kernels
    (``vpmaddubsw`` + ``vpmaddwd``, ``vcvtph2ps`` for the f16 scales); elsewhere a generic LLVM vector
    formulation computes the same integer lanes. Q4_0 decode (one token) runs 4 weight rows per pass
    sharing the activation loads; prefill runs one weight row against 8 tokens, unpacking each weight
    block once per 8 tokens. Q4_1 and Q8_0 run eight rows per register for any number of tokens (one
    pmaddubsw serves eight rows).
    With VNNI (``simd.VNNI``) the prefill loops use vpdpbusd: Q8_0 on the activations shifted by 128
    (unsigned) with the 128 Σq of each row's block taken back out, Q4_1 and Q4_0 directly on the
    nibbles; the same exact integers as the AVX2 sequences, so the same bits (``tests/test_vnni.py``).
    With AVX-512 VNNI (``simd512.WIDE``) the Q8_0 prefill runs two groups of eight rows per 512-bit
    register (``_q8_0_pairs``; lane for lane the same operations, ``tests/test_avx512_kernels.py``): 512
    tokens at 1.7B shapes 1.40-1.60x the eight-row kernel. Its first pass over a pair's blocks prefetches
    them: a pass of 2, 4 or 8 tokens then costs 1.00x, 1.10x, 1.30x a 1-token pass (1.7B Q8_0, was 1.38x,
    1.43x, 1.51x on the eight-row kernel).
    Q4_1 against the row-by-row kernels (kept in the bench as variants): 8 tokens ~20% faster, 2-4
    tokens ~2x, prompts of 64+ tokens ~1.7x; one token 10-20% slower in the matmuls alone (it streams the
    same bytes), which end to end (tg128) was lost in the noise. Q8_0 (SmolLM2's 49152x576 output head,
    caches flushed between calls): 8 tokens 3.6 ms against 4.0 ms, one token the same (1.3 ms).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from minfer.backends.cpu import block32_rows8, float_matmul
from minfer.backends.cpu.matmul_tiles import (
    GEMM_ROWS,
    GEMM_TOKENS,
    PARALLEL_QUANTIZE_TOKENS,
    PREFETCH_ROWS,
    as_f32_2d,
    check_operands,
    read_only,
    store_tile,
    weight_bytes,
    weight_shape,
)
from minfer.backends.cpu.simd import (
    LL_F32,
    LL_I32,
    V8I,
    V32B,
    VNNI,
    add_i16x16,
    add_i32x8,
    broadcast_4bytes,
    bytes_128,
    dot_s8s8,
    dot_u8s8,
    dpbusd,
    element_pointer,
    fma_f32,
    fma_f32x8,
    fma_i32x8,
    high_nibbles32,
    hsum_folded,
    hsum_i32x8,
    i8x32,
    i32x8,
    ir_call,
    ir_dot_u8s8,
    ir_isum,
    ir_splat,
    ir_sum_quads,
    is_1d,
    load_bytes32,
    load_element,
    load_f32x8,
    load_half,
    load_halves8,
    load_i32x8,
    load_nibbles32,
    low_nibbles32,
    mul_f32x8,
    neg_i32x8,
    pairs_u8s8,
    prefetch,
    shuffle_mask,
    splat_at,
    splat_constant,
    splat_f32x8,
    store_f32x8,
    store_i32x8,
    sub_i32x8,
    widen_pairs,
    zeros_f32x8,
    zeros_i32x8,
)
from minfer.backends.cpu.simd512 import (
    WIDE,
    add_i32x16,
    broadcast_4bytes_x16,
    bytes_128_x16,
    bytes_x16,
    dpbusd_x16,
    fma_i32x16,
    halves_x16,
    load_f32x16,
    mul_f32x16,
    neg_i32x16,
    splat_at_x16,
    store_f32x16,
    zeros_i32x16,
)
from minfer.errors import ModelError
from minfer.formats.quants import GGMLType
from minfer.formats.tensors import WeightTensor

QK = 32  # values per block of every integer-path type (and of the activation quantization)

_BLOCK_BYTES = {GGMLType.Q8_0: 34, GGMLType.Q4_0: 18, GGMLType.Q4_1: 20}
SUPPORTED_TYPES = (*float_matmul.WIDENING, *_BLOCK_BYTES)


@intrinsic
def _q4_0_offset(typingctx, a):
    """Eight int32 lanes, lane i = 8 Σ_{k<4} a[4i+k]: what Q4_0's ``-8`` removes from Σ n a."""

    def codegen(context, builder, sig, args):
        s = ir_dot_u8s8(builder, splat_constant(V32B, 1), args[0])
        return builder.shl(s, ir.Constant(V8I, [3] * 8))

    return i32x8(i8x32), codegen


# ---------------------------------------------------------------------------------------------------
# Activation quantization
# ---------------------------------------------------------------------------------------------------


class QuantizedActivations:
    """Activations ``x[n_tok, n_in]`` as Q8 blocks of 32: ``x ≈ d * q`` per block.

    ``q``: int8 ``[n_tok, n_in]``, values in -127..127. ``ds``: float32 ``[n_tok, n_in // 32, 2]``
    holding ``(d, d * Σq)`` per block (the second is Q4_1's offset term, llama.cpp's ``block_q8_1.s``).
    Both are views of flat buffers (``q_flat``, ``ds_flat``) that the kernels take directly (no view is
    built per call).
    """

    __slots__ = ("q", "ds", "_q", "_ds")

    def __init__(self, n_tok: int, n_in: int, take: Callable[[str, int, Any], np.ndarray] | None = None) -> None:
        # ``take(part, elements, dtype)``: where the flat buffers come from (a plan's shared arena)
        take = take or (lambda part, n, dtype: np.empty(n, dtype))
        self._q = take("q", n_tok * n_in, np.int8)
        self._ds = take("ds", n_tok * (n_in // QK) * 2, np.float32)
        self.q = self._q.reshape(n_tok, n_in)
        self.ds = self._ds.reshape(n_tok, n_in // QK, 2)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def q_flat(self) -> np.ndarray:
        """``q`` as the flat buffer the kernels take."""
        return self._q

    @property
    def ds_flat(self) -> np.ndarray:
        """``ds`` as the flat buffer the kernels take."""
        return self._ds


@intrinsic
def _block_amax(typingctx, x, o):
    """max |x[o:o+32]| of a flat float32 array, in vector registers (max is exact in any order)."""
    if not (is_1d(x) and x.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        v32f = ir.VectorType(LL_F32, QK)
        xv = load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], v32f)
        a = ir_call(builder, "llvm.fabs.v32f32", v32f, [xv])
        while a.type.count > 1:  # halves: 16, 8, 4, 2, 1 lanes
            n = a.type.count // 2
            lo = builder.shuffle_vector(a, a, shuffle_mask(n, lambda i: i))
            hi = builder.shuffle_vector(a, a, shuffle_mask(n, lambda i, n=n: i + n))
            a = builder.select(builder.fcmp_ordered(">", hi, lo), hi, lo)
        return builder.extract_element(a, ir.Constant(LL_I32, 0))

    return types.float32(x, o), codegen


@intrinsic
def _quantize_block(typingctx, x, xo, inv, q, qo):
    """``q[qo:qo+32] = roundf(x[xo:xo+32] * inv)`` (int8; flat float32 ``x``, int8 ``q``) and the sum of
    the 32 integers, in vector registers. roundf (half away from zero, llama.cpp's ``roundf``) is taken as
    rint (half to even) corrected on exact halves: ``v - rint(v)`` is exact, and where it is ±0.5 the
    result is ``v + copysign(0.5, v)``, itself exact. The same integers as ``floor(|v| + 0.5)`` with v's
    sign, for every float32 v (checked against it on random and tie-heavy blocks)."""
    if not (is_1d(x) and is_1d(q) and x.dtype == types.float32 and inv == types.float32):
        return None

    def codegen(context, builder, sig, args):
        v32f = ir.VectorType(LL_F32, QK)
        xv = load_element(context, builder, sig.args[0], args[0], args[1], sig.args[1], v32f)
        v = builder.fmul(xv, ir_splat(builder, args[2], QK))
        r = ir_call(builder, "llvm.rint.v32f32", v32f, [v])
        diff = ir_call(builder, "llvm.fabs.v32f32", v32f, [builder.fsub(v, r)])
        half = ir.Constant(v32f, [0.5] * QK)
        away = builder.fadd(v, ir_call(builder, "llvm.copysign.v32f32", v32f, [half, v]))
        r = builder.select(builder.fcmp_ordered("==", diff, half), away, r)
        qi = builder.fptosi(r, ir.VectorType(LL_I32, QK))
        q_ptr = element_pointer(context, builder, sig.args[3], args[3], args[4], sig.args[4], V32B)
        builder.store(builder.trunc(qi, V32B), q_ptr, align=1)
        return ir_isum(builder, ir_sum_quads(builder, qi))  # 8 lanes of 4, then the 8 lanes: exact integers

    return types.int32(x, xo, inv, q, qo), codegen


@njit(inline="always")
def _quantize_token(x, q, ds, t, n_in):
    """Token ``t`` of the flat ``x [n_tok * n_in]`` into the flat ``q`` and ``ds [n_tok * n_blocks * 2]``."""
    nb = n_in // QK
    for b in range(nb):
        o = t * n_in + b * QK
        d = _block_amax(x, o) / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        total = _quantize_block(x, o, inv, q, o)
        ds[2 * (t * nb + b)] = d
        ds[2 * (t * nb + b) + 1] = d * np.float32(total)


@njit(cache=True)
def _quantize_serial(x, q, ds, n_in):
    for t in range(x.shape[0] // n_in):
        _quantize_token(x, q, ds, t, n_in)


@njit(parallel=True, cache=True)
def _quantize_parallel(x, q, ds, n_in):
    for t in prange(x.shape[0] // n_in):
        _quantize_token(x, q, ds, t, n_in)


def quantize_activations(x: np.ndarray, out: QuantizedActivations | None = None) -> QuantizedActivations:
    """Quantize float32 activations ``x[n_tok, n_in]`` (``n_in`` a multiple of 32) to Q8 blocks.

    The result can be shared by every matmul that reads the same ``x`` (q/k/v, gate/up). Pass ``out``
    (of the same shape) to reuse its buffers instead of allocating.
    """
    x = as_f32_2d(x)
    n_tok, n_in = x.shape
    if n_in % QK:
        raise ModelError(f"cannot quantize activations of width {n_in}: not a multiple of {QK}")
    if out is None or out.q.shape != x.shape:
        out = QuantizedActivations(n_tok, n_in)
    kernel = _quantize_parallel if n_tok >= PARALLEL_QUANTIZE_TOKENS else _quantize_serial
    kernel(x.reshape(-1), out._q, out._ds, n_in)
    return out


# ---------------------------------------------------------------------------------------------------
# Per-block steps, shared by decode and prefill so that both run the same float operations
# ---------------------------------------------------------------------------------------------------
# ``w`` is the whole weight tensor as one flat uint8 array, ``o`` a block's byte offset; ``a`` the 32
# activation int8 of the matching block; ``dx`` its scale.


@njit(inline="always")
def _step_q4_0(acc, w, o, a, off8, dx):
    """Q4_0: acc += (Σn·a - 8Σa) lanes * (d_w d_x); exact integers up to the scale."""
    vi = sub_i32x8(dot_u8s8(load_nibbles32(w, o + 2), a), off8)
    return fma_i32x8(acc, vi, splat_f32x8(load_half(w, o) * dx))


@njit(inline="always")
def _row_q4_0(w, o, nb, aq, ao, ds, do):
    acc = zeros_f32x8()
    for b in range(nb):
        a = load_bytes32(aq, ao + QK * b)
        acc = _step_q4_0(acc, w, o + 18 * b, a, _q4_0_offset(a), ds[do + 2 * b])
    return hsum_folded(acc)


# ---------------------------------------------------------------------------------------------------
# Decode: one token (GEMV), 4 weight rows per pass sharing each activation block's loads
# ---------------------------------------------------------------------------------------------------
# Arguments: w flat uint8 raw blocks, rb bytes per row, aq int8[n_in], ds float32[2 * n_blocks],
# out float32[1, n_out] (the same flat arguments as prefill, so the caller builds no views).
# Each prange iteration owns four whole rows; the last 1..3 rows run after the parallel loop.
#
# Decode streams every weight once from DRAM (SmolLM2's 92 MiB exceed the L3), and four interleaved
# row streams defeat the hardware prefetcher: without help one thread read only ~7 GB/s on the
# 49152x576 output head (measured with the row-by-row Q8_0 kernel, now a bench variant). Each pass
# therefore prefetches the bytes it will need PREFETCH_ROWS rows ahead (the four rows of a pass are
# contiguous, consumed at 4 blocks per iteration), which tripled that.


@njit(parallel=True, cache=True)
def _gemv_q4_0(w, rb, aq, ds, out):
    n_out = out.shape[1]
    nb = aq.shape[0] // QK
    n_pass = n_out // 4
    for p in prange(n_pass):
        r0 = 4 * p
        acc0, acc1, acc2, acc3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
        o = r0 * rb
        pf = o + PREFETCH_ROWS * rb
        for b in range(nb):
            prefetch(w, pf)
            prefetch(w, pf + 64)
            pf += 72
            a = load_bytes32(aq, QK * b)
            off8 = _q4_0_offset(a)
            dx = ds[2 * b]
            acc0 = _step_q4_0(acc0, w, o, a, off8, dx)
            acc1 = _step_q4_0(acc1, w, o + rb, a, off8, dx)
            acc2 = _step_q4_0(acc2, w, o + 2 * rb, a, off8, dx)
            acc3 = _step_q4_0(acc3, w, o + 3 * rb, a, off8, dx)
            o += 18
        out[0, r0] = hsum_folded(acc0)
        out[0, r0 + 1] = hsum_folded(acc1)
        out[0, r0 + 2] = hsum_folded(acc2)
        out[0, r0 + 3] = hsum_folded(acc3)
    for r in range(4 * n_pass, n_out):
        out[0, r] = _row_q4_0(w, r * rb, nb, aq, 0, ds, 0)


# ---------------------------------------------------------------------------------------------------
# Prefill: many tokens (GEMM). Work item = GEMM_ROWS weight rows (one worker owns them); inside it,
# tiles of GEMM_TOKENS tokens: each weight block is unpacked once and used against all 8 tokens.
# Tokens past the last whole tile run the decode row functions (same operations, same results).
# ---------------------------------------------------------------------------------------------------
# Arguments: w flat uint8, rb, aq int8[n_tok * n_in] flat, ds float32[n_tok * n_blocks * 2] flat,
# out float32[n_tok, n_out].


@njit(inline="always")
def tile_scales(ds, n_full, nb):
    """Every whole tile's activation block scales, laid out for the inner loop, computed once per call.

    ``d_b[((tile * nb + block) * 8 + token) * 8 + lane]``: the scale d_x repeated in 8 lanes, so that the
    per-pair product d_w * d_x is one vector multiply with a plain 256-bit load. (Given a scalar, LLVM
    multiplies first and broadcasts after: one more instruction per pair, and the pairs are the whole
    cost: prefill ran 1.5x slower that way.) ``s_t[(tile * nb + block) * 8 + token]``: d_x Σq, whose
    8 tokens one load serves (Q4_1's offset term).
    """
    d_b = np.empty(n_full * nb * 8, np.float32)
    s_t = np.empty(n_full * nb, np.float32)
    for t in range(n_full):
        base = (t // GEMM_TOKENS) * nb * GEMM_TOKENS + t % GEMM_TOKENS
        for b in range(nb):
            i = base + b * GEMM_TOKENS
            d = ds[(t * nb + b) * 2]
            for lane in range(8):
                d_b[i * 8 + lane] = d
            s_t[i] = ds[(t * nb + b) * 2 + 1]
    return d_b, s_t


@njit(inline="always")
def _q4_0_dot(q, aq, ao, off, k):
    """Σ (n - 8) a of one block in eight int32 lanes: ``off[k:]`` holds 8 Σa (its negation under VNNI,
    where one vpdpbusd adds Σ n a to it; the same exact integers)."""
    if VNNI:
        return dpbusd(load_i32x8(off, k), q, load_bytes32(aq, ao))
    return sub_i32x8(dot_u8s8(q, load_bytes32(aq, ao)), load_i32x8(off, k))


@njit(parallel=True, cache=True)
def _gemm_q4_0(w, rb, aq, ds, out):
    n_tok, n_out = out.shape
    n_in = aq.shape[0] // n_tok
    nb = n_in // QK
    n_full = n_tok - n_tok % GEMM_TOKENS
    d_b, _ = tile_scales(ds, n_full, nb)
    # the tiles' -8 Σa lanes (Q4_0's offset), computed once per call rather than once per weight row
    off = np.empty(n_full * nb * 8, np.int32)
    for t in range(n_full):
        for b in range(nb):
            i = ((t // GEMM_TOKENS) * nb + b) * GEMM_TOKENS + t % GEMM_TOKENS
            o8 = _q4_0_offset(load_bytes32(aq, t * n_in + b * QK))
            store_i32x8(off, i * 8, neg_i32x8(o8) if VNNI else o8)
    for g in prange((n_out + GEMM_ROWS - 1) // GEMM_ROWS):
        r0 = g * GEMM_ROWS
        r1 = min(n_out, r0 + GEMM_ROWS)
        for t0 in range(0, n_full, GEMM_TOKENS):
            tb = t0 * nb
            for r in range(r0, r1):
                a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
                a4, a5, a6, a7 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
                o = r * rb
                ao = t0 * n_in
                for b in range(nb):
                    q = load_nibbles32(w, o + 2)
                    dw = splat_f32x8(load_half(w, o))
                    c = tb + b * GEMM_TOKENS
                    k = c * 8  # c indexes [tile, block, token]; 8 lanes each
                    v0 = _q4_0_dot(q, aq, ao, off, k)
                    v1 = _q4_0_dot(q, aq, ao + n_in, off, k + 8)
                    v2 = _q4_0_dot(q, aq, ao + 2 * n_in, off, k + 16)
                    v3 = _q4_0_dot(q, aq, ao + 3 * n_in, off, k + 24)
                    v4 = _q4_0_dot(q, aq, ao + 4 * n_in, off, k + 32)
                    v5 = _q4_0_dot(q, aq, ao + 5 * n_in, off, k + 40)
                    v6 = _q4_0_dot(q, aq, ao + 6 * n_in, off, k + 48)
                    v7 = _q4_0_dot(q, aq, ao + 7 * n_in, off, k + 56)
                    a0 = fma_i32x8(a0, v0, mul_f32x8(dw, load_f32x8(d_b, 8 * c)))
                    a1 = fma_i32x8(a1, v1, mul_f32x8(dw, load_f32x8(d_b, 8 * c + 8)))
                    a2 = fma_i32x8(a2, v2, mul_f32x8(dw, load_f32x8(d_b, 8 * c + 16)))
                    a3 = fma_i32x8(a3, v3, mul_f32x8(dw, load_f32x8(d_b, 8 * c + 24)))
                    a4 = fma_i32x8(a4, v4, mul_f32x8(dw, load_f32x8(d_b, 8 * c + 32)))
                    a5 = fma_i32x8(a5, v5, mul_f32x8(dw, load_f32x8(d_b, 8 * c + 40)))
                    a6 = fma_i32x8(a6, v6, mul_f32x8(dw, load_f32x8(d_b, 8 * c + 48)))
                    a7 = fma_i32x8(a7, v7, mul_f32x8(dw, load_f32x8(d_b, 8 * c + 56)))
                    o += 18
                    ao += QK
                store_tile(out, t0, r, a0, a1, a2, a3, a4, a5, a6, a7)
        for t in range(n_full, n_tok):
            for r in range(r0, r1):
                out[t, r] = _row_q4_0(w, r * rb, nb, aq, t * n_in, ds, t * nb * 2)


# ---------------------------------------------------------------------------------------------------
# Q4_1 in groups of eight rows: the weights are repacked once (see _repack_q4_1) so that one 256-bit
# register holds four consecutive values of each of eight rows; four activation bytes broadcast to all
# lanes then give eight rows' products in one pmaddubsw. The int16 pair sums of a block's eight such
# steps are added exactly (at most 16 products of 15 x 127 per lane: 30480 < 2^15), widened once, and
# converted once: per token and block that is ~20 vector operations for eight rows, against ~40 in the
# row-by-row tile. Every row and token then does, in block order, ``acc = fma(float(Σqa), d_w d_x,
# acc); acc = fma(m, d_x Σa, acc)`` (the block's integer sum is exact): the same float operations for
# any number of tokens (decode or prefill), any thread count, and for the rows past the last whole
# group, which take _q4_1_row_exact on the raw blocks.
#
# Up to ROWS8_REGISTER_TOKENS tokens (decode, a batch of decodes) go four at a time through a group's
# blocks, their eight-row accumulators held in registers from the first block to the last (then one at
# a time for the last n_tok % 4): the four tokens' independent chains sit side by side in one loop body,
# where the CPU overlaps them. More tokens (prefill) take one pass per block over up to ROWS8_TOKENS
# tokens with the accumulators in memory, which unpacks each block's nibbles once for all of them.
# Measured on SmolLM2's shapes, cold weights, 2 threads (old/new paired, median): 8 tokens 10-20%
# faster in registers, 4 tokens 13-43%; 16 and 32 tokens even or 6% slower, 64 tokens 8% slower on
# 576x1536. (Q8_0 keeps the memory path: its sign trick needs 16 weight registers, and four register
# accumulators measured even at 8 tokens, 15% slower at 64.)
# ---------------------------------------------------------------------------------------------------
ROWS8_QUAD = 4  # tokens whose accumulators stay in registers through one pass over a group's blocks
ROWS8_REGISTER_TOKENS = 8  # the most tokens that take the register path
ROWS8_TOKENS = 64  # tokens per pass over a group's weights in memory: their activations stay in L2
# decode streams the weights from DRAM: fetch this many bytes of the repacked copy ahead
ROWS8_PREFETCH = 2048


@njit(inline="always")
def _rows8_weights(packed, o):
    """A group's block at byte ``o`` of the repacked copy, as one tuple: its eight nibble registers (four
    consecutive values of each row), then the rows' d and m; the bytes a few blocks ahead are prefetched
    (decode streams the weights from DRAM). (One flat tuple, indexed: numba's parallel-loop analysis
    rejects unpacking a nested one.)"""
    prefetch(packed, o + ROWS8_PREFETCH)
    prefetch(packed, o + ROWS8_PREFETCH + 64)
    prefetch(packed, o + ROWS8_PREFETCH + 128)
    return (
        low_nibbles32(packed, o), high_nibbles32(packed, o), low_nibbles32(packed, o + 32),
        high_nibbles32(packed, o + 32), low_nibbles32(packed, o + 64), high_nibbles32(packed, o + 64),
        low_nibbles32(packed, o + 96), high_nibbles32(packed, o + 96),
        load_halves8(packed, o + 128), load_halves8(packed, o + 144),
    )


@njit(inline="always")
def _rows8_block(w, aq, ao):
    """Eight int32 lanes: lane r = Σ q a over one block of row r (registers 0..7 of _rows8_weights)
    against the activation block at byte ``ao``; exact."""
    p = pairs_u8s8(w[0], broadcast_4bytes(aq, ao))
    p = add_i16x16(p, pairs_u8s8(w[1], broadcast_4bytes(aq, ao + 4)))
    p = add_i16x16(p, pairs_u8s8(w[2], broadcast_4bytes(aq, ao + 8)))
    p = add_i16x16(p, pairs_u8s8(w[3], broadcast_4bytes(aq, ao + 12)))
    p = add_i16x16(p, pairs_u8s8(w[4], broadcast_4bytes(aq, ao + 16)))
    p = add_i16x16(p, pairs_u8s8(w[5], broadcast_4bytes(aq, ao + 20)))
    p = add_i16x16(p, pairs_u8s8(w[6], broadcast_4bytes(aq, ao + 24)))
    p = add_i16x16(p, pairs_u8s8(w[7], broadcast_4bytes(aq, ao + 28)))
    return widen_pairs(p)


@njit(inline="always")
def _rows8_block_vnni(w, aq, ao):
    """``_rows8_block`` as eight vpdpbusd (VNNI; the same exact integers)."""
    return block32_rows8.dot_block_vnni(zeros_i32x8(), w, aq, ao)


@njit(inline="always")
def _q4_1_rows8_step_vnni(acc, w, aq, ao, ds, do):
    """``_q4_1_rows8_step`` with ``_rows8_block_vnni`` (prefill)."""
    acc = fma_i32x8(acc, _rows8_block_vnni(w, aq, ao), mul_f32x8(w[8], splat_at(ds, do)))
    return fma_f32x8(acc, w[9], splat_at(ds, do + 1))


@njit(inline="always")
def _q4_1_row_exact(raw, o, nb, aq, ao, ds, do):
    """One Q4_1 row (raw blocks from byte ``o``) against one token, with the row groups' arithmetic."""
    acc = np.float32(0.0)
    for b in range(nb):
        isum = hsum_i32x8(dot_u8s8(load_nibbles32(raw, o + 20 * b + 4), load_bytes32(aq, ao + QK * b)))
        acc = fma_f32(np.float32(isum), load_half(raw, o + 20 * b) * ds[do + 2 * b], acc)
        acc = fma_f32(load_half(raw, o + 20 * b + 2), ds[do + 2 * b + 1], acc)
    return acc


@njit(inline="always")
def _q4_1_rows8_step(acc, w, aq, ao, ds, do):
    """``acc`` (eight rows of one token) after one block: ``w`` from _rows8_weights, the token's
    activation block at byte ``ao`` of ``aq`` and its (d, d Σa) at ``ds[do]``."""
    acc = fma_i32x8(acc, _rows8_block(w, aq, ao), mul_f32x8(w[8], splat_at(ds, do)))
    return fma_f32x8(acc, w[9], splat_at(ds, do + 1))


@njit(parallel=True, cache=True)
def _q4_1_rows8(packed, raw, rb, aq, ds, out):
    """``out[n_tok, n_out]`` for a Q4_1 weight: ``packed`` from _repack_q4_1 (whole groups of eight rows),
    ``raw`` the original blocks (rows past the last whole group)."""
    n_tok, n_out = out.shape
    nb = rb // 20
    n_in = nb * QK
    n_groups = n_out // 8
    in_registers = n_tok <= ROWS8_REGISTER_TOKENS
    span = 0 if in_registers else 8 * min(n_tok, ROWS8_TOKENS)
    acc = np.empty(n_groups * span, np.float32)  # each group's accumulators (one allocation per call)
    flat = out.reshape(-1)
    for g in prange(n_groups):
        o = g * nb * 160
        if in_registers:
            t = 0
            while t + ROWS8_QUAD <= n_tok:
                a0 = a1 = a2 = a3 = zeros_f32x8()
                for b in range(nb):
                    w = _rows8_weights(packed, o + b * 160)
                    ao = t * n_in + b * QK
                    do = (t * nb + b) * 2
                    a0 = _q4_1_rows8_step(a0, w, aq, ao, ds, do)
                    a1 = _q4_1_rows8_step(a1, w, aq, ao + n_in, ds, do + 2 * nb)
                    a2 = _q4_1_rows8_step(a2, w, aq, ao + 2 * n_in, ds, do + 4 * nb)
                    a3 = _q4_1_rows8_step(a3, w, aq, ao + 3 * n_in, ds, do + 6 * nb)
                store_f32x8(flat, t * n_out + 8 * g, a0)
                store_f32x8(flat, (t + 1) * n_out + 8 * g, a1)
                store_f32x8(flat, (t + 2) * n_out + 8 * g, a2)
                store_f32x8(flat, (t + 3) * n_out + 8 * g, a3)
                t += ROWS8_QUAD
            while t < n_tok:  # decode, and the last n_tok % 4 tokens
                a0 = zeros_f32x8()
                for b in range(nb):
                    w = _rows8_weights(packed, o + b * 160)
                    a0 = _q4_1_rows8_step(a0, w, aq, t * n_in + b * QK, ds, (t * nb + b) * 2)
                store_f32x8(flat, t * n_out + 8 * g, a0)
                t += 1
            continue
        h = g * span
        for t0 in range(0, n_tok, ROWS8_TOKENS):
            t1 = min(n_tok, t0 + ROWS8_TOKENS)
            for i in range(h, h + 8 * (t1 - t0)):
                acc[i] = np.float32(0.0)
            for b in range(nb):
                w = _rows8_weights(packed, o + b * 160)
                for t in range(t0, t1):
                    k = h + 8 * (t - t0)
                    if VNNI:
                        step = _q4_1_rows8_step_vnni(load_f32x8(acc, k), w, aq, t * n_in + b * QK, ds,
                                                     (t * nb + b) * 2)
                    else:
                        step = _q4_1_rows8_step(load_f32x8(acc, k), w, aq, t * n_in + b * QK, ds, (t * nb + b) * 2)
                    store_f32x8(acc, k, step)
            for t in range(t0, t1):
                store_f32x8(flat, t * n_out + 8 * g, load_f32x8(acc, h + 8 * (t - t0)))
    for r in range(8 * n_groups, n_out):  # the last 1..7 rows
        for t in range(n_tok):
            out[t, r] = _q4_1_row_exact(raw, r * rb, nb, aq, t * n_in, ds, t * nb * 2)


@njit(parallel=True, cache=True)
def _repack_q4_1_kernel(raw, rb, packed):
    """:func:`repack_q4_1_reference`'s layout from the flat raw rows (``rb`` bytes each), one pass, the
    groups in parallel (at load: 0.03 s for SmolLM2's 200 Q4_1 matrices on 2 threads, 0.5 s in numpy)."""
    nb = rb // 20
    n_groups = packed.shape[0] // (nb * 160)
    for g in prange(n_groups):
        for b in range(nb):
            po = (g * nb + b) * 160
            for r in range(8):
                src = (8 * g + r) * rb + b * 20
                for c in range(4):
                    # values 8c + i and 8c + 4 + i: low nibbles of bytes 0..15 for c < 2, high ones after
                    q = src + 4 + 8 * (c % 2)
                    shift = 4 * (c // 2)
                    for i in range(4):
                        lo = (raw[q + i] >> shift) & 15
                        hi = (raw[q + 4 + i] >> shift) & 15
                        packed[po + 32 * c + 4 * r + i] = lo | (hi << 4)
                for j in range(4):  # d (bytes 0, 1), then m (2, 3)
                    packed[po + 128 + 16 * (j // 2) + 2 * r + j % 2] = raw[src + j]


def _repack_q4_1(data: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q4_1 rows [n_out, n_in] -> the layout of :func:`repack_q4_1_reference`, by the compiled kernel."""
    nb = n_in // QK
    packed = np.empty(n_out // 8 * nb * 160, np.uint8)
    _repack_q4_1_kernel(np.ascontiguousarray(data).reshape(-1), nb * 20, packed)
    return packed


def repack_q4_1_reference(data: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q4_1 rows [n_out, n_in] (raw blocks of 20 bytes: f16 d, f16 m, 16 bytes of nibbles with value j in
    byte j's low and value j + 16 in its high nibble) -> the layout of _q4_1_rows8 for the whole groups
    of 8 rows: per group and block, 160 bytes (the same 20 per row and block as the file, one stream):

    * 128 bytes ``[chunk c (4), row (8), i (4)]`` holding value 8c + i of the row in the low nibble and
      value 8c + 4 + i in the high one (chunk c's low nibbles: four consecutive values of each row, as
      are its high nibbles);
    * the eight rows' d, then their m, as float16 (16 + 16 bytes)."""
    nb = n_in // QK
    g = n_out // 8
    blocks = data[: 8 * g].reshape(g, 8, nb, 20)
    qs = blocks[..., 4:20]
    values = np.concatenate((qs & 15, qs >> 4), axis=3)  # [g, row, block, value k]
    v = values.transpose(0, 2, 1, 3).reshape(g, nb, 8, 4, 8).transpose(0, 1, 3, 2, 4)  # [g, block, c, row, j]
    nibbles = (v[..., :4] | (v[..., 4:] << 4)).astype(np.uint8).reshape(g, nb, 128)
    scales = blocks[..., 0:4].reshape(g, 8, nb, 2, 2).transpose(0, 2, 3, 1, 4).reshape(g, nb, 32)  # d x8, m x8
    return np.ascontiguousarray(np.concatenate((nibbles, scales), axis=2)).reshape(-1)


# ---------------------------------------------------------------------------------------------------
# Q8_0 in groups of eight rows, as Q4_1: a repacked copy (see _repack_q8_0) holds in one 256-bit
# register four consecutive values of each of eight rows; four activation bytes broadcast to all lanes
# then give eight rows' products per register with llama.cpp's sign trick (|w| * (a * sign(w)) in one
# pmaddubsw: pairs at most 2 * 128 * 127 < 2^15), widened to int32 at once (two such pairs would not
# fit int16). A block's integer sum is exact; every row and token then does ``acc = fma(float(Σqa),
# d_w d_x, acc)`` block after block: the same float operations for any number of tokens, any thread
# count, and for the rows past the last whole group (_q8_0_row_exact on the raw blocks). Per token and
# block that is ~35 vector operations for eight rows, against ~56 in the row-by-row tile.
# ---------------------------------------------------------------------------------------------------


@njit(inline="always")
def _q8_rows8_weights(packed, o):
    """A group's block at byte ``o`` of the repacked Q8_0 copy: its eight value registers (four
    consecutive values of each row), then the rows' d; the bytes a few blocks ahead are prefetched."""
    prefetch(packed, o + ROWS8_PREFETCH)
    prefetch(packed, o + ROWS8_PREFETCH + 64)
    prefetch(packed, o + ROWS8_PREFETCH + 128)
    prefetch(packed, o + ROWS8_PREFETCH + 192)
    prefetch(packed, o + ROWS8_PREFETCH + 256)
    return (
        load_bytes32(packed, o), load_bytes32(packed, o + 32), load_bytes32(packed, o + 64),
        load_bytes32(packed, o + 96), load_bytes32(packed, o + 128), load_bytes32(packed, o + 160),
        load_bytes32(packed, o + 192), load_bytes32(packed, o + 224),
        load_halves8(packed, o + 256),
    )


@njit(inline="always")
def _q8_rows8_block(w, aq, ao):
    """Eight int32 lanes: lane r = Σ q a over one block of row r against the activation block at byte
    ``ao``; exact."""
    s = dot_s8s8(w[0], broadcast_4bytes(aq, ao))
    s = add_i32x8(s, dot_s8s8(w[1], broadcast_4bytes(aq, ao + 4)))
    s = add_i32x8(s, dot_s8s8(w[2], broadcast_4bytes(aq, ao + 8)))
    s = add_i32x8(s, dot_s8s8(w[3], broadcast_4bytes(aq, ao + 12)))
    s = add_i32x8(s, dot_s8s8(w[4], broadcast_4bytes(aq, ao + 16)))
    s = add_i32x8(s, dot_s8s8(w[5], broadcast_4bytes(aq, ao + 20)))
    s = add_i32x8(s, dot_s8s8(w[6], broadcast_4bytes(aq, ao + 24)))
    return add_i32x8(s, dot_s8s8(w[7], broadcast_4bytes(aq, ao + 28)))


@njit(inline="always")
def _q8_rows8_offset(w):
    """-128 Σ q of each of the eight rows' block (VNNI: what the activations' +128 adds to Σ q a)."""
    k = bytes_128()
    s = dpbusd(dpbusd(dpbusd(dpbusd(zeros_i32x8(), k, w[0]), k, w[1]), k, w[2]), k, w[3])
    return neg_i32x8(dpbusd(dpbusd(dpbusd(dpbusd(s, k, w[4]), k, w[5]), k, w[6]), k, w[7]))


@njit(inline="always")
def _q8_rows8_block_vnni(w, neg, au, ao):
    """``_q8_rows8_block`` under VNNI (the same exact integers): ``au`` holds the activations + 128 as
    unsigned bytes, so one vpdpbusd does four values of eight rows; ``neg`` (``_q8_rows8_offset``) takes
    the 128 Σ q back out."""
    # two chains of four (integer sums: any order gives the same result), half the latency of one
    s = dpbusd(neg, broadcast_4bytes(au, ao), w[0])
    r = dpbusd(zeros_i32x8(), broadcast_4bytes(au, ao + 4), w[1])
    s = dpbusd(s, broadcast_4bytes(au, ao + 8), w[2])
    r = dpbusd(r, broadcast_4bytes(au, ao + 12), w[3])
    s = dpbusd(s, broadcast_4bytes(au, ao + 16), w[4])
    r = dpbusd(r, broadcast_4bytes(au, ao + 20), w[5])
    s = dpbusd(s, broadcast_4bytes(au, ao + 24), w[6])
    return add_i32x8(s, dpbusd(r, broadcast_4bytes(au, ao + 28), w[7]))


@njit(parallel=True, cache=True)
def _shift_activations(aq, au):
    """``au`` = the int8 activations + 128 as uint8 (VNNI prefill: vpdpbusd multiplies unsigned by signed)."""
    for i in prange(au.shape[0]):
        au[i] = np.uint8(np.int32(aq[i]) + 128)


def _shifted_activations(aq: np.ndarray, n_tok: int) -> np.ndarray:
    """What _q8_0_rows8 takes as ``au``: the shifted activations for a VNNI prefill, else nothing."""
    if not VNNI or n_tok == 1:
        return _NO_BYTES
    au = np.empty(aq.shape[0], np.uint8)
    _shift_activations(aq, au)
    return au


@njit(inline="always")
def _q8_0_row_exact(raw, o, nb, aq, ao, ds, do):
    """One Q8_0 row (raw blocks from byte ``o``) against one token, with the row groups' arithmetic."""
    acc = np.float32(0.0)
    for b in range(nb):
        isum = hsum_i32x8(dot_s8s8(load_bytes32(raw, o + 34 * b + 2), load_bytes32(aq, ao + QK * b)))
        acc = fma_f32(np.float32(isum), load_half(raw, o + 34 * b) * ds[do + 2 * b], acc)
    return acc


@njit(parallel=True, cache=True)
def _q8_0_rows8(packed, raw, rb, aq, au, ds, out):
    """``out[n_tok, n_out]`` for a Q8_0 weight: ``packed`` from _repack_q8_0 (whole groups of eight rows),
    ``raw`` the original blocks (rows past the last whole group), ``au`` the activations + 128 (VNNI
    prefill, see _shifted_activations; unused otherwise)."""
    n_tok, n_out = out.shape
    nb = rb // 34
    n_in = nb * QK
    n_groups = n_out // 8
    span = 0 if n_tok == 1 else 8 * min(n_tok, ROWS8_TOKENS)
    acc = np.empty(n_groups * span, np.float32)  # each group's accumulators (one allocation per call)
    flat = out.reshape(-1)
    for g in prange(n_groups):
        o = g * nb * 272
        if n_tok == 1:  # decode: the accumulator stays in a register
            a = zeros_f32x8()
            for b in range(nb):
                w = _q8_rows8_weights(packed, o + b * 272)
                a = fma_i32x8(a, _q8_rows8_block(w, aq, b * QK), mul_f32x8(w[8], splat_at(ds, 2 * b)))
            store_f32x8(flat, 8 * g, a)
            continue
        _q8_0_group_prefill(packed, o, aq, au, ds, acc, g * span, n_tok, nb, flat, n_out, g)
    for r in range(8 * n_groups, n_out):  # the last 1..7 rows
        for t in range(n_tok):
            out[t, r] = _q8_0_row_exact(raw, r * rb, nb, aq, t * n_in, ds, t * nb * 2)


@njit(inline="always")
def _q8_0_group_prefill(packed, o, aq, au, ds, acc, h, n_tok, nb, flat, n_out, g):
    """Group ``g`` (its repacked blocks from byte ``o``) against ``n_tok`` > 1 tokens, ``ROWS8_TOKENS`` at a
    time, with its accumulators at ``acc[h:]``."""
    n_in = nb * QK
    for t0 in range(0, n_tok, ROWS8_TOKENS):
        t1 = min(n_tok, t0 + ROWS8_TOKENS)
        for i in range(h, h + 8 * (t1 - t0)):
            acc[i] = np.float32(0.0)
        for b in range(nb):
            w = _q8_rows8_weights(packed, o + b * 272)
            neg = _q8_rows8_offset(w) if VNNI else zeros_i32x8()
            for t in range(t0, t1):
                k = h + 8 * (t - t0)
                if VNNI:
                    isum = _q8_rows8_block_vnni(w, neg, au, t * n_in + b * QK)
                else:
                    isum = _q8_rows8_block(w, aq, t * n_in + b * QK)
                scale = mul_f32x8(w[8], splat_at(ds, (t * nb + b) * 2))
                store_f32x8(acc, k, fma_i32x8(load_f32x8(acc, k), isum, scale))
        for t in range(t0, t1):
            store_f32x8(flat, t * n_out + 8 * g, load_f32x8(acc, h + 8 * (t - t0)))


@njit(inline="always")
def _q8_0_pair_block(w, neg, au, ao):
    """``_q8_rows8_block_vnni`` for sixteen rows (two groups: ``simd512.bytes_x16``); the same integers."""
    s = dpbusd_x16(neg, broadcast_4bytes_x16(au, ao), w[0])
    r = dpbusd_x16(zeros_i32x16(), broadcast_4bytes_x16(au, ao + 4), w[1])
    s = dpbusd_x16(s, broadcast_4bytes_x16(au, ao + 8), w[2])
    r = dpbusd_x16(r, broadcast_4bytes_x16(au, ao + 12), w[3])
    s = dpbusd_x16(s, broadcast_4bytes_x16(au, ao + 16), w[4])
    r = dpbusd_x16(r, broadcast_4bytes_x16(au, ao + 20), w[5])
    s = dpbusd_x16(s, broadcast_4bytes_x16(au, ao + 24), w[6])
    return add_i32x16(s, dpbusd_x16(r, broadcast_4bytes_x16(au, ao + 28), w[7]))


@njit(inline="always")
def _q8_0_pair_offset(w):
    """``_q8_rows8_offset`` for sixteen rows."""
    k = bytes_128_x16()
    s = zeros_i32x16()
    for c in range(8):
        s = dpbusd_x16(s, k, w[c])
    return neg_i32x16(s)


@njit(parallel=True, cache=True)
def _q8_0_pairs(packed, raw, rb, aq, au, ds, out):
    """``_q8_0_rows8`` for a prefill (``n_tok`` > 1) on 512-bit registers (``simd512.WIDE`` only): two groups
    of eight rows per work item, one in each half of a register. Lane for lane the same integer and float
    operations as the eight-row kernel, so the same bits; an odd last group runs the eight-row code."""
    n_tok, n_out = out.shape
    nb = rb // 34
    n_in = nb * QK
    n_groups = n_out // 8
    n_items = (n_groups + 1) // 2
    span = 16 * min(n_tok, ROWS8_TOKENS)
    acc = np.empty(n_items * span, np.float32)
    flat = out.reshape(-1)
    for p in prange(n_items):
        g = 2 * p
        o = g * nb * 272
        h = p * span
        if g + 1 == n_groups:
            _q8_0_group_prefill(packed, o, aq, au, ds, acc, h, n_tok, nb, flat, n_out, g)
            continue
        o2 = o + nb * 272
        for t0 in range(0, n_tok, ROWS8_TOKENS):
            t1 = min(n_tok, t0 + ROWS8_TOKENS)
            for i in range(h, h + 16 * (t1 - t0)):
                acc[i] = np.float32(0.0)
            for b in range(nb):
                if t0 == 0:  # the first pass over the pair's blocks reads them from memory
                    for c in range(0, 272, 64):
                        prefetch(packed, o + b * 272 + ROWS8_PREFETCH + c)
                        prefetch(packed, o2 + b * 272 + ROWS8_PREFETCH + c)
                w = bytes_x16(packed, o + b * 272, o2 + b * 272)
                wd = halves_x16(packed, o + b * 272 + 256, o2 + b * 272 + 256)
                neg = _q8_0_pair_offset(w)
                for t in range(t0, t1):
                    k = h + 16 * (t - t0)
                    isum = _q8_0_pair_block(w, neg, au, t * n_in + b * QK)
                    scale = mul_f32x16(wd, splat_at_x16(ds, (t * nb + b) * 2))
                    store_f32x16(acc, k, fma_i32x16(load_f32x16(acc, k), isum, scale))
            for t in range(t0, t1):  # groups g and g + 1 are columns 8 g .. 8 g + 15
                store_f32x16(flat, t * n_out + 8 * g, load_f32x16(acc, h + 16 * (t - t0)))
    for r in range(8 * n_groups, n_out):  # the last 1..7 rows
        for t in range(n_tok):
            out[t, r] = _q8_0_row_exact(raw, r * rb, nb, aq, t * n_in, ds, t * nb * 2)


def _q8_0_kernel(n_tok: int) -> Callable[..., None]:
    """The repacked Q8_0 kernel for a call of ``n_tok`` tokens: the 512-bit pairs for a prefill where the
    CPU has them (the same bits as the eight-row kernel's), else the eight-row kernel."""
    return _q8_0_pairs if WIDE and n_tok > 1 else _q8_0_rows8


@njit(parallel=True, cache=True)
def _repack_q8_0_kernel(raw, rb, packed):
    """:func:`repack_q8_0_reference`'s layout from the flat raw rows (``rb`` bytes each), groups in parallel."""
    nb = rb // 34
    n_groups = packed.shape[0] // (nb * 272)
    for g in prange(n_groups):
        for b in range(nb):
            po = (g * nb + b) * 272
            for r in range(8):
                src = (8 * g + r) * rb + b * 34
                for c in range(8):
                    for i in range(4):
                        packed[po + 32 * c + 4 * r + i] = raw[src + 2 + 4 * c + i]
                packed[po + 256 + 2 * r] = raw[src]
                packed[po + 256 + 2 * r + 1] = raw[src + 1]


def _repack_q8_0(data: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q8_0 rows [n_out, n_in] -> the layout of :func:`repack_q8_0_reference`, by the compiled kernel."""
    nb = n_in // QK
    packed = np.empty(n_out // 8 * nb * 272, np.uint8)
    _repack_q8_0_kernel(np.ascontiguousarray(data).reshape(-1), nb * 34, packed)
    return packed


def repack_q8_0_reference(data: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
    """Q8_0 rows [n_out, n_in] (raw blocks of 34 bytes: f16 d, 32 int8 values) -> the layout of
    _q8_0_rows8 for the whole groups of 8 rows: per group and block, 272 bytes (the same 34 per row and
    block as the file, one stream): 256 bytes ``[chunk c (8), row (8), i (4)]`` holding value 4c + i of
    the row, then the eight rows' d as float16 (16 bytes)."""
    nb = n_in // QK
    g = n_out // 8
    blocks = data[: 8 * g].reshape(g, 8, nb, 34)
    values = blocks[..., 2:].reshape(g, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, 256)  # [g, b, c, row, i]
    scales = blocks[..., 0:2].transpose(0, 2, 1, 3).reshape(g, nb, 16)
    return np.ascontiguousarray(np.concatenate((values, scales), axis=2)).reshape(-1)


# Q4_1 and Q8_0 run their row-group kernels on a repacked copy for any number of tokens (Q4_0 block32_rows8's,
# or where its rows are not whole groups, its decode and prefill kernels on the raw blocks): the kernels and
# the repacking
_ROWS8 = {GGMLType.Q4_1: (_q4_1_rows8, _repack_q4_1), GGMLType.Q8_0: (_q8_0_rows8, _repack_q8_0)}


def supports(ggml_type: GGMLType) -> bool:
    """Whether :func:`matmul` has a kernel for weights of this type."""
    return ggml_type in SUPPORTED_TYPES


_NO_BYTES = np.empty(0, np.uint8)  # decode's (unused) shifted activations


class _Prepared:
    """What the kernels need from one weight tensor, computed once per tensor (a decode step calls
    matmul ~200 times on the same tensors: building views and checking sizes each time would cost
    about as much as the small matmuls themselves)."""

    __slots__ = ("tensor", "flat", "rb", "float_kind", "n_out", "n_in", "rows8", "rows8_kernel", "block32_kind")

    def __init__(self, w: WeightTensor) -> None:
        t = w.ggml_type
        self.float_kind = float_matmul.WIDENING.get(t)  # None for blocks
        n_out, n_in = weight_shape(w, "fast", SUPPORTED_TYPES, 1 if self.float_kind is not None else QK)
        if self.float_kind is None:
            rb = n_in // QK * _BLOCK_BYTES[t]
        else:
            rb = n_in * (4 if t == GGMLType.F32 else 2)
        data = w.data
        self.tensor = w
        self.flat = read_only(weight_bytes(w, rb))
        self.rb = rb
        self.n_out, self.n_in = n_out, n_in
        # Q4_1 and Q8_0 run on a repacked copy (both decode and prefill), and so does Q4_0 in whole groups of
        # eight rows (block32_rows8's layout); the raw pages are then given back
        self.rows8 = self.rows8_kernel = self.block32_kind = None
        if block32_rows8.supports(t, n_out, n_in):
            self.block32_kind = block32_rows8.KINDS[t]
            self.rows8 = block32_rows8.repack(t, data.reshape(n_out, rb), n_out, n_in)
            release_file_pages(data)
        elif t in _ROWS8:
            self.rows8_kernel, repack = _ROWS8[t]
            self.rows8 = repack(data.reshape(n_out, rb), n_out, n_in)
            if n_out % 8 == 0:
                release_file_pages(data)


def release_file_pages(data: np.ndarray) -> None:
    """Give back the resident pages of ``data`` when it is a view of a read-only file mapping (a GGUF
    tensor that was copied into another layout): they are dropped from this process, not from the file,
    and a later read faults them in again. Memory of any other kind is left alone."""
    base = data
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, mmap.mmap) or not hasattr(base, "madvise"):
        return
    start = data.ctypes.data - np.frombuffer(base, np.uint8).ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # only whole pages inside the tensor
    last = (start + data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        base.madvise(mmap.MADV_DONTNEED, first, last - first)


def prepare(w: WeightTensor) -> _Prepared:
    """What :func:`matmul` needs from a weight, computed once: pass the result instead of the tensor to
    skip that work on every call (the backend prepares each weight when it binds a plan)."""
    return _Prepared(w)


def matmul(x: np.ndarray, w: WeightTensor | _Prepared, out: np.ndarray, xq: QuantizedActivations | None = None) -> None:
    """``out[n_tok, n_out] = x[n_tok, n_in] @ W^T`` with ``W`` (shape ``(n_out, n_in)``) read as raw blocks.

    ``xq`` is ``quantize_activations(x)`` computed once by the caller when several quantized matmuls
    share ``x``; without it the activations are quantized here. Float weight types ignore it.
    ``out`` must be float32 ``[n_tok, n_out]``; it is written, never read.
    """
    p = w if isinstance(w, _Prepared) else _Prepared(w)
    w = p.tensor
    n_tok = check_operands(x, w, out, p.n_in, p.n_out)
    if n_tok == 0 or p.n_out == 0:
        return
    dst = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
    if p.float_kind is not None:
        float_matmul.matmul(p.flat, p.float_kind, x, dst)
    else:
        if xq is None:
            xq = quantize_activations(x)
        elif xq.q.shape != x.shape:
            raise ModelError(f"{w.name}: quantized activations of shape {xq.q.shape} do not match x {x.shape}")
        if p.rows8_kernel is _q8_0_rows8:
            au = _shifted_activations(xq._q, n_tok)
            _q8_0_kernel(n_tok)(p.rows8, p.flat, p.rb, xq._q, au, xq._ds, dst)
        elif p.block32_kind is not None:
            block32_rows8.matmul(p.block32_kind, p.rows8, xq._q, xq._ds, dst)
        elif p.rows8 is not None:
            _q4_1_rows8(p.rows8, p.flat, p.rb, xq._q, xq._ds, dst)
        else:
            (_gemv_q4_0 if n_tok == 1 else _gemm_q4_0)(p.flat, p.rb, xq._q, xq._ds, dst)
    if dst is not out:
        out[...] = dst


def direct_call(
    x: np.ndarray, w: _Prepared, out: np.ndarray, xq: QuantizedActivations | None
) -> Callable[[], None] | None:
    """What ``matmul(x, w, out, xq)`` runs, bound to these very arrays with none of its checks: a plan calls
    each matmul with the same buffers every step, and the checks and dispatch cost ~2-6 µs a call
    (SmolLM2 makes 211 matmul calls per token). Only for a call that :func:`matmul` has just run on them
    (so they passed its checks); None where the call needs the general path (a copy of ``x`` or ``out``).
    The bound call runs the same kernel on the same buffers: the same bits."""
    if not isinstance(w, _Prepared) or not out.flags.c_contiguous or out.shape[0] == 0 or w.n_out == 0:
        return None
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        return None
    if w.float_kind is not None:
        kernel = float_matmul._gemv_float if out.shape[0] == 1 else float_matmul._gemm_float
        flat, kind, xf = w.flat, w.float_kind, x.reshape(-1)
        return lambda: kernel(flat, kind, xf, out)
    quantize = None
    if xq is None:  # quantized here on every call, as matmul does, into buffers of this call's own
        xq = QuantizedActivations(*x.shape)
        quantize = direct_quantize(x, xq)
    q, ds = xq._q, xq._ds
    if w.rows8_kernel is _q8_0_rows8:
        rows8, flat, rb = w.rows8, w.flat, w.rb
        if VNNI and out.shape[0] > 1:  # the activations + 128, made again on every call into one buffer
            au = np.empty(q.shape[0], np.uint8)
            prefill = _q8_0_kernel(out.shape[0])

            def run() -> None:
                _shift_activations(q, au)
                prefill(rows8, flat, rb, q, au, ds, out)
        else:

            def run() -> None:
                _q8_0_rows8(rows8, flat, rb, q, _NO_BYTES, ds, out)
    elif w.block32_kind is not None:
        run = block32_rows8.bound_call(w.block32_kind, w.rows8, q, ds, out)
    elif w.rows8 is not None:
        rows8, rows8_kernel, flat, rb = w.rows8, w.rows8_kernel, w.flat, w.rb

        def run() -> None:
            rows8_kernel(rows8, flat, rb, q, ds, out)
    else:
        kernel = _gemv_q4_0 if out.shape[0] == 1 else _gemm_q4_0
        flat, rb = w.flat, w.rb

        def run() -> None:
            kernel(flat, rb, q, ds, out)
    if quantize is None:
        return run

    def quantize_and_run() -> None:
        quantize()
        run()

    return quantize_and_run


def direct_quantize(x: np.ndarray, out: QuantizedActivations) -> Callable[[], None] | None:
    """What ``quantize_activations(x, out)`` runs, bound to these arrays (see :func:`direct_call`); None
    where it would copy ``x`` or reallocate ``out``."""
    if x.ndim != 2 or x.dtype != np.float32 or not x.flags.c_contiguous or out.q.shape != x.shape:
        return None
    n_tok, n_in = x.shape
    kernel = _quantize_parallel if n_tok >= PARALLEL_QUANTIZE_TOKENS else _quantize_serial
    xf, q, ds = x.reshape(-1), out._q, out._ds
    return lambda: kernel(xf, q, ds, n_in)


def warmup() -> None:
    """Compile (or load from numba's on-disk cache) every kernel, so no call pays for compilation later."""
    rng = np.random.default_rng(0)
    n_in, n_out = 64, 5
    for n_tok in (1, GEMM_TOKENS + 1):
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        out = np.empty((n_tok, n_out), np.float32)
        xq = quantize_activations(x)
        for t in _BLOCK_BYTES:
            raw = np.zeros((n_out, n_in // QK * _BLOCK_BYTES[t]), np.uint8)
            matmul(x, WeightTensor("warmup", t, (n_out, n_in), raw), out, xq)
        for t in float_matmul.WIDENING:
            raw = np.zeros((n_out, n_in), np.float32 if t == GGMLType.F32 else np.uint16).view(np.uint8)
            matmul(x, WeightTensor("warmup", t, (n_out, n_in), raw), out)
    big = rng.standard_normal((PARALLEL_QUANTIZE_TOKENS, n_in)).astype(np.float32)
    quantize_activations(big)
