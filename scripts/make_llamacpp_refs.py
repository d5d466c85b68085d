"""Reference data from llama.cpp (through llama-cpp-python) for the real models the tests use.

Writes ``tests/data/<name>_llamacpp.json``: for a few fixed prompts, llama.cpp's greedy tokens with the
top-1 / top-2 logit margin at each step, and the perplexity of ``tests/data/GPL-3`` by the
llama-perplexity method (chunks of 256 tokens, each chunk's first token replaced by BOS when the model
adds one, second half scored).

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python   # builds llama.cpp (~10 min)
    python scripts/make_llamacpp_refs.py "$(python -c 'from minfer.pull import pull; print(pull())')"
    python scripts/make_llamacpp_refs.py "$(python -c 'from minfer.pull import pull; print(pull("gemma3-270m"))')" \
        --name gemma3_270m

``smollm2`` (SmolLM2-135M-Instruct Q4_1): 32 tokens for each of ``PROMPTS["smollm2"]``.
``gemma3_270m`` (Gemma 3 270M Q4_K_M, a base model): 32 tokens for plain prompts, one rendered with
Gemma 3's chat template (the file has none; minfer uses the published one), and one whose prompt is the
first ``LONG_PROMPT_TOKENS`` tokens of GPL-3, longer than the 512-position sliding window, with the
``TOP_LOGITS`` best logits of its last prompt position (``last_prompt_top_ids`` / ``_logits``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import llama_cpp
import numpy as np

PROMPTS = {
    "smollm2": [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    ],
    "gemma3_270m": [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    ],
}
LONG_PROMPT_TOKENS = {"gemma3_270m": 700}
TOP_LOGITS = 64  # beyond Gemma 3 270M's sliding window of 512
ROOT = Path(__file__).resolve().parent.parent


def greedy(llm: llama_cpp.Llama, prompt: str, n: int, ids: list[int] | None = None) -> dict:
    if ids is None:
        # a prompt that writes its own <bos> (a rendered chat template) gets none added
        ids = llm.tokenize(prompt.encode(), add_bos=not prompt.startswith("<bos>"), special=True)
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
    bos = llm.token_bos() if llm._model.add_bos_token() else None
    for c in range(n_chunks):
        chunk = ids[c * n_ctx : (c + 1) * n_ctx]
        if bos is not None:  # llama-perplexity evaluates each chunk from a BOS
            chunk = [bos, *chunk[1:]]
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the GGUF file")
    ap.add_argument("--name", default="smollm2", choices=sorted(PROMPTS))
    args = ap.parse_args()
    llm = llama_cpp.Llama(args.model, n_ctx=1024, n_batch=1024, n_threads=2, logits_all=True, verbose=False)
    text = (ROOT / "tests/data/GPL-3").read_text(encoding="utf-8")
    out = {
        "model": Path(args.model).name,
        "engine": f"llama-cpp-python {llama_cpp.__version__}",
        "greedy": [greedy(llm, p, 32) for p in PROMPTS[args.name]],
        "perplexity_gpl3_c256": perplexity(llm, text, 256),
    }
    n_long = LONG_PROMPT_TOKENS.get(args.name)
    if n_long:
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)[:n_long]
        long = greedy(llm, "", 16, ids)
        long["prompt"] = f"the first {n_long} tokens of tests/data/GPL-3"
        llm.reset()
        llm.eval(ids)
        last = np.array(llm.scores[n_long - 1], dtype=np.float64)
        top = np.argsort(-last)[:TOP_LOGITS]
        long["last_prompt_top_ids"] = [int(i) for i in top]
        long["last_prompt_top_logits"] = [round(float(last[i]), 5) for i in top]
        out["long_prompt"] = long
    dest = ROOT / f"tests/data/{args.name}_llamacpp.json"
    dest.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["perplexity_gpl3_c256"]))


if __name__ == "__main__":
    main()
