"""Reference data from llama.cpp (through llama-cpp-python) for SmolLM2-135M-Instruct Q4_1.

Writes ``tests/data/smollm2_llamacpp.json``: for a few fixed prompts, llama.cpp's 32 greedy tokens with
the top-1 / top-2 logit margin at each step, and the perplexity of ``tests/data/GPL-3`` by the
llama-perplexity method (chunks of 256 tokens, second half scored, no BOS for this model).

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python   # builds llama.cpp (~10 min)
    python scripts/make_llamacpp_refs.py "$(python -c 'from minfer.pull import pull; print(pull())')"
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import llama_cpp
import numpy as np

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
ROOT = Path(__file__).resolve().parent.parent


def greedy(llm: llama_cpp.Llama, prompt: str, n: int) -> dict:
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    llm.reset()
    llm.eval(ids)
    out, margins = [], []
    for _ in range(n):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top2 = np.sort(logits)[-2:]
        tok = int(np.argmax(logits))
        out.append(tok)
        margins.append(float(top2[1] - top2[0]))
        llm.eval([tok])
    return {"prompt": prompt, "prompt_ids": ids, "generated_ids": out, "top1_minus_top2": margins}


def perplexity(llm: llama_cpp.Llama, text: str, n_ctx: int) -> dict:
    ids = llm.tokenize(text.encode(), add_bos=llm._model.add_bos_token(), special=False)
    n_chunks = len(ids) // n_ctx
    first = n_ctx // 2
    nll_sum = nll2_sum = 0.0
    count = 0
    for c in range(n_chunks):
        chunk = ids[c * n_ctx : (c + 1) * n_ctx]
        llm.reset()
        llm.eval(chunk)
        logits = np.array(llm.scores[: n_ctx], dtype=np.float64)
        for j in range(first, n_ctx - 1):
            x = logits[j]
            m = x.max()
            nll = m + math.log(np.exp(x - m).sum()) - x[chunk[j + 1]]
            nll_sum += nll
            nll2_sum += nll * nll
            count += 1
    mean = nll_sum / count
    ppl = math.exp(mean)
    var = nll2_sum / count - mean * mean
    return {"n_ctx": n_ctx, "n_tokens": len(ids), "n_chunks": n_chunks, "tokens_scored": count, "ppl": ppl,
            "error": ppl * math.sqrt(var / (count - 1))}


def main() -> None:
    model = sys.argv[1]
    llm = llama_cpp.Llama(model, n_ctx=512, n_batch=512, n_threads=2, logits_all=True, verbose=False)
    out = {
        "model": Path(model).name,
        "engine": f"llama-cpp-python {llama_cpp.__version__}",
        "greedy": [greedy(llm, p, 32) for p in PROMPTS],
        "perplexity_gpl3_c256": perplexity(llm, (ROOT / "tests/data/GPL-3").read_text(encoding="utf-8"), 256),
    }
    dest = ROOT / "tests/data/smollm2_llamacpp.json"
    dest.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["perplexity_gpl3_c256"]))


if __name__ == "__main__":
    main()
