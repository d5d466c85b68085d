"""Dequantizers of the non-linear 4-bit block types: IQ4_NL (32 values per block), IQ4_XS (256 per super-block)
and MXFP4 (gpt-oss's microscaling FP4, 32 per block), bit-equal to ``gguf.quants.dequantize``.

* IQ4_NL: f16 ``d``, then 16 bytes of 4-bit indices (value i of the block in the low nibble of byte i for
  i < 16, in the high nibble of byte i - 16 otherwise) into the table ``IQ4_VALUES``: ``x = d * table[q]``.
* IQ4_XS: f16 ``d``, u16 ``scales_h``, 4 bytes ``scales_l``, 128 bytes of indices: eight sub-blocks of 32 values,
  each with a 6-bit scale ``ls`` (low 4 bits from ``scales_l``, high 2 from ``scales_h``) and the IQ4_NL layout:
  ``x = d * (ls - 32) * table[q]``.
* MXFP4: one E8M0 exponent byte ``e`` (the scale 2^(e - 127), halved because the table holds doubled E2M1
  values) and 16 bytes of 4-bit indices laid out as IQ4_NL's, into ``MXFP4_VALUES``.
"""

from __future__ import annotations

import numpy as np

from minfer.formats.block_types import GGMLType, type_size

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
_F32 = np.float32


def _blocks(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, type_size(t))


def _indices(qs: np.ndarray) -> np.ndarray:
    """``[n, 16 m]`` bytes -> ``[n, 32 m]`` 4-bit indices, per 16 bytes the low nibbles then the high ones."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def dequantize_iq4_nl(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.IQ4_NL)
    d = np.ascontiguousarray(b[:, :2]).view(np.float16).astype(_F32)
    return (d * IQ4_VALUES[_indices(b[:, 2:])].astype(_F32)).reshape(-1, n)


def iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """The eight 6-bit sub-block scales of each IQ4_XS super-block, minus 32: int8 ``[n_blocks, 8]``."""
    nb = b.shape[0]
    h = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)  # [nb, 1]
    low = (b[:, 4:8].reshape(nb, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)).reshape(nb, 8) & np.uint8(15)
    high = ((h >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)).astype(np.uint8)
    return (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)


def dequantize_iq4_xs(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.IQ4_XS)
    nb = b.shape[0]
    d = np.ascontiguousarray(b[:, :2]).view(np.float16).astype(_F32)
    dl = (d * iq4_xs_scales(b).astype(_F32)).reshape(nb, 8, 1)
    q = IQ4_VALUES[_indices(b[:, 8:])].astype(_F32).reshape(nb, 8, 32)
    return (dl * q).reshape(-1, n)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """``2^(e - 127) / 2`` as float32 (ggml's ``ggml_e8m0_to_fp32_half``: e < 2 gives subnormals)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32)
    return bits.view(_F32)


def dequantize_mxfp4(raw: np.ndarray, n: int) -> np.ndarray:
    b = _blocks(raw, GGMLType.MXFP4)
    d = e8m0_half(b[:, :1])
    return (d * MXFP4_VALUES[_indices(b[:, 1:])].astype(_F32)).reshape(-1, n)


IQUANT_DEQUANTIZERS = {
    GGMLType.IQ4_NL: dequantize_iq4_nl,
    GGMLType.IQ4_XS: dequantize_iq4_xs,
    GGMLType.MXFP4: dequantize_mxfp4,
}
