"""One long request beside seven short streams, on a real server whose 8 slots share one KV pool.

``minfer serve MODEL --parallel 8 --ctx-size 8192`` gets a prompt of ``--long`` tokens (6,000 by default;
split slots of 1,024 positions each used to refuse it) and, right after it, seven short greedy requests at
once. Each short answer is compared with the one the same server gives it alone, and the long one is
checked to have run; the server's /health (blocks, preemptions) is printed.

    python bench/kv_long_beside_short.py [MODEL] [--long 6000] [--ctx-size 8192]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

import httpx
import numpy as np

from minfer.testing.server_process import ServerProcess

SHORT = [f"Write one sentence about the number {i}." for i in range(7)]


def complete(url: str, prompt: str | list[int], n: int) -> dict:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/completion", json=body, timeout=900)
    r.raise_for_status()
    return r.json()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--long", type=int, default=6000)
    ap.add_argument("--ctx-size", type=int, default=8192)
    a = ap.parse_args()
    long_prompt = np.random.default_rng(0).integers(100, 10000, a.long).tolist()
    with ServerProcess(a.model, ["--parallel", "8", "--ctx-size", str(a.ctx_size)]) as s:
        alone = [complete(s.url, p, 32)["content"] for p in SHORT]
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            long_job = pool.submit(complete, s.url, long_prompt, 8)
            time.sleep(0.2)  # the long prompt is being evaluated when the short ones arrive
            shorts = list(pool.map(lambda p: complete(s.url, p, 32), SHORT))
            long_answer = long_job.result()
        seconds = time.perf_counter() - t0
        health = httpx.get(s.url + "/health").json()
    same = [x["content"] == y for x, y in zip(shorts, alone, strict=True)]
    print(json.dumps({"model": a.model, "long_prompt_tokens": long_answer["tokens_evaluated"],
                      "long_generated": long_answer["tokens_predicted"], "seconds": round(seconds, 1),
                      "short_equal_to_alone": same, "health": health}, indent=1))


if __name__ == "__main__":
    main()
