"""minfer bench against the machine: the read-bandwidth and FMA probes, what tg and pp records imply, and
llama.cpp's runs alternating with minfer's (``--compare``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minfer.errors import BadRequestError
from minfer.tools import machine
from minfer.tools.bench import BenchRecord, BenchReport, bench

FIXTURE = Path(__file__).parent / "fixtures" / "llama" / "model-q8_0.gguf"
LLAMACPP_PYTHON = os.environ.get("MINFER_LLAMACPP_PYTHON", "/tmp/lcpenv/bin/python")


def test_probes_measure_something():
    assert machine.measure_read_bandwidth(1, nbytes=32 << 20, seconds=0.05) > 1e8  # > 0.1 GB/s on anything
    assert machine.measure_fma_peak(1, tries=1) > 1e8
    probe = machine.MachineProbe()
    probe.bandwidth[2] = 5e9
    assert probe.read_bandwidth(2) == 5e9  # kept for the run: not measured again


def test_instruction_sets_from_flags():
    assert machine.instruction_set(frozenset({"avx", "avx2", "fma"})) == ("AVX2+FMA", 8, False)
    assert machine.instruction_set(frozenset({"avx2", "fma", "avx_vnni"})) == ("AVX2+FMA AVX-VNNI", 8, True)
    assert machine.instruction_set(frozenset({"avx2", "fma", "avx512f", "avx512_vnni"})) == ("AVX-512 VNNI", 16, True)


def test_records_against_the_machine():
    report = BenchReport(model="m", model_bytes=0, n_params=0, weight_bytes_per_token=10**9,
                         layer_matmul_params=10**8, output_params=10**7, attention_flops_unit=1000)
    report.machine.bandwidth[2] = 20e9
    report.machine.fma_flops[2] = 100e9
    tg = report.against_machine(BenchRecord("llama.cpp", "tg32", 2, [10.0]))
    assert tg == pytest.approx({"bandwidth_gb_s": 10.0, "bandwidth_fraction": 0.5})
    pp = report.against_machine(BenchRecord("minfer", "pp100", 2, [50.0]))  # 2 s
    matmul = 2 * 10**8 * 100 + 2 * 10**7
    total = matmul + 1000 * 100 * 101 / 2
    want = {"gflop_s": total / 2 / 1e9, "matmul_gflop_s": matmul / 2 / 1e9, "peak_fraction": total / 2 / 100e9}
    if machine.instruction_set(machine.cpu_flags())[2]:  # VNNI: the int8 peak, 4x the float32 one
        want["int8_peak_fraction"] = total / 2 / 400e9
    assert pp == pytest.approx(want)


def test_bench_json_reports_bandwidth_and_gflops():
    r = subprocess.run([sys.executable, "-m", "minfer", "bench", str(FIXTURE), "-p", "16", "-n", "4", "-r", "1",
                        "-t", "1", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {row["test"]: row for row in json.loads(r.stdout)}
    assert rows["tg4"]["bandwidth_fraction"] > 0 and rows["tg4"]["bandwidth_gb_s"] > 0
    assert rows["pp16"]["gflop_s"] > rows["pp16"]["matmul_gflop_s"] > 0
    m = rows["pp16"]["machine"]
    assert m["read_bandwidth_bytes_s"]["1"] > 0 and m["f32_fma_flop_s"]["1"] > 0
    assert m["amx"] == "ok" or len(m["amx"]) > 10  # whether the AMX tiles ran, or why not


def test_compare_without_llamacpp_still_reports_minfer(tmp_path):
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama_cpp is importable here: the missing-peer path cannot be shown with this interpreter")
    report = bench(FIXTURE, [8], [2], [1], 1, compare=True, measure_machine=False)
    llama = next(p for p in report.peers if p["engine"] == "llama.cpp")
    assert "not installed" in llama["error"]
    assert {r.engine for r in report.records} == {"minfer"}


@pytest.mark.skipif(not Path(LLAMACPP_PYTHON).exists(), reason=f"no llama-cpp-python at {LLAMACPP_PYTHON} "
                    "(MINFER_LLAMACPP_PYTHON)")
def test_compare_alternates_with_llamacpp():
    report = bench(FIXTURE, [8], [4], [1], 2, compare=True, peer_python={"llama.cpp": LLAMACPP_PYTHON},
                   measure_machine=False)
    llama = next(p for p in report.peers if p["engine"] == "llama.cpp")
    assert "error" not in llama, llama
    runs = {(r.engine, r.test): r.runs for r in report.records}
    assert len(runs[("llama.cpp", "pp8")]) == 2 and len(runs[("llama.cpp", "tg4")]) == 2
    assert all(v > 0 for v in runs[("llama.cpp", "tg4")])


def test_a_size_of_zero_leaves_that_test_out_as_in_llama_bench():
    report = bench(FIXTURE, [0], [2], [1], 1, measure_machine=False)
    assert {r.test for r in report.records} == {"tg2"}
    with pytest.raises(BadRequestError, match="nothing to measure"):
        bench(FIXTURE, [0], [0], [1], 1, measure_machine=False)
    with pytest.raises(BadRequestError, match="test sizes must be >= 0"):
        bench(FIXTURE, [-1], [2], [1], 1, measure_machine=False)


def test_a_peer_that_crashes_is_reported_as_a_crash(tmp_path):
    """A llama.cpp build that dies in its kernels (this one's AMX path did, on a Sapphire Rapids VM) must be
    reported as the crash it is, with its last words, not as a plain exit."""
    from minfer.tools.bench import PairedPeer

    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho \'{"engine": "llama.cpp", "version": "fake"}\'\nread line\n'
                    'echo "ggml: boom" >&2\nkill -SEGV $$\n')
    fake.chmod(0o755)
    peer = PairedPeer(str(fake), FIXTURE, [8], [4])
    assert peer.ok
    peer.run("pp8", 1, 0, keep=True)
    assert peer.info["error"] == "the llama.cpp child exited (killed by SIGSEGV): ggml: boom"
    assert not peer.ok and peer.records == {}
