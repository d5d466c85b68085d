"""Each block type dequantizes bit-exactly like the gguf package's reference."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as gq

from minfer.errors import ModelError
from minfer.formats.quants import GGMLType, dequantize_rows, row_nbytes


def _raw(values: np.ndarray, t: GGMLType) -> np.ndarray:
    if t == GGMLType.F32:
        return values.astype(np.float32).view(np.uint8)
    q = gq.quantize(values.astype(np.float32), t)
    return q if q.dtype == np.uint8 else q.view(np.uint8)  # F16/BF16 come back as 16-bit arrays


@pytest.mark.parametrize("t", [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1])
def test_dequantize_bit_equal_to_gguf(t):
    rng = np.random.default_rng(int(t))
    x = rng.standard_normal((7, 256)).astype(np.float32) * rng.uniform(0.01, 10, (7, 1)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (d = 0)
    x[1, 32:64] = -3.0  # a constant block
    raw = _raw(x, t)
    assert raw.shape == (7, row_nbytes(t, 256))
    ours = dequantize_rows(raw, t, 256)
    theirs = gq.dequantize(raw, t).reshape(7, 256)
    assert ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


def test_q4_1_layout_by_hand():
    # one block: d = 0.5, m = -1, nibbles: byte j = (j+16 in the high nibble... as values j%16, (15-j)%16)
    d, m = np.float16(0.5), np.float16(-1.0)
    lo = np.arange(16, dtype=np.uint8)
    hi = 15 - lo
    block = np.concatenate([np.array([d, m], np.float16).view(np.uint8), lo | (hi << 4)])
    out = dequantize_rows(block[None, :], GGMLType.Q4_1, 32)[0]
    np.testing.assert_array_equal(out[:16], 0.5 * lo - 1.0)
    np.testing.assert_array_equal(out[16:], 0.5 * hi - 1.0)


def test_unsupported_type_is_a_clear_error():
    with pytest.raises(ModelError, match="Q6_K is not supported yet"):
        dequantize_rows(np.zeros((1, 210), np.uint8), GGMLType.Q6_K, 256)


def test_row_not_whole_blocks():
    with pytest.raises(ModelError, match="not a whole number of Q8_0 blocks"):
        row_nbytes(GGMLType.Q8_0, 33)
