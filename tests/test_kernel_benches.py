"""Smoke test of the kernel benchmarks in bench/ (tiny sizes: they run, print every row, and report rates that
are numbers; the figures themselves are the benchmarks' business, not a test's)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kquant_bench  # noqa: E402


def test_machine_tables_on_tiny_shapes(capsys):
    rows = kquant_bench.bench_machine([kquant_bench.GGMLType[n] for n in ("Q4_K", "Q6_K", "Q8_0", "Q4_1", "F16")],
                                      [(256, 256)], [1], [8], 0.01, 1 << 20)
    assert [r["type"] for r in rows] == ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "F16"]
    for r in rows:
        assert r["gemv_bytes_s"] > 0 and 0 < r["gemv_fraction"] and r["gemm8_flop_s"] > 0
        assert r["weight_bytes"] >= 256 * 256 * 4.5 / 8  # at least Q4's 4.5 bits per weight
    out = capsys.readouterr().out
    assert "measured read bandwidth" in out and "GEMM8 GFLOP/s" in out


def test_cli_runs_both_modes(capsys):
    kquant_bench.main(["--machine", "--threads", "1", "--shapes", "256x256", "--tokens", "4", "--working-set", "1",
                       "--seconds", "0.01", "--types", "Q4_0"])
    kquant_bench.main(["--threads", "1", "--tokens", "1", "--seconds", "0.01", "--types", "Q6_K"])
    out = capsys.readouterr().out
    assert "Q4_0  256x256" in out and "summary, GFLOP/s" in out
