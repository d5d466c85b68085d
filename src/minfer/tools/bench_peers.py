"""Peers for ``minfer bench --compare``: llama.cpp (llama-cpp-python) and HF transformers on the CPU.

This file is run as a script in a child process (``python bench_peers.py ENGINE ...``), possibly by
another interpreter that has the peer installed (``--peer-python``), so it imports nothing from minfer:
only the standard library, numpy and the peer's own package. It prints one JSON object on stdout:
``{"engine": ..., "version": ..., "load_s": ..., "records": [{"test", "threads", "runs"}, ...]}``, or
``{"engine": ..., "error": "..."}`` when the peer is not available.

The workload mirrors minfer's: pp<N> evaluates N random tokens from position 0 in one batch, tg<N>
evaluates N random tokens one at a time from position 0; each repeated ``repetitions`` times after one
warm-up run.

``--serve`` (llama.cpp only) keeps the model loaded and runs one test per request, so that ``minfer bench
--compare`` can alternate minfer's runs with llama.cpp's (both see the same load on a shared machine): after
a first line ``{"engine", "version"}`` it reads JSON lines ``{"test", "threads", "seed"}`` on stdin and answers
each with ``{"tokens_per_s", "load_s"}`` (load_s: the load for a new thread count, else 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _tests(prompts: list[int], gens: list[int]) -> list[tuple[str, int]]:
    return [(f"pp{p}", p) for p in prompts] + [(f"tg{n}", n) for n in gens]


def _random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def bench_llamacpp(model: Path, prompts: list[int], gens: list[int], threads: list[int], reps: int) -> dict:
    import llama_cpp

    if model.is_dir():
        raise ValueError("llama.cpp reads GGUF files, not HF folders (convert the folder to compare)")
    out: dict = {"engine": "llama.cpp", "version": f"llama-cpp-python {llama_cpp.__version__}", "records": []}
    n_ctx = max(prompts + gens) + 8
    for t in threads:
        t0 = time.perf_counter()
        llm = llama_cpp.Llama(str(model), n_ctx=n_ctx, n_threads=t, n_threads_batch=t, n_batch=max(prompts + [1]),
                              n_ubatch=max(prompts + [1]), verbose=False)
        out.setdefault("load_s", time.perf_counter() - t0)
        vocab = llm.n_vocab()
        for name, n in _tests(prompts, gens):
            runs = []
            for r in range(reps + 1):
                toks = _random_tokens(n, vocab, r)
                llm.reset()  # n_tokens = 0: the next eval clears the cache from position 0 on
                t1 = time.perf_counter()
                if name.startswith("pp"):
                    llm.eval(toks)
                else:
                    for tok in toks:
                        llm.eval([tok])
                dt = time.perf_counter() - t1
                if r > 0:  # the first run warms up
                    runs.append(n / dt)
            out["records"].append({"test": name, "threads": t, "runs": runs})
        del llm
    return out


def bench_transformers(model: Path, prompts: list[int], gens: list[int], threads: list[int], reps: int) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    out: dict = {"engine": "transformers", "version": f"transformers {transformers.__version__}, "
                 f"torch {torch.__version__}, float32", "records": []}
    t0 = time.perf_counter()
    if model.is_dir():  # an HF folder: its own weights, in float32
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=torch.float32).eval()
    out["load_s"] = time.perf_counter() - t0
    vocab = hf.config.vocab_size
    for t in threads:
        torch.set_num_threads(t)
        for name, n in _tests(prompts, gens):
            runs = []
            for r in range(reps + 1):
                toks = torch.tensor([_random_tokens(n, vocab, r)])
                with torch.no_grad():
                    t1 = time.perf_counter()
                    if name.startswith("pp"):
                        hf(toks, use_cache=False)
                    else:
                        past = None
                        for i in range(n):
                            res = hf(toks[:, i : i + 1], past_key_values=past, use_cache=True)
                            past = res.past_key_values
                    dt = time.perf_counter() - t1
                if r > 0:
                    runs.append(n / dt)
            out["records"].append({"test": name, "threads": t, "runs": runs})
    return out


def serve_llamacpp(model: Path, prompts: list[int], gens: list[int]) -> None:
    import llama_cpp

    if model.is_dir():
        raise ValueError("llama.cpp reads GGUF files, not HF folders (convert the folder to compare)")
    print(json.dumps({"engine": "llama.cpp", "version": f"llama-cpp-python {llama_cpp.__version__}"}), flush=True)
    n_ctx = max(prompts + gens) + 8
    llm, loaded_threads = None, None
    for line in sys.stdin:
        req = json.loads(line)
        load_s = 0.0
        if req["threads"] != loaded_threads:
            llm = None  # one model in memory at a time
            t0 = time.perf_counter()
            llm = llama_cpp.Llama(str(model), n_ctx=n_ctx, n_threads=req["threads"],
                                  n_threads_batch=req["threads"], n_batch=max(prompts + [1]),
                                  n_ubatch=max(prompts + [1]), verbose=False)
            load_s, loaded_threads = time.perf_counter() - t0, req["threads"]
        name = req["test"]
        n = int(name[2:])
        toks = _random_tokens(n, llm.n_vocab(), req["seed"])
        llm.reset()
        t1 = time.perf_counter()
        if name.startswith("pp"):
            llm.eval(toks)
        else:
            for tok in toks:
                llm.eval([tok])
        print(json.dumps({"tokens_per_s": n / (time.perf_counter() - t1), "load_s": load_s}), flush=True)


PEERS = {"llama.cpp": bench_llamacpp, "transformers": bench_transformers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=sorted(PEERS))
    ap.add_argument("model")
    ap.add_argument("--prompts", default="")
    ap.add_argument("--gens", default="")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help="answer one test per stdin line (llama.cpp)")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    if a.serve:
        try:
            serve_llamacpp(Path(a.model), ints(a.prompts), ints(a.gens))
        except ImportError as e:
            print(json.dumps({"engine": a.engine, "error": f"not installed ({e.name or e})"}), flush=True)
        except Exception as e:
            print(json.dumps({"engine": a.engine, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    try:
        result = PEERS[a.engine](Path(a.model), ints(a.prompts), ints(a.gens), ints(a.threads), a.reps)
    except ImportError as e:
        result = {"engine": a.engine, "error": f"not installed ({e.name or e})"}
    except Exception as e:  # a peer's failure must not hide minfer's own numbers
        result = {"engine": a.engine, "error": f"{type(e).__name__}: {e}"}
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
