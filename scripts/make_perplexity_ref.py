"""Reference perplexity of SmolLM2-135M-Instruct Q4_1 with HF transformers (fp32, dequantized weights).

Same method as ``minfer.runtime.perplexity`` and llama-perplexity: tokens of the whole text (SmolLM2 adds no
BOS), chunks of ``n_ctx`` tokens, each chunk evaluated from position 0, the second half scored
(positions n_ctx/2 .. n_ctx-2 predicting the next token), PPL = exp(mean NLL) with llama.cpp's error.

    /opt/refenv/bin/python scripts/make_perplexity_ref.py GGUF tests/data/GPL-3 --ctx 256 \
        --out tests/data/smollm2_gpl3_ppl_hf.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("text")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    path = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    torch.set_num_threads(2)
    text = Path(args.text).read_text(encoding="utf-8")
    ids = tok(text, add_special_tokens=True)["input_ids"]
    n_ctx = args.ctx
    n_chunks = len(ids) // n_ctx
    first = n_ctx // 2
    nll_sum = nll2_sum = 0.0
    count = 0
    running = []
    with torch.no_grad():
        for c in range(n_chunks):
            chunk = torch.tensor([ids[c * n_ctx : (c + 1) * n_ctx]])
            logits = model(chunk).logits[0].double()
            logp = torch.log_softmax(logits[first : n_ctx - 1], dim=-1)
            targets = chunk[0, first + 1 :]
            nll = -logp[torch.arange(len(targets)), targets]
            nll_sum += float(nll.sum())
            nll2_sum += float((nll * nll).sum())
            count += len(nll)
            running.append(math.exp(nll_sum / count))
            print(f"[{c + 1}] {running[-1]:.4f}", flush=True)
    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    ppl = math.exp(mean)
    out = {
        "model": path.name,
        "text": Path(args.text).name,
        "n_ctx": n_ctx,
        "n_tokens": len(ids),
        "n_chunks": n_chunks,
        "tokens_scored": count,
        "ppl": ppl,
        "error": ppl * math.sqrt(var / (count - 1)),
        "chunk_ppl": running,
        "loader": "transformers AutoModelForCausalLM gguf_file=, float32, eager attention",
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "chunk_ppl"}))


if __name__ == "__main__":
    main()
