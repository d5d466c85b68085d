"""Write ``tests/data/embedding_refs.json``: transformers' pooled embeddings of the tiny fixtures.

For each fixture (``tests/fixtures/<name>/hf``, float32, eager attention) and a few texts tokenized by the
fixture's own ``tokenizer.json`` (BOS added as the tokenizer says): the last entry of
``output_hidden_states``, checked here to be the final norm's output (a forward hook on ``model.norm``),
then pooled as llama.cpp pools: mean over every position (BOS included), the first (cls) and the last
position, each L2-normalised in float64. The tests compare minfer's embeddings of the GGUF and HF files
against these vectors (cosine).

Run in the reference environment (see scripts/README.md):
``/opt/refenv/bin/python scripts/make_embedding_refs.py [--out tests/data/embedding_refs.json]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
NAMES = ["llama", "qwen2", "qwen3", "gemma3", "olmo2"]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    "Embeddings pool the final hidden states of every position, the first one included.",
]


def final_norm_states(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """[tokens, hidden]: ``output_hidden_states[-1]``, asserted equal to the final norm's output."""
    seen: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda _m, _a, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=False, output_hidden_states=True)
    finally:
        hook.remove()
    last = out.hidden_states[-1][0].numpy()
    normed = seen[0][0].numpy()
    if not np.array_equal(last, normed):
        raise SystemExit(f"output_hidden_states[-1] is not the final norm's output (max diff "
                         f"{np.abs(last - normed).max()})")
    return last.astype(np.float64)


def unit(v: np.ndarray) -> list[float]:
    return (v / np.linalg.norm(v)).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "embedding_refs.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    refs: dict[str, object] = {
        "how": "scripts/make_embedding_refs.py", "transformers": transformers.__version__, "torch": torch.__version__,
        "models": {},
    }
    for name in NAMES:
        hf = FIXTURES / name / "hf"
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32,
                                                                  attn_implementation="eager")
        model.eval()
        tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
        cases = []
        for text in TEXTS:
            ids = tok.encode(text).ids
            h = final_norm_states(model, ids)
            cases.append({"text": text, "ids": ids, "mean": unit(h.mean(axis=0)), "cls": unit(h[0]),
                          "last": unit(h[-1]), "last_raw": h[-1].tolist()})
        refs["models"][name] = cases  # type: ignore[index]
        print(f"{name}: {len(cases)} texts, hidden {len(cases[0]['mean'])}, tokens {[len(c['ids']) for c in cases]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(refs, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
