"""Build the tiny random-weight Gemma 3 vision fixture in ``tests/fixtures/gemma3_vision``.

A sibling of ``make_gemma3_fixture.py`` for ``Gemma3ForConditionalGeneration`` (images in, text out), run in
the reference environment (torch 2.13.0 CPU, transformers 5.24.0, Pillow 13.0.0, tokenizers, safetensors;
no torchvision, so transformers uses ``Gemma3ImageProcessorPil``)::

    /tmp/refenv/bin/python scripts/make_vision_fixtures.py [--out tests/fixtures/gemma3_vision]

Recipe:

1. Tokenizer: the ``gemma3`` fixture's ``hf/tokenizer.json`` (384 pieces) plus ``<start_of_image>``,
   ``<end_of_image>``, ``<image_soft_token>`` added as special tokens at the end (ids 384, 385, 386; the
   tokenizer's ``boi_token`` / ``eoi_token`` / ``image_token``), with Gemma 3's published chat template (an
   image content part renders as ``<start_of_image>``).
2. Config (``TEXT_CONFIG``, ``VISION_CONFIG``): ``Gemma3TextConfig`` hidden 32, 6 layers (5 sliding, then full:
   Gemma 3's pattern, which llama.cpp's GGUF files assume), 4 query heads, 2 kv heads, head dim 16, ffn 64, sliding
   window 64 (> the 20 tokens of an image block; the two-image prompt is longer than the window),
   query_pre_attn_scalar 16, RoPE 1e6 linear x8 / 1e4 local, tied; ``SiglipVisionConfig`` image 32, patch 4 (8x8 =
   64 patches), hidden 32, 2 layers, 2 heads, ffn 64, tanh GELU, layer_norm_eps 1e-6; ``mm_tokens_per_image`` 16
   (the projector average-pools 2x2 patches), boi / eoi / image token ids as above.
3. Weights: ``torch.manual_seed(SEED)``, then per parameter in order ``randn * std + mean``: matrices and
   the patch conv (0, 0.15), embeddings incl. the vision position embedding (0, 0.3), Gemma RMSNorm
   weights incl. the projector's ``mm_soft_emb_norm`` (0, 0.2) (it multiplies by 1 + w), SigLIP LayerNorm
   weights (1, 0.2), biases (0, 0.1).
4. ``hf/``: ``save_pretrained`` of the model (fp32 safetensors), the tokenizer and the ``Gemma3Processor``
   (``Gemma3ImageProcessorPil``, 32x32, bilinear, mean = std = 0.5, ``image_seq_length`` 16); reloaded
   (model with ``attn_implementation="eager"``, ``AutoProcessor``); every reference comes from the reload.
5. References for each prompt k (0: one image, 1: two images with text before, between and after),
   built by the reloaded processor from ``apply_chat_template``'s text (``prompt_<k>.json``; tokenized with
   ``add_special_tokens=False``, the text holds ``<bos>``, as ``apply_chat_template(tokenize=True)``): the
   ``input_ids``, ``token_type_ids`` (1 on the image soft tokens: Gemma 3 attends bidirectionally within
   an image), ``pixel_values``, the fp32 logits at every position (``token_type_ids`` passed), the same
   without ``token_type_ids`` (plain causal: how much the bidirectional mask matters), the projector output
   (``get_image_features(...).pooler_output``, ``[n_images, 16, 32]``) and the vision tower's last hidden
   state (after ``post_layernorm``, ``[n_images, 64, 32]``).
6. ``images/``: small test images (sizes, aspect ratios, modes RGB / RGBA / L / P with transparency / LA,
   PNG, JPEG, GIF, WEBP, BMP) and ``images/pixels_ref.npz``: the processor's ``pixel_values`` of each, opened
   with ``PIL.Image.open`` from the stored file (what the engine's loader sees).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

NAME = "gemma3_vision"
SEED = 3304
WEIGHT_STD, EMBED_STD, NORM_STD, BIAS_STD = 0.15, 0.3, 0.2, 0.1
ROOT = Path(__file__).resolve().parent.parent
BASE_TOKENIZER = ROOT / "tests" / "fixtures" / "gemma3" / "hf"
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
IMAGE_SIZE, PATCH, MM_TOKENS = 32, 4, 16

TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 64,
    # Gemma 3's own pattern (5 sliding, then 1 full): what llama.cpp's converter and loader assume for a GGUF
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
}
VISION_CONFIG: dict[str, Any] = {
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH,
    "num_channels": 3,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
    "vision_use_head": False,
}
PROCESSOR_CONFIG: dict[str, Any] = {
    "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    "resample": 2,  # PIL.Image.BILINEAR
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": None,  # as google/gemma-3-*: the processor's default (True) applies
    "do_pan_and_scan": None,
}

# Gemma 3's chat template as published with google/gemma-3-*-it (same as make_gemma3_fixture.py)
GEMMA3_CHAT_TEMPLATE = (BASE_TOKENIZER / "chat_template.jinja").read_text(encoding="utf-8")

# conversations whose images are images/<name> (prompt 0: one image, prompt 1: two images)
PROMPTS: list[dict[str, Any]] = [
    {
        "images": ["rgb_45x20.png"],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "text", "text": "What is in this image?"},
                ],
            }
        ],
    },
    {
        "images": ["rgba_24x18.png", "photo_40x28.jpg"],
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare the first image"},
                    {"type": "image"},
                    {"type": "text", "text": "with the second one,"},
                    {"type": "image"},
                    {"type": "text", "text": "and say which one is brighter. Hello, world! The capital of France."},
                ],
            },
        ],
    },
]


# ---------------------------------------------------------------------------------------------------
# test images
# ---------------------------------------------------------------------------------------------------


def _rgb_array(rng: np.random.Generator, w: int, h: int, channels: int = 3) -> np.ndarray:
    """A smooth gradient plus noise (uint8 [h, w, channels]): structure for JPEG, variation for resizing."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    base = [127 + 100 * np.sin(x / max(w, 1) * 3.1 + c) * np.cos(y / max(h, 1) * 2.3 - c) for c in range(channels)]
    arr = np.stack(base, axis=-1) + rng.normal(0, 25, (h, w, channels))
    return np.clip(np.round(arr), 0, 255).astype(np.uint8)


def make_images(img_dir: Path) -> list[str]:
    """Write the test images; returns their file names in order."""
    from PIL import Image

    rng = np.random.default_rng(SEED)
    img_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, bytes] = {}

    def save(name: str, im: Image.Image, fmt: str, **kw: Any) -> None:
        buf = io.BytesIO()
        im.save(buf, format=fmt, **kw)
        out[name] = buf.getvalue()

    for w, h in [(1, 1), (7, 3), (45, 20), (20, 45), (64, 64), (100, 13)]:
        save(f"rgb_{w}x{h}.png", Image.fromarray(_rgb_array(rng, w, h)), "PNG")
    rgba = _rgb_array(rng, 24, 18, 4)
    rgba[..., 3] = np.clip(np.linspace(0, 255, 24)[None, :] + rng.normal(0, 40, (18, 24)), 0, 255).astype(np.uint8)
    rgba[:4, :4, 3] = 0  # fully transparent corner
    save("rgba_24x18.png", Image.fromarray(rgba, mode="RGBA"), "PNG")
    save("gray_L_17x29.png", Image.fromarray(_rgb_array(rng, 17, 29, 1)[..., 0], mode="L"), "PNG")
    la = _rgb_array(rng, 13, 11, 2)
    save("gray_LA_13x11.png", Image.fromarray(la, mode="LA"), "PNG")
    pal = Image.fromarray(_rgb_array(rng, 30, 30)).quantize(colors=16, method=Image.Quantize.MEDIANCUT)
    save("palette_P_30x30.png", pal, "PNG", transparency=3)
    save("photo_40x28.jpg", Image.fromarray(_rgb_array(rng, 40, 28)), "JPEG", quality=85)
    gif = Image.fromarray(_rgb_array(rng, 19, 23)).quantize(colors=32)
    gif2 = Image.fromarray(_rgb_array(rng, 19, 23)).quantize(colors=32)
    save("anim_19x23.gif", gif, "GIF", save_all=True, append_images=[gif2], duration=100, loop=0)
    save("rgb_33x21.webp", Image.fromarray(_rgb_array(rng, 33, 21)), "WEBP", lossless=True)
    save("rgb_9x14.bmp", Image.fromarray(_rgb_array(rng, 9, 14)), "BMP")
    for name, data in out.items():
        (img_dir / name).write_bytes(data)
    return list(out)


def open_image(path: Path) -> Any:
    from PIL import Image

    im = Image.open(io.BytesIO(path.read_bytes()))
    im.load()
    return im


# ---------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------


def build_tokenizer() -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(BASE_TOKENIZER), extra_special_tokens=dict(IMAGE_TOKENS))
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids(list(IMAGE_TOKENS.values()))
    if ids != [384, 385, 386] or len(tok) != 387:
        raise SystemExit(f"unexpected image token ids {ids} / vocabulary {len(tok)}")
    return tok


def init_weights(model: Any) -> Any:
    import torch

    torch.manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean, std = 0.0, WEIGHT_STD
            if name.endswith("bias"):
                std = BIAS_STD
            elif "layernorm" in name or "layer_norm" in name:  # SigLIP LayerNorm: plain gain
                mean, std = 1.0, NORM_STD
            elif "norm" in name:  # Gemma RMSNorm (1 + w), mm_soft_emb_norm included
                std = NORM_STD
            elif "embed_tokens" in name or "position_embedding" in name:
                std = EMBED_STD
            p.copy_(torch.randn(p.shape) * std + mean)
    return model.eval()


def build_model(tok: Any) -> Any:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    ids = tok.convert_tokens_to_ids(list(IMAGE_TOKENS.values()))
    cfg = Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=len(tok), **TEXT_CONFIG),
        vision_config=SiglipVisionConfig(**VISION_CONFIG),
        mm_tokens_per_image=MM_TOKENS,
        boi_token_index=ids[0],
        eoi_token_index=ids[1],
        image_token_index=ids[2],
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "eager"
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    return init_weights(model)


def build_processor(tok: Any) -> Any:
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    ip = Gemma3ImageProcessorPil(**PROCESSOR_CONFIG)
    return Gemma3Processor(image_processor=ip, tokenizer=tok, chat_template=GEMMA3_CHAT_TEMPLATE, image_seq_length=16)


# ---------------------------------------------------------------------------------------------------
# fixture
# ---------------------------------------------------------------------------------------------------


def _dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def make_fixture(out: Path) -> dict[str, Any]:
    import PIL
    import safetensors
    import tokenizers
    import torch
    import transformers
    from safetensors.numpy import load_file
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    hf_dir = out / "hf"
    names = make_images(out / "images")

    tok = build_tokenizer()
    model = build_model(tok)
    processor = build_processor(tok)
    model.save_pretrained(hf_dir, safe_serialization=True)
    processor.save_pretrained(hf_dir)  # processor_config.json (image processor inside), tokenizer, template
    processor.image_processor.save_pretrained(hf_dir)  # preprocessor_config.json, as the Hub's gemma-3 folders

    model = Gemma3ForConditionalGeneration.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    processor = AutoProcessor.from_pretrained(hf_dir)
    ip = processor.image_processor
    if type(ip).__name__ != "Gemma3ImageProcessorPil" or processor.image_seq_length != MM_TOKENS:
        raise SystemExit(f"unexpected processor {type(ip).__name__} / {processor.image_seq_length}")

    # pixel references of every test image, through the processor (whose do_convert_rgb default is True)
    pixels = {}
    for name in names:
        enc = processor(text=processor.boi_token, images=[open_image(out / "images" / name)], return_tensors="np")
        pv = enc["pixel_values"]
        pixels[name] = np.asarray(pv[0], dtype=np.float32)
    np.savez_compressed(out / "images" / "pixels_ref.npz", **pixels)

    tensors = load_file(hf_dir / "model.safetensors")
    summary: dict[str, Any] = {"prompts": []}
    for k, prompt in enumerate(PROMPTS):
        text = processor.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
        images = [open_image(out / "images" / n) for n in prompt["images"]]
        # the chat text holds <bos> already: no second one (as apply_chat_template(tokenize=True) does it)
        enc = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
        rendered = tok.decode(enc["input_ids"][0].tolist(), skip_special_tokens=False)
        with torch.no_grad():
            logits = model(
                input_ids=enc["input_ids"],
                pixel_values=enc["pixel_values"],
                token_type_ids=enc["token_type_ids"],
                attention_mask=enc["attention_mask"],
            ).logits[0]
            causal = model(input_ids=enc["input_ids"], pixel_values=enc["pixel_values"]).logits[0]
            feats = model.model.get_image_features(enc["pixel_values"], return_dict=True)
        ids = enc["input_ids"][0].numpy().astype(np.int64)
        tti = enc["token_type_ids"][0].numpy().astype(np.int64)
        np.save(out / f"input_ids_{k}.npy", ids)
        np.save(out / f"token_type_ids_{k}.npy", tti)
        np.save(out / f"pixel_values_{k}.npy", enc["pixel_values"].numpy().astype(np.float32))
        np.save(out / f"logits_{k}.npy", logits.numpy().astype(np.float32))
        np.save(out / f"logits_causal_{k}.npy", causal.numpy().astype(np.float32))
        np.save(out / f"image_features_{k}.npy", feats.pooler_output.numpy().astype(np.float32))
        np.save(out / f"vision_last_hidden_{k}.npy", feats.last_hidden_state.numpy().astype(np.float32))
        expanded = processor.full_image_sequence
        _dump_json(
            out / f"prompt_{k}.json",
            {
                "messages": prompt["messages"],
                "images": prompt["images"],
                "add_generation_prompt": True,
                "chat_text": text,
                "expanded_text": text.replace(processor.boi_token, expanded),
                "decoded_input_ids": rendered,
                "n_tokens": len(ids),
                "image_token_positions": [int(i) for i in np.flatnonzero(tti == 1)],
            },
        )
        summary["prompts"].append(
            {
                "n_tokens": len(ids),
                "bidirectional_vs_causal_max_abs": float((logits - causal).abs().max()),
                "logit_std": float(logits.std(-1).mean()),
            }
        )
    cfg = model.config.to_dict()
    for d in (cfg, cfg.get("text_config", {}), cfg.get("vision_config", {})):
        d.pop("_name_or_path", None)  # the output path: not part of the fixture
    _dump_json(
        out / "meta.json",
        {
            "name": NAME,
            "hf_class": "Gemma3ForConditionalGeneration",
            "config": cfg,
            "processor": {**PROCESSOR_CONFIG, "image_seq_length": MM_TOKENS, "class": type(ip).__name__},
            "image_token_ids": {v: tok.convert_tokens_to_ids(v) for v in IMAGE_TOKENS.values()},
            "init": {
                "seed": SEED,
                "weight_std": WEIGHT_STD,
                "embed_std": EMBED_STD,
                "norm_std": NORM_STD,
                "bias_std": BIAS_STD,
            },
            "tensors": {n: list(t.shape) for n, t in tensors.items()},
            "images": {n: list(p.shape) for n, p in pixels.items()},
            "stats": summary,
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "Pillow": PIL.__version__,
                "safetensors": safetensors.__version__,
                "tokenizers": tokenizers.__version__,
                "numpy": np.__version__,
            },
        },
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / NAME, help="output folder")
    args = ap.parse_args(argv)
    summary = make_fixture(args.out)
    from safetensors.numpy import load_file

    for name, t in load_file(args.out / "hf" / "model.safetensors").items():
        if "vision_tower" in name or "multi_modal_projector" in name:
            print(f"  {name} {list(t.shape)}")
    total = 0
    for p in sorted(args.out.rglob("*")):
        if p.is_file():
            total += p.stat().st_size
            extra = ""
            if p.suffix == ".npy":
                a = np.load(p)
                extra = f" {a.dtype} {list(a.shape)}"
            print(f"{p.relative_to(args.out)}: {p.stat().st_size} bytes{extra}")
    print(f"total {total} bytes")
    print(json.dumps(summary, indent=1))
    return 0 if total < 2_000_000 else 1


if __name__ == "__main__":
    sys.exit(main())
