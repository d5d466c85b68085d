"""The STREAM-like read bandwidth measurement that kernel benchmarks and ``minfer bench`` compare against."""

import numpy as np
import pytest

from minfer.tools.read_bandwidth import measure_read_bandwidth, read_once


def test_read_once_sums_every_slice():
    buf = np.arange(4096, dtype=np.float32) % 7
    for threads in (1, 2, 4):
        assert read_once(buf, threads) == pytest.approx(float(buf.sum()))


def test_measure_read_bandwidth_is_a_positive_rate_and_restores_threads():
    import numba

    before = numba.get_num_threads()
    rate = measure_read_bandwidth(1, nbytes=8 << 20, seconds=0.05)
    assert np.isfinite(rate) and 1e8 < rate < 1e13  # bytes/s: between 0.1 GB/s and 10 TB/s
    assert numba.get_num_threads() == before


def test_measure_read_bandwidth_rejects_no_threads():
    with pytest.raises(ValueError, match="threads must be at least 1"):
        measure_read_bandwidth(0)
