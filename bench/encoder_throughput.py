"""Sentence embeddings on the CPU: minfer's encoder against sentence-transformers and llama.cpp, same machine,
same run, rounds alternating between the engines.

The model is all-MiniLM-L6-v2 (``minfer.load("all-minilm")``; its folder from ``minfer.pull.pull``). Each peer
stays loaded in its own interpreter (``bench/encoder_peers.py``, a child process answering JSON lines on
stdin/stdout, as ``minfer.tools.bench_peers --serve`` does for llama.cpp), so the rounds go minfer /
sentence-transformers / llama.cpp (the first engine of a round rotating) without reloading, and every engine
sees the same load on a shared machine.

* **Sentences**: ``--sentences`` (1,000) of 8-128 tokens each, [CLS] and [SEP] included: a target length drawn
  uniformly from a seeded RNG, then words drawn from a fixed word list until the model's tokenizer counts exactly
  that many tokens (the distribution it actually gives is printed).
* **Throughput**: all the sentences embedded in one call (minfer ``enc.embed(texts)``; sentence-transformers
  ``SentenceTransformer(folder, device="cpu").encode(texts, batch_size=32)`` with ``torch.set_num_threads(T)``;
  llama.cpp ``Llama(GGUF, embedding=True, n_threads=T, n_ctx = n_batch = n_ubatch = --llamacpp-batch,
  pooling_type=MEAN).embed(texts, normalize=True)``), tokenization included; sentences per second, the median of
  ``--rounds`` rounds (5), each engine's call timed in its own process.
* **Latency**: one sentence of 32 tokens, ``--calls`` (50) calls spread over the rounds, after 5 warm-up calls;
  the median.
* **Check**: each engine's embeddings of the first round against sentence-transformers', the lowest cosine over
  the sentences: at least 0.99999 for minfer, 0.999 for llama.cpp (its GELU is the tanh approximation).

Every engine runs at ``--threads`` threads (the peers also get ``OMP_NUM_THREADS``, and the Rust tokenizer of
sentence-transformers ``RAYON_NUM_THREADS``). A peer that is missing (no interpreter, package not installed, no
GGUF) is one line in the output and the others still run.

The peers live in their own environments, e.g. ``/tmp/refenv`` (``pip install torch sentence-transformers``) and
``/tmp/lcpenv`` (``pip install llama-cpp-python==0.3.36``). llama.cpp's F16 GGUF of the model comes from
llama.cpp's own converter, from the sources of that llama-cpp-python::

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36   # unpack it; L=.../vendor/llama.cpp
    PYTHONPATH=$L/gguf-py /tmp/refenv/bin/python $L/convert_hf_to_gguf.py FOLDER --outtype f16 --outfile OUT

with FOLDER the path ``python -c 'import minfer.pull as p; print(p.pull("all-minilm", progress=False))'`` prints.

    python bench/encoder_throughput.py [--model all-minilm] [--sentences 1000] [--rounds 5] [--threads 2] \\
        [--st-python /tmp/refenv/bin/python] [--llamacpp-python /tmp/lcpenv/bin/python] \\
        [--gguf /tmp/x/minilm-f16.gguf] [--calls 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import minfer
from minfer.pull import pull
from minfer.tools.machine import MachineProbe

PEERS_SCRIPT = Path(__file__).with_name("encoder_peers.py")
REFERENCE = "sentence-transformers"
MIN_COSINE = {"minfer": 0.99999, "llama.cpp": 0.999}
WARMUP_CALLS = 5

WORDS = """the of and to in is was for that with as on by at from his her they this which people time year
day world life hand part child eye woman place work week case point number group problem fact house water
city river mountain garden morning evening music story book letter paper table window door road car train
school student teacher doctor market price money company office country government family friend mother
father brother sister animal dog cat bird tree flower field sea island summer winter spring autumn light
night fire stone bridge village kitchen bread coffee dinner language question answer idea reason power
history science art picture voice song game team player ball street church hospital factory machine engine
computer network system memory signal energy weather cloud rain snow wind storm ocean forest desert valley
quick slow bright dark small large old young new early late happy quiet loud warm cold green blue red
white heavy simple strange careful beautiful important different possible ancient modern gentle
walks runs reads writes builds opens closes carries watches follows finds keeps brings holds turns
shows moves lives believes remembers explains describes discovers""".split()


def make_sentences(enc, n: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n`` sentences of ``lo``..``hi`` tokens each ([CLS], [SEP] and the final period included), as the
    model's tokenizer counts them: a target length, then words until it is reached."""
    rng = np.random.default_rng(seed)
    cost = {w: len(enc.tokenize(w)) - 2 for w in WORDS}  # wordpieces of a word between spaces add up
    words = [w for w in WORDS if 1 <= cost[w] <= 3]
    assert any(cost[w] == 1 for w in words), "the word list needs single-token words to hit every length"
    out = []
    for target in rng.integers(lo, hi + 1, n):
        remaining, chosen = int(target) - 3, []  # [CLS], [SEP], "."
        while remaining > 0:
            w = words[int(rng.integers(len(words)))]
            if cost[w] <= remaining:
                chosen.append(w)
                remaining -= cost[w]
        out.append(" ".join(chosen).capitalize() + ".")
    return out


def distribution(lengths: list[int]) -> dict[str, float]:
    q = np.percentile(lengths, [0, 25, 50, 75, 100])
    return {"min": int(q[0]), "p25": float(q[1]), "median": float(q[2]), "p75": float(q[3]), "max": int(q[4]),
            "mean": round(float(np.mean(lengths)), 1), "total": int(np.sum(lengths))}


class Minfer:
    name = "minfer"

    def __init__(self, model: str, threads: int) -> None:
        t0 = time.perf_counter()
        self.enc = minfer.load(model, threads=threads)
        self.load_s = time.perf_counter() - t0
        self.version = f"minfer {getattr(minfer, '__version__', '')}".strip() + ", float32"
        self.error: str | None = None

    def run(self, texts: list[str], calls: int = 1, want: bool = False) -> tuple[list[float], np.ndarray | None]:
        seconds, vectors = [], None
        for _ in range(calls):
            t0 = time.perf_counter()
            vectors = self.enc.embed(texts)
            seconds.append(time.perf_counter() - t0)
        return seconds, (np.asarray(vectors, dtype=np.float32) if want else None)

    def close(self) -> None:
        pass


class Peer:
    """One peer in a child process (``encoder_peers.py``), loaded once; ``error`` says why it cannot run."""

    def __init__(self, name: str, python: str, model: str | None, threads: int, n_batch: int, tmp: Path) -> None:
        self.name, self.tmp = name, tmp
        self.version, self.load_s, self.error = "", 0.0, None
        self.proc: subprocess.Popen | None = None
        if model is None:
            self.error = "no --gguf given; this script's docstring has the command that makes one"
            return
        if not (Path(python).is_file() and os.access(python, os.X_OK)):
            self.error = f"no interpreter {python}"
            return
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   RAYON_NUM_THREADS=str(threads), RAYON_RS_NUM_CPUS=str(threads), TOKENIZERS_PARALLELISM="true")
        self.stderr = open(tmp / f"{name}.stderr", "w+")  # noqa: SIM115 (kept open for the child's life)
        self.proc = subprocess.Popen([python, str(PEERS_SCRIPT), name, model, "--threads", str(threads),
                                      "--n-batch", str(n_batch)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=env)
        hello = self._read()
        if "error" in hello:
            self.error = hello["error"]
            self.close()
        else:
            self.version, self.load_s = hello["version"], hello["load_s"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline() if self.proc else ""
        if not line:
            self.stderr.seek(0)
            tail = [s for s in self.stderr.read().strip().splitlines() if s.strip()][-1:]
            return {"error": f"the peer process ended (exit {self.proc.wait() if self.proc else '?'})"
                    + (f": {tail[0].strip()}" if tail else "")}
        return json.loads(line)

    def run(self, texts: list[str], calls: int = 1, want: bool = False) -> tuple[list[float], np.ndarray | None]:
        out = self.tmp / f"{self.name}.npy"
        self.proc.stdin.write(json.dumps({"texts": texts, "calls": calls, "out": str(out) if want else None}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["seconds"], (np.load(out) if want else None)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None
            self.stderr.close()


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def cpu_line() -> str:
    mach = MachineProbe().describe()  # the instruction set from the CPU's flags; nothing measured
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU") if os.path.exists("/proc/cpuinfo") else "unknown CPU"
    amx = mach.get("amx", "")
    return (f"CPU: {model}, {os.cpu_count()} logical cores; {mach['instruction_set']} ({mach['f32_lanes']} float32 "
            f"lanes), int8 dot products: {'yes' if mach['int8_dot'] else 'no'}, AMX: "
            f"{'usable' if amx == 'ok' else amx}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="all-minilm", help="minfer's name or folder of the model")
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50, help="latency calls in all (spread over the rounds)")
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--latency-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--st-python", default=sys.executable, help="interpreter with sentence-transformers")
    ap.add_argument("--llamacpp-python", default=sys.executable, help="interpreter with llama-cpp-python")
    ap.add_argument("--gguf", help="llama.cpp's F16 GGUF of the model (without it llama.cpp is skipped)")
    ap.add_argument("--llamacpp-batch", type=int, default=512, help="llama.cpp's n_ctx = n_batch = n_ubatch")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    a = ap.parse_args()

    folder = Path(a.model) if Path(a.model).is_dir() else pull(a.model, progress=False)
    with tempfile.TemporaryDirectory(prefix="encoder_bench_") as tmp:
        # the peers load first, one after the other, then minfer (no two loads at once)
        engines: list = []
        skipped: dict[str, str] = {}
        for name, python, model in ((REFERENCE, a.st_python, str(folder)),
                                    ("llama.cpp", a.llamacpp_python, a.gguf)):
            peer = Peer(name, python, model, a.threads, a.llamacpp_batch, Path(tmp))
            if peer.error:
                skipped[name] = peer.error
            else:
                engines.append(peer)
        engines.insert(0, Minfer(str(folder), a.threads))
        mf = engines[0]
        texts = make_sentences(mf.enc, a.sentences, a.min_tokens, a.max_tokens, a.seed)
        lengths = [len(mf.enc.tokenize(t)) for t in texts]
        one = make_sentences(mf.enc, 1, a.latency_tokens, a.latency_tokens, a.seed + 1)
        one_len = len(mf.enc.tokenize(one[0]))

        throughput: dict[str, list[float]] = {e.name: [] for e in engines}
        latency: dict[str, list[float]] = {e.name: [] for e in engines}
        vectors: dict[str, np.ndarray] = {}
        per_round = max(1, math.ceil(a.calls / a.rounds))

        def step(e, r: int) -> None:
            try:
                if r < 0:  # warm-up, not counted
                    e.run(texts[:64])
                    e.run(one, WARMUP_CALLS)
                    return
                time.sleep(0.2)  # the previous engine's threads stop spinning
                seconds, vecs = e.run(texts, 1, want=r == 0)
                throughput[e.name].append(len(texts) / seconds[0])
                if vecs is not None:
                    vectors[e.name] = vecs
                latency[e.name].extend(e.run(one, per_round)[0])
            except Exception as err:  # a peer failing mid-run: reported, the others go on
                e.error = f"{type(err).__name__}: {err}"

        try:
            for r in range(-1, a.rounds):
                live = [e for e in engines if not e.error]
                if not live:
                    break
                k = max(r, 0) % len(live)
                for e in live[k:] + live[:k]:
                    step(e, r)
        finally:
            for e in engines:
                e.close()

    for e in engines:
        if e.error:
            skipped[e.name] = e.error
    ran = [e for e in engines if e.name not in skipped]
    ref = vectors.get(REFERENCE)
    results = {}
    for e in ran:
        sps, lat = statistics.median(throughput[e.name]), statistics.median(latency[e.name]) * 1e3
        cos = min_cosine(vectors[e.name], ref) if ref is not None and e.name != REFERENCE else None
        results[e.name] = {"version": e.version, "load_s": round(e.load_s, 2), "sentences_per_s": round(sps, 1),
                           "sentences_per_s_rounds": [round(x, 1) for x in throughput[e.name]],
                           "latency_ms": round(lat, 2), "latency_calls": len(latency[e.name]),
                           "min_cosine_vs_st": cos,
                           "check": None if cos is None else cos >= MIN_COSINE[e.name]}
    if "minfer" in results:
        m = results["minfer"]
        for name, res in results.items():
            if name != "minfer":
                res["minfer_over_peer_throughput"] = round(m["sentences_per_s"] / res["sentences_per_s"], 2)
                res["peer_over_minfer_latency"] = round(res["latency_ms"] / m["latency_ms"], 2)
    report = {"model": str(folder), "threads": a.threads, "rounds": a.rounds, "sentences": len(texts),
              "tokens_per_sentence": distribution(lengths), "latency_sentence_tokens": one_len,
              "cpu": cpu_line(), "llamacpp_batch": a.llamacpp_batch, "engines": results, "skipped": skipped}
    if a.json:
        print(json.dumps(report, indent=1))
        return
    d = report["tokens_per_sentence"]
    print(f"{folder.name}, {a.threads} thread{'s' if a.threads > 1 else ''}, median of {a.rounds} "
          f"round{'s' if a.rounds > 1 else ''} (engines alternating)")
    print(report["cpu"])
    print(f"{len(texts)} sentences, tokens each ([CLS], [SEP] included, the model's tokenizer): min {d['min']}, "
          f"p25 {d['p25']:g}, median {d['median']:g}, p75 {d['p75']:g}, max {d['max']}, mean {d['mean']}, "
          f"{d['total']} in all; latency: one sentence of {one_len} tokens, {per_round * a.rounds} calls\n")
    print("| engine | sentences/s | minfer/peer | latency ms | peer/minfer latency | cosine vs s-t (min) |")
    print("|---|---|---|---|---|---|")
    for name, res in results.items():
        spread = res["sentences_per_s_rounds"]
        rng = f" ({min(spread):.0f}-{max(spread):.0f})" if len(spread) > 1 else ""
        ratio = f"{res['minfer_over_peer_throughput']:.2f}" if "minfer_over_peer_throughput" in res else "-"
        lratio = f"{res['peer_over_minfer_latency']:.2f}" if "peer_over_minfer_latency" in res else "-"
        cos = "reference" if name == REFERENCE else "n/a (no reference)" if res["min_cosine_vs_st"] is None else \
            f"{res['min_cosine_vs_st']:.7f} {'ok' if res['check'] else 'FAIL'} (>= {MIN_COSINE[name]})"
        print(f"| {name} | {res['sentences_per_s']:.1f}{rng} | {ratio} | {res['latency_ms']:.2f} | {lratio} | {cos} |")
    print()
    for name, res in results.items():
        print(f"{name}: {res['version']}, load {res['load_s']:.2f} s")
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    print("\nminfer/peer = minfer's sentences/s over the peer's; peer/minfer latency = the peer's ms over minfer's "
          "(above 1: minfer is faster)")


if __name__ == "__main__":
    main()
