"""The Ray front against the plain server on this machine, all of them up at once and measured in turn
(a shared machine drifts by tens of percent from one minute to the next: only same-minute ratios mean
something).

    PYTHONPATH=src python3 bench/ray_scaling.py [--rounds 3] [--clients 1,4,8] [--requests 4] [--max-tokens 32]

It starts a Ray head on this machine (``ray start --head``: the multi-node recipe of docs/scaling.md, on
one node), then three servers of the same model, each engine with 1 thread and 8 parallel sequences:
the plain ``minfer serve``; ``--ray --ray-address`` with 1 replica; and with 2 replicas. Each round runs
``bench/server_load.py``'s load (N clients x M streamed chat requests of exactly ``--max-tokens`` tokens)
against each server in turn, for each concurrency. It reports each server's median token rate, the
per-round ratios (1 replica behind the front over the plain server: what the front costs; 2 replicas over
1: what the second replica adds), the front's CPU time while idle and, beyond that, per request and per
streamed token (from /proc; both figures are the same CPU seconds, divided by requests or by tokens),
and a small request's latency straight to an engine and through the front. At the end the servers stop
and ``ray stop`` ends the head.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import time
from pathlib import Path

import httpx
from server_load import load_run  # the script's own folder is on sys.path when it runs

import minfer  # noqa: E402
from minfer.pull import resolve_model  # noqa: E402
from minfer.testing.server_process import ServerProcess

ENGINE = ["--threads", "1", "--parallel", "8", "--ctx-size", "8192", "--log-format", "off"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--small", type=int, default=100, help="small requests per path for the latency figure")
    ap.add_argument("--idle", type=float, default=20.0, help="seconds the fronts' idle CPU is measured over")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    path = resolve_model(args.model)
    bias = {str(t): -100.0 for t in minfer.load(path, n_ctx=16).tokenizer.eog_ids}
    clients = [int(c) for c in args.clients.split(",")]
    # the head and the fronts that join it share the token of ~/.ray/auth_token (Ray's token authentication)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
    port = free_port()
    subprocess.run(["ray", "start", "--head", "--port", str(port), "--num-cpus", "4", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, env=env, capture_output=True)
    address = f"127.0.0.1:{port}"
    servers: dict[str, ServerProcess] = {}
    try:
        servers["plain"] = ServerProcess(path, ENGINE).__enter__()
        for name, n in (("ray1", 1), ("ray2", 2)):
            servers[name] = ServerProcess(path, ["--ray", "--ray-address", address, "--replicas", str(n), *ENGINE],
                                          env=env, health_timeout=900).__enter__()
            deadline = time.monotonic() + 900
            while sum(r["state"] == "ready" for r in httpx.get(servers[name].url + "/health", timeout=10)
                      .json()["replicas"]) < n:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name}: its replicas never became ready")
                time.sleep(1)
        for s in servers.values():
            asyncio.run(load_run(s.url, 2, 1, 8, bias))  # warm-up: plans for the common batch shapes
        # the fronts' CPU while idle (the replica list, the probes, Ray's own threads): taken out of the
        # per-token figure below
        idle0 = {n: cpu_seconds(servers[n].proc.pid) for n in ("ray1", "ray2")}  # type: ignore[union-attr]
        t_idle = time.monotonic()
        time.sleep(args.idle)
        idle_rate = {n: (cpu_seconds(servers[n].proc.pid) - idle0[n]) / (time.monotonic() - t_idle)  # type: ignore[union-attr]
                     for n in idle0}
        rates: dict[str, list[dict[int, float]]] = {name: [] for name in servers}
        front_cpu = {name: 0.0 for name in ("ray1", "ray2")}
        front_tokens = {name: 0.0 for name in ("ray1", "ray2")}
        front_requests = {name: 0 for name in ("ray1", "ray2")}
        for k in range(args.rounds):
            for name in servers:
                rates[name].append({})
            for c in clients:
                for name, s in servers.items():
                    assert s.proc is not None
                    cpu0 = cpu_seconds(s.proc.pid)
                    run = asyncio.run(load_run(s.url, c, args.requests, args.max_tokens, bias))
                    if name in front_cpu:
                        front_cpu[name] += cpu_seconds(s.proc.pid) - cpu0 - idle_rate[name] * run["seconds"]
                        front_tokens[name] += run["tokens_per_s"] * run["seconds"]
                        front_requests[name] += run["requests"]
                    rates[name][-1][c] = run["tokens_per_s"]
                    if not args.json:
                        print(f"round {k + 1}: {name:5s} {c} clients: {run['tokens_per_s']:.1f} tok/s, TTFT p50 "
                              f"{run['ttft_p50_ms']:.0f} ms, ITL p50 {run['itl_p50_ms']:.1f} ms, failed "
                              f"{run['failed']}", flush=True)
        engine_url = httpx.get(servers["ray1"].url + "/health", timeout=10).json()["replicas"][0]["url"]
        direct, through = [], []
        with httpx.Client(timeout=30) as client:
            for _ in range(args.small):
                for url, out in ((engine_url, direct), (servers["ray1"].url, through)):
                    t0 = time.perf_counter()
                    client.get(url + "/v1/models").raise_for_status()
                    out.append(time.perf_counter() - t0)
    finally:
        for s in servers.values():
            s.stop()
        subprocess.run(["ray", "stop"], env=env, capture_output=True)

    def ratio(a: str, b: str, c: int) -> list[float]:
        return [x[c] / y[c] for x, y in zip(rates[a], rates[b], strict=True)]

    report = {
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "median_tokens_per_s": {name: {c: statistics.median(r[c] for r in rows) for c in clients}
                                for name, rows in rates.items()},
        "ray1_over_plain": {c: ratio("ray1", "plain", c) for c in clients},
        "ray2_over_ray1": {c: ratio("ray2", "ray1", c) for c in clients},
        "ray2_over_plain": {c: ratio("ray2", "plain", c) for c in clients},
        "front_idle_cpu_share": idle_rate,
        "front_cpu_ms_per_request": {n: 1e3 * front_cpu[n] / max(front_requests[n], 1) for n in front_cpu},
        "front_cpu_us_per_token": {n: 1e6 * front_cpu[n] / max(front_tokens[n], 1) for n in front_cpu},
        "small_request_ms": {"engine_p50": 1e3 * statistics.median(direct),
                             "front_p50": 1e3 * statistics.median(through)},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"\nload average at the end: {' '.join(report['loadavg'])}")
    for name, row in report["median_tokens_per_s"].items():
        print(f"{name:5s} median tok/s: " + ", ".join(f"{c} clients {v:.1f}" for c, v in row.items()))
    for key in ("ray1_over_plain", "ray2_over_ray1", "ray2_over_plain"):
        print(f"{key}: " + "; ".join(f"{c} clients median {statistics.median(v):.2f} (rounds "
                                     + ", ".join(f"{x:.2f}" for x in v) + ")" for c, v in report[key].items()))
    print("front CPU idle: " + ", ".join(f"{n}: {100 * v:.1f}% of a core" for n, v in idle_rate.items()))
    per = [f"{n}: {report['front_cpu_ms_per_request'][n]:.2f} ms/request, "
           f"{report['front_cpu_us_per_token'][n]:.0f} us/token" for n in front_cpu]
    print("front CPU under load, idle share taken out: " + ", ".join(per))
    s = report["small_request_ms"]
    print(f"GET /v1/models p50: {s['engine_p50']:.2f} ms straight to the engine, {s['front_p50']:.2f} ms through "
          "the front")


if __name__ == "__main__":
    main()
