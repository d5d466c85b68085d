"""What a LoRA adapter costs a model's prompt and decode passes: the base alone, the base with a random rank-r
PEFT adapter on every linear layer (unmerged: graph nodes beside the matmuls), and where the base's matrices
are float, the same adapter merged at load, measured in alternating rounds in one process.

    python bench/lora_cost.py                       # SmolLM2-135M Q4_1 (minfer pull smollm2), rank 16
    python bench/lora_cost.py MODEL --rank 16 --threads 2 --rounds 5 -p 128 -n 64

The adapter is written as a PEFT folder (adapter_config.json + adapter_model.safetensors) under a temporary
folder, with the target shapes read from the model's own matrices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import minfer
from minfer.formats.block_types import GGMLType
from minfer.models.hf_checkpoint import hf_tensor_name
from minfer.models.model import TransformerModel
from minfer.pull import resolve_model

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
HF_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(model_path: Path, rank: int, out: Path, dtype: str = "f16") -> tuple[Path, bool]:
    """A random rank-``rank`` PEFT adapter of every linear layer of the model, stored as ``dtype`` (``f16``, as
    adapters trained in half precision are, and as llama.cpp's converter writes them; or ``f32``); (folder, base
    is float)."""
    base = TransformerModel.from_path(model_path)
    rng = np.random.default_rng(0)
    tensors = {}
    floats = True
    for name, t in base.tensors.items():
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in TARGETS:
            continue
        floats &= t.ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
        module = "base_model.model." + hf_tensor_name(base.arch.hf, name).removesuffix(".weight")
        n_out, n_in = t.shape
        store = np.float16 if dtype == "f16" else np.float32
        tensors[module + ".lora_A.weight"] = (rng.standard_normal((rank, n_in)) * 0.01).astype(store)
        tensors[module + ".lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.01).astype(store)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                         "target_modules": HF_MODULES}))
    return out, floats


def timed(model: minfer.Model, prompt: list[int], n_gen: int) -> tuple[float, float]:
    """(prompt tokens/s, generated tokens/s) of one fresh generation."""
    model.kv.clear()
    t0 = time.perf_counter()
    model.runner.forward(prompt, range(len(prompt)), output_rows=[len(prompt) - 1])
    t1 = time.perf_counter()
    model.kv.clear()
    tok, pos = prompt[0], 0
    t2 = time.perf_counter()
    for _ in range(n_gen):
        logits = model.runner.forward([tok], [pos])
        tok, pos = int(np.argmax(logits[0])), pos + 1
    t3 = time.perf_counter()
    return len(prompt) / (t1 - t0), n_gen / (t3 - t2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--prompt", type=int, default=128)
    ap.add_argument("-n", "--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", choices=("f16", "f32"), default="f16", help="the adapter's stored type")
    args = ap.parse_args()
    path = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        adapter, floats = write_adapter(path, args.rank, Path(tmp) / "adapter", args.dtype)
        n_ctx = args.prompt + args.gen + 8
        models = {"base": minfer.load(path, n_ctx=n_ctx, threads=args.threads),
                  f"rank-{args.rank} unmerged": minfer.load(path, n_ctx=n_ctx, threads=args.threads, lora=adapter)}
        if floats:
            models[f"rank-{args.rank} merged"] = minfer.load(path, n_ctx=n_ctx, threads=args.threads, lora=adapter,
                                                             lora_merge=True)
        prompt = [int(t) for t in np.random.default_rng(1).integers(10, 1000, args.prompt)]
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in models}
        for m in models.values():  # warm: plans built, kernels compiled
            timed(m, prompt, 4)
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(reversed(models))
            for name in order:
                runs[name].append(timed(models[name], prompt, args.gen))
    base_pp = statistics.median(p for p, _ in runs["base"])
    base_tg = statistics.median(g for _, g in runs["base"])
    print(f"{path.name}, {args.dtype} adapter, {args.threads} threads, pp{args.prompt} / tg{args.gen}, median of "
          f"{args.rounds} alternating rounds")
    for name, rs in runs.items():
        pp, tg = statistics.median(p for p, _ in rs), statistics.median(g for _, g in rs)
        print(f"  {name:22s} pp {pp:8.1f} t/s ({pp / base_pp:5.3f}x base)   "
              f"tg {tg:7.1f} t/s ({tg / base_tg:5.3f}x base)")


if __name__ == "__main__":
    main()
