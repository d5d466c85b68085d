"""Time to first token of a prompt whose cached cells left the KV cache, cold against ``--cache-ram``.

A server with 2 slots and ``--cache-ram`` gets a long prompt A (cold: every token evaluated), then two
other long prompts that overwrite both slots (A's blocks go to host memory), then A again: its blocks come
back from host memory instead of being evaluated. For reference, the same sequence on a server without
``--cache-ram`` (A evaluated again), and A right after A (its slot still holds it). Each figure is the
median of ``--rounds`` rounds, each round with fresh prompts.

    python bench/prompt_cache_ttft.py [MODEL] [--tokens 1500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx
import numpy as np

from minfer.testing.server_process import ServerProcess


def ttft(url: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds until the answer of one generated token, and the prompt tokens it reused."""
    t0 = time.perf_counter()
    r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": 1, "temperature": 0}, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0, int(r.json()["tokens_cached"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    results: dict[str, list[float]] = {"cold": [], "after eviction, no --cache-ram": [],
                                       "after eviction, --cache-ram": [], "warm (slot still holds it)": []}
    cached: dict[str, int] = {}
    args = ["--parallel", "2", "--ctx-size", str(4 * a.tokens)]
    with ServerProcess(a.model, args) as plain, ServerProcess(a.model, [*args, "--cache-ram", "1024"]) as ram:
        for _ in range(a.rounds):
            prompt, other1, other2 = (rng.integers(100, 10000, a.tokens).tolist() for _ in range(3))
            for server, label in ((plain, "after eviction, no --cache-ram"), (ram, "after eviction, --cache-ram")):
                seconds, _ = ttft(server.url, prompt)
                if server is plain:
                    results["cold"].append(seconds)
                ttft(server.url, other1)
                ttft(server.url, other2)
                seconds, cached[label] = ttft(server.url, prompt)
                results[label].append(seconds)
                if server is ram:
                    seconds, cached["warm (slot still holds it)"] = ttft(server.url, prompt)
                    results["warm (slot still holds it)"].append(seconds)
    report = {k: {"ttft_ms": round(statistics.median(v) * 1e3, 1), "cached_tokens": cached.get(k, 0)}
              for k, v in results.items()}
    print(json.dumps({"model": a.model, "prompt_tokens": a.tokens, "rounds": a.rounds, **report}, indent=1))


if __name__ == "__main__":
    main()
