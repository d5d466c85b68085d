"""Fast ``out = x @ W^T`` on raw Q5_0, Q5_1 and K-quant (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) blocks.

The companion of :mod:`minfer.backends.cpu.quant_matmul` (same SIMD layer, :mod:`minfer.backends.cpu.simd`,
same determinism rules, same decode/prefill loop shapes); the block layouts are described in
:mod:`minfer.formats.kquants`. No kernel ever builds the f32 weight matrix.

Activations, quantized once per call the way llama.cpp quantizes them for each weight type
    * Q5_0, Q5_1: blocks of 32 int8 with a float32 scale, :func:`quant_matmul.quantize_activations`
      (llama.cpp's Q8_0 / Q8_1: ``d = amax / 127``, ``q = roundf(x / d)``, plus ``d Σq`` for Q5_1's offset).
    * K-quants: Q8_K, :func:`quantize_activations_q8_k`: super-blocks of 256 int8 ``q = nearest_int(x *
      (-127 / max))`` (round half to even, ``max`` the first value of largest magnitude), the float32 scale
      ``d = 1 / (-127 / max)``, and the int16 sums of each 16 consecutive ``q`` (``bsums``), exactly as
      ``quantize_row_q8_K_ref``.

Integer work per block (what llama.cpp's AVX2 ``ggml_vec_dot_*_q8_K`` / ``q5_*_q8_*`` do)
    Every weight is first made an unsigned integer ``u`` (its low bits OR its high bits; Q5_0 signed), so
    that one ``pmaddubsw`` (u8 x s8 -> pairs in int16) and one ``pmaddwd`` (-> int32) do 32 products:

    ======= ====================================== ===============================================================
    type    weight integer u                       per super-block (K) / block (Q5), all integer until the last step
    ======= ====================================== ===============================================================
    Q5_0    q = u - 16 (-16..15), kept signed      Σ q a as |q| * sign(a, q) (llama.cpp's trick); acc += Σ d_w d_x
    Q5_1    0..31                                  acc += Σ u a * d_w d_x; m-sum += m * (d_x Σq)
    Q2_K    0..3                                   S = Σ_sub sc Σ u a; M = Σ_16 mn bsum; acc += S d d_x - M dmin d_x
    Q3_K    low | hbit << 2 (0..7) = q + 4         S = Σ_sub sc Σ u a - 4 Σ_16 sc bsum;  acc += S d d_x
    Q4_K    0..15                                  S = Σ_sub sc Σ u a; M = Σ_32 mn bsum; acc += S d d_x - M dmin d_x
    Q5_K    0..31                                  as Q4_K
    Q6_K    low | high << 4 (0..63) = q + 32       S = Σ_sub sc Σ u a - 32 Σ_16 sc bsum; acc += S d d_x
    ======= ====================================== ===============================================================

    The sub-block scale multiplies the int16 pair sums inside ``pmaddwd`` (``sc`` broadcast to the lanes of
    its sub-block), so a whole super-block stays in eight int32 lanes (no overflow: at most ~3.3e7 per lane,
    Q6_K). The subtracted offsets and the min terms use Q8_K's ``bsums``, once per super-block. Each int32
    lane is then converted to float32 and accumulated with one fused multiply-add per (super-)block, by
    the float32 scale products ``d_w * d_x`` (and ``-(dmin * d_x)``). The result is a fixed-order horizontal
    sum of the eight lanes (Q5_1: plus the sequential float sum of its ``m d_x Σq`` terms).

Determinism
    Every output element is one worker's fixed sequence of float operations, independent of the thread
    count and of whether its token is computed alone (decode) or inside a prompt tile (prefill): results
    are bit-identical across thread counts and between GEMV and GEMM (tests hold both). The integer parts
    are exact, so the AVX2 and the generic LLVM formulations (``MINFER_GENERIC_SIMD=1``) agree bit for bit.

Loop shapes
    The per-block work is emitted as LLVM IR by small Python "decoders" (one per type) inside numba
    intrinsics that process R weight rows x C tokens per call, decoding each weight block once and loading
    each activation block once: decode (GEMV) runs 4 rows x 1 token per pass with the next rows prefetched,
    prefill (GEMM) runs 1 row x 8 tokens (tiles of 8 tokens, work items of 16 rows owned by one worker).
    Tokens past the last whole tile run the decode step (same operations, same results). One kernel
    serves a whole family, decode and prefill alike (``kind`` picks the decoder; the branch is per block,
    never per value), which keeps the JIT time low (~15 s cold for everything, ~1 s from numba's cache).
    Where the CPU has VNNI (AVX-512 VNNI + VL, or AVX-VNNI: ``simd.VNNI``), the prefill tile's pmaddwd
    by the scales and its add are one vpdpwssd (Q5_0/Q5_1: pmaddubsw + pmaddwd one vpdpbusd): the same
    exact integers, so the same bits as the AVX2 sequence and as decode (``tests/test_vnni.py``). That
    leaves two multiply instructions per 32 products, the floor of this per-lane arithmetic.

Repacked rows
    Q4_K, Q5_K and Q6_K weights whose rows come in whole groups of eight run instead on a copy repacked at
    load with the rows in the lanes (:mod:`minfer.backends.cpu.kquant_rows8`, decode and prefill alike);
    so do Q5_0 and Q5_1 weights (:mod:`minfer.backends.cpu.block32_rows8`). The file's pages are given back. Other
    shapes, and the other types, take the kernels here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from minfer.backends.cpu import block32_rows8, kquant_amx, kquant_rows8
from minfer.backends.cpu.matmul_tiles import (
    GEMM_ROWS,
    GEMM_TOKENS,
    PARALLEL_QUANTIZE_TOKENS,
    PREFETCH_ROWS,
    as_f32_2d,
    check_operands,
    read_only,
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
    AVX2,
    LL_F32,
    LL_I1,
    LL_I8,
    LL_I16,
    LL_I32,
    V8F,
    V8I,
    V16S,
    V32B,
    VNNI,
    array_data,
    f32x8,
    ir_abs_i8x32,
    ir_call,
    ir_dot_s8s8,
    ir_dot_u8s8,
    ir_dpbusd,
    ir_dpwssd,
    ir_fmadd,
    ir_half_to_float,
    ir_halves4,
    ir_hsum_folded,
    ir_lane,
    ir_load,
    ir_madd,
    ir_maddubs,
    ir_plus,
    ir_splat,
    ir_unpack_nibbles,
    prefetch,
    splat_constant,
)
from minfer.errors import ModelError
from minfer.formats.quants import GGMLType, type_size
from minfer.formats.tensors import WeightTensor

if TYPE_CHECKING:  # annotations only
    from numba.core.extending import _Intrinsic as Intrinsic

QK_K = 256  # values per K-quant super-block (and per Q8_K activation block)

# kinds: which decoder a family kernel runs (a runtime argument: one compiled kernel per family)
_K_KIND = {GGMLType.Q2_K: 0, GGMLType.Q3_K: 1, GGMLType.Q4_K: 2, GGMLType.Q5_K: 3, GGMLType.Q6_K: 4}
_Q5_KIND = {GGMLType.Q5_0: 0, GGMLType.Q5_1: 1}
SUPPORTED_TYPES = (*_Q5_KIND, *_K_KIND)

_V16B = ir.VectorType(LL_I8, 16)


# ---------------------------------------------------------------------------------------------------
# LLVM IR building blocks of the decoders (the generic ones are simd's)
# ---------------------------------------------------------------------------------------------------


def _shift(builder: ir.IRBuilder, v: ir.Value, s: int) -> ir.Value:
    """v shifted left by s bits (right by -s), per byte lane."""
    if s > 0:
        return builder.shl(v, splat_constant(v.type, s))
    if s < 0:
        return builder.lshr(v, splat_constant(v.type, -s))
    return v


def _field(builder: ir.IRBuilder, v: ir.Value, bit: int, width: int, to: int = 0) -> ir.Value:
    """Per byte: ``((v >> bit) & (2**width - 1)) << to`` (shift first, so one mask serves)."""
    return builder.and_(_shift(builder, v, to - bit), splat_constant(v.type, ((1 << width) - 1) << to))


def _bytes_at(builder: ir.IRBuilder, v: ir.Value, idx: list[int]) -> ir.Value:
    """Bytes ``v[idx[0]], v[idx[1]], ...`` of a byte vector, as a new vector."""
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(LL_I32, len(idx)), idx))


def _chunk_scales(builder: ir.IRBuilder, sc: ir.Value, per32: bool) -> ir.Value:
    """The per-chunk multiplier source P (<16 x i16>) from 16 (or, ``per32``, 8) signed byte scales.

    Chunk k (32 values) needs sc[2k] in lanes 0..7 and sc[2k+1] in lanes 8..15 (per-32 scales: sc[k] in
    all 16). P holds the even scales in its low 128-bit half and the odd ones in its high half (per-32:
    the 8 scales in both halves), so chunk k's multiplier is P[k] splat within each half: one in-lane
    byte shuffle (vpshufb), see :func:`_chunk_scale`. Built from vector values only: when the scales came
    from scalar words, LLVM extracted every byte through general registers (5 instructions per chunk).
    """
    order = list(range(8)) * 2 if per32 else [2 * i for i in range(8)] + [2 * i + 1 for i in range(8)]
    return builder.sext(_bytes_at(builder, sc, order), V16S)


def _chunk_scale(builder: ir.IRBuilder, P: ir.Value, k: int) -> ir.Value:
    return builder.shuffle_vector(P, P, ir.Constant(ir.VectorType(LL_I32, 16), [k] * 8 + [8 + k] * 8))


def _f16_at(builder: ir.IRBuilder, wb: ir.Value, o: ir.Value, off: int) -> ir.Value:
    return ir_half_to_float(builder, ir_load(builder, wb, ir_plus(builder, o, off), LL_I16))


def _words(builder: ir.IRBuilder, v: ir.Value, idx: list[int]) -> ir.Value:
    """<4 x i32> lanes ``v[idx[0]], ...`` of a <4 x i32>."""
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(LL_I32, 4), idx))


def _v4(values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(LL_I32, 4), values)


# ---------------------------------------------------------------------------------------------------
# Decoders: one K-quant super-block of one weight row, as eight 32-value chunks of unsigned bytes u_k
# with their <16 x i16> scale multipliers, plus what the per-super-block correction needs.
# ``coef`` (<16 x i16>) multiplies Q8_K's 16 bsums: the mins (Q2_K; Q4_K/Q5_K's repeated per 16 values)
# or the scales (Q3_K/Q6_K, whose offset 4 / 32 is removed as integers: ``offset_shift`` = log2 of it).
# ---------------------------------------------------------------------------------------------------


class _Decoder:
    offset_shift = 0  # 0: the correction is a min term (dmin); else S -= (coef . bsums) << offset_shift

    # set by each decoder: P (see _chunk_scales), coef, d and (types with mins) dmin, as LLVM values
    P: ir.Value
    coef: ir.Value
    d: ir.Value

    def __init__(self, builder: ir.IRBuilder, wb: ir.Value, o: ir.Value) -> None:
        self.b, self.wb, self.o = builder, wb, o
        self._loads: dict[int, ir.Value] = {}
        self.dmin: ir.Value | None = None

    def chunk(self, k: int) -> tuple[ir.Value, ir.Value]:
        """Chunk k (values 32k..32k+31): its unsigned bytes u and its <16 x i16> scale multiplier."""
        raise NotImplementedError

    def bytes32(self, off: int) -> ir.Value:
        """The 32 bytes at ``off`` in the block, loaded once however many chunks read them."""
        if off not in self._loads:
            self._loads[off] = ir_load(self.b, self.wb, ir_plus(self.b, self.o, off), V32B)
        return self._loads[off]


class _Q2K(_Decoder):
    # scales u8[16] | qs u8[64] | d f16 | dmin f16
    def __init__(self, builder: ir.IRBuilder, wb: ir.Value, o: ir.Value) -> None:
        super().__init__(builder, wb, o)
        b = builder
        packed = ir_load(b, wb, o, _V16B)
        self.P = _chunk_scales(b, b.and_(packed, splat_constant(_V16B, 15)), per32=False)
        self.coef = b.zext(b.lshr(packed, splat_constant(_V16B, 4)), V16S)
        self.d = _f16_at(b, wb, o, 80)
        self.dmin = _f16_at(b, wb, o, 82)

    def chunk(self, k: int) -> tuple[ir.Value, ir.Value]:
        h, c = divmod(k, 4)  # values 128 h + 32 c + l are bits 2c of byte 32 h + l
        u = _field(self.b, self.bytes32(16 + 32 * h), 2 * c, 2)
        return u, _chunk_scale(self.b, self.P, k)


class _Q3K(_Decoder):
    # hmask u8[32] | qs u8[64] | scales u8[12] | d f16
    offset_shift = 2

    def __init__(self, builder: ir.IRBuilder, wb: ir.Value, o: ir.Value) -> None:
        super().__init__(builder, wb, o)
        b = builder
        # llama.cpp's aux-word unpacking, on four i32 lanes: lane w holds scales 4w..4w+3, low nibbles from
        # bytes 0..7 (words a0, a1, then their high nibbles), two high bits from word a2 >> 2w
        w01 = ir_load(b, wb, ir_plus(b, o, 96), ir.VectorType(LL_I32, 2))
        a2 = ir_load(b, wb, ir_plus(b, o, 104), LL_I32)
        lows = b.shuffle_vector(w01, w01, _v4([0, 1, 0, 1]))
        lows = b.and_(b.lshr(lows, _v4([0, 0, 4, 4])), _v4([0x0F0F0F0F] * 4))
        highs = b.and_(b.lshr(ir_splat(b, a2, 4), _v4([0, 2, 4, 6])), _v4([0x03030303] * 4))
        sc = b.bitcast(b.or_(lows, b.shl(highs, _v4([4] * 4))), _V16B)
        sc = b.sub(sc, splat_constant(_V16B, 32))  # -32..31
        self.P = _chunk_scales(b, sc, per32=False)
        self.coef = b.sext(sc, V16S)
        self.d = _f16_at(b, wb, o, 108)

    def chunk(self, k: int) -> tuple[ir.Value, ir.Value]:
        h, c = divmod(k, 4)
        low = _field(self.b, self.bytes32(32 + 32 * h), 2 * c, 2)
        hbit = _field(self.b, self.bytes32(0), k, 1, to=2)  # value 32 k + l: bit k of hmask[l]
        return self.b.or_(low, hbit), _chunk_scale(self.b, self.P, k)


class _Q4K(_Decoder):
    # d f16 | dmin f16 | scales u8[12] | qs u8[128]
    qs_at = 16

    def __init__(self, builder: ir.IRBuilder, wb: ir.Value, o: ir.Value) -> None:
        super().__init__(builder, wb, o)
        b = builder
        # llama.cpp's unpacking of the 6-bit scales and mins (words u0, u1, u2 = scale bytes 0..11), on
        # four i32 lanes: scales 0..3 = u0 & 0x3f.., scales 4..7 = (u2 & 0x0f..) | ((u0 >> 6) & 0x03..) << 4,
        # mins 0..3 = u1 & 0x3f.., mins 4..7 = ((u2 >> 4) & 0x0f..) | ((u1 >> 6) & 0x03..) << 4
        u = ir_load(b, wb, ir_plus(b, o, 4), ir.VectorType(LL_I32, 4))  # bytes 4..19: the scales and 4 bytes of qs
        low = b.and_(b.lshr(_words(b, u, [0, 2, 1, 2]), _v4([0, 0, 0, 4])), _v4([0x3F3F3F3F, 0x0F0F0F0F] * 2))
        high = b.and_(b.lshr(_words(b, u, [0, 0, 1, 1]), _v4([6] * 4)), _v4([0, 0x03030303] * 2))
        sm = b.bitcast(b.or_(low, b.shl(high, _v4([4] * 4))), _V16B)  # bytes: scales 0..7, mins 0..7
        self.P = _chunk_scales(b, sm, per32=True)
        self.coef = b.sext(_bytes_at(b, sm, [8 + j // 2 for j in range(16)]), V16S)  # min per 16 values
        ddm = ir_halves4(b, wb, o)
        self.d, self.dmin = ir_lane(b, ddm, 0), ir_lane(b, ddm, 1)

    def chunk(self, k: int) -> tuple[ir.Value, ir.Value]:
        c, h = divmod(k, 2)  # values 64 c + 32 h + l: nibble h of byte 32 c + l
        u = _field(self.b, self.bytes32(self.qs_at + 32 * c), 4 * h, 4)
        return u, _chunk_scale(self.b, self.P, k)


class _Q5K(_Q4K):
    # d f16 | dmin f16 | scales u8[12] | qh u8[32] | qs u8[128]
    qs_at = 48

    def chunk(self, k: int) -> tuple[ir.Value, ir.Value]:
        u, s = super().chunk(k)
        return self.b.or_(u, _field(self.b, self.bytes32(16), k, 1, to=4)), s


class _Q6K(_Decoder):
    # ql u8[128] | qh u8[64] | scales i8[16] | d f16
    offset_shift = 5

    def __init__(self, builder: ir.IRBuilder, wb: ir.Value, o: ir.Value) -> None:
        super().__init__(builder, wb, o)
        sc = ir_load(builder, wb, ir_plus(builder, o, 192), _V16B)
        self.P = _chunk_scales(builder, sc, per32=False)
        self.coef = builder.sext(sc, V16S)
        self.d = _f16_at(builder, wb, o, 208)

    def chunk(self, k: int) -> tuple[ir.Value, ir.Value]:
        h, c = divmod(k, 4)  # value 128 h + 32 c + l
        low = _field(self.b, self.bytes32(64 * h + 32 * (c % 2)), 4 * (c // 2), 4)
        high = _field(self.b, self.bytes32(128 + 32 * h), 2 * c, 2, to=4)
        return self.b.or_(low, high), _chunk_scale(self.b, self.P, k)


_DECODERS = {
    GGMLType.Q2_K: _Q2K,
    GGMLType.Q3_K: _Q3K,
    GGMLType.Q4_K: _Q4K,
    GGMLType.Q5_K: _Q5K,
    GGMLType.Q6_K: _Q6K,
}


def _q5_values(builder: ir.IRBuilder, wb: ir.Value, o: ir.Value, qh_at: int, signed: bool) -> ir.Value:
    """Q5_0/Q5_1's 32 5-bit values: nibbles of the 16 bytes after qh, with qh's bit j as value j's fifth bit.

    Unsigned (Q5_1): nibble | bit << 4 (0..31). Signed (Q5_0): that minus 16, formed as llama.cpp does:
    nibble | (bit ? 0 : 0xF0), which is the int8 nibble - 16 when the bit is clear.
    """
    b = builder
    nib = ir_unpack_nibbles(b, ir_load(b, wb, ir_plus(b, o, qh_at + 4), _V16B))
    bits = b.bitcast(ir_load(b, wb, ir_plus(b, o, qh_at), LL_I32), ir.VectorType(LL_I1, 32))  # bit j -> lane j
    if signed:
        return b.or_(nib, b.select(bits, splat_constant(V32B, 0), splat_constant(V32B, 0xF0)))
    return b.or_(nib, b.select(bits, splat_constant(V32B, 16), splat_constant(V32B, 0)))


# ---------------------------------------------------------------------------------------------------
# Intrinsics: R rows x C tokens per call, accumulators carried as a tuple of R*C + 1 float32 x 8
# (pair p = i*C + j for row i, token j; the last vector holds Q5_1's m-sum of pair p in lane p)
# ---------------------------------------------------------------------------------------------------


def _tuple_of(n: int) -> types.UniTuple:
    return types.UniTuple(f32x8, n)


def _make_zeros(n: int) -> Intrinsic:
    tup = _tuple_of(n)

    @intrinsic
    def zeros(typingctx):
        def codegen(context, builder, sig, args):
            return context.make_tuple(builder, tup, [ir.Constant(V8F, [0.0] * 8)] * n)

        return tup(), codegen

    return zeros


def _make_store(rows: int, cols: int) -> Intrinsic:
    """``out[t0 + j, r0 + i] = hsum(acc_p) + m-sum lane p`` for the R x C pairs (``out`` float32 2D)."""
    n = rows * cols + 1

    @intrinsic
    def store(typingctx, out, t0, r0, accs):
        if accs != _tuple_of(n) or not isinstance(out, types.Array) or out.ndim != 2:
            return None

        def codegen(context, builder, sig, args):
            aty = sig.args[0]
            arr = context.make_array(aty)(context, builder, args[0])
            shape = cgutils.unpack_tuple(builder, arr.shape, 2)
            strides = cgutils.unpack_tuple(builder, arr.strides, 2)
            t0 = context.cast(builder, args[1], sig.args[1], types.intp)
            r0 = context.cast(builder, args[2], sig.args[2], types.intp)
            vs = cgutils.unpack_tuple(builder, args[3], n)
            for i in range(rows):
                for j in range(cols):
                    p = i * cols + j
                    v = builder.fadd(ir_hsum_folded(builder, vs[p]), ir_lane(builder, vs[-1], p))
                    at = [ir_plus(builder, t0, j), ir_plus(builder, r0, i)]
                    ptr = cgutils.get_item_pointer2(context, builder, arr.data, shape, strides, aty.layout, at)
                    builder.store(v, ptr)
            return context.get_dummy_value()

        return types.none(out, t0, r0, accs), codegen

    return store


def _scales(builder: ir.IRBuilder, dw: ir.Value, dsrc_base: ir.Value, dso: ir.Value, cols: int, j: int) -> ir.Value:
    """float32 x 8 of ``dw * d_x`` for token j: d_x a scalar at dso (C == 1), or pre-broadcast at dso + 8 j."""
    if cols == 1:
        return ir_splat(builder, builder.fmul(dw, ir_load(builder, dsrc_base, dso, LL_F32)), 8)
    return builder.fmul(ir_splat(builder, dw, 8), ir_load(builder, dsrc_base, ir_plus(builder, dso, 8 * j), V8F))


def _make_kstep(t: GGMLType, rows: int, cols: int) -> Intrinsic:
    """One K-quant super-block of ``rows`` weight rows against ``cols`` Q8_K tokens.

    ``step(accs, w, o, rb, aq, ao, astride, bs, bo, bstride, dsrc, dso) -> accs``: weights of row i at
    byte ``o + i rb`` of ``w``; token j's 256 int8 at ``aq[ao + j astride]``, its 16 bsums at
    ``bs[bo + j bstride]``; its scale ``dsrc[dso]`` (one token) or pre-broadcast ``dsrc[dso + 8 j:][:8]``.
    """
    dec_cls = _DECODERS[t]
    n = rows * cols + 1
    tup = _tuple_of(n)

    @intrinsic
    def step(typingctx, accs, w, o, rb, aq, ao, astride, bs, bo, bstride, dsrc, dso):
        if accs != tup:
            return None
        sig = tup(accs, w, o, rb, aq, ao, astride, bs, bo, bstride, dsrc, dso)

        def codegen(context, builder, sig, args):
            b = builder
            ta = sig.args

            def ix(k):
                return context.cast(b, args[k], ta[k], types.intp)

            acc = cgutils.unpack_tuple(b, args[0], n)
            wb, ab, bb, db = (array_data(context, b, ta[k], args[k]) for k in (1, 4, 7, 10))
            o, rb, ao, ast, bo, bst, dso = (ix(k) for k in (2, 3, 5, 6, 8, 9, 11))
            decs = [dec_cls(b, wb, b.add(o, b.mul(rb, ir.Constant(rb.type, i)))) for i in range(rows)]
            a_at = [b.add(ao, b.mul(ast, ir.Constant(ast.type, j))) for j in range(cols)]
            sums = [[None] * cols for _ in range(rows)]
            for k in range(8):  # chunk-outer: each u_k and each activation chunk is live only briefly
                a = [ir_load(b, ab, ir_plus(b, a_at[j], 32 * k), V32B) for j in range(cols)]
                for i in range(rows):
                    u, s = decs[i].chunk(k)
                    for j in range(cols):
                        pairs = ir_maddubs(b, u, a[j])
                        if cols > 1 and VNNI:  # prefill: the madd and its add in one vpdpwssd (same integers)
                            sums[i][j] = ir_dpwssd(b, sums[i][j] or ir.Constant(V8I, [0] * 8), pairs, s)
                            continue
                        p = ir_madd(b, pairs, s)
                        sums[i][j] = p if sums[i][j] is None else b.add(sums[i][j], p)
            bsums = [ir_load(b, bb, b.add(bo, b.mul(bst, ir.Constant(bst.type, j))), V16S) for j in range(cols)]
            out = list(acc)
            for i, dec in enumerate(decs):
                neg_dmin = None if dec.dmin is None else b.fmul(dec.dmin, ir.Constant(LL_F32, -1.0))
                for j in range(cols):
                    corr = ir_madd(b, bsums[j], dec.coef)
                    s = sums[i][j]
                    if dec.offset_shift:
                        s = b.sub(s, b.shl(corr, splat_constant(V8I, dec.offset_shift)))
                    p = i * cols + j
                    out[p] = ir_fmadd(b, b.sitofp(s, V8F), _scales(b, dec.d, db, dso, cols, j), out[p])
                    if neg_dmin is not None:
                        out[p] = ir_fmadd(b, b.sitofp(corr, V8F), _scales(b, neg_dmin, db, dso, cols, j), out[p])
            return context.make_tuple(b, tup, out)

        return sig, codegen

    return step


def _make_q5step(t: GGMLType, rows: int, cols: int) -> Intrinsic:
    """One Q5_0/Q5_1 block of ``rows`` weight rows against ``cols`` Q8 tokens.

    ``step(accs, w, o, rb, aq, ao, astride, dsrc, dso, ssrc, so) -> accs``: one token: ``dsrc[dso]`` is
    d_x and ``dsrc[dso + 1]`` is d_x Σq (quant_matmul's ``ds`` pairs); a tile: ``dsrc[dso + 8 j:]`` the
    pre-broadcast d_x of token j, ``ssrc[so:so + 8]`` the eight tokens' d_x Σq.
    """
    n = rows * cols + 1
    tup = _tuple_of(n)
    signed = t == GGMLType.Q5_0
    if rows > 1 and cols > 1:
        raise ValueError("the m-sum lanes need rows == 1 or cols == 1")

    @intrinsic
    def step(typingctx, accs, w, o, rb, aq, ao, astride, dsrc, dso, ssrc, so):
        if accs != tup:
            return None
        sig = tup(accs, w, o, rb, aq, ao, astride, dsrc, dso, ssrc, so)

        def codegen(context, builder, sig, args):
            b = builder
            ta = sig.args

            def ix(k):
                return context.cast(b, args[k], ta[k], types.intp)

            acc = cgutils.unpack_tuple(b, args[0], n)
            wb, ab, db, sb = (array_data(context, b, ta[k], args[k]) for k in (1, 4, 7, 9))
            o, rb, ao, ast, dso, so = (ix(k) for k in (2, 3, 5, 6, 8, 10))
            a = [ir_load(b, ab, b.add(ao, b.mul(ast, ir.Constant(ast.type, j))), V32B) for j in range(cols)]
            out = list(acc)
            ms = []
            for i in range(rows):
                oi = b.add(o, b.mul(rb, ir.Constant(rb.type, i)))
                dm = ir_halves4(b, wb, oi)  # (d, m) for Q5_1; d and two qh halves for Q5_0
                dw = ir_lane(b, dm, 0)
                u = _q5_values(b, wb, oi, 2 if signed else 4, signed)
                if signed:
                    wv = u
                    wabs = ir_abs_i8x32(b, wv) if AVX2 else None
                else:
                    ms.append(ir_lane(b, dm, 1))
                for j in range(cols):
                    if cols > 1 and VNNI:  # prefill: one vpdpbusd (Q5_0 with the sign trick), same integers
                        zero = ir.Constant(V8I, [0] * 8)
                        if signed:
                            sa = ir_call(b, "llvm.x86.avx2.psign.b", V32B, [a[j], wv])
                            dot = ir_dpbusd(b, zero, wabs, sa)
                        else:
                            dot = ir_dpbusd(b, zero, u, a[j])
                    elif signed:
                        dot = ir_dot_s8s8(b, wv, a[j], wabs)
                    else:
                        dot = ir_dot_u8s8(b, u, a[j])
                    p = i * cols + j
                    out[p] = ir_fmadd(b, b.sitofp(dot, V8F), _scales(b, dw, db, dso, cols, j), out[p])
            if not signed:  # m-sum lane p += m_row(p) * (d_x Σq)_token(p)
                if cols == 1:
                    mv = ir.Constant(V8F, [0.0] * 8)
                    for i, m in enumerate(ms):
                        mv = b.insert_element(mv, m, ir.Constant(LL_I32, i))
                    sv = ir_splat(b, ir_load(b, db, ir_plus(b, dso, 1), LL_F32), 8)
                else:
                    mv = ir_splat(b, ms[0], 8)
                    sv = ir_load(b, sb, so, V8F)
                out[-1] = ir_fmadd(b, mv, sv, out[-1])
            return context.make_tuple(b, tup, out)

        return sig, codegen

    return step


# decode: 4 rows x 1 token; prefill: 1 row x 8 tokens
_zeros5, _zeros9 = _make_zeros(5), _make_zeros(9)
_store_4x1, _store_1x8 = _make_store(4, 1), _make_store(1, 8)
_q2k_4x1, _q2k_1x8 = _make_kstep(GGMLType.Q2_K, 4, 1), _make_kstep(GGMLType.Q2_K, 1, 8)
_q3k_4x1, _q3k_1x8 = _make_kstep(GGMLType.Q3_K, 4, 1), _make_kstep(GGMLType.Q3_K, 1, 8)
_q4k_4x1, _q4k_1x8 = _make_kstep(GGMLType.Q4_K, 4, 1), _make_kstep(GGMLType.Q4_K, 1, 8)
_q5k_4x1, _q5k_1x8 = _make_kstep(GGMLType.Q5_K, 4, 1), _make_kstep(GGMLType.Q5_K, 1, 8)
_q6k_4x1, _q6k_1x8 = _make_kstep(GGMLType.Q6_K, 4, 1), _make_kstep(GGMLType.Q6_K, 1, 8)
_q50_4x1, _q50_1x8 = _make_q5step(GGMLType.Q5_0, 4, 1), _make_q5step(GGMLType.Q5_0, 1, 8)
_q51_4x1, _q51_1x8 = _make_q5step(GGMLType.Q5_1, 4, 1), _make_q5step(GGMLType.Q5_1, 1, 8)


# ---------------------------------------------------------------------------------------------------
# Q8_K activation quantization (llama.cpp's quantize_row_q8_K_ref, bit for bit)
# ---------------------------------------------------------------------------------------------------


class Q8KActivations:
    """Activations ``x[n_tok, n_in]`` as Q8_K super-blocks of 256: ``x ≈ d * q``.

    ``q``: int8 ``[n_tok, n_in]`` (-127..127); ``d``: float32 ``[n_tok, n_in // 256]``; ``bsums``: int16
    ``[n_tok, n_in // 256, 16]``, the sums of each 16 consecutive ``q``. Views of flat buffers that the
    kernels take directly.
    """

    __slots__ = ("q", "d", "bsums", "_q", "_d", "_bs")

    def __init__(self, n_tok: int, n_in: int, take: Callable[[str, int, Any], np.ndarray] | None = None) -> None:
        if take is None:
            take = lambda part, n, dtype: np.empty(n, dtype)  # noqa: E731
        nbk = n_in // QK_K
        self._q = take("q", n_tok * n_in, np.int8)
        self._d = take("d", n_tok * nbk, np.float32)
        self._bs = take("bsums", n_tok * nbk * 16, np.int16)
        self.q = self._q.reshape(n_tok, n_in)
        self.d = self._d.reshape(n_tok, nbk)
        self.bsums = self._bs.reshape(n_tok, nbk, 16)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> np.ndarray:
        """``d * q`` as float32 ``[n_tok, n_in]`` (what the kernels multiply by, for references)."""
        n_tok, n_in = self.q.shape
        return (self.q.reshape(n_tok, -1, QK_K).astype(np.float32) * self.d[:, :, None]).reshape(n_tok, n_in)


class Q8KScratch:
    """The Q8_K buffers that a backend's bound K-quant matmuls quantize their activations into.

    A bound call quantizes its activations and consumes them inside itself, and a backend runs one step
    at a time (on the engine thread), so every call of every plan shares one set, sized for the largest
    call. (With a set of their own per call, a 1.7B model's 512-token plan held ~250 MiB of them.)
    A set that grows is replaced: the calls bound to the old one keep it alive (correct, not shared);
    ``retired_bytes`` counts those."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self.retired_bytes = 0

    def _take(self, part: str, n: int, dtype: Any) -> np.ndarray:
        a = self._arrays.get(part)
        if a is None or a.size < n:
            if a is not None:
                self.retired_bytes += a.nbytes
            a = self._arrays[part] = np.empty(n, dtype)
        return a[:n]

    def activations(self, n_tok: int, n_in: int) -> Q8KActivations:
        """Views for ``x[n_tok, n_in]``: valid until the next call's quantization overwrites them."""
        return Q8KActivations(n_tok, n_in, take=self._take)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays.values())


@njit(fastmath=True, cache=True)
def _amax256(x, t, k0):
    # max is exact in any order: fastmath only lets LLVM vectorize it
    amax = np.float32(0.0)
    for j in range(QK_K):
        amax = max(amax, abs(x[t, k0 + j]))
    return amax


@njit(inline="always")
def _q8k_token(x, t, q, d, bs):
    n_in = x.shape[1]
    nbk = n_in // QK_K
    for b in range(nbk):
        k0 = b * QK_K
        base = t * nbk + b
        qo = t * n_in + k0
        amax = _amax256(x, t, k0)
        if not amax > 0:  # an all-zero block (llama.cpp stores d = 0 and q = 0)
            d[base] = 0.0
            for j in range(QK_K):
                q[qo + j] = 0
            for g in range(16):
                bs[base * 16 + g] = 0
            continue
        # llama.cpp keeps the first value of largest magnitude, with its sign
        j = 0
        while j < QK_K - 1 and abs(x[t, k0 + j]) != amax:
            j += 1
        iscale = np.float32(-127.0) / x[t, k0 + j]
        for j in range(QK_K):
            # nearest_int: float32 product, rounded half to even (llama.cpp adds 1.5 * 2**23); |v| <= 127
            v = np.int32(np.rint(iscale * x[t, k0 + j]))
            q[qo + j] = min(v, 127)
        for g in range(16):
            s = np.int32(0)
            for j in range(16):
                s += q[qo + 16 * g + j]
            bs[base * 16 + g] = s
        d[base] = np.float32(1.0) / iscale


@njit(cache=True)
def _q8k_serial(x, q, d, bs):
    for t in range(x.shape[0]):
        _q8k_token(x, t, q, d, bs)


@njit(parallel=True, cache=True)
def _q8k_parallel(x, q, d, bs):
    for t in prange(x.shape[0]):
        _q8k_token(x, t, q, d, bs)



def quantize_activations_q8_k(x: np.ndarray, out: Q8KActivations | None = None) -> Q8KActivations:
    """Quantize float32 ``x[n_tok, n_in]`` (``n_in`` a multiple of 256) to Q8_K, as llama.cpp does.

    The result can be shared by every K-quant matmul reading the same ``x``; pass ``out`` (same shape) to
    reuse its buffers.
    """
    x = as_f32_2d(x)
    n_tok, n_in = x.shape
    if n_in % QK_K:
        raise ModelError(f"cannot quantize activations of width {n_in} to Q8_K: not a multiple of {QK_K}")
    if out is None or out.q.shape != x.shape:
        out = Q8KActivations(n_tok, n_in)
    if n_tok >= PARALLEL_QUANTIZE_TOKENS:
        _q8k_parallel(x, out._q, out._d, out._bs)
    else:
        _q8k_serial(x, out._q, out._d, out._bs)
    return out


# ---------------------------------------------------------------------------------------------------
# Kernels: one per family, serving decode and prefill alike (a single JIT per family)
#
# Work item = GEMM_ROWS weight rows owned by one worker (the last item takes the remainder, so every
# item has at least 4 rows: callers pad weights of fewer than 4 rows). Inside an item: tiles of
# GEMM_TOKENS tokens, one row at a time against the tile (each weight block decoded once per 8 tokens);
# the tokens past the last whole tile (all of them when decoding one token) run the decode step, 4 rows
# at a time with the next rows prefetched. An item's last group of 4 rows may overlap the previous group
# (rows recomputed by the same worker with the same operations: identical bits, no extra variant to
# compile).
# ---------------------------------------------------------------------------------------------------


@njit(inline="always")
def _k_rows4(kind, accs, w, o, rb, aq, ao, bs, bo, dq, dqo):
    if kind == 0:
        return _q2k_4x1(accs, w, o, rb, aq, ao, 0, bs, bo, 0, dq, dqo)
    if kind == 1:
        return _q3k_4x1(accs, w, o, rb, aq, ao, 0, bs, bo, 0, dq, dqo)
    if kind == 2:
        return _q4k_4x1(accs, w, o, rb, aq, ao, 0, bs, bo, 0, dq, dqo)
    if kind == 3:
        return _q5k_4x1(accs, w, o, rb, aq, ao, 0, bs, bo, 0, dq, dqo)
    return _q6k_4x1(accs, w, o, rb, aq, ao, 0, bs, bo, 0, dq, dqo)


@njit(inline="always")
def _k_tile(kind, accs, w, o, aq, ao, n_in, bs, bo, bstride, dtab, do):
    if kind == 0:
        return _q2k_1x8(accs, w, o, 0, aq, ao, n_in, bs, bo, bstride, dtab, do)
    if kind == 1:
        return _q3k_1x8(accs, w, o, 0, aq, ao, n_in, bs, bo, bstride, dtab, do)
    if kind == 2:
        return _q4k_1x8(accs, w, o, 0, aq, ao, n_in, bs, bo, bstride, dtab, do)
    if kind == 3:
        return _q5k_1x8(accs, w, o, 0, aq, ao, n_in, bs, bo, bstride, dtab, do)
    return _q6k_1x8(accs, w, o, 0, aq, ao, n_in, bs, bo, bstride, dtab, do)


@njit(inline="always")
def _k_four(kind, w, rb, nbk, aq, dq, bs, out, t, r0):
    """Rows r0..r0+3 against token t, prefetching PREFETCH_ROWS rows ahead (decode streams the weights)."""
    accs = _zeros5()
    bsz = rb // nbk
    o = r0 * rb
    pf = o + PREFETCH_ROWS * rb
    for b in range(nbk):
        for k in range(0, 4 * bsz, 64):  # the four rows of a pass are contiguous: one linear stream
            prefetch(w, pf + k)
        pf += 4 * bsz
        tb = t * nbk + b
        accs = _k_rows4(kind, accs, w, o, rb, aq, tb * QK_K, bs, tb * 16, dq, tb)
        o += bsz
    _store_4x1(out, t, r0, accs)


@njit(inline="always")
def _tile_scales_k(dq, n_full, nbk):
    """``dtab[((tile * nbk + b) * 8 + token) * 8 + lane]``: each whole tile's d_x, repeated in 8 lanes, so
    that the per-pair scale ``d_w * d_x`` is one vector multiply with a plain load (see quant_matmul)."""
    dtab = np.empty(n_full * nbk * 8, np.float32)
    for t in range(n_full):
        for b in range(nbk):
            i = ((t // GEMM_TOKENS) * nbk + b) * GEMM_TOKENS + t % GEMM_TOKENS
            for lane in range(8):
                dtab[i * 8 + lane] = dq[t * nbk + b]
    return dtab


@njit(parallel=True, cache=True)
def _matmul_k(kind, w, rb, aq, dq, bs, out):
    """K-quants. w flat uint8 raw blocks, rb bytes per row, aq int8[n_tok * n_in], dq float32[n_tok * nbk],
    bs int16[n_tok * nbk * 16], out float32[n_tok, n_out] (C-contiguous, n_out >= 4)."""
    n_tok, n_out = out.shape
    n_in = aq.shape[0] // n_tok
    nbk = n_in // QK_K
    bsz = rb // nbk
    n_full = n_tok - n_tok % GEMM_TOKENS
    dtab = _tile_scales_k(dq, n_full, nbk)
    n_items = max(1, n_out // GEMM_ROWS)
    for g in prange(n_items):
        r0 = g * GEMM_ROWS
        r1 = n_out if g == n_items - 1 else r0 + GEMM_ROWS
        for t0 in range(0, n_full, GEMM_TOKENS):
            for r in range(r0, r1):
                accs = _zeros9()
                o = r * rb
                for b in range(nbk):
                    tb = t0 * nbk + b
                    do = ((t0 // GEMM_TOKENS) * nbk + b) * GEMM_TOKENS * 8
                    accs = _k_tile(kind, accs, w, o, aq, tb * QK_K, n_in, bs, tb * 16, nbk * 16, dtab, do)
                    o += bsz
                _store_1x8(out, t0, r, accs)
        for t in range(n_full, n_tok):
            for r in range(r0, r1, 4):
                _k_four(kind, w, rb, nbk, aq, dq, bs, out, t, min(r, r1 - 4))


@njit(inline="always")
def _q5_four(kind, w, rb, nb, aq, ds, out, t, r0):
    accs = _zeros5()
    bsz = rb // nb
    o = r0 * rb
    pf = o + PREFETCH_ROWS * rb
    for b in range(nb):
        prefetch(w, pf)
        prefetch(w, pf + 64)
        pf += 4 * bsz  # 88 or 96 bytes: two lines cover it
        tb = t * nb + b
        if kind == 0:
            accs = _q50_4x1(accs, w, o, rb, aq, tb * QK, 0, ds, 2 * tb, ds, 0)
        else:
            accs = _q51_4x1(accs, w, o, rb, aq, tb * QK, 0, ds, 2 * tb, ds, 0)
        o += bsz
    _store_4x1(out, t, r0, accs)


@njit(parallel=True, cache=True)
def _matmul_q5(kind, w, rb, aq, ds, out):
    """Q5_0/Q5_1. w, rb as above, aq int8[n_tok * n_in], ds float32[n_tok * nb * 2] (the (d, d Σq) pairs of
    quant_matmul.QuantizedActivations), out float32[n_tok, n_out] (C-contiguous, n_out >= 4)."""
    n_tok, n_out = out.shape
    n_in = aq.shape[0] // n_tok
    nb = n_in // QK
    bsz = rb // nb
    n_full = n_tok - n_tok % GEMM_TOKENS
    d_b, s_t = tile_scales(ds, n_full, nb)
    n_items = max(1, n_out // GEMM_ROWS)
    for g in prange(n_items):
        r0 = g * GEMM_ROWS
        r1 = n_out if g == n_items - 1 else r0 + GEMM_ROWS
        for t0 in range(0, n_full, GEMM_TOKENS):
            tb = t0 * nb  # this tile's scales: s_t[tb:], d_b[8 * tb:]
            for r in range(r0, r1):
                accs = _zeros9()
                o = r * rb
                for b in range(nb):
                    c = tb + b * GEMM_TOKENS
                    ao = t0 * n_in + b * QK
                    if kind == 0:
                        accs = _q50_1x8(accs, w, o, 0, aq, ao, n_in, d_b, 8 * c, s_t, c)
                    else:
                        accs = _q51_1x8(accs, w, o, 0, aq, ao, n_in, d_b, 8 * c, s_t, c)
                    o += bsz
                _store_1x8(out, t0, r, accs)
        for t in range(n_full, n_tok):
            for r in range(r0, r1, 4):
                _q5_four(kind, w, rb, nb, aq, ds, out, t, min(r, r1 - 4))


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


def supports(ggml_type: GGMLType) -> bool:
    """Whether :func:`matmul` has a kernel for weights of this type."""
    return ggml_type in _K_KIND or ggml_type in _Q5_KIND


class _Prepared:
    """What the kernels need from one weight tensor, computed once per tensor (see quant_matmul)."""

    __slots__ = ("tensor", "flat", "rb", "n_out", "n_in", "kind", "is_k", "padded", "rows8", "rows8_kernel",
                 "block32_kind")

    def __init__(self, w: WeightTensor) -> None:
        t = w.ggml_type
        self.is_k = t in _K_KIND
        bs = QK_K if self.is_k else QK
        n_out, n_in = weight_shape(w, "K-quant", SUPPORTED_TYPES, bs)
        rb = n_in // bs * type_size(t)
        flat = weight_bytes(w, rb)
        # The kernels compute rows in groups of 4: a weight of fewer rows gets zero rows appended (a
        # copy of a few bytes; real models never have one), whose outputs are dropped.
        self.padded = n_out < 4
        if self.padded:
            flat = np.concatenate([flat, np.zeros((4 - n_out) * rb, np.uint8)])
        flat = read_only(flat)
        self.tensor = w
        self.flat = flat
        self.rb = rb
        self.n_out, self.n_in = n_out, n_in
        self.kind = _K_KIND[t] if self.is_k else _Q5_KIND[t]
        # Q4_K, Q5_K and Q6_K in whole groups of eight rows run on a copy repacked for them (kquant_rows8;
        # kquant_rows16 on AVX-512 VNNI, Q4_K's prefill on AMX tiles where they run: kquant_amx), and so do
        # Q5_0's (block32_rows8); the raw pages are then given back, so the copy replaces them in memory rather
        # than sitting beside them
        self.rows8 = self.rows8_kernel = self.block32_kind = None
        if kquant_rows8.supports(t, n_out, n_in):
            repack, self.rows8_kernel = kquant_amx.REPACKED[t]
            self.rows8 = repack(flat, n_out, n_in)
            release_file_pages(w.data)
        elif block32_rows8.supports(t, n_out, n_in):  # Q5_0, Q5_1 (the kernel depends on the token count)
            self.block32_kind = block32_rows8.KINDS[t]
            self.rows8 = block32_rows8.repack(t, flat, n_out, n_in)
            release_file_pages(w.data)


def prepare(w: WeightTensor) -> _Prepared:
    """What :func:`matmul` needs from a weight, computed once: pass the result instead of the tensor to
    skip that work on every call (the backend prepares each weight when it binds a plan)."""
    return _Prepared(w)


def matmul(
    x: np.ndarray, w: WeightTensor | _Prepared, out: np.ndarray, xq: Q8KActivations | QuantizedActivations | None = None
) -> None:
    """``out[n_tok, n_out] = x[n_tok, n_in] @ W^T`` with ``W`` (shape ``(n_out, n_in)``) read as raw blocks.

    ``xq``, when given, is ``x`` already quantized by the caller (shared by several matmuls): Q8_K
    (:func:`quantize_activations_q8_k`) for K-quant weights, quant_matmul's Q8 blocks for Q5_0/Q5_1.
    ``out`` must be float32 ``[n_tok, n_out]``; it is written, never read.
    """
    p = w if isinstance(w, _Prepared) else _Prepared(w)
    w = p.tensor
    n_tok = check_operands(x, w, out, p.n_in, p.n_out)
    if n_tok == 0 or p.n_out == 0:
        return
    if p.n_in == 0:  # an empty sum (the kernels divide by the block count)
        out[...] = 0.0
        return
    if p.padded:
        dst = np.empty((n_tok, 4), np.float32)
    else:
        dst = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)
    if p.is_k:
        if xq is None:
            xq = quantize_activations_q8_k(x)
        elif not isinstance(xq, Q8KActivations) or xq.q.shape != x.shape:
            raise ModelError(f"{w.name}: K-quant weights need Q8_K activations of shape {x.shape}")
        if p.rows8 is not None:
            p.rows8_kernel(p.rows8, xq._q, xq._d, xq._bs, dst)
        else:
            _matmul_k(p.kind, p.flat, p.rb, xq._q, xq._d, xq._bs, dst)
    else:
        if xq is None:
            xq = quantize_activations(x)
        elif not isinstance(xq, QuantizedActivations) or xq.q.shape != x.shape:
            raise ModelError(f"{w.name}: {w.ggml_type.name} weights need Q8 activations of shape {x.shape}")
        if p.rows8 is not None:
            block32_rows8.matmul(p.block32_kind, p.rows8, xq.q_flat, xq.ds_flat, dst)
        else:
            _matmul_q5(p.kind, p.flat, p.rb, xq.q_flat, xq.ds_flat, dst)
    if dst is not out:
        out[...] = dst[:, : p.n_out]


def _quantizer(x: np.ndarray, scratch: Q8KScratch | None) -> tuple[Q8KActivations, Callable[..., None]]:
    """Q8_K buffers for ``x`` (``scratch``'s, or a call's own without one), and the kernel that quantizes
    ``x`` into them (the parallel one from ``PARALLEL_QUANTIZE_TOKENS`` tokens on)."""
    buffers = Q8KActivations(*x.shape) if scratch is None else scratch.activations(*x.shape)
    return buffers, _q8k_parallel if x.shape[0] >= PARALLEL_QUANTIZE_TOKENS else _q8k_serial


def direct_call(
    x: np.ndarray, w: _Prepared, out: np.ndarray, xq: Q8KActivations | QuantizedActivations | None,
    scratch: Q8KScratch | None = None,
) -> Callable[[], None] | None:
    """What ``matmul(x, w, out, xq)`` runs, bound to these very arrays with none of its checks (see
    :func:`minfer.backends.cpu.quant_matmul.direct_call`); None where the general path is needed.
    Without ``xq``, the activations are quantized on every call into ``scratch`` (shared with the
    backend's other bound calls), or into buffers of the call's own."""
    if not isinstance(w, _Prepared) or w.padded or w.n_in == 0 or w.n_out == 0 or out.shape[0] == 0:
        return None
    if not out.flags.c_contiguous or x.dtype != np.float32 or not x.flags.c_contiguous:
        return None
    kind, flat, rb, rows8, rows8_kernel = w.kind, w.flat, w.rb, w.rows8, w.rows8_kernel
    if w.is_k:
        if xq is None:  # quantized here on every call, as matmul does
            own, quantize = _quantizer(x, scratch)

            def run() -> None:
                quantize(x, own._q, own._d, own._bs)
                if rows8 is not None:
                    rows8_kernel(rows8, own._q, own._d, own._bs, out)
                else:
                    _matmul_k(kind, flat, rb, own._q, own._d, own._bs, out)

            return run
        if not isinstance(xq, Q8KActivations):
            return None
        q, d, bs = xq._q, xq._d, xq._bs
        if rows8 is not None:
            return lambda: rows8_kernel(rows8, q, d, bs, out)
        return lambda: _matmul_k(kind, flat, rb, q, d, bs, out)
    if not isinstance(xq, QuantizedActivations):
        return None
    q, ds = xq.q_flat, xq.ds_flat
    if rows8 is not None:
        return block32_rows8.bound_call(w.block32_kind, rows8, q, ds, out)
    return lambda: _matmul_q5(kind, flat, rb, q, ds, out)


def group_call(
    x: np.ndarray, ws: Sequence[_Prepared], outs: Sequence[np.ndarray], scratch: Q8KScratch | None = None,
    xq: QuantizedActivations | None = None,
) -> Callable[[], None] | None:
    """``matmul(x, w, out)`` for two or three weights that read the same activations ``x`` (q/k/v,
    gate/up), bound to these arrays with none of the checks: ``x`` quantized once (K-quants: into
    ``scratch``, as :func:`direct_call` does; Q5_0: ``xq``, a shared QUANTIZE node's), then one parallel
    loop over all the weights' groups of rows. None unless every weight is on the same repacked layout
    (kquant_rows8, block32_rows8) and every operand fits. Each output is the same bits as its own call's."""
    if not 2 <= len(ws) <= 3 or len(outs) != len(ws):
        return None
    kinds = {getattr(w, "block32_kind", None) for w in ws}
    block32 = len(kinds) == 1 and None not in kinds  # one kind of block32_rows8's layouts (Q5_0, Q4_0, IQ4)
    if not block32 and not all(isinstance(w, _Prepared) and w.is_k and w.rows8 is not None for w in ws):
        return None
    if x.ndim != 2 or x.dtype != np.float32 or not x.flags.c_contiguous or x.shape[0] == 0:
        return None
    n_tok, n_in = x.shape
    if len({w.tensor.ggml_type for w in ws}) != 1 or any(w.n_in != n_in for w in ws):
        return None
    if any(o.shape != (n_tok, w.n_out) or o.dtype != np.float32 or not o.flags.c_contiguous
           for w, o in zip(ws, outs, strict=True)):
        return None
    if block32:  # the activations come quantized (a shared QUANTIZE node's)
        if not isinstance(xq, QuantizedActivations) or xq.q.shape != x.shape:
            return None
        more = [(w.rows8, o) for w, o in zip(ws[1:], outs[1:], strict=True)]
        return block32_rows8.bound_call(kinds.pop(), ws[0].rows8, xq.q_flat, xq.ds_flat, outs[0], more)
    own, quantize = _quantizer(x, scratch)
    kernel = ws[0].rows8_kernel
    args = [ws[0].rows8, own._q, own._d, own._bs, outs[0]]
    for w, o in zip(ws[1:], outs[1:], strict=True):
        args += [w.rows8, o]

    def run() -> None:
        quantize(x, own._q, own._d, own._bs)
        kernel(*args)

    return run


def warmup() -> None:
    """Compile (or load from numba's on-disk cache) every kernel, so no call pays for compilation later."""
    rng = np.random.default_rng(0)
    n_in = QK_K
    for n_tok in (1, GEMM_TOKENS + 1):
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        for n_out in (5, 8):  # 8: Q4_K's, Q5_K's, Q6_K's and Q5_0's repacked groups
            out = np.empty((n_tok, n_out), np.float32)
            for t in SUPPORTED_TYPES:
                raw = np.zeros((n_out, n_in // (QK_K if t in _K_KIND else QK) * type_size(t)), np.uint8)
                matmul(x, WeightTensor("warmup", t, (n_out, n_in), raw), out)
    quantize_activations_q8_k(rng.standard_normal((PARALLEL_QUANTIZE_TOKENS, n_in)).astype(np.float32))
