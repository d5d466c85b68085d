"""Image encoding and time to first token of a one-image question: minfer against llama.cpp's mtmd, on the same files.

The issue's question: "time to encode one 512x512 image and TTFT of a one-image question, 2 threads; compare
against llama.cpp's mtmd on the same files". Random weights at real sizes: the vision tower and projector are
Gemma 3 4B's (SigLIP so400m, 896x896 images, 256 tokens per image, projector 1152 -> 2560); the text model is
2560 wide (so the projector is real) but has 2 layers and the tiny fixture vocabulary (387 tokens).

SmolVLM (``--shape smolvlm-256m``): a random ``Idefics3ForConditionalGeneration`` at SmolVLM-256M-Instruct's shapes:
the vision tower SigLIP base/16 at 512 (768 wide, 12 layers, 12 heads, ffn 3072), ``scale_factor`` 4 (64 tokens per
tile), the connector 768 * 16 -> 576; the text model SmolLM2-135M's (576 wide, 30 layers, 9 heads, 3 kv heads, ffn
1536, rope theta 1e5, tied embeddings) with the SmolVLM fixture's tiny vocabulary (``make_smolvlm_fixture.py``) plus
the "\\n\\n" piece mtmd looks up and the ``<row_r_col_c>`` tags up to 4 x 4; the processor at SmolVLM's settings
(``size.longest_edge`` 2048, ``max_image_size.longest_edge`` 512, LANCZOS, splitting on): the 512x512 test image is
resized to 2048, cut into 4 x 4 tiles plus the whole image, 17 tiles, 1088 image tokens (n_ctx 2048). Both engines
encode all 17 tiles in ``encode``. ``--shape smolvlm-tiny``: the SmolVLM fixture's shapes (64x64 -> 2 x 2 tiles of
32 + the whole image), for checking the pairing. The converter is run on the folder with the Hub's
``text_config.architectures`` (``make_smolvlm_gguf.py``); llama.cpp's prompt gets minfer's text with the media
marker alone (mtmd writes the tiles' tags, the rows' newlines and the whole image's ``"\\n\\n<fake_token_around_image>
<global-img>"`` itself); its resize is its own LANCZOS, so its pixels, and logits, differ a little from the
processor's.

    timeout 1800 /tmp/refenv/bin/python bench/vision_speed.py --make /tmp/vsb-smolvlm --shape smolvlm-256m
    timeout 3600 .venv/bin/python bench/vision_speed.py --run /tmp/vsb-smolvlm --threads 2 --reps 3 [--rounds 2] [--hf]

Step 1, the files (reference environment: torch, transformers 5.24, Pillow; llama.cpp's own converter)::

    timeout 1800 /tmp/refenv/bin/python bench/vision_speed.py --make /tmp/vsb-4b --shape gemma3-4b [--outtype f16]
    timeout 600  /tmp/refenv/bin/python bench/vision_speed.py --make /tmp/vsb-tiny --shape tiny

writes ``DIR/hf`` (an f32 ``Gemma3ForConditionalGeneration`` folder, tensors under the Hub's names), the two GGUF
files llama.cpp's ``convert_hf_to_gguf.py`` writes from it (``DIR/text-<outtype>.gguf``; ``DIR/mmproj-<outtype>.gguf``
with ``--mmproj``), and the test image ``DIR/test_512.png`` (512x512, deterministic: gradients and shapes).

Step 2, the measurement (minfer's venv; the llama.cpp side runs under ``--llama-python``, default
``/tmp/lcpenv/bin/python``, with llama-cpp-python 0.3.36 built natively)::

    timeout 3600 .venv/bin/python bench/vision_speed.py --run /tmp/vsb-4b --threads 2 --reps 3 [--rounds 2] [--hf]

Each engine runs in a process of its own, one after the other (``--rounds N``: N such pairs, the order alternating;
times pooled), each warmed up first (one encode and one question before the timed reps). Per engine:

- ``preprocess``: the image file's bytes -> the tower's pixels. minfer: ``load_image`` + ``preprocess``. llama.cpp:
  ``mtmd_helper_bitmap_init_from_file`` + ``mtmd_tokenize`` of the prompt (clip's resize / normalize happens in
  ``mtmd_tokenize``; the text tokenization in it is some microseconds).
- ``encode``: pixels -> the image's 256 text-model vectors. minfer: ``VisionRunner.encode([pixels])``. llama.cpp:
  ``mtmd_encode_chunk`` of the image chunk.
- ``ttft``: the question "What is in this image?" with the image, from the file on disk to the first sampled token
  (greedy). minfer: ``model.chat([...], max_tokens=1, temperature=0)``; before each rep the image-token cache
  (``model.images._cache``) and the KV cache (``model.kv.clear()``) are emptied, and the rep is checked to have
  encoded the image (``VisionRunner.images_encoded`` went up by one) and reused no cached prompt token (the slot
  ``Slots.take`` gave held 0 tokens). llama.cpp: ``kv_cache_clear``, then bitmap from file + ``mtmd_tokenize`` +
  ``mtmd_helper_eval_chunks`` (which encodes the image every time: mtmd keeps no image cache) + the argmax of the
  last position's logits.
- ``load``: the model files -> ready (minfer: ``minfer.load`` incl. its warm-up; llama.cpp: ``Llama(...)`` +
  ``mtmd_init_from_file`` incl. clip's warm-up). Reported, not compared closely (page cache).
- ``first encode`` / ``first ttft``: the warm-up calls (minfer builds and compiles the plans there).

The prompt: minfer renders the chat template with its media marker; llama.cpp gets that text with the marker
replaced by ``"\\n\\n" + <__media__> + "\\n\\n"`` (mtmd writes ``<start_of_image>`` / ``<end_of_image>`` itself, but
not the blank lines that Gemma3Processor, and minfer, put around them), so that both engines evaluate the same
token ids (checked: the table says whether they match) and their last-position logits can be compared (``max |d|``;
llama.cpp keeps ``mm.input_projection.weight`` in F16 even in an f32 mmproj, so ~1e-3 at the tiny shape).

Weights: ``--outtype f16`` (default, what the published mmproj files are: llama.cpp's clip reads F32, F16, BF16 and
quantized mmproj files) or ``f32``. minfer widens every mmproj tensor to float32 at load (``minfer.models.mmproj``)
and computes the tower in f32; llama.cpp multiplies the F16 weights as they are. The table lists the stored types of
both files and the types minfer holds at run time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP = Path("/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
LLAMA_PYTHON = "/tmp/lcpenv/bin/python"
MINFER_PYTHON = str(ROOT / ".venv" / "bin" / "python")
IMAGE_NAME = "test_512.png"
QUESTION = "What is in this image?"
N_CTX = 1024

# ---------------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------------

ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}


def _script(name: str) -> Any:
    """A module of scripts/ (the fixture and conversion scripts), loaded from its file once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def shape_configs(shape: str) -> dict[str, Any]:
    """Text config, vision config, tokens per image and the init of a shape."""
    fx = _script("make_vision_fixtures")
    if shape == "tiny":
        return {"text": dict(fx.TEXT_CONFIG), "vision": dict(fx.VISION_CONFIG), "mm_tokens": fx.MM_TOKENS,
                "init": "fixture"}
    if shape == "gemma3-4b":
        text = {
            "hidden_size": 2560,  # Gemma 3 4B's width: the projector is 1152 -> 2560 as in the real model
            "intermediate_size": 10240,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 1024,
            # both sliding: what a GGUF file without a pattern key means (every 6th layer global)
            "layer_types": ["sliding_attention"] * 2,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": ROPE,
            "tie_word_embeddings": True,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "pad_token_id": 0,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        }
        vision = {  # SigLIP so400m/14 at 896, as google/gemma-3-4b-it
            "image_size": 896,
            "patch_size": 14,
            "num_channels": 3,
            "hidden_size": 1152,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "intermediate_size": 4304,
            "layer_norm_eps": 1e-6,
            "hidden_act": "gelu_pytorch_tanh",
            "vision_use_head": False,
        }
        return {"text": text, "vision": vision, "mm_tokens": 256, "init": "scaled"}
    if shape == "smolvlm-tiny":
        sf = _script("make_smolvlm_fixture")
        return {"family": "smolvlm", "text": dict(SMOLVLM_TINY_TEXT), "vision": {
            "image_size": sf.TILE, "patch_size": sf.PATCH, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "intermediate_size": 64, "layer_norm_eps": 1e-6}, "scale_factor": sf.SCALE,
            "processor": {**sf.PROCESSOR_CONFIG}, "init": "fixture", "n_ctx": N_CTX}
    if shape == "smolvlm-256m":
        text = {  # SmolLM2-135M's shape, as HuggingFaceTB/SmolVLM-256M-Instruct's text model
            "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": SMOLVLM_256M_LAYERS,
            "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 0,
            "eos_token_id": 1, "pad_token_id": 2}
        vision = {  # SigLIP base/16 at 512, as SmolVLM-256M's
            "image_size": 512, "patch_size": 16, "hidden_size": 768, "num_hidden_layers": 12,
            "num_attention_heads": 12, "intermediate_size": 3072, "layer_norm_eps": 1e-6}
        processor = {**_script("make_smolvlm_fixture").PROCESSOR_CONFIG,
                     "size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512}}
        # a 512x512 image: resized to 2048, 4 x 4 tiles + the whole image, 17 x 64 = 1088 image tokens
        return {"family": "smolvlm", "text": text, "vision": vision, "scale_factor": 4, "processor": processor,
                "init": "scaled", "n_ctx": 2048}
    raise SystemExit(f"unknown shape {shape!r} ({', '.join(SHAPES)})")


SHAPES = ("tiny", "gemma3-4b", "smolvlm-tiny", "smolvlm-256m")
SMOLVLM_256M_LAYERS = 30  # SmolLM2-135M's
SMOLVLM_TINY_TEXT = {  # make_smolvlm_fixture.py's text model
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


def init_scaled(model: Any, seed: int = 1234, llama_norms: bool = False) -> None:
    """Random weights whose activations stay in range at real widths (HF's initializer_range 0.02): matrices,
    embeddings, convs N(0, 0.02); SigLIP LayerNorm gains 1 + N(0, 0.02); Gemma RMSNorm weights N(0, 0.1)
    (it multiplies by 1 + w), or with ``llama_norms`` (Llama's RMSNorm multiplies by w) 1 + N(0, 0.02); biases
    N(0, 0.02)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean, std = 0.0, 0.02
            if "layernorm" in name or "layer_norm" in name or (llama_norms and "norm" in name
                                                                  and not name.endswith("bias")):
                mean = 1.0
            elif "norm" in name and not name.endswith("bias"):
                std = 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std + mean)


def make_image(path: Path) -> None:
    """A deterministic 512x512 RGB test image: two gradients, a disc, a rectangle, lines and some noise."""
    import numpy as np
    from PIL import Image, ImageDraw

    y, x = np.mgrid[0:512, 0:512].astype(np.float64)
    rgb = np.stack([x / 511 * 255, y / 511 * 255, 128 + 100 * np.sin((x + y) / 40)], axis=-1)
    rgb += np.random.default_rng(512).normal(0, 6, rgb.shape)
    im = Image.fromarray(np.clip(np.round(rgb), 0, 255).astype(np.uint8), "RGB")
    d = ImageDraw.Draw(im)
    d.ellipse((60, 70, 230, 240), fill=(230, 40, 40), outline=(0, 0, 0), width=4)
    d.rectangle((280, 300, 470, 440), fill=(30, 60, 200))
    d.polygon([(300, 60), (460, 90), (380, 230)], fill=(250, 220, 30))
    for k in range(0, 512, 32):
        d.line((k, 500, 511 - k, 470), fill=(255, 255, 255), width=2)
    im.save(path, format="PNG")


def smolvlm_tokenizer(hf: Path, grid: int) -> Any:
    """The SmolVLM fixture's tokenizer (make_smolvlm_fixture.py), saved to ``hf`` with two additions: the piece
    "\\n\\n" (byte-level "ĊĊ", merge "Ċ Ċ", at the end of the BPE vocabulary, the special tokens one id up;
    SmolLM2's vocabulary has it, and mtmd looks it up by its text to write
    the blank line before the whole image, so without it llama.cpp's prompt would hold an invalid id) and the
    ``<row_r_col_c>`` tags up to ``grid`` x ``grid``."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    sf = _script("make_smolvlm_fixture")
    tok = sf.build_tokenizer()
    tok.save_pretrained(hf)
    tj = json.loads((hf / "tokenizer.json").read_text(encoding="utf-8"))
    vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
    n = len(vocab)  # the new piece ends the BPE vocabulary; the added tokens after it move up by one
    vocab["ĊĊ"] = n
    for a in tj["added_tokens"]:
        a["id"] += a["id"] >= n
    merges.append(["Ċ", "Ċ"] if merges and isinstance(merges[0], list) else "Ċ Ċ")
    (hf / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(hf / "tokenizer.json"), **{
        k: getattr(tok, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token") if getattr(tok, k)})
    tags = [f"<row_{r}_col_{c}>" for r in range(1, grid + 1) for c in range(1, grid + 1)]
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in tags
                    if t not in tok.get_vocab()], special_tokens=True)
    tok.chat_template = sf.CHAT_TEMPLATE
    assert tok("\n\n", add_special_tokens=False)["input_ids"] == [n]
    assert all(len(tok(t, add_special_tokens=False)["input_ids"]) == 1 for t in [*sf.SPECIAL, *tags])
    return tok


def make_smolvlm(out: Path, shape: str, outtype: str, llama_cpp: Path) -> int:
    """A random ``Idefics3ForConditionalGeneration`` folder at ``shape`` and llama.cpp's two GGUF files of it."""
    import shutil

    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    sf = _script("make_smolvlm_fixture")
    sg = _script("make_smolvlm_gguf")
    cfgs = shape_configs(shape)
    out.mkdir(parents=True, exist_ok=True)
    hf = out / "hf"
    if hf.exists():
        shutil.rmtree(hf)
    hf.mkdir()
    t0 = time.perf_counter()
    proc_cfg = cfgs["processor"]
    tile = proc_cfg["max_image_size"]["longest_edge"]
    grid = -(-proc_cfg["size"]["longest_edge"] // tile)
    tok = smolvlm_tokenizer(hf, grid)
    t = dict(cfgs["text"])
    rope_theta = t.pop("rope_theta")
    text = LlamaConfig(vocab_size=len(tok), rope_theta=rope_theta, **t)
    vision = Idefics3VisionConfig(**cfgs["vision"])
    cfg = Idefics3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                         scale_factor=cfgs["scale_factor"], image_token_id=tok.convert_tokens_to_ids("<image>"),
                         tie_word_embeddings=text.tie_word_embeddings)
    model = Idefics3ForConditionalGeneration(cfg).to(torch.float32)
    if cfgs["init"] == "fixture":
        torch.manual_seed(sf.SEED)
        with torch.no_grad():
            for name, p in model.named_parameters():
                mean, std = 0.0, sf.WEIGHT_STD
                if name.endswith("bias"):
                    std = sf.BIAS_STD
                elif "norm" in name:
                    mean, std = 1.0, sf.NORM_STD
                elif "embed_tokens" in name or "position_embedding" in name:
                    std = sf.EMBED_STD
                p.copy_(torch.randn(p.shape) * std + mean)
    else:
        init_scaled(model, llama_norms=True)
    model.eval()
    model.save_pretrained(hf, safe_serialization=True)
    del model
    seq_len = (cfgs["vision"]["image_size"] // cfgs["vision"]["patch_size"] // cfgs["scale_factor"]) ** 2
    proc = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(**proc_cfg), tokenizer=tok,
                             chat_template=sf.CHAT_TEMPLATE, image_seq_len=seq_len)
    proc.save_pretrained(hf)
    proc.image_processor.save_pretrained(hf)
    # the Hub's text_config.architectures, which the converter's text side keys on (make_smolvlm_gguf.py)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(sg.hub_config(config), indent=1) + "\n")
    t1 = time.perf_counter()
    text_gguf, mmproj = out / f"text-{outtype}.gguf", out / f"mmproj-{outtype}.gguf"
    name = f"smolvlm-{shape}"
    sg.convert(llama_cpp, hf, text_gguf, "--outtype", outtype, model_name=name)
    sg.convert(llama_cpp, hf, mmproj, "--outtype", outtype, "--mmproj", model_name=name)
    t2 = time.perf_counter()
    make_image(out / IMAGE_NAME)
    meta = {"shape": shape, "family": "smolvlm", "outtype": outtype, "text_config": cfgs["text"],
            "vision_config": cfgs["vision"], "scale_factor": cfgs["scale_factor"], "processor": proc_cfg,
            "tokens_per_tile": seq_len, "init": cfgs["init"], "n_ctx": cfgs["n_ctx"],
            "hf_seconds": round(t1 - t0, 1), "convert_seconds": round(t2 - t1, 1)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    for p in sorted(out.rglob("*")):
        if p.is_file():
            print(f"{p.relative_to(out)}: {p.stat().st_size / 1e6:.1f} MB")
    print(f"hf folder {t1 - t0:.1f} s, conversion {t2 - t1:.1f} s")
    return 0


def make(out: Path, shape: str, outtype: str, llama_cpp: Path) -> int:
    import shutil

    if shape.startswith("smolvlm"):
        return make_smolvlm(out, shape, outtype, llama_cpp)

    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    fx = _script("make_vision_fixtures")
    vg = _script("make_vision_gguf")

    cfgs = shape_configs(shape)
    out.mkdir(parents=True, exist_ok=True)
    hf = out / "hf"
    if hf.exists():
        shutil.rmtree(hf)
    t0 = time.perf_counter()
    tok = fx.build_tokenizer()
    ids = tok.convert_tokens_to_ids(list(fx.IMAGE_TOKENS.values()))
    cfg = Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=len(tok), **cfgs["text"]),
        vision_config=SiglipVisionConfig(**cfgs["vision"]),
        mm_tokens_per_image=cfgs["mm_tokens"],
        boi_token_index=ids[0], eoi_token_index=ids[1], image_token_index=ids[2], tie_word_embeddings=True,
    )
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    if cfgs["init"] == "fixture":
        fx.init_weights(model)
    else:
        init_scaled(model)
    model.eval()
    model.save_pretrained(hf, safe_serialization=True)
    del model
    size = cfgs["vision"]["image_size"]
    ip = Gemma3ImageProcessorPil(**{**fx.PROCESSOR_CONFIG, "size": {"height": size, "width": size}})
    proc = Gemma3Processor(image_processor=ip, tokenizer=tok, chat_template=fx.GEMMA3_CHAT_TEMPLATE,
                           image_seq_length=cfgs["mm_tokens"])
    proc.save_pretrained(hf)
    ip.save_pretrained(hf)
    # the Hub's tensor names (vision_tower.vision_model.*: what the converter maps) and a tokenizer.model, as
    # make_vision_gguf.py's hub_folder, but in place (no second copy of a 2.4 GB file)
    shards = sorted(hf.glob("model*.safetensors"))
    for shard in shards:
        tensors = {vg.hub_name(k): v for k, v in load_file(shard).items()}
        tmp = shard.with_suffix(".tmp")
        save_file(tensors, tmp, metadata={"format": "pt"})
        del tensors
        tmp.replace(shard)
    index = hf / "model.safetensors.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        idx["weight_map"] = {vg.hub_name(k): v for k, v in idx["weight_map"].items()}
        index.write_text(json.dumps(idx, indent=1))
    (hf / "tokenizer.model").write_bytes(vg.sentencepiece_model(hf / "tokenizer.json"))
    t1 = time.perf_counter()
    text, mmproj = out / f"text-{outtype}.gguf", out / f"mmproj-{outtype}.gguf"
    name = ("--model-name", f"gemma3-vision-{shape}")
    vg.convert(llama_cpp, hf, text, "--outtype", outtype, *name)
    vg.convert(llama_cpp, hf, mmproj, "--outtype", outtype, "--mmproj", *name)
    t2 = time.perf_counter()
    make_image(out / IMAGE_NAME)
    meta = {"shape": shape, "family": "gemma3", "outtype": outtype, "text_config": cfgs["text"],
            "vision_config": cfgs["vision"], "mm_tokens_per_image": cfgs["mm_tokens"], "init": cfgs["init"],
            "hf_seconds": round(t1 - t0, 1), "convert_seconds": round(t2 - t1, 1)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    for p in sorted(out.rglob("*")):
        if p.is_file():
            print(f"{p.relative_to(out)}: {p.stat().st_size / 1e6:.1f} MB")
    print(f"hf folder {t1 - t0:.1f} s, conversion {t2 - t1:.1f} s")
    return 0


# ---------------------------------------------------------------------------------------------------
# workers (each in a process of its own)
# ---------------------------------------------------------------------------------------------------


def _type_counts(tensors: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tensors.values():
        k = getattr(getattr(t, "ggml_type", None), "name", type(t).__name__)
        out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items()))


def _meta(d: Path) -> dict[str, Any]:
    return json.loads((d / "meta.json").read_text()) if (d / "meta.json").is_file() else {}


def worker_minfer(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    import minfer
    from minfer.runtime.vision import ImageInput, extract_images

    d = Path(args.dir)
    image = d / IMAGE_NAME
    n_ctx = _meta(d).get("n_ctx", N_CTX)
    t0 = time.perf_counter()
    if args.source == "hf":
        m = minfer.load(str(d / "hf"), threads=args.threads, n_ctx=n_ctx)
    else:
        m = minfer.load(str(d / f"text-{args.outtype}.gguf"), mmproj=str(d / f"mmproj-{args.outtype}.gguf"),
                        threads=args.threads, n_ctx=n_ctx)
    load_s = time.perf_counter() - t0
    assert m.images is not None
    prompter, runner = m.images, m.images.runner
    data = image.read_bytes()

    def pixels() -> list[np.ndarray]:  # the tiles (Gemma 3: the one image)
        return prompter.tiles(ImageInput(data, str(image)))[0]

    pre = []
    for _ in range(args.reps + 1):
        t = time.perf_counter()
        px = pixels()
        pre.append(time.perf_counter() - t)
    t = time.perf_counter()
    runner.encode(px)
    first_encode = time.perf_counter() - t
    enc = []
    for _ in range(args.reps):
        t = time.perf_counter()
        runner.encode(px)
        enc.append(time.perf_counter() - t)

    messages = [{"role": "user", "content": [{"type": "image", "path": str(image)},
                                             {"type": "text", "text": QUESTION}]}]
    reused: list[int] = []
    take = m.engine.slots.take

    def counting_take(*a: Any, **k: Any) -> tuple[int, int]:
        slot, cached = take(*a, **k)
        reused.append(cached)
        return slot, cached

    m.engine.slots.take = counting_take  # type: ignore[method-assign]

    def question() -> tuple[float, str]:
        prompter._cache.clear()
        m.kv.clear()
        before, n_take = runner.images_encoded, len(reused)
        t = time.perf_counter()
        reply = m.chat(messages, max_tokens=1, temperature=0)
        dt = time.perf_counter() - t
        if runner.images_encoded != before + len(px) or reused[n_take:] != [0]:
            raise SystemExit(f"minfer reused work: images encoded {runner.images_encoded - before}, cached prompt "
                             f"tokens {reused[n_take:]}")
        return dt, reply

    first_ttft, reply = question()
    ttft = [question()[0] for _ in range(args.reps)]

    msgs, imgs = extract_images(messages, allow_paths=True)
    prompt = m.render_chat(msgs)
    ids, placed = m.image_prompt(prompt, [ImageInput(data, str(image))])
    logits = m.runner.forward(ids, np.arange(len(ids)), images=placed)[-1]
    np.save(d / f"logits_minfer_{args.source}.npy", np.asarray(logits, np.float32))
    ids_marked = [int(i) if i >= 0 else -1 for i in ids]
    vision = m.transformer.vision
    return {
        "engine": f"minfer ({args.source})", "load": load_s, "preprocess": pre[1:], "first_preprocess": pre[0],
        "encode": enc, "first_encode": first_encode, "ttft": ttft, "first_ttft": first_ttft,
        "prompt_text": prompt, "ids": ids_marked, "reply": reply, "n_prompt": len(ids), "n_tiles": len(px),
        "weights": {"text (held)": _type_counts(m.transformer.tensors), "vision (held)": _type_counts(vision.tensors)},
        "kernels": os.environ.get("MINFER_KERNELS", "fast (default)"),
    }


def worker_llama(args: argparse.Namespace) -> dict[str, Any]:
    import ctypes

    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd
    import numpy as np

    d = Path(args.dir)
    image = str(d / IMAGE_NAME).encode()
    prompt = Path(args.prompt_file).read_text(encoding="utf-8")
    marker = mtmd.mtmd_default_marker().decode()
    meta = _meta(d)
    if meta.get("family", "gemma3") == "gemma3":
        text = prompt.replace("<__media__>", "\n\n" + marker + "\n\n")
    else:  # SmolVLM: mtmd writes the tiles' tags, the rows' "\n" and the whole image's "\n\n<fake><global-img>"
        text = prompt.replace("<__media__>", marker)
    n_ctx = meta.get("n_ctx", N_CTX)
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(str(d / f"text-{args.outtype}.gguf"), n_ctx=n_ctx, n_threads=args.threads,
                          n_threads_batch=args.threads, n_batch=512, n_ubatch=512, verbose=False)
    p = mtmd.mtmd_context_params_default()
    p.use_gpu = False
    p.print_timings = False
    p.n_threads = args.threads
    ctx = mtmd.mtmd_init_from_file(str(d / f"mmproj-{args.outtype}.gguf").encode(), llm.model, p)
    if not ctx:
        raise SystemExit("mtmd_init_from_file failed")
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()
    lctx = llm._ctx.ctx
    text_b = text.encode("utf-8")

    def tokenize() -> tuple[Any, Any]:
        bitmap = mtmd.mtmd_helper_bitmap_init_from_file(ctx, image, False)
        if not bitmap:
            raise SystemExit("mtmd_helper_bitmap_init_from_file failed")
        chunks = mtmd.mtmd_input_chunks_init()
        inp = mtmd.mtmd_input_text()
        inp.text, inp.text_len, inp.add_special, inp.parse_special = text_b, len(text_b), False, True
        arr = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), arr, 1)
        if rc != 0:
            raise SystemExit(f"mtmd_tokenize: {rc}")
        return bitmap, chunks

    def free(bitmap: Any, chunks: Any) -> None:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)

    def image_chunks(chunks: Any) -> list[Any]:  # one per tile (SmolVLM) or the one image (Gemma 3)
        out = [c for c in (mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks)))
               if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE]
        if not out:
            raise SystemExit("no image chunk")
        return out

    pre = []
    for _ in range(args.reps + 1):
        t = time.perf_counter()
        bitmap, chunks = tokenize()
        pre.append(time.perf_counter() - t)
        free(bitmap, chunks)
    bitmap, chunks = tokenize()
    tiles = image_chunks(chunks)
    enc = []
    for _ in range(args.reps + 1):
        t = time.perf_counter()
        for chunk in tiles:
            if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
                raise SystemExit("mtmd_encode_chunk failed")
        enc.append(time.perf_counter() - t)
    # the prompt's ids (-1 on the image's positions), to compare with minfer's
    ids: list[int] = []
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        c = mtmd.mtmd_input_chunks_get(chunks, i)
        if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            ptr = mtmd.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
            ids += [int(ptr[j]) for j in range(n.value)]
        else:
            ids += [-1] * mtmd.mtmd_input_chunk_get_n_tokens(c)
    free(bitmap, chunks)

    def question() -> tuple[float, np.ndarray]:
        llm._ctx.kv_cache_clear()
        t = time.perf_counter()
        bitmap, chunks = tokenize()
        new_n_past = llama_cpp.llama_pos(0)
        rc = mtmd.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, 512, True, ctypes.byref(new_n_past))
        if rc != 0:
            raise SystemExit(f"mtmd_helper_eval_chunks: {rc}")
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lctx, -1), shape=(n_vocab,))
        int(np.argmax(logits))  # the first token (greedy)
        dt = time.perf_counter() - t
        free(bitmap, chunks)
        return dt, logits.copy()

    first_ttft, _ = question()
    ttft = []
    for _ in range(args.reps):
        dt, logits = question()
        ttft.append(dt)
    np.save(d / "logits_llama.npy", logits.astype(np.float32))
    mtmd.mtmd_free(ctx)
    return {
        "engine": "llama.cpp", "load": load_s, "preprocess": pre[1:], "first_preprocess": pre[0],
        "encode": enc[1:], "first_encode": enc[0], "ttft": ttft, "first_ttft": first_ttft, "ids": ids,
        "n_prompt": len(ids), "n_tiles": len(tiles),
        "reply": llm.detokenize([int(np.argmax(logits))]).decode("utf-8", "replace"),
        "system_info": llama_cpp.llama_print_system_info().decode(),
        "version": llama_cpp.__version__,
    }


# ---------------------------------------------------------------------------------------------------
# the run: workers one after the other, then the table
# ---------------------------------------------------------------------------------------------------


def cpu_summary() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    want = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
            "amx_bf16", "amx_int8"]
    return f"{model}; {os.cpu_count()} CPUs; flags: {' '.join(f for f in want if f in flags) or '(none of avx2..amx)'}"


def file_types(path: Path) -> dict[str, int]:
    from minfer.formats.gguf_file import GGUFFile

    return _type_counts(GGUFFile(path).tensors)


def spawn(python: str, worker: str, args: argparse.Namespace, extra: list[str], log: Path) -> dict[str, Any]:
    out = Path(args.run) / f".{worker}.json"
    out.unlink(missing_ok=True)
    cmd = [python, str(Path(__file__).resolve()), "--worker", worker, "--dir", str(args.run), "--threads",
           str(args.threads), "--reps", str(args.reps), "--outtype", args.outtype, "--json-out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0 or not out.is_file():
        tail = log.read_text(errors="replace")[-4000:]
        raise SystemExit(f"{worker} worker failed ({rc}); {log}:\n{tail}")
    return json.loads(out.read_text())


def fmt(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.2f} s"


def run(args: argparse.Namespace) -> int:
    import numpy as np

    d = Path(args.run)
    meta = _meta(d)
    log = d / "run.log"
    log.write_text("")
    engines = ["minfer-gguf", "llama"] + (["minfer-hf"] if args.hf else [])
    results: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    prompt_file = d / ".prompt.txt"
    for r in range(args.rounds):
        order = engines if r % 2 == 0 else list(reversed(engines))
        if r == 0:  # minfer renders the prompt llama.cpp gets
            order = engines
        for e in order:
            print(f"round {r + 1}/{args.rounds}: {e} ...", flush=True)
            if e == "llama":
                res = spawn(args.llama_python, "llama", args, ["--prompt-file", str(prompt_file)], log)
            else:
                res = spawn(args.minfer_python, "minfer", args, ["--source", e.split("-")[1]], log)
                prompt_file.write_text(res["prompt_text"], encoding="utf-8")
            results[e].append(res)

    def pooled(e: str, key: str) -> list[float]:
        return [x for res in results[e] for x in (res[key] if isinstance(res[key], list) else [res[key]])]

    def med(e: str, key: str) -> float:
        return statistics.median(pooled(e, key))

    rows = [("load", "load", med), ("preprocess (median)", "preprocess", med),
            ("encode (median)", "encode", med), ("encode (min)", "encode", lambda e, k: min(pooled(e, k))),
            ("first encode (warm-up)", "first_encode", med),
            ("TTFT (median)", "ttft", med), ("TTFT (min)", "ttft", lambda e, k: min(pooled(e, k))),
            ("first TTFT (warm-up)", "first_ttft", med)]
    names = {"minfer-gguf": "minfer (gguf)", "llama": "llama.cpp", "minfer-hf": "minfer (hf)"}
    head = f"{'':24s}" + "".join(f"{names[e]:>16s}" for e in engines) + f"{'minfer/llama':>14s}"
    lines = [head, "-" * len(head)]
    for label, key, f in rows:
        vals = {e: f(e, key) for e in engines}
        ratio = vals["minfer-gguf"] / vals["llama"] if vals["llama"] else float("nan")
        lines.append(f"{label:24s}" + "".join(f"{fmt(vals[e]):>16s}" for e in engines) + f"{ratio:>13.2f}x")
    m0, l0 = results["minfer-gguf"][0], results["llama"][0]
    same_ids = m0["ids"] == l0["ids"]
    lm = np.load(d / "logits_minfer_gguf.npy")
    ll = np.load(d / "logits_llama.npy")
    print()
    print(f"vision_speed: shape {meta.get('shape', '?')}, threads {args.threads}, reps {args.reps} x rounds "
          f"{args.rounds} (times pooled), image {IMAGE_NAME} 512x512 ({m0.get('n_tiles', 1)} tiles; llama.cpp "
          f"{l0.get('n_tiles', 1)}), prompt {m0['n_prompt']} tokens (llama.cpp {l0['n_prompt']})")
    print(f"CPU: {cpu_summary()}")
    print(f"llama.cpp {l0['version']} system_info: {l0['system_info'].strip()}")
    print(f"minfer kernels: {m0['kernels']}")
    print()
    print("\n".join(lines))
    print()
    print("per process (median encode / median TTFT, in run order; a spread here means a busy machine):")
    for e in engines:
        print(f"  {names[e]:14s}" + "  ".join(f"{fmt(statistics.median(res['encode']))} / "
                                            f"{fmt(statistics.median(res['ttft']))}" for res in results[e]))
    print()
    print("weights:")
    for p in (d / f"text-{args.outtype}.gguf", d / f"mmproj-{args.outtype}.gguf"):
        print(f"  {p.name} (file; llama.cpp uses it as stored): {file_types(p)}")
    for k, v in m0["weights"].items():
        print(f"  minfer {k}: {v}")
    print()
    print(f"same prompt ids in both engines: {same_ids}")
    print(f"last-position logits max |minfer - llama.cpp| = {float(np.abs(lm - ll).max()):.3g} "
          f"(logit std {float(ll.std()):.3g}); greedy tokens {int(lm.argmax())} / {int(ll.argmax())}")
    if args.hf:
        lh = np.load(d / "logits_minfer_hf.npy")
        print(f"last-position logits max |minfer hf - minfer gguf| = {float(np.abs(lh - lm).max()):.3g}")
    (d / "results.json").write_text(json.dumps({"meta": meta, "results": results, "table": lines}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--make", type=Path, metavar="DIR", help="write the model files and test image to DIR")
    ap.add_argument("--shape", choices=SHAPES, default="gemma3-4b")
    ap.add_argument("--outtype", choices=["f16", "f32"], default="f16", help="GGUF weight type (both files)")
    ap.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP, help="the sdist's vendor/llama.cpp (converter)")
    ap.add_argument("--run", type=Path, metavar="DIR", help="measure both engines on DIR's files")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="minfer / llama.cpp process pairs, order alternating")
    ap.add_argument("--hf", action="store_true", help="also minfer on DIR/hf (the f32 HF folder)")
    ap.add_argument("--llama-python", default=LLAMA_PYTHON)
    ap.add_argument("--minfer-python", default=MINFER_PYTHON if Path(MINFER_PYTHON).exists() else sys.executable)
    # internal: one engine's worker
    ap.add_argument("--worker", choices=["minfer", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    ap.add_argument("--source", default="gguf", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        res = worker_minfer(args) if args.worker == "minfer" else worker_llama(args)
        Path(args.json_out).write_text(json.dumps(res))
        return 0
    if args.make:
        return make(args.make, args.shape, args.outtype, args.llama_cpp)
    if args.run:
        return run(args)
    ap.error("one of --make DIR or --run DIR")
    return 2


if __name__ == "__main__":
    sys.exit(main())
