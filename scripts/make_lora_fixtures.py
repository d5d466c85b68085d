"""Make the LoRA adapter fixtures: random-initialised PEFT adapters on the llama, qwen3 and gemma3 fixtures, the
GGUF adapters llama.cpp's ``convert_lora_to_gguf.py`` makes of them, and transformers + peft's fp32 logits.

Run with torch, transformers (the fixtures' version, tests/fixtures/VERSIONS.json) and peft installed, and the
llama-cpp-python sdist unpacked (``pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36``):

    python scripts/make_lora_fixtures.py --llama-cpp /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp

Writes ``tests/fixtures/<model>/lora/<variant>/``: ``peft/`` (``adapter_config.json``,
``adapter_model.safetensors``), ``adapter-f32.gguf`` (not for rsLoRA variants: llama.cpp's adapter files have
no rsLoRA flag, their scale is alpha / rank), ``logits_2.npy`` (the 33-token sequence of ``tokens.json``,
base + adapter), ``logits_2_half.npy`` (the adapter at scale 0.5, as peft's ``set_scale`` sets it) and
``meta.json`` (the config, and how far the adapter moves the base model's logits).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]

# (model, variant, rank, alpha, targets, rsLoRA, seed)
VARIANTS = [
    ("llama", "r4-attn", 4, 8, ATTN, False, 1),
    ("llama", "r16-all-rslora", 16, 16, ALL, True, 2),
    ("qwen3", "r16-all", 16, 32, ALL, False, 3),
    ("gemma3", "r4-all", 4, 4, ALL, False, 4),
    ("gemma3", "r16-all-rslora", 16, 8, ALL, True, 5),
]
A_STD, B_STD = 0.2, 0.2  # large enough that the adapter moves the logits by far more than the tolerance


def make(model_name: str, variant: str, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int,
         llama_cpp: Path) -> None:
    base_dir = FIXTURES / model_name / "hf"
    out = FIXTURES / model_name / "lora" / variant
    out.mkdir(parents=True, exist_ok=True)
    tokens = json.loads((FIXTURES / model_name / "tokens.json").read_text())["sequences"][2]
    ids = torch.tensor([tokens])
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        base = model(ids).logits[0].numpy()
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                     init_lora_weights=False)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * A_STD)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * B_STD)
    peft_model.eval()
    with torch.no_grad():
        logits = peft_model(ids).logits[0].numpy()
        for module in peft_model.modules():
            if hasattr(module, "set_scale"):
                module.set_scale("default", 0.5)
        half = peft_model(ids).logits[0].numpy()
        for module in peft_model.modules():
            if hasattr(module, "set_scale"):
                module.set_scale("default", 1.0)
    peft_model.save_pretrained(out / "peft")
    cfg_path = out / "peft" / "adapter_config.json"  # the base as a path in the repository, not on this machine
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = f"tests/fixtures/{model_name}/hf"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # the folder is the adapter alone: PEFT's README (a model card template) is not part of it
    (out / "peft" / "README.md").unlink(missing_ok=True)
    np.save(out / "logits_2.npy", logits.astype(np.float32))
    np.save(out / "logits_2_half.npy", half.astype(np.float32))
    gguf = None
    if not rslora:
        gguf = out / "adapter-f32.gguf"
        env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
        subprocess.run([sys.executable, str(llama_cpp / "convert_lora_to_gguf.py"), "--base", str(base_dir),
                        "--outtype", "f32", "--outfile", str(gguf), str(out / "peft")], check=True, env=env)
    meta = {
        "base": f"tests/fixtures/{model_name}/hf",
        "rank": rank, "lora_alpha": alpha, "target_modules": targets, "use_rslora": rslora,
        "init": f"lora_A ~ N(0, {A_STD}), lora_B ~ N(0, {B_STD}), torch seed {seed}",
        "sequence": "tokens.json sequences[2]",
        "max_abs_change_of_base_logits": float(np.abs(logits - base).max()),
        "max_abs_change_at_scale_0.5": float(np.abs(half - base).max()),
        "gguf": gguf.name if gguf else None,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "peft": __import__("peft").__version__},
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{model_name}/{variant}: adapter moves the logits by {meta['max_abs_change_of_base_logits']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="the sdist's vendor/llama.cpp folder")
    args = ap.parse_args()
    torch.manual_seed(0)
    for v in VARIANTS:
        make(*v, llama_cpp=args.llama_cpp)


if __name__ == "__main__":
    main()
