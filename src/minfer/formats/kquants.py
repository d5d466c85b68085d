"""The remaining GGML block types (Q5_0, Q5_1 and the K-quants Q2_K..Q6_K): plain numpy dequantizers.

Each ``dequantize_<type>(raw, n)`` takes raw bytes ``uint8[rows, row_nbytes]`` holding ``n`` values per row
and returns ``f32[rows, n]``, computing exactly what ``gguf.quants.dequantize`` (gguf-py 0.19) computes with
the same float32 operations in the same order, so the results are bit-equal (tests hold this). Each
product below is one float32 rounding: ``dl * q - ml`` means ``f32(f32(dl * q) - ml)``, never a fused
multiply-add.

Block layouts (little-endian; all offsets in bytes; ``f16`` fields are IEEE half floats widened to f32):

====== ===== ===== ========================================================================================
type   block bytes layout
====== ===== ===== ========================================================================================
Q5_0   32    22    d: f16 | qh: u32 | qs: u8[16]
                   q_j = (nibble_j | bit_j(qh) << 4) - 16 (-16..15);  x_j = d * q_j
Q5_1   32    24    d: f16 | m: f16 | qh: u32 | qs: u8[16]
                   q_j = nibble_j | bit_j(qh) << 4 (0..31);  x_j = d * q_j + m
Q2_K   256   84    scales: u8[16] | qs: u8[64] | d: f16 | dmin: f16
                   16 sub-blocks of 16: sc = scales[s] & 15, mn = scales[s] >> 4
                   q_i (0..3) = (qs[32h + l] >> 2c) & 3 for i = 128h + 32c + l (h < 2, c < 4, l < 32)
                   x_i = (d * sc) * q_i - (dmin * mn)
Q3_K   256   110   hmask: u8[32] | qs: u8[64] | scales: u8[12] | d: f16
                   16 sub-blocks of 16, 6-bit scales: low 4 bits = scales[s] & 15 (s < 8) or
                   scales[s - 8] >> 4 (s >= 8); high 2 bits = (scales[8 + s % 4] >> 2 (s // 4)) & 3;
                   sc = that - 32 (-32..31)
                   low bits as Q2_K's q_i; high bit hb_i = (hmask[l] >> k) & 1 for i = 32k + l (k < 8)
                   q_i = low_i - 4 (1 - hb_i) (-4..3);  x_i = (d * sc) * q_i
Q4_K   256   144   d: f16 | dmin: f16 | scales: u8[12] | qs: u8[128]
                   8 sub-blocks of 32, 6-bit scale sc and min mn packed in 12 bytes (s = sub-block):
                     s < 4:  sc = scales[s] & 63, mn = scales[s + 4] & 63
                     s >= 4: sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4,
                             mn = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4
                   q_i (0..15) = (qs[32c + l] >> 4h) & 15 for i = 64c + 32h + l (c < 4, h < 2, l < 32)
                   x_i = (d * sc) * q_i - (dmin * mn)
Q5_K   256   176   d: f16 | dmin: f16 | scales: u8[12] | qh: u8[32] | qs: u8[128]
                   scales, mins and low nibbles as Q4_K; high bit (qh[l] >> k) & 1 for i = 32k + l
                   q_i = nibble_i | hb_i << 4 (0..31);  x_i = (d * sc) * q_i - (dmin * mn)
Q6_K   256   210   ql: u8[128] | qh: u8[64] | scales: i8[16] | d: f16
                   16 sub-blocks of 16, sc = scales[s] (signed)
                   low 4 bits (ql[64h + l] >> 4c) & 15 for i = 128h + 64c + l (h < 2, c < 2, l < 64)
                   high 2 bits (qh[32h + l] >> 2c) & 3 for i = 128h + 32c + l (c < 4, l < 32)
                   q_i = (low | high << 4) - 32 (-32..31);  x_i = (d * sc) * q_i
====== ===== ===== ========================================================================================

Q5_0/Q5_1 nibble order is Q4_0's: byte j of qs holds value j in its low nibble and value j + 16 in its high
nibble; bit j of qh (a little-endian u32) is value j's fifth bit. Every K-quant sub-block scale is first
multiplied by the block's ``d`` (and the min by ``dmin``) in float32, then applied to the integer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from minfer.formats.block_types import GGMLType, type_size

QK_K = 256  # values per K-quant super-block

_F32 = np.float32


def _blocks(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    """Raw rows as one block per row, ``uint8[n_blocks, type_size]``."""
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, type_size(t))


def _f16(b: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte ``start`` of every block, as float32 ``[n_blocks, 1]``."""
    return np.ascontiguousarray(b[:, start : start + 2]).view(np.float16).astype(_F32)


def _bits(bytes_: np.ndarray, n_bits: int) -> np.ndarray:
    """``[n_blocks, m]`` bytes -> ``[n_blocks, 8 // n_bits, m]`` fields: [:, k, l] = (byte l >> k n_bits) & mask."""
    shifts = np.arange(0, 8, n_bits, dtype=np.uint8).reshape(1, -1, 1)
    return (bytes_[:, None, :] >> shifts) & np.uint8((1 << n_bits) - 1)


def _q5_values(b: np.ndarray, qh_at: int) -> np.ndarray:
    """Q5_0/Q5_1's 32 unsigned 5-bit values per block (0..31), uint8 ``[n_blocks, 32]``."""
    qh = np.ascontiguousarray(b[:, qh_at : qh_at + 4]).view(np.uint32)  # [n_blocks, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
    low = _bits(b[:, qh_at + 4 :], 4).reshape(-1, 32)  # low nibbles (values 0..15), then high (16..31)
    return low | (high << np.uint8(4))


def dequantize_q5_0(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.Q5_0)
    q = _q5_values(b, 2).astype(np.int8) - np.int8(16)
    return (_f16(b, 0) * q.astype(_F32)).reshape(-1, n)


def dequantize_q5_1(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.Q5_1)
    q = _q5_values(b, 4).astype(_F32)
    return (_f16(b, 0) * q + _f16(b, 2)).reshape(-1, n)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's low 2-bit fields: ``[n_blocks, 64]`` bytes -> ``[n_blocks, 256]`` in value order."""
    nb = qs.shape[0]
    # i = 128 h + 32 c + l reads bits 2c of byte 32 h + l
    return _bits(qs.reshape(nb * 2, 32), 2).reshape(nb, QK_K)


def _high_bits(hm: np.ndarray) -> np.ndarray:
    """Q3_K/Q5_K's high bits: ``[n_blocks, 32]`` bytes -> ``[n_blocks, 256]``, value 32 k + l = bit k of byte l."""
    return _bits(hm, 1).reshape(hm.shape[0], QK_K)


def dequantize_q2_k(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.Q2_K)
    nb = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & np.uint8(15)).astype(_F32)).reshape(nb, 16, 1)
    ml = (dmin * (scales >> np.uint8(4)).astype(_F32)).reshape(nb, 16, 1)
    q = _crumbs(b[:, 16:80]).reshape(nb, 16, 16).astype(_F32)
    return (dl * q - ml).reshape(-1, n)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 16 signed 6-bit scales (-32..31) from its 12 scale bytes, as float32 ``[n_blocks, 16]``."""
    low = _bits(s[:, 0:8], 4).reshape(-1, 16)  # s < 8: low nibbles of bytes 0..7; s >= 8: their high nibbles
    high = _bits(s[:, 8:12], 2).reshape(-1, 16)  # s: bits 2 (s // 4) of byte 8 + s % 4
    u = low | (high << np.uint8(4))
    return (u.astype(np.int8) - np.int8(32)).astype(_F32)


def dequantize_q3_k(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.Q3_K)
    nb = b.shape[0]
    dl = (_f16(b, 108) * _q3_k_scales(b[:, 96:108])).reshape(nb, 16, 1)
    low = _crumbs(b[:, 32:96])
    missing = _high_bits(b[:, 0:32]) ^ np.uint8(1)  # a clear hmask bit means "subtract 4"
    q = (low.astype(np.int8) - (missing << np.uint8(2)).astype(np.int8)).astype(_F32)
    return (dl * q.reshape(nb, 16, 16)).reshape(-1, n)


def k4_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit scales and eight 6-bit mins from 12 bytes ``[n_blocks, 12]`` (uint8 each)."""
    lo, mid, top = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & np.uint8(63), (top & np.uint8(15)) | ((lo >> np.uint8(2)) & np.uint8(48))], axis=1)
    mn = np.concatenate([mid & np.uint8(63), (top >> np.uint8(4)) | ((mid >> np.uint8(2)) & np.uint8(48))], axis=1)
    return sc, mn


def _k4_dequantize(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``(d * sc) * q - (dmin * mn)`` per 32-value sub-block for Q4_K/Q5_K (d, dmin, scales in bytes 0..15)."""
    nb = b.shape[0]
    sc, mn = k4_scales_mins(b[:, 4:16])
    dl = (_f16(b, 0) * sc.astype(_F32)).reshape(nb, 8, 1)
    ml = (_f16(b, 2) * mn.astype(_F32)).reshape(nb, 8, 1)
    return (dl * q.reshape(nb, 8, 32).astype(_F32) - ml).reshape(nb, QK_K)


def _k4_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's low nibbles: ``[n_blocks, 128]`` -> ``[n_blocks, 256]``, i = 64 c + 32 h + l from byte 32 c + l."""
    nb = qs.shape[0]
    return _bits(qs.reshape(nb * 4, 32), 4).reshape(nb, QK_K)


def dequantize_q4_k(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.Q4_K)
    return _k4_dequantize(b, _k4_nibbles(b[:, 16:144])).reshape(-1, n)


def dequantize_q5_k(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.Q5_K)
    q = _k4_nibbles(b[:, 48:176]) | (_high_bits(b[:, 16:48]) << np.uint8(4))
    return _k4_dequantize(b, q).reshape(-1, n)


def dequantize_q6_k(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.Q6_K)
    nb = b.shape[0]
    dl = (_f16(b, 208) * b[:, 192:208].view(np.int8).astype(_F32)).reshape(nb, 16, 1)
    low = _bits(b[:, 0:128].reshape(nb * 2, 64), 4).reshape(nb, QK_K)  # i = 128 h + 64 c + l
    high = _bits(b[:, 128:192].reshape(nb * 2, 32), 2).reshape(nb, QK_K)  # i = 128 h + 32 c + l
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return (dl * q.reshape(nb, 16, 16).astype(_F32)).reshape(-1, n)


KQUANT_DEQUANTIZERS: dict[GGMLType, Callable[[np.ndarray, int], np.ndarray]] = {
    GGMLType.Q5_0: dequantize_q5_0,
    GGMLType.Q5_1: dequantize_q5_1,
    GGMLType.Q2_K: dequantize_q2_k,
    GGMLType.Q3_K: dequantize_q3_k,
    GGMLType.Q4_K: dequantize_q4_k,
    GGMLType.Q5_K: dequantize_q5_k,
    GGMLType.Q6_K: dequantize_q6_k,
}
