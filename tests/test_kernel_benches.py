"""Smoke test of the kernel benchmark ``bench/kquant_bench.py`` (``minfer.testing.kquant_bench``): tiny
sizes, it runs, prints every row, and reports rates that are numbers (the figures themselves are the
benchmark's business, not a test's)."""

from __future__ import annotations

from minfer.testing import kquant_bench


def test_gemm_against_the_peak_on_tiny_shapes(capsys):
    types = [kquant_bench.GGMLType[n] for n in ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "F16")]
    rows = kquant_bench.bench_peak(types, [(256, 256)], [1], [8], 0.01)
    assert [r["type"] for r in rows] == ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "F16"]
    assert all(r["flop_s"] > 0 and r["peak_flop_s"] > 0 and r["tokens"] == 8 for r in rows)
    out = capsys.readouterr().out
    assert "float32 FMA peak" in out and "Q4_K  256x256 8 tok" in out


def test_cli_runs_peak_and_compare_modes(capsys):
    kquant_bench.main(["--peak", "--threads", "1", "--shapes", "256x256", "--tokens", "4", "--seconds", "0.01",
                       "--types", "Q5_K"])
    kquant_bench.main(["--threads", "1", "--tokens", "1", "--seconds", "0.01", "--types", "Q6_K"])
    out = capsys.readouterr().out
    assert "Q5_K  256x256 4 tok" in out and "summary, GFLOP/s" in out
