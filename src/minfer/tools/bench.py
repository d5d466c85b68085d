"""``minfer bench``: llama-bench style throughput of prompt processing (pp) and generation (tg).

pp<N>: N random tokens evaluated from position 0 in one forward pass. tg<N>: N random tokens evaluated
one at a time at positions 0..N-1 (what a decode loop does, without sampling). With ``--lookup`` or
``--draft MODEL``: gen<N> and gen<N>+lookup (or +draft), at most N tokens generated greedily through the
engine for a prompt that asks the model to repeat a paragraph of about 120 tokens (the case prompt lookup
is made for), without and with speculative decoding, with the acceptance rate and the tokens per target
pass. Each test runs once to
warm up, then ``repetitions`` times; tokens/s are reported as mean and standard deviation over runs.
Peers (``--compare``) run the same workload on the same file in child processes, so minfer's peak RSS is
its own: llama.cpp alternates with minfer run by run (one child keeps its model loaded, ``bench_peers.py
--serve``), so both see the same load on a shared machine; transformers runs after minfer.

Against the machine (:mod:`minfer.tools.machine`, measured in the same run at each thread count):

* tg: the bytes of weights one token reads (every matrix once, the embedding one row unless it is also
  the output) times tokens/s is the read bandwidth the run implies, set against the measured read bandwidth;
* pp: FLOPs = 2 x (parameters of the layers' matrices) x N + 2 x (output matrix) (logits of the last
  position only) + attention (QK^T and PV over the causal half: 4 x layers x heads x head_dim x N(N+1)/2),
  over the run's seconds, set against the measured float32 FMA peak (and, with VNNI, 4x that for int8).
"""

from __future__ import annotations

import json
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minfer.api import Model
from minfer.errors import BadRequestError
from minfer.tools.machine import MachineProbe


@dataclass
class BenchRecord:
    engine: str
    test: str
    threads: int
    runs: list[float]
    tokens_per_s: float = 0.0
    stddev: float = 0.0
    acceptance_rate: float | None = None  # speculative tests: drafted tokens the target kept
    tokens_per_pass: float | None = None

    def __post_init__(self) -> None:
        if self.runs:
            self.tokens_per_s = statistics.fmean(self.runs)
            self.stddev = statistics.stdev(self.runs) if len(self.runs) > 1 else 0.0


@dataclass
class BenchReport:
    model: str
    model_bytes: int
    n_params: int
    weight_bytes_per_token: int
    expert_bytes_per_token: float = 0.0  # measured by the MoE kernels' byte counter during tg (0: no experts)
    load_s: float = 0.0
    peak_rss_bytes: int = 0
    kv_bytes_per_position: int = 0
    kv_bytes: int = 0  # the KV cache the bench's model allocated (n_ctx = the largest test)
    layer_matmul_params: int = 0  # parameters of the layers' matrices (MoE: the experts a token uses)
    output_params: int = 0  # the output matrix (the embedding when tied)
    attention_flops_unit: int = 0  # 4 x layers x heads x head_dim: attention FLOPs per (query, key) pair
    records: list[BenchRecord] = field(default_factory=list)
    peers: list[dict[str, Any]] = field(default_factory=list)
    machine: MachineProbe = field(default_factory=MachineProbe)

    def pp_flops(self, n: int) -> tuple[float, float]:
        """(matmul FLOPs, attention FLOPs) of a pp<n> run."""
        matmul = 2.0 * self.layer_matmul_params * n + 2.0 * self.output_params
        return matmul, self.attention_flops_unit * n * (n + 1) / 2

    def against_machine(self, r: BenchRecord) -> dict[str, float]:
        """What a record implies: tg the bandwidth and its fraction of the measured one, pp GFLOP/s and theirs
        of the float32 FMA peak (and, where the CPU has VNNI, of the int8 dot-product peak)."""
        if r.tokens_per_s <= 0:
            return {}
        n = int(r.test[2:]) if r.test[2:].isdigit() else 0
        if r.test.startswith("tg"):
            bw = self.weight_bytes_per_token * r.tokens_per_s
            measured = self.machine.bandwidth.get(r.threads, 0.0)
            return {"bandwidth_gb_s": bw / 1e9, "bandwidth_fraction": bw / measured if measured else 0.0}
        if r.test.startswith("pp") and n:
            matmul, attention = self.pp_flops(n)
            seconds = n / r.tokens_per_s
            peak = self.machine.fma_flops.get(r.threads, 0.0)
            out = {"gflop_s": (matmul + attention) / seconds / 1e9, "matmul_gflop_s": matmul / seconds / 1e9,
                   "peak_fraction": (matmul + attention) / seconds / peak if peak else 0.0}
            int8_peak = self.machine.describe()["int8_peak_op_s"].get(r.threads, 0.0)
            if int8_peak:  # the bound of integer-quantized weights' matmuls where the CPU has VNNI
                out["int8_peak_fraction"] = (matmul + attention) / seconds / int8_peak
            return out
        return {}

    def to_json(self) -> list[dict[str, Any]]:
        out = []
        machine = self.machine.describe()
        for r in self.records:
            d = asdict(r)
            d.update(model=self.model, load_s=self.load_s, peak_rss_bytes=self.peak_rss_bytes,
                     model_bytes=self.model_bytes, kv_bytes_per_position=self.kv_bytes_per_position,
                     kv_bytes=self.kv_bytes,
                     weight_bytes_per_token=self.weight_bytes_per_token,
                     expert_bytes_per_token=self.expert_bytes_per_token, machine=machine)
            d.update(self.against_machine(r))
            out.append(d)
        return out


def weight_bytes_per_token(model: Model) -> int:
    """Bytes of weights one decode step reads: every tensor, except that the embedding gives one row and a
    mixture of experts' stacks give the experts a token uses (n_expert_used of n_expert, on average)."""
    from minfer.formats.tensors import ExpertTensors

    total = 0
    hp = model.hparams
    for t in model.transformer.tensors.values():
        if t.name == "token_embd.weight" and not model.transformer.tied_output:
            total += t.nbytes // t.shape[0]
        elif isinstance(t, ExpertTensors):
            total += t.nbytes * hp.n_expert_used // hp.n_expert
        else:
            total += t.nbytes
    return total


def matmul_params(model: Model) -> tuple[int, int]:
    """(parameters of the layers' matrices, of the output matrix): MoE stacks count the experts a token uses."""
    from minfer.formats.tensors import ExpertTensors

    hp = model.hparams
    layers = output = 0
    for t in model.transformer.tensors.values():
        n = int(np.prod(t.shape))
        if t.name in ("output.weight", "token_embd.weight"):
            if t.name == "output.weight" or model.transformer.tied_output:
                output += n
        elif isinstance(t, ExpertTensors):
            layers += n * hp.n_expert_used // hp.n_expert
        elif len(t.shape) >= 2:  # projections, FFN matrices, MoE routers
            layers += n
    return layers, output


def _file_bytes(path: Path) -> int:
    """Size of a model file, or of an HF folder's safetensors files."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return path.stat().st_size


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _child_exit(proc: subprocess.Popen[str]) -> str:
    """How a peer's child ended, with the last line it wrote to stderr (a crash must say it crashed)."""
    code = proc.returncode
    try:
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
    except ValueError:
        how = f"killed by signal {-code}"
    last = (proc.stderr.read() if proc.stderr is not None else "").strip().splitlines()[-1:]
    return f"the llama.cpp child exited ({how})" + (f": {last[0][:200]}" if last else "")


class PairedPeer:
    """llama.cpp in a child that keeps its model loaded (``bench_peers.py --serve``) and runs one test on request,
    so that its runs alternate with minfer's."""

    def __init__(self, python: str, model_path: Path, prompts: Sequence[int], gens: Sequence[int]) -> None:
        script = Path(__file__).with_name("bench_peers.py")
        cmd = [python, str(script), "llama.cpp", str(model_path), "--serve", "--prompts",
               ",".join(map(str, prompts)), "--gens", ",".join(map(str, gens))]
        self.info: dict[str, Any] = {"engine": "llama.cpp"}
        self.records: dict[tuple[str, int], list[float]] = {}
        try:
            self.proc: subprocess.Popen[str] | None = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            self.proc = None
            self.info["error"] = str(e)
            return
        self.info.update(self._read())

    def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            proc = self.proc
            self.close()
            return {"error": _child_exit(proc)}
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            return {"error": f"unexpected output: {line.strip()[:200]}"}

    @property
    def ok(self) -> bool:
        return self.proc is not None and "error" not in self.info

    def run(self, test: str, threads: int, seed: int, keep: bool) -> None:
        """Run one test in the child; ``keep``: a measured run (not a warm-up)."""
        if not self.ok:
            return
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"test": test, "threads": threads, "seed": seed}) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            self.info["error"] = f"the llama.cpp child is gone: {e}"
            return
        answer = self._read()
        if "error" in answer:
            self.info["error"] = answer["error"]
            return
        if answer.get("load_s"):
            self.info.setdefault("load_s", answer["load_s"])
        if keep:
            self.records.setdefault((test, threads), []).append(float(answer["tokens_per_s"]))

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def run_minfer(model_path: str | Path, prompts: Sequence[int], gens: Sequence[int], threads: Sequence[int],
               reps: int, report: BenchReport | None = None, quantize: str | None = None,
               peer: PairedPeer | None = None, progress: Callable[[str], None] | None = None) -> BenchReport:
    n_ctx = max([*prompts, *gens, 1])
    report_ = report
    for t in threads:
        t0 = time.perf_counter()
        model = Model(model_path, n_ctx=n_ctx, threads=t, quantize=quantize)
        load_s = time.perf_counter() - t0
        if report_ is None:
            hp = model.hparams
            layers, output = matmul_params(model)
            report_ = BenchReport(
                model=model.path.name,
                model_bytes=_file_bytes(model.path),
                n_params=sum(int(np.prod(x.shape)) for x in model.transformer.tensors.values()),
                weight_bytes_per_token=weight_bytes_per_token(model),
                load_s=load_s,
                kv_bytes_per_position=hp.kv_f32_bytes_per_position,
                layer_matmul_params=layers,
                output_params=output,
                attention_flops_unit=4 * hp.n_layer * hp.n_head * hp.head_dim_k,
                kv_bytes=model.kv.nbytes,
            )
        vocab = model.hparams.n_vocab
        runner = model.runner
        for kind, sizes in (("pp", prompts), ("tg", gens)):
            for n in sizes:
                runs = []
                for r in range(reps + 1):
                    toks = np.random.default_rng(r).integers(0, vocab, n)
                    reads = runner.backend.expert_reads
                    reads.reset()
                    t1 = time.perf_counter()
                    if kind == "pp":
                        runner.forward(toks, np.arange(n), output_rows=[n - 1])
                    else:
                        for i in range(n):
                            runner.forward(toks[i : i + 1], [i])
                    dt = time.perf_counter() - t1
                    if r > 0:
                        runs.append(n / dt)
                    if kind == "tg" and reads.bytes:
                        report_.expert_bytes_per_token = reads.bytes / n
                    if peer is not None:
                        peer.run(f"{kind}{n}", t, r, keep=r > 0)
                    if progress is not None:
                        theirs = peer.records.get((f"{kind}{n}", t), []) if peer is not None and r > 0 else []
                        progress(f"{kind}{n} at {t} threads, run {r}/{reps}{' (warm-up)' if r == 0 else ''}: "
                                 f"minfer {n / dt:.2f} t/s" + (f", llama.cpp {theirs[-1]:.2f} t/s" if theirs else ""))
                report_.records.append(BenchRecord("minfer", f"{kind}{n}", t, runs))
        model.backend.close()
    assert report_ is not None
    report_.peak_rss_bytes = _peak_rss()
    return report_


REPEAT_PROMPT = (
    "Repeat the following paragraph exactly, word for word:\n\n"
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
    "climbed the narrow stairs, trimmed the wick, and polished the great glass lens until it shone. Ships "
    "passing through the dangerous strait relied on its steady beam to find the safe channel between the "
    "rocks. When the keeper grew too old to climb, his daughter took over the work, and she kept the light "
    "burning through storms, fog, and the long winter nights. Today the lighthouse is a museum, but its lamp "
    "is still lit every evening."
)


# free text, where prompt lookup finds few drafts: speculation must cost (almost) nothing there
STORY_PROMPT = "Write a short story about a cat who learns to fly."


def run_speculative(model_path: str | Path, gens: Sequence[int], threads: Sequence[int], reps: int,
                    report: BenchReport, lookup: bool = False, draft: str | Path | None = None,
                    quantize: str | None = None) -> None:
    """gen<N> without and with speculative decoding on the repeat prompt, story<N> the same on free text
    (runs alternate, so that both see the same load)."""
    mode = "draft" if draft is not None else "lookup"
    for t in threads:
        model = Model(model_path, threads=t, quantize=quantize, draft=draft, lookup=lookup and draft is None)
        for test, text in (("gen", REPEAT_PROMPT), ("story", STORY_PROMPT)):
            prompt = text
            if model.chat_template is not None:
                prompt = model.render_chat([{"role": "user", "content": text}])
            ids = model.tokenize(prompt, add_special=model.chat_template is None)
            _speculative_records(model, ids, test, mode, gens, t, reps, report)
        model.backend.close()


def _speculative_records(model: Model, ids: list[int], test: str, mode: str, gens: Sequence[int], t: int,
                         reps: int, report: BenchReport) -> None:
    for n in gens:
        runs: dict[str, list[float]] = {"off": [], mode: []}
        spec = {"drafted": 0, "accepted": 0, "passes": 0, "tokens": 0}
        for r in range(reps + 1):
            for which in ("off", mode):
                done = model.complete(ids, n, temperature=0, speculative=which)
                st = done.stats
                if r > 0:
                    runs[which].append(st.generated_tokens / (st.prefill_seconds + st.decode_seconds))
                    if which != "off":
                        spec["drafted"] += st.drafted_tokens
                        spec["accepted"] += st.accepted_tokens
                        spec["passes"] += st.target_passes
                        spec["tokens"] += st.generated_tokens
        report.records.append(BenchRecord("minfer", f"{test}{n}", t, runs["off"]))
        report.records.append(BenchRecord(
            "minfer", f"{test}{n}+{mode}", t, runs[mode],
            acceptance_rate=spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0,
            tokens_per_pass=spec["tokens"] / spec["passes"] if spec["passes"] else 0.0))


def run_peer(engine: str, model_path: Path, prompts: Sequence[int], gens: Sequence[int], threads: Sequence[int],
             reps: int, python: str) -> dict[str, Any]:
    script = Path(__file__).with_name("bench_peers.py")
    cmd = [python, str(script), engine, str(model_path), "--prompts", ",".join(map(str, prompts)),
           "--gens", ",".join(map(str, gens)), "--threads", ",".join(map(str, threads)), "--reps", str(reps)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"engine": engine, "error": str(e)}
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"engine": engine, "error": f"exit {r.returncode}: {tail}"}


def markdown(report: BenchReport) -> str:
    overhead = report.peak_rss_bytes - report.model_bytes - report.kv_bytes
    lines = [
        f"model: {report.model}, {report.model_bytes / 2**20:.1f} MiB, {report.n_params / 1e6:.1f} M params, "
        f"load {report.load_s:.2f} s, peak RSS {report.peak_rss_bytes / 2**20:.0f} MiB (file + KV "
        f"{report.kv_bytes / 2**20:.0f} MiB + {overhead / 2**20:.0f} MiB), "
        f"weights read per token {report.weight_bytes_per_token / 2**20:.1f} MiB"
        + (f" (experts measured: {report.expert_bytes_per_token / 2**20:.1f} MiB)" if report.expert_bytes_per_token
           else "") + ", "
        f"KV (f32) {report.kv_bytes_per_position / 1024:.1f} KiB/position",
        "",
        "| engine | threads | test | t/s | vs minfer | against the machine |",
        "| --- | ---: | --- | ---: | ---: | --- |",
    ]
    ours = {(r.test, r.threads): r.tokens_per_s for r in report.records if r.engine == "minfer"}
    for r in report.records:
        ratio = ""
        if r.engine != "minfer" and (r.test, r.threads) in ours and r.tokens_per_s:
            ratio = f"{ours[(r.test, r.threads)] / r.tokens_per_s:.2f}x"
        if r.acceptance_rate is not None:
            ratio = f"acceptance {r.acceptance_rate:.0%}, {r.tokens_per_pass:.2f} tokens/pass"
        m = report.against_machine(r)
        vs = ""
        if "bandwidth_gb_s" in m:
            vs = f"{m['bandwidth_gb_s']:.1f} GB/s = {m['bandwidth_fraction']:.0%} of measured"
        elif "gflop_s" in m:
            vs = f"{m['gflop_s']:.1f} GFLOP/s = {m['peak_fraction']:.0%} of f32 FMA peak"
            if "int8_peak_fraction" in m:
                vs += f", {m['int8_peak_fraction']:.0%} of int8 peak"
        lines.append(f"| {r.engine} | {r.threads} | {r.test} | {r.tokens_per_s:.2f} ± {r.stddev:.2f} | {ratio} "
                     f"| {vs} |")
    mach = report.machine.describe()
    for t in sorted(report.machine.bandwidth):
        lines.append(f"\nmachine at {t} thread{'s' if t > 1 else ''}: read bandwidth "
                     f"{report.machine.bandwidth[t] / 1e9:.1f} GB/s (sum over {max(512, 8 * mach['l3_bytes'] >> 20)} "
                     f"MiB, best of 8), float32 FMA peak {report.machine.fma_flops.get(t, 0) / 1e9:.0f} GFLOP/s "
                     f"(measured, {mach['instruction_set']}, {mach['f32_lanes']} lanes)"
                     + (f", int8 dot-product peak ~{4 * report.machine.fma_flops.get(t, 0) / 1e9:.0f} GOP/s (4x, "
                        "derived)" if mach["int8_dot"] else ""))
    amx = mach.get("amx", "")
    used = "Q4_K and Q6_K prefill of 32+ tokens runs on them"
    lines.append("\nAMX tiles: " + (used if amx == "ok" else f"not used ({amx})"))
    lines.append(f"\nGFLOP/s of pp: matmuls 2 x {report.layer_matmul_params / 1e6:.0f} M x N + output "
                 f"2 x {report.output_params / 1e6:.0f} M + causal attention; tg bandwidth: "
                 f"{report.weight_bytes_per_token / 2**20:.1f} MiB of weights per token x t/s")
    for p in report.peers:
        if "error" in p:
            lines.append(f"\npeer {p['engine']}: skipped ({p['error']})")
        else:
            lines.append(f"\npeer {p['engine']}: {p.get('version', '')}, load {p.get('load_s', 0):.2f} s")
    lines.append("\n'vs minfer' = minfer t/s / peer t/s (above 1: minfer is faster)")
    return "\n".join(lines)


def bench(model_path: Path, prompts: Sequence[int], gens: Sequence[int], threads: Sequence[int], reps: int,
          compare: bool = False, peer_python: dict[str, str] | None = None, quantize: str | None = None,
          lookup: bool = False, draft: str | Path | None = None, measure_machine: bool = True,
          progress: Callable[[str], None] | None = None) -> BenchReport:
    """Run the tests; with ``compare`` also the peers (``peer_python`` maps an engine to its interpreter);
    with ``lookup`` or ``draft`` also generation without and with speculative decoding."""
    if reps < 1:
        raise BadRequestError(f"repetitions must be >= 1, got {reps}")
    if any(n < 0 for n in [*prompts, *gens]) or any(t < 1 for t in threads):
        raise BadRequestError("test sizes must be >= 0 and thread counts >= 1")
    # as llama-bench: a size of 0 leaves that test out (-p 0: generation only)
    prompts, gens = [n for n in prompts if n], [n for n in gens if n]
    if not prompts and not gens:
        raise BadRequestError("nothing to measure: every prompt (-p) and generation (-n) size is 0")
    paired = None
    if compare:
        paired = PairedPeer((peer_python or {}).get("llama.cpp", sys.executable), Path(model_path), prompts, gens)
    try:
        report = run_minfer(model_path, prompts, gens, threads, reps, quantize=quantize, peer=paired,
                            progress=progress)
    finally:
        if paired is not None:
            paired.close()
    if paired is not None:
        report.peers.append(paired.info)
        for (test, t), runs in paired.records.items():
            report.records.append(BenchRecord("llama.cpp", test, t, runs))
    if lookup or draft is not None:
        run_speculative(model_path, gens, threads, reps, report, lookup=lookup, draft=draft, quantize=quantize)
    if compare:
        python = (peer_python or {}).get("transformers", sys.executable)
        peer = run_peer("transformers", model_path, prompts, gens, threads, reps, python)
        report.peers.append(peer)
        for rec in peer.get("records", []):
            report.records.append(BenchRecord("transformers", rec["test"], rec["threads"], rec["runs"]))
    if measure_machine:
        for t in threads:  # after the runs: the probe's 512 MiB buffer is gone before minfer's RSS peak is read
            report.machine.read_bandwidth(t)
            report.machine.fma_peak(t)
    return report
