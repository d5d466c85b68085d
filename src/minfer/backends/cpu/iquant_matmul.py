"""Fast matmul for the non-linear 4-bit block types: IQ4_NL, IQ4_XS and MXFP4 (their layouts:
:mod:`minfer.formats.iquants`), on the integer path of :mod:`~minfer.backends.cpu.quant_matmul`.

The activations are Q8 blocks of 32 (``quant_matmul.quantize_activations``, shared with the other integer
types' matmuls by a plan's QUANTIZE node), as llama.cpp does for these types. A weight block's 32 indices
(16 bytes of nibbles) go through the type's 16-entry int8 table in a register (one ``vpshufb``), and the
block against an activation block is an exact integer dot product in eight int32 lanes: on AVX2 llama.cpp's
sign trick (``|w| * (a * sign w)``), with VNNI one ``vpdpbusd`` on the table biased by +128 (``_dot``), the
same integers. Each block then does ``acc = fma(float(lanes), d_w d_x, acc)`` with the
block's float32 scale ``d_w``: IQ4_NL's f16 ``d``, IQ4_XS's ``d * (ls - 32)`` of the sub-block, MXFP4's
``2^(e - 128)`` (its table is doubled): the scales of the dequantizer, so the integer sum times them is the
dequantized row against the quantized activations, up to float32 rounding. The row's result is the
fixed-order horizontal sum of the eight lanes.

Decode (one token) runs 4 weight rows per pass sharing each activation block's loads, with the weights
prefetched ahead; prefill runs one weight row against tiles of 8 tokens, each block unpacked once per tile.
Both do the same float operations per (row, token), in block order: a token's row of output is the same
bits alone or in a prompt, at any thread count (each row is one worker's).

IQ4_NL and IQ4_XS weights whose rows come in whole groups of eight (every real model's) run instead on a
copy repacked at load with the rows in the lanes (:mod:`~minfer.backends.cpu.block32_rows8`, decode and
prefill alike); the kernels here serve the other shapes and MXFP4. Measured on the 1.7B-shaped IQ4_XS file
(2 threads, AVX-512 VNNI, against llama-cpp-python 0.3.36 in the same run): pp512 132 t/s against 120
(1.10x; these row-by-row kernels: 0.35x), tg32 22.6 against 7.8.

Measured before the repacked layout (1.7B-shaped IQ4_XS, 2 threads, AVX2 only): tg32 13.9 t/s against
llama.cpp's 11.7 (the float-activation kernel this replaced ran at about an eighth of llama.cpp), pp512 29.4
against 42.9. Decode reads 13.1 GB/s where Q4_0's kernel reads 21.7 on the same shapes: the sign trick and
the table lookup cost three instructions per block that Q4_0's unsigned nibbles do not need (llama.cpp's
IQ4_XS/Q4_0 ratio there is alike, 11.7 / 17.4 t/s).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.extending import intrinsic

from minfer.backends.cpu import block32_rows8
from minfer.backends.cpu.matmul_tiles import (
    GEMM_ROWS,
    GEMM_TOKENS,
    PREFETCH_ROWS,
    check_operands,
    read_only,
    store_tile,
    weight_bytes,
    weight_shape,
)
from minfer.backends.cpu.quant_matmul import (
    QK,
    QuantizedActivations,
    quantize_activations,
    release_file_pages,
    tile_scales,
)
from minfer.backends.cpu.simd import (
    LL_I16,
    LL_I32,
    V8F,
    V8I,
    V32B,
    VNNI,
    array_data,
    as_intp,
    dot_s8s8,
    dpbusd,
    f32x8,
    fma_i32x8,
    hsum_folded,
    i8x32,
    i32x8,
    ir_dot_u8s8,
    ir_halves4,
    ir_lane,
    ir_load,
    ir_splat,
    is_1d,
    lane_splat_f32x8,
    load_bytes32,
    load_f32x8,
    load_half,
    load_i32x8,
    load_nibbles32,
    lookup16,
    mul_f32x8,
    prefetch,
    splat_constant,
    splat_f32x8,
    store_i32x8,
    table16,
    zeros_f32x8,
    zeros_i32x8,
)
from minfer.errors import ModelError
from minfer.formats.block_types import block_size, type_size
from minfer.formats.iquants import IQ4_VALUES, MXFP4_VALUES
from minfer.formats.quants import GGMLType
from minfer.formats.tensors import WeightTensor

SUPPORTED_TYPES = (GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.MXFP4)


def _vnni_table(values: np.ndarray) -> np.ndarray:
    """The table the kernels look up: the values themselves, or under VNNI the values + 128 (as unsigned bytes:
    vpdpbusd's unsigned operand; ``_dot`` takes the bias back out)."""
    return ((values.astype(np.int16) + 128).astype(np.uint8).view(np.int8) if VNNI else values).copy()


_IQ4_TABLE = _vnni_table(IQ4_VALUES)
_TABLE = {GGMLType.IQ4_NL: _IQ4_TABLE, GGMLType.IQ4_XS: _IQ4_TABLE, GGMLType.MXFP4: _vnni_table(MXFP4_VALUES)}
# MXFP4's E8M0 exponent byte e as its block scale 2^(e - 128) (2^(e - 127), halved for the doubled table)
_E8M0 = np.array([math.ldexp(1.0, e - 128) for e in range(256)], np.float32)


# ---------------------------------------------------------------------------------------------------
# Block groups: IQ4_XS's super-block of eight blocks (one f16 d, eight 6-bit scales), or one IQ4_NL / MXFP4
# block. ``w`` is the whole weight tensor as one flat uint8 array, ``row`` a row's first byte, ``g`` a group's
# index in that row; ``kind`` (0 IQ4_NL, 1 IQ4_XS, 2 MXFP4) is a constant in each compiled kernel.
# ---------------------------------------------------------------------------------------------------


@intrinsic
def _xs_scales(typingctx, w, o):
    """The eight sub-block scales ``d * (ls - 32)`` of the IQ4_XS super-block at byte ``o``, as float32 lanes
    (exact: d's 11 bits times 6 bits): d is the f16 at o, ls's low 4 bits are nibble i of the 4 bytes
    ``scales_l`` (at o + 4), its high 2 bits field i of the u16 ``scales_h`` (at o + 2)."""
    if not is_1d(w):
        return None

    def codegen(context, builder, sig, args):
        base = array_data(context, builder, sig.args[0], args[0])
        at = as_intp(context, builder, args[1], sig.args[1])
        high = builder.zext(ir_load(builder, base, builder.add(at, ir.Constant(at.type, 2)), LL_I16), LL_I32)
        low = ir_load(builder, base, builder.add(at, ir.Constant(at.type, 4)), LL_I32)
        low = builder.and_(builder.lshr(ir_splat(builder, low, 8), ir.Constant(V8I, [4 * i for i in range(8)])),
                           splat_constant(V8I, 15))
        high = builder.and_(builder.lshr(ir_splat(builder, high, 8), ir.Constant(V8I, [2 * i for i in range(8)])),
                            splat_constant(V8I, 3))
        ls = builder.sub(builder.or_(low, builder.shl(high, splat_constant(V8I, 4))), splat_constant(V8I, 32))
        d = ir_splat(builder, ir_lane(builder, ir_halves4(builder, base, at), 0), 8)
        return builder.fmul(builder.sitofp(ls, V8F), d)

    return f32x8(w, o), codegen


@intrinsic
def _neg128_quads(typingctx, a):
    """Eight int32 lanes, lane i = -128 Σ_{k<4} a[4i+k]: what the table's +128 bias adds to a VNNI block sum."""
    if a != i8x32:
        return None

    def codegen(context, builder, sig, args):
        s = ir_dot_u8s8(builder, splat_constant(V32B, 1), args[0])
        return builder.neg(builder.shl(s, splat_constant(V8I, 7)))

    return i32x8(a), codegen


@njit(inline="always")
def _group(kind, w, row, g, e8m0):
    """(byte offset of group ``g``'s first 16 index bytes, its blocks' float32 scales: IQ4_XS's eight in the
    lanes (``_xs_scales``), the other types' one block's in every lane)."""
    if kind == 1:  # IQ4_XS: 136 bytes: f16 d, u16 scales_h, 4 bytes scales_l, 8 x 16 bytes of indices
        o = row + 136 * g
        return o + 8, _xs_scales(w, o)
    if kind == 0:  # IQ4_NL: 18 bytes: f16 d, 16 bytes of indices
        o = row + 18 * g
        return o + 2, splat_f32x8(load_half(w, o))
    o = row + 17 * g  # MXFP4: 17 bytes: the exponent byte, 16 bytes of indices
    return o + 1, splat_f32x8(e8m0[w[o]])


@njit(inline="always")
def _scale(kind, scales, ib):
    """Block ``ib`` of its group: its scale (``_group``'s) in every lane."""
    if kind == 1:
        return lane_splat_f32x8(scales, ib)
    return scales


@njit(inline="always")
def _dot(q, a, off):
    """Σ table[n] a of one block in eight int32 lanes, exact, from the looked-up indices ``q``. With VNNI the
    table is biased by +128 (unsigned, ``_vnni_table``): one vpdpbusd onto ``off`` = -128 Σa (``_neg128_quads``)
    leaves the same integers as the AVX2 sign trick (``|w| * (a * sign w)``), which needs two more
    instructions."""
    if VNNI:
        return dpbusd(off, q, a)
    return dot_s8s8(q, a)


@njit(inline="always")
def _lanes(w, qo, tv, a, off):
    """The exact lanes (``_dot``) of the block whose indices are at ``qo`` against the activations ``a``
    (|Σ| <= 32 * 127 * 127 < 2^24: their float conversion is exact too)."""
    return _dot(lookup16(load_nibbles32(w, qo), tv), a, off)


@njit(inline="always")
def _off(offs, k):
    """The offset lanes at ``offs[k:]`` under VNNI (elsewhere unused: zeros)."""
    if VNNI:
        return load_i32x8(offs, k)
    return zeros_i32x8()


@njit(inline="always")
def _offsets(aq, n_blocks):
    """Every activation block's ``_neg128_quads`` (VNNI only; else an empty array), once per call."""
    offs = np.empty(n_blocks * 8 if VNNI else 0, np.int32)
    if VNNI:
        for b in range(n_blocks):
            store_i32x8(offs, 8 * b, _neg128_quads(load_bytes32(aq, QK * b)))
    return offs


@njit(inline="always")
def _row(kind, w, row, nb, e8m0, tv, aq, ao, ds, do):
    """One row against one token, block by block: ``acc = fma(float(lanes), d_w d_x, acc)``."""
    per = 8 if kind == 1 else 1
    acc = zeros_f32x8()
    for g in range(nb // per):
        qo, scales = _group(kind, w, row, g, e8m0)
        for ib in range(per):
            b = g * per + ib
            a = load_bytes32(aq, ao + QK * b)
            v = _lanes(w, qo + 16 * ib, tv, a, _neg128_quads(a) if VNNI else zeros_i32x8())
            acc = fma_i32x8(acc, v, mul_f32x8(_scale(kind, scales, ib), splat_f32x8(ds[do + 2 * b])))
    return hsum_folded(acc)


# ---------------------------------------------------------------------------------------------------
# Decode: one token (GEMV), 4 weight rows per pass sharing each activation block's loads
# ---------------------------------------------------------------------------------------------------
# Arguments: w flat uint8 raw blocks, rb bytes per row, kind, the table (int8[16]), e8m0, aq int8[n_in],
# ds float32[2 * n_blocks], out float32[1, n_out]. Each prange iteration owns four whole rows; the last 1..3
# rows run after the parallel loop. The bytes PREFETCH_ROWS rows ahead are fetched as the pass goes (see
# quant_matmul's decode: four interleaved row streams defeat the hardware prefetcher).


@njit(inline="always")
def _gemv_iq(w, rb, kind, table, e8m0, aq, ds, out):
    tv = table16(table)
    n_out = out.shape[1]
    nb = aq.shape[0] // QK
    per = 8 if kind == 1 else 1
    n_pass = n_out // 4
    ahead = 4 * rb // nb  # the bytes of a pass per block of its rows
    offs = _offsets(aq, nb)
    for p in prange(n_pass):
        r0 = 4 * p
        acc0, acc1, acc2, acc3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
        o = r0 * rb
        pf = o + PREFETCH_ROWS * rb
        for g in range(nb // per):
            q0, s0 = _group(kind, w, o, g, e8m0)
            q1, s1 = _group(kind, w, o + rb, g, e8m0)
            q2, s2 = _group(kind, w, o + 2 * rb, g, e8m0)
            q3, s3 = _group(kind, w, o + 3 * rb, g, e8m0)
            for ib in range(per):
                prefetch(w, pf)
                prefetch(w, pf + 64)
                pf += ahead
                b = g * per + ib
                a = load_bytes32(aq, QK * b)
                off = _off(offs, 8 * b)
                dx = splat_f32x8(ds[2 * b])
                k = 16 * ib
                acc0 = fma_i32x8(acc0, _lanes(w, q0 + k, tv, a, off), mul_f32x8(_scale(kind, s0, ib), dx))
                acc1 = fma_i32x8(acc1, _lanes(w, q1 + k, tv, a, off), mul_f32x8(_scale(kind, s1, ib), dx))
                acc2 = fma_i32x8(acc2, _lanes(w, q2 + k, tv, a, off), mul_f32x8(_scale(kind, s2, ib), dx))
                acc3 = fma_i32x8(acc3, _lanes(w, q3 + k, tv, a, off), mul_f32x8(_scale(kind, s3, ib), dx))
        out[0, r0] = hsum_folded(acc0)
        out[0, r0 + 1] = hsum_folded(acc1)
        out[0, r0 + 2] = hsum_folded(acc2)
        out[0, r0 + 3] = hsum_folded(acc3)
    for r in range(4 * n_pass, n_out):
        out[0, r] = _row(kind, w, r * rb, nb, e8m0, tv, aq, 0, ds, 0)


# ---------------------------------------------------------------------------------------------------
# Prefill: many tokens (GEMM). Work item = GEMM_ROWS weight rows; inside it, tiles of GEMM_TOKENS tokens:
# each weight block is looked up once and used against all 8 tokens. Tokens past the last whole tile run
# the decode row function (same operations, same results).
# ---------------------------------------------------------------------------------------------------


@njit(inline="always")
def _tile_step(acc, q, dw, aq, ao, offs, d_b, k):
    """One token of a tile against one block (looked-up indices ``q``, scale ``dw`` in every lane):
    acc += its exact lanes * (d_w d_x), the activation scale and offset at ``k`` of ``d_b`` and ``offs``."""
    return fma_i32x8(acc, _dot(q, load_bytes32(aq, ao), _off(offs, k)), mul_f32x8(dw, load_f32x8(d_b, k)))


@njit(inline="always")
def _gemm_iq(w, rb, kind, table, e8m0, aq, ds, out):
    tv = table16(table)
    n_tok, n_out = out.shape
    n_in = aq.shape[0] // n_tok
    nb = n_in // QK
    per = 8 if kind == 1 else 1
    n_full = n_tok - n_tok % GEMM_TOKENS
    d_b, _ = tile_scales(ds, n_full, nb)
    offs = np.empty(n_full * nb * 8 if VNNI else 0, np.int32)  # _neg128_quads, laid out as d_b
    if VNNI:
        for t in range(n_full):
            for b in range(nb):
                i = ((t // GEMM_TOKENS) * nb + b) * GEMM_TOKENS + t % GEMM_TOKENS
                store_i32x8(offs, 8 * i, _neg128_quads(load_bytes32(aq, t * n_in + b * QK)))
    for gr in prange((n_out + GEMM_ROWS - 1) // GEMM_ROWS):
        r0 = gr * GEMM_ROWS
        r1 = min(n_out, r0 + GEMM_ROWS)
        for t0 in range(0, n_full, GEMM_TOKENS):
            tb = t0 * nb
            for r in range(r0, r1):
                a0, a1, a2, a3 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
                a4, a5, a6, a7 = zeros_f32x8(), zeros_f32x8(), zeros_f32x8(), zeros_f32x8()
                ao = t0 * n_in
                for g in range(nb // per):
                    qo, scales = _group(kind, w, r * rb, g, e8m0)
                    for ib in range(per):
                        q = lookup16(load_nibbles32(w, qo + 16 * ib), tv)
                        dw = _scale(kind, scales, ib)
                        k = 8 * (tb + (g * per + ib) * GEMM_TOKENS)  # [tile, block, token] of d_b, 8 lanes each
                        a0 = _tile_step(a0, q, dw, aq, ao, offs, d_b, k)
                        a1 = _tile_step(a1, q, dw, aq, ao + n_in, offs, d_b, k + 8)
                        a2 = _tile_step(a2, q, dw, aq, ao + 2 * n_in, offs, d_b, k + 16)
                        a3 = _tile_step(a3, q, dw, aq, ao + 3 * n_in, offs, d_b, k + 24)
                        a4 = _tile_step(a4, q, dw, aq, ao + 4 * n_in, offs, d_b, k + 32)
                        a5 = _tile_step(a5, q, dw, aq, ao + 5 * n_in, offs, d_b, k + 40)
                        a6 = _tile_step(a6, q, dw, aq, ao + 6 * n_in, offs, d_b, k + 48)
                        a7 = _tile_step(a7, q, dw, aq, ao + 7 * n_in, offs, d_b, k + 56)
                        ao += QK
                store_tile(out, t0, r, a0, a1, a2, a3, a4, a5, a6, a7)
        for t in range(n_full, n_tok):
            for r in range(r0, r1):
                out[t, r] = _row(kind, w, r * rb, nb, e8m0, tv, aq, t * n_in, ds, t * nb * 2)


# ---------------------------------------------------------------------------------------------------
# The compiled kernels, one pair per type: each inlines the bodies above with ``kind`` a constant, so that
# every branch on it folds away and IQ4_XS's eight-block loop unrolls (with ``kind`` an argument, IQ4_NL's
# decode ran ~1.4x Q4_0's time; see the note on issue 28).
# ---------------------------------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _gemv_iq4_nl(w, rb, table, e8m0, aq, ds, out):
    _gemv_iq(w, rb, 0, table, e8m0, aq, ds, out)


@njit(parallel=True, cache=True)
def _gemm_iq4_nl(w, rb, table, e8m0, aq, ds, out):
    _gemm_iq(w, rb, 0, table, e8m0, aq, ds, out)


@njit(parallel=True, cache=True)
def _gemv_iq4_xs(w, rb, table, e8m0, aq, ds, out):
    _gemv_iq(w, rb, 1, table, e8m0, aq, ds, out)


@njit(parallel=True, cache=True)
def _gemm_iq4_xs(w, rb, table, e8m0, aq, ds, out):
    _gemm_iq(w, rb, 1, table, e8m0, aq, ds, out)


@njit(parallel=True, cache=True)
def _gemv_mxfp4(w, rb, table, e8m0, aq, ds, out):
    _gemv_iq(w, rb, 2, table, e8m0, aq, ds, out)


@njit(parallel=True, cache=True)
def _gemm_mxfp4(w, rb, table, e8m0, aq, ds, out):
    _gemm_iq(w, rb, 2, table, e8m0, aq, ds, out)


# (decode kernel, prefill kernel) of each type
_KERNELS = {GGMLType.IQ4_NL: (_gemv_iq4_nl, _gemm_iq4_nl), GGMLType.IQ4_XS: (_gemv_iq4_xs, _gemm_iq4_xs),
            GGMLType.MXFP4: (_gemv_mxfp4, _gemm_mxfp4)}


def supports(ggml_type: GGMLType) -> bool:
    return ggml_type in _KERNELS


class _Prepared:
    """The flat bytes and geometry of one weight, computed once per tensor."""

    __slots__ = ("tensor", "flat", "rb", "n_out", "n_in", "kernels", "table", "rows8", "block32_kind")

    def __init__(self, w: WeightTensor) -> None:
        t = w.ggml_type
        self.n_out, self.n_in = weight_shape(w, "IQ4/MXFP4", SUPPORTED_TYPES, block_size(t))
        self.rb = self.n_in // block_size(t) * type_size(t)
        self.flat = read_only(weight_bytes(w, self.rb))
        self.tensor, self.kernels, self.table = w, _KERNELS[t], _TABLE[t]
        # IQ4_NL and IQ4_XS in whole groups of eight rows run on a copy repacked for them (block32_rows8,
        # decode and prefill alike); the file's pages are then given back, so the copy replaces them
        self.rows8 = self.block32_kind = None
        if block32_rows8.supports(t, self.n_out, self.n_in):
            self.block32_kind = block32_rows8.KINDS[t]
            self.rows8 = block32_rows8.repack(t, self.flat, self.n_out, self.n_in)
            release_file_pages(w.data)


def prepare(w: WeightTensor) -> _Prepared:
    return _Prepared(w)


def matmul(x: np.ndarray, w: WeightTensor | _Prepared, out: np.ndarray, xq: QuantizedActivations | None = None) -> None:
    """``out[n_tok, n_out] = x[n_tok, n_in] @ W^T`` with ``W`` read as raw IQ4_NL / IQ4_XS / MXFP4 blocks.

    ``xq`` is ``quantize_activations(x)`` when the caller shares it between matmuls; else it is made here.
    ``out`` must be float32 ``[n_tok, n_out]``; it is written, never read."""
    p = w if isinstance(w, _Prepared) else _Prepared(w)
    n_tok = check_operands(x, p.tensor, out, p.n_in, p.n_out)
    if n_tok == 0 or p.n_out == 0:
        return
    if xq is None:
        xq = quantize_activations(x)
    elif xq.q.shape != x.shape:
        raise ModelError(f"{p.tensor.name}: quantized activations of shape {xq.q.shape} do not match x {x.shape}")
    dst = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
    if p.rows8 is not None:
        block32_rows8.matmul(p.block32_kind, p.rows8, xq.q_flat, xq.ds_flat, dst)
    else:
        p.kernels[n_tok > 1](p.flat, p.rb, p.table, _E8M0, xq.q_flat, xq.ds_flat, dst)
    if dst is not out:
        out[...] = dst


def warmup() -> None:
    """Compile (or load from numba's cache) the kernels once (8 rows: IQ4's repacked layout)."""
    for n_tok in (1, 9):
        x = np.zeros((n_tok, 256), np.float32)
        for n_out in (3, 8):
            out = np.empty((n_tok, n_out), np.float32)
            for t in SUPPORTED_TYPES:
                raw = np.zeros((n_out, 256 // block_size(t) * type_size(t)), np.uint8)
                matmul(x, WeightTensor("warmup", t, (n_out, 256), raw), out)
