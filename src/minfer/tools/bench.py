"""``minfer bench``: llama-bench style throughput of prompt processing (pp) and generation (tg).

pp<N>: N random tokens evaluated from position 0 in one forward pass. tg<N>: N random tokens evaluated
one at a time at positions 0..N-1 (what a decode loop does, without sampling). With ``--lookup`` or
``--draft MODEL``: gen<N> and gen<N>+lookup (or +draft), at most N tokens generated greedily through the
engine for a prompt that asks the model to repeat a paragraph of about 120 tokens (the case prompt lookup
is made for), without and with speculative decoding, with the acceptance rate and the tokens per target
pass. Each test runs once to
warm up, then ``repetitions`` times; tokens/s are reported as mean and standard deviation over runs.
Peers (``--compare``) run the same workload on the same file in child processes, after minfer, so
minfer's peak RSS is its own.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minfer.api import Model
from minfer.errors import BadRequestError


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
    records: list[BenchRecord] = field(default_factory=list)
    peers: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> list[dict[str, Any]]:
        out = []
        for r in self.records:
            d = asdict(r)
            d.update(model=self.model, load_s=self.load_s, peak_rss_bytes=self.peak_rss_bytes,
                     weight_bytes_per_token=self.weight_bytes_per_token,
                     expert_bytes_per_token=self.expert_bytes_per_token)
            if r.test.startswith("tg") and r.engine == "minfer":
                d["bandwidth_gb_s"] = self.weight_bytes_per_token * r.tokens_per_s / 1e9
            out.append(d)
        return out


def weight_bytes_per_token(model: Model) -> int:
    """Bytes of weights one decode step reads: every tensor, except that the embedding gives one row and a
    mixture of experts' stacks give the experts a token uses (n_expert_used of n_expert, on average)."""
    from minfer.formats.gguf_file import ExpertTensors

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


def _file_bytes(path: Path) -> int:
    """Size of a model file, or of an HF folder's safetensors files."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return path.stat().st_size


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_minfer(model_path: str | Path, prompts: Sequence[int], gens: Sequence[int], threads: Sequence[int],
               reps: int, report: BenchReport | None = None, quantize: str | None = None) -> BenchReport:
    n_ctx = max([*prompts, *gens, 1])
    report_ = report
    for t in threads:
        t0 = time.perf_counter()
        model = Model(model_path, n_ctx=n_ctx, threads=t, quantize=quantize)
        load_s = time.perf_counter() - t0
        if report_ is None:
            hp = model.hparams
            report_ = BenchReport(
                model=model.path.name,
                model_bytes=_file_bytes(model.path),
                n_params=sum(int(np.prod(x.shape)) for x in model.transformer.tensors.values()),
                weight_bytes_per_token=weight_bytes_per_token(model),
                load_s=load_s,
                kv_bytes_per_position=hp.kv_f32_bytes_per_position,
            )
        vocab = model.hparams.n_vocab
        runner = model.runner
        for kind, sizes in (("pp", prompts), ("tg", gens)):
            for n in sizes:
                runs = []
                for r in range(reps + 1):
                    toks = np.random.default_rng(r).integers(0, vocab, n)
                    reads = getattr(runner.backend, "expert_reads", None)
                    if reads is not None:
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
                    if kind == "tg" and reads is not None and reads.bytes:
                        report_.expert_bytes_per_token = reads.bytes / n
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


def run_speculative(model_path: str | Path, gens: Sequence[int], threads: Sequence[int], reps: int,
                    report: BenchReport, lookup: bool = False, draft: str | Path | None = None,
                    quantize: str | None = None) -> None:
    """gen<N> without and with speculative decoding (runs alternate, so that both see the same load)."""
    mode = "draft" if draft is not None else "lookup"
    for t in threads:
        model = Model(model_path, threads=t, quantize=quantize, draft=draft, lookup=lookup and draft is None)
        prompt = REPEAT_PROMPT
        if model.chat_template is not None:
            prompt = model.render_chat([{"role": "user", "content": REPEAT_PROMPT}])
        ids = model.tokenize(prompt, add_special=model.chat_template is None)
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
            report.records.append(BenchRecord("minfer", f"gen{n}", t, runs["off"]))
            report.records.append(BenchRecord(
                "minfer", f"gen{n}+{mode}", t, runs[mode],
                acceptance_rate=spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0,
                tokens_per_pass=spec["tokens"] / spec["passes"] if spec["passes"] else 0.0))
        model.backend.close()


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
    lines = [
        f"model: {report.model}, {report.model_bytes / 2**20:.1f} MiB, {report.n_params / 1e6:.1f} M params, "
        f"load {report.load_s:.2f} s, peak RSS {report.peak_rss_bytes / 2**20:.0f} MiB, "
        f"weights read per token {report.weight_bytes_per_token / 2**20:.1f} MiB"
        + (f" (experts measured: {report.expert_bytes_per_token / 2**20:.1f} MiB)" if report.expert_bytes_per_token
           else "") + ", "
        f"KV (f32) {report.kv_bytes_per_position / 1024:.1f} KiB/position",
        "",
        "| engine | threads | test | t/s | vs minfer |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    ours = {(r.test, r.threads): r.tokens_per_s for r in report.records if r.engine == "minfer"}
    for r in report.records:
        ratio = ""
        if r.engine != "minfer" and (r.test, r.threads) in ours and r.tokens_per_s:
            ratio = f"{ours[(r.test, r.threads)] / r.tokens_per_s:.2f}x"
        if r.acceptance_rate is not None:
            ratio = f"acceptance {r.acceptance_rate:.0%}, {r.tokens_per_pass:.2f} tokens/pass"
        lines.append(f"| {r.engine} | {r.threads} | {r.test} | {r.tokens_per_s:.2f} ± {r.stddev:.2f} | {ratio} |")
    tg = [r for r in report.records if r.engine == "minfer" and r.test.startswith("tg")]
    for r in tg:
        gbs = report.weight_bytes_per_token * r.tokens_per_s / 1e9
        lines.append(f"\n{r.test} at {r.threads} threads reads weights at {gbs:.1f} GB/s")
    for p in report.peers:
        if "error" in p:
            lines.append(f"\npeer {p['engine']}: skipped ({p['error']})")
        else:
            lines.append(f"\npeer {p['engine']}: {p.get('version', '')}, load {p.get('load_s', 0):.2f} s")
    lines.append("\n'vs minfer' = minfer t/s / peer t/s (above 1: minfer is faster)")
    return "\n".join(lines)


def bench(model_path: Path, prompts: Sequence[int], gens: Sequence[int], threads: Sequence[int], reps: int,
          compare: bool = False, peer_python: dict[str, str] | None = None, quantize: str | None = None,
          lookup: bool = False, draft: str | Path | None = None) -> BenchReport:
    """Run the tests; with ``compare`` also the peers (``peer_python`` maps an engine to its interpreter);
    with ``lookup`` or ``draft`` also generation without and with speculative decoding."""
    if reps < 1:
        raise BadRequestError(f"repetitions must be >= 1, got {reps}")
    if any(n < 1 for n in [*prompts, *gens]) or any(t < 1 for t in threads):
        raise BadRequestError("test sizes and thread counts must be positive")
    report = run_minfer(model_path, prompts, gens, threads, reps, quantize=quantize)
    if lookup or draft is not None:
        run_speculative(model_path, gens, threads, reps, report, lookup=lookup, draft=draft, quantize=quantize)
    if compare:
        for engine in ("llama.cpp", "transformers"):
            python = (peer_python or {}).get(engine, sys.executable)
            peer = run_peer(engine, model_path, prompts, gens, threads, reps, python)
            report.peers.append(peer)
            for rec in peer.get("records", []):
                report.records.append(BenchRecord(engine, rec["test"], rec["threads"], rec["runs"]))
    return report
