"""What the Ray front costs: ``minfer serve --ray --replicas 1`` on this machine, then

* the latency of a small request (``GET /v1/models``) straight to the replica's engine and through the
  front, alternated (the front's added milliseconds per request);
* a streamed load through the front (``--clients`` x ``--requests`` chat requests of ``--max-tokens``):
  the front process's CPU seconds per request and per streamed token (from /proc), which set how many
  requests and tokens per second one front process can pass on one core.

    PYTHONPATH=src python3 bench/ray_front_overhead.py [--clients 8] [--requests 4] [--max-tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_load import load_run  # noqa: E402
from server_process import ServerProcess  # noqa: E402

import minfer  # noqa: E402
from minfer.pull import resolve_model  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--small", type=int, default=200, help="small requests per path")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    path = resolve_model(args.model)
    bias = {str(t): -100.0 for t in minfer.load(path, n_ctx=16).tokenizer.eog_ids}
    flags = ["--ray", "--replicas", "1", "--threads", "1", "--parallel", "8", "--ctx-size", "8192",
             "--log-format", "off"]
    with ServerProcess(path, flags, health_timeout=900) as front:
        assert front.proc is not None
        engine = httpx.get(front.url + "/health", timeout=10).json()["replicas"][0]["url"]
        asyncio.run(load_run(front.url, 2, 1, 8, bias))  # warm-up
        direct, through = [], []
        with httpx.Client(timeout=30) as client:
            for _ in range(args.small):
                for url, out in ((engine, direct), (front.url, through)):
                    t0 = time.perf_counter()
                    client.get(url + "/v1/models").raise_for_status()
                    out.append(time.perf_counter() - t0)
        cpu0 = cpu_seconds(front.proc.pid)
        run = asyncio.run(load_run(front.url, args.clients, args.requests, args.max_tokens, bias))
        cpu = cpu_seconds(front.proc.pid) - cpu0
    n_requests = args.clients * args.requests
    tokens = run["tokens_per_s"] * run["seconds"]
    report = {"small_request_ms": {"direct_p50": 1e3 * statistics.median(direct),
                                   "front_p50": 1e3 * statistics.median(through)},
              "stream": {"requests": n_requests, "tokens": tokens, "front_cpu_s": cpu,
                         "front_cpu_ms_per_request": 1e3 * cpu / n_requests,
                         "front_cpu_us_per_token": 1e6 * cpu / max(tokens, 1),
                         "tokens_per_s": run["tokens_per_s"], "failed": run["failed"]},
              "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    s, st = report["small_request_ms"], report["stream"]
    print(f"GET /v1/models p50: {s['direct_p50']:.2f} ms to the engine, {s['front_p50']:.2f} ms through the front "
          f"(+{s['front_p50'] - s['direct_p50']:.2f} ms)")
    print(f"streamed load through the front ({n_requests} requests, {st['tokens']:.0f} tokens, "
          f"{st['tokens_per_s']:.1f} tok/s, failed {st['failed']}): the front used {st['front_cpu_s']:.2f} CPU s, "
          f"{st['front_cpu_ms_per_request']:.2f} ms per request, {st['front_cpu_us_per_token']:.0f} us per token "
          f"(load average {' '.join(report['loadavg'])})")


if __name__ == "__main__":
    main()
