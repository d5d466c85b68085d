"""Peers for ``bench/encoder_throughput.py``: sentence-transformers and llama.cpp (llama-cpp-python) embedding
sentences on the CPU, each kept loaded in its own long-lived child process.

Run as a script by another interpreter, the one that has the peer installed (``--st-python``,
``--llamacpp-python``), so it imports nothing from minfer: only the standard library, numpy and the peer's own
package. ``python encoder_peers.py ENGINE MODEL --threads T [--n-batch N]`` (ENGINE: ``sentence-transformers``,
MODEL the model's folder; ``llama.cpp``, MODEL a GGUF file) loads the model and prints one JSON line
``{"engine", "version", "load_s"}``, or ``{"engine", "error"}`` when the peer cannot run (then exits). Then it
reads JSON lines on stdin and answers each with one JSON line:

* ``{"texts": [...], "calls": K, "out": PATH}``: embeds ``texts`` as one call, ``K`` times (1 by default);
  answers ``{"seconds": [...]}``, the time of each call measured here (the pipe's transfer left out, as minfer
  is timed in its own process). With ``out``, the last call's embeddings ``[n, dim]`` float32 go to that
  ``.npy`` file.

A failing request answers ``{"error": "..."}`` and the peer goes on; end of stdin ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

Embed = Callable[[list[str]], np.ndarray]


def load_sentence_transformers(model: Path, threads: int, n_batch: int) -> tuple[str, Embed]:
    import torch
    from sentence_transformers import SentenceTransformer, __version__

    torch.set_num_threads(threads)
    st = SentenceTransformer(str(model), device="cpu")

    def embed(texts: list[str]) -> np.ndarray:
        return st.encode(texts, batch_size=32, convert_to_numpy=True, show_progress_bar=False)

    return f"sentence-transformers {__version__}, torch {torch.__version__}, float32", embed


def load_llamacpp(model: Path, threads: int, n_batch: int) -> tuple[str, Embed]:
    import llama_cpp

    if model.is_dir() or model.suffix != ".gguf":
        raise ValueError(f"llama.cpp reads GGUF files, not {model}")
    if not model.is_file():
        raise FileNotFoundError(f"no GGUF file {model}")
    # an encoder evaluates a batch in one ubatch: n_batch = n_ubatch; n_ctx = n_batch, shared by the sequences
    # of a batch (llama-cpp-python's embed packs sentences into batches of up to n_batch tokens)
    llm = llama_cpp.Llama(model_path=str(model), embedding=True, n_threads=threads, n_threads_batch=threads,
                          n_ctx=n_batch, n_batch=n_batch, n_ubatch=n_batch,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, verbose=False)

    def embed(texts: list[str]) -> np.ndarray:
        return np.asarray(llm.embed(texts, normalize=True), dtype=np.float32).reshape(len(texts), -1)

    return f"llama-cpp-python {llama_cpp.__version__}, GGUF {model.name}", embed


PEERS = {"sentence-transformers": load_sentence_transformers, "llama.cpp": load_llamacpp}


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=sorted(PEERS))
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-batch", type=int, default=512, help="llama.cpp: n_ctx = n_batch = n_ubatch")
    a = ap.parse_args()
    t0 = time.perf_counter()
    try:
        version, embed = PEERS[a.engine](Path(a.model), a.threads, a.n_batch)
    except ImportError as e:
        say({"engine": a.engine, "error": f"not installed in {sys.executable}: no module {e.name or e}"})
        return
    except Exception as e:
        say({"engine": a.engine, "error": f"{type(e).__name__}: {e}"})
        return
    say({"engine": a.engine, "version": version, "load_s": time.perf_counter() - t0})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            texts = list(req["texts"])
            seconds = []
            for _ in range(max(1, int(req.get("calls", 1)))):
                t1 = time.perf_counter()
                vectors = embed(texts)
                seconds.append(time.perf_counter() - t1)
            if req.get("out"):
                np.save(req["out"], np.asarray(vectors, dtype=np.float32))
            say({"seconds": seconds})
        except Exception as e:  # one bad request must not end the peer
            say({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
