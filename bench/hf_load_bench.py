"""Load time of an HF folder: memory-mapped as stored, and quantized at load (q8_0, q4_k).

Builds (once) a synthetic bf16 llama folder of a chosen size with the llama fixture's tokenizer, then times
``minfer.load`` for each ``--quantize`` setting (best of ``--reps``, after one run that compiles the numba
kernels) and one short forward pass, and reports the process RSS.

    python bench/hf_load_bench.py [--dir /tmp/minfer-synthetic] [--hidden 1024] [--ff 3072] [--layers 8]
        [--vocab 32000] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

import minfer

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "llama" / "hf"


def _bf16(x: np.ndarray) -> bytes:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def build(dst: Path, hidden: int, ff: int, layers: int, vocab: int) -> Path:
    if (dst / "model.safetensors").is_file():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(FIXTURE / name, dst / name)
    cfg = json.loads((FIXTURE / "config.json").read_text())
    n_head, n_kv = hidden // 64, max(1, hidden // 256)
    kv = 64 * n_kv
    cfg.update(hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers, num_attention_heads=n_head,
               num_key_value_heads=n_kv, head_dim=64, vocab_size=vocab, max_position_embeddings=4096)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (ff, hidden), p + "mlp.up_proj.weight": (ff, hidden),
            p + "mlp.down_proj.weight": (hidden, ff),
        })
    rng = np.random.default_rng(0)
    header, offset, blobs = {}, 0, []
    for name, shape in shapes.items():
        w = 1 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else rng.standard_normal(shape) / np.sqrt(shape[-1])
        data = _bf16(w)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(dst / "model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for b in blobs:
            f.write(b)
    return dst


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/minfer-synthetic"))
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    folder = build(a.dir, a.hidden, a.ff, a.layers, a.vocab)
    size = (folder / "model.safetensors").stat().st_size
    print(f"{folder}: {size / 2**20:.1f} MiB of bf16 safetensors")
    for quantize in (None, "q8_0", "q4_k"):
        times = []
        for _ in range(a.reps + 1):
            t0 = time.perf_counter()
            model = minfer.load(folder, n_ctx=64, threads=a.threads, quantize=quantize)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        model.logits(list(range(3, 19)))
        fwd = time.perf_counter() - t0
        types = sorted({t.ggml_type.name for t in model.transformer.tensors.values()})
        print(f"quantize={quantize}: load {min(times[1:]):.2f} s (first {times[0]:.2f} s), types {types}, "
              f"weights {model.transformer.weight_bytes / 2**20:.1f} MiB, 16-token forward {fwd:.2f} s, "
              f"RSS {rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
