"""Load benchmark of ``minfer serve`` on loopback: N concurrent clients x M streamed chat requests each.

For each concurrency it reports requests/s, aggregate generated tokens/s, p50/p95 time to first token
and inter-token latency, failures, and the server's resident memory (``process_resident_memory_bytes``
from /metrics) before and after. Every request generates exactly ``--max-tokens`` tokens (end-of-
generation tokens get a -100 logit bias), so the token rates compare like with like. A last part
measures prefix reuse: the time to first token of a request with a long system prompt, cold and then
warm (the system prompt's cells reused).

    python bench/server_load.py [MODEL] [--clients 1,4,8] [--requests 8] [--max-tokens 64] [--parallel 8]
        [--repeat 5] [--long-run 200] [--peer-url URL] [--json]

``--repeat K`` (default 5, about five minutes in all) runs the whole list of concurrencies K times,
interleaved, and reports for each concurrency the run with the median token rate (a shared 2-core machine
drifts by ±30% from one minute to the next, so single runs of 1 and 8 clients taken minutes apart give a
ratio that is mostly drift), and the ratio of each round's 8-client rate to the same round's 1-client
rate, and the median of those ratios. ``--repeat 1`` is the quick look.

``--peer-url`` names another OpenAI-compatible server with the same model file, already running on this
machine (llama-cpp-python's: ``python -m llama_cpp.server --model M --port 8001 --interrupt_requests False``;
by default that server cuts a running stream short when the next request arrives): each concurrency then
runs against it right after minfer, in every round, and the report gives minfer's token rate over the
peer's per round. A peer that streams no usage chunk has its tokens counted as content chunks; requests
that got fewer than ``--max-tokens`` tokens are reported as short.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import time

import httpx

import minfer  # noqa: E402
from minfer.pull import resolve_model  # noqa: E402
from minfer.testing.server_process import ServerProcess

QUESTIONS = [
    "Tell me about the history of Rome.", "How do airplanes fly?", "Explain photosynthesis.",
    "What is a black hole?", "Describe how a computer works.", "Why is the sky blue?",
    "How do vaccines work?", "What causes earthquakes?", "Explain the water cycle.", "What is democracy?",
]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def one_request(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
                      bias: dict[str, float], need_usage: bool = True) -> dict:
    """One streamed chat request. ``need_usage``: a stream without a usage chunk counts as failed (minfer
    must send one); otherwise (a peer that does not) the tokens are counted as content chunks."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.8, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": bias}
    t0 = time.perf_counter()
    first, stamps, usage, ok = None, [], None, False
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                ok = True
                break
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if c["delta"].get("content"):
                    now = time.perf_counter()
                    first = first or now
                    stamps.append(now)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ok": ok and (usage is not None or not need_usage), "ttft": (first or time.perf_counter()) - t0,
            "tokens": usage["completion_tokens"] if usage else len(stamps),
            "cached": details.get("cached_tokens", 0), "gaps": gaps,
            "seconds": time.perf_counter() - t0}


async def load_run(url: str, clients: int, requests: int, max_tokens: int, bias: dict[str, float],
                   need_usage: bool = True) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        async def worker(w: int) -> list[dict]:
            out = []
            for i in range(requests):
                q = QUESTIONS[(w * requests + i) % len(QUESTIONS)] + f" (request {w}.{i})"
                out.append(await one_request(client, url, [{"role": "user", "content": q}], max_tokens, bias,
                                             need_usage))
            return out

        t0, cpu0 = time.perf_counter(), time.process_time()
        results = [r for rs in await asyncio.gather(*(worker(w) for w in range(clients))) for r in rs]
        wall, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    good = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in good)
    short = sum(r["tokens"] < max_tokens for r in good)
    ttft = [r["ttft"] for r in good]
    gaps = [g for r in good for g in r["gaps"]]
    return {"clients": clients, "requests": len(results), "failed": len(results) - len(good), "short": short,
            "seconds": wall,
            "requests_per_s": len(good) / wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p95_ms": 1e3 * percentile(ttft, 0.95),
            "itl_p50_ms": 1e3 * percentile(gaps, 0.5), "itl_p95_ms": 1e3 * percentile(gaps, 0.95),
            # the clients share the server's machine: the share of one core they used themselves
            "client_cpu_share": client_cpu / wall}


def rss_mib(server: ServerProcess) -> float:
    """The server's resident memory (a Ray front's: its replicas' engines, summed)."""
    rss = server.metric("process_resident_memory_bytes") or server.metric("process_resident_memory_bytes",
                                                                          'replica="all"')
    return rss / 2**20


async def prefix_reuse(url: str, bias: dict[str, float]) -> dict:
    system = " ".join(f"Rule {i}: answer politely, briefly and truthfully." for i in range(30))
    async with httpx.AsyncClient(timeout=600) as client:
        out = {}
        for name, q in (("cold", "Who are you?"), ("warm", "What can you do?")):
            r = await one_request(client, url, [{"role": "system", "content": system}, {"role": "user", "content": q}],
                                  8, bias)
            out[name] = {"ttft_ms": 1e3 * r["ttft"], "cached_tokens": r["cached"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=8, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=5, help="rounds over the concurrencies, interleaved")
    ap.add_argument("--long-run", type=int, default=200, help="requests of the memory run (8 clients), 0 = skip")
    ap.add_argument("--peer-url", help="an OpenAI-compatible server already running on this machine with the "
                    "same model file (e.g. python -m llama_cpp.server --model M --port 8001): every round runs each "
                    "concurrency against it too, right after minfer's, and the report gives minfer's rate over it")
    ap.add_argument("--server-args", default="", help="more minfer serve flags, e.g. \"--ray --replicas 2 "
                    "--threads 1\" (the load run against the Ray front)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    path = resolve_model(args.model)
    eog = minfer.load(path, n_ctx=16).tokenizer.eog_ids
    bias = {str(t): -100.0 for t in eog}
    server_args = ["--parallel", str(args.parallel), "--ctx-size", str(1024 * args.parallel)]
    if args.threads:
        server_args += ["--threads", str(args.threads)]
    server_args += shlex.split(args.server_args)
    report: dict = {"model": str(path), "server_args": server_args, "parallel": args.parallel,
                    "max_tokens": args.max_tokens, "runs": []}
    with ServerProcess(path, server_args, health_timeout=900 if "--ray" in server_args else 30) as server:
        asyncio.run(load_run(server.url, 2, 1, 8, bias))  # warm-up: plans for the common batch shapes
        concurrencies = [int(x) for x in args.clients.split(",")]
        if args.peer_url:
            asyncio.run(load_run(args.peer_url, 2, 1, 8, bias, need_usage=False))
        rounds: list[dict[int, dict]] = []
        peer_rounds: list[dict[int, dict]] = []
        for k in range(args.repeat):
            rounds.append({})
            peer_rounds.append({})
            for c in concurrencies:
                before = rss_mib(server)
                run = asyncio.run(load_run(server.url, c, args.requests, args.max_tokens, bias))
                run["rss_before_mib"], run["rss_after_mib"] = before, rss_mib(server)
                rounds[-1][c] = run
                if not args.json:
                    print(f"{'' if args.repeat == 1 else f'round {k + 1}: '}{c:2d} clients x {args.requests}: "
                          f"{run['requests_per_s']:.2f} req/s, "
                          f"{run['tokens_per_s']:.1f} tok/s, TTFT p50 {run['ttft_p50_ms']:.0f} ms p95 "
                          f"{run['ttft_p95_ms']:.0f} ms, ITL p50 {run['itl_p50_ms']:.1f} ms "
                          f"p95 {run['itl_p95_ms']:.1f} ms, "
                          f"failed {run['failed']}, RSS {before:.0f} -> {run['rss_after_mib']:.0f} MiB, "
                          f"client CPU {100 * run['client_cpu_share']:.0f}% of a core", flush=True)
                if args.peer_url:
                    peer = asyncio.run(load_run(args.peer_url, c, args.requests, args.max_tokens, bias,
                                                need_usage=False))
                    peer_rounds[-1][c] = peer
                    if not args.json:
                        print(f"{'' if args.repeat == 1 else f'round {k + 1}: '}{c:2d} clients x {args.requests}, "
                              f"peer: {peer['tokens_per_s']:.1f} tok/s, TTFT p50 {peer['ttft_p50_ms']:.0f} ms, "
                              f"ITL p50 {peer['itl_p50_ms']:.1f} ms, failed {peer['failed']}, "
                              f"short {peer['short']}", flush=True)
        for c in concurrencies:  # the median round of each concurrency
            runs = sorted((r[c] for r in rounds), key=lambda r: r["tokens_per_s"])
            report["runs"].append({**runs[len(runs) // 2], "rounds": len(runs),
                                   "failed_all_rounds": sum(r["failed"] for r in runs)})
        single = next((r["tokens_per_s"] for r in report["runs"] if r["clients"] == 1), None)
        if single:
            for r in report["runs"]:
                r["speedup_vs_1_client"] = r["tokens_per_s"] / single
                r["speedup_by_round"] = [x[r["clients"]]["tokens_per_s"] / x[1]["tokens_per_s"] for x in rounds]
        if args.peer_url:
            report["peer"] = {"url": args.peer_url, "runs": []}
            for c in concurrencies:
                runs = sorted((r[c] for r in peer_rounds), key=lambda r: r["tokens_per_s"])
                ratios = [x[c]["tokens_per_s"] / p[c]["tokens_per_s"] if p[c]["tokens_per_s"] else float("inf")
                          for x, p in zip(rounds, peer_rounds, strict=True)]
                report["peer"]["runs"].append({**runs[len(runs) // 2], "minfer_over_peer_by_round": ratios,
                                               "failed_all_rounds": sum(r["failed"] for r in runs),
                                               "short_all_rounds": sum(r["short"] for r in runs)})
        if args.long_run:
            samples = [rss_mib(server)]
            per_client = max(1, args.long_run // 8)
            for _ in range(4):
                asyncio.run(load_run(server.url, 8, max(1, per_client // 4), 16, bias))
                samples.append(rss_mib(server))
            report["long_run"] = {"requests": 8 * 4 * max(1, per_client // 4), "rss_mib": samples}
            if not args.json:
                print(f"memory over {report['long_run']['requests']} requests: "
                      + " -> ".join(f"{x:.0f}" for x in samples) + " MiB", flush=True)
        report["prefix_reuse"] = asyncio.run(prefix_reuse(server.url, bias))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in report["runs"]:
            if "speedup_vs_1_client" in r:
                rounds_txt = "" if r["rounds"] == 1 else (
                    f" (median of {r['rounds']} rounds: {r['tokens_per_s']:.1f} tok/s; each round's ratio: "
                    + ", ".join(f"{x:.2f}" for x in r["speedup_by_round"])
                    + f", their median {statistics.median(r['speedup_by_round']):.2f})")
                print(f"aggregate tokens/s at {r['clients']} clients: {r['speedup_vs_1_client']:.2f}x one client"
                      f"{rounds_txt}; failed {r['failed_all_rounds']}")
        for r in report.get("peer", {}).get("runs", []):
            ratios = r["minfer_over_peer_by_round"]
            print(f"minfer over the peer at {r['clients']} clients: median {statistics.median(ratios):.2f}x "
                  f"(peer median {r['tokens_per_s']:.1f} tok/s; each round: " + ", ".join(f"{x:.2f}" for x in ratios)
                  + f"); peer failed {r['failed_all_rounds']}, short {r['short_all_rounds']}")
        pr = report["prefix_reuse"]
        print(f"prefix reuse: TTFT cold {pr['cold']['ttft_ms']:.0f} ms ({pr['cold']['cached_tokens']} cached), "
              f"warm {pr['warm']['ttft_ms']:.0f} ms ({pr['warm']['cached_tokens']} cached)")
        print(f"median decode gap (ms): {statistics.median([r['itl_p50_ms'] for r in report['runs']]):.1f}")


if __name__ == "__main__":
    main()
