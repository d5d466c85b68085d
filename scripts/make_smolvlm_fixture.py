"""Build the tiny random-weight SmolVLM (Idefics3) fixture in ``tests/fixtures/smolvlm``.

Run in the reference environment (torch CPU, transformers 5.24.0, Pillow; no torchvision, so transformers uses
``Idefics3ImageProcessorPil``)::

    /tmp/refenv/bin/python scripts/make_smolvlm_fixture.py [--out tests/fixtures/smolvlm]

Recipe:

1. Tokenizer: the ``llama`` fixture's ``hf/tokenizer.json`` (512 pieces) plus Idefics3's special tokens
   (``SPECIAL``: ``<|im_start|>``, ``<fake_token_around_image>``, ``<image>``, ``<global-img>``,
   ``<end_of_utterance>``, ``<row_r_col_c>`` for r, c in 1..2) at ids 512.., with a chat template that renders as
   SmolVLM's (``User: ...<end_of_utterance>\\n``, an image part as ``<image>``) and also takes string contents.
2. Config: ``LlamaConfig`` hidden 64, 2 layers, 4 query heads, 2 kv heads, ffn 128, untied; ``Idefics3VisionConfig``
   image 32, patch 4 (8x8 patches), hidden 32, 2 layers, 2 heads, ffn 64; ``scale_factor`` 2 (16 tokens per tile).
3. Weights: ``torch.manual_seed(SEED)``, then per parameter ``randn * std + mean``: matrices and the patch conv
   (0, 0.15), embeddings incl. the position embedding (0, 0.3), norm gains (1, 0.2), biases (0, 0.1).
4. ``hf/``: ``save_pretrained`` of the model (fp32), the ``Idefics3Processor`` (``Idefics3ImageProcessorPil``:
   ``size.longest_edge`` 64, ``max_image_size.longest_edge`` 32, LANCZOS, mean = std = 0.5; ``image_seq_len`` 16),
   reloaded (eager attention, ``AutoProcessor``); every reference comes from the reload.
5. References for each prompt k (``prompt_<k>.json``; 0: one portrait image split into 2 x 1 tiles + the whole
   image; 1: two images with text between them; 2: prompt 0 unsplit, ``do_image_splitting`` false), tokenized with
   ``add_special_tokens=False``: ``input_ids``, ``pixel_values`` (``[n_tiles, 3, 32, 32]``, every
   ``pixel_attention_mask`` being all ones is checked), the connector's output (``image_features``,
   ``[n_tiles * 16, 64]``) and the fp32 logits at every position.
6. ``images/pixels_ref.npz``: the image processor's pixel values (and ``<name>.grid``: rows, cols) of each image of
   ``tests/fixtures/gemma3_vision/images``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

SEED = 4242
WEIGHT_STD, EMBED_STD, NORM_STD, BIAS_STD = 0.15, 0.3, 0.2, 0.1
ROOT = Path(__file__).resolve().parent.parent
BASE_TOKENIZER = ROOT / "tests" / "fixtures" / "llama" / "hf"
IMAGES = ROOT / "tests" / "fixtures" / "gemma3_vision" / "images"
SPECIAL = ["<|im_start|>", "<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
           *[f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]]
TILE, LONGEST, PATCH, SCALE = 32, 64, 4, 2
SEQ_LEN = (TILE // PATCH) ** 2 // SCALE ** 2
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
PROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": True, "do_resize": True, "size": {"longest_edge": LONGEST}, "resample": 1,
    "do_image_splitting": True, "max_image_size": {"longest_edge": TILE}, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_pad": True,
}
PROMPTS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is in this image? "},
                                               {"type": "image"}, {"type": "text", "text": " Say it."}]}],
     "images": ["rgb_20x45.png"]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                               {"type": "text", "text": " with "}, {"type": "image"},
                                               {"type": "text", "text": "."}]}],
     "images": ["rgb_45x20.png", "photo_40x28.jpg"]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is in this image? "},
                                               {"type": "image"}, {"type": "text", "text": " Say it."}]}],
     "images": ["rgb_20x45.png"], "do_image_splitting": False},
]


def build_tokenizer() -> Any:
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(BASE_TOKENIZER))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    ids = tok.convert_tokens_to_ids(SPECIAL)
    if ids != list(range(512, 512 + len(SPECIAL))):
        raise SystemExit(f"unexpected special token ids {ids}")
    return tok


def build_model(tok: Any) -> Any:
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0,
                       eos_token_id=1, pad_token_id=2)
    vision = Idefics3VisionConfig(image_size=TILE, patch_size=PATCH, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, layer_norm_eps=1e-6)
    cfg = Idefics3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), scale_factor=SCALE,
                         image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    model = Idefics3ForConditionalGeneration(cfg).to(torch.float32)
    torch.manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean, std = 0.0, WEIGHT_STD
            if name.endswith("bias"):
                std = BIAS_STD
            elif "norm" in name:
                mean, std = 1.0, NORM_STD
            elif "embed_tokens" in name or "position_embedding" in name:
                std = EMBED_STD
            p.copy_(torch.randn(p.shape) * std + mean)
    return model.eval()


def build_processor(tok: Any) -> Any:
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return Idefics3Processor(image_processor=Idefics3ImageProcessorPil(**PROCESSOR_CONFIG), tokenizer=tok,
                             chat_template=CHAT_TEMPLATE, image_seq_len=SEQ_LEN)


def make_fixture(out: Path) -> None:
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    hf_dir = out / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    build_model(tok).save_pretrained(hf_dir, safe_serialization=True)
    processor = build_processor(tok)
    processor.save_pretrained(hf_dir)
    processor.image_processor.save_pretrained(hf_dir)  # preprocessor_config.json, as the Hub's SmolVLM folders
    model = Idefics3ForConditionalGeneration.from_pretrained(hf_dir, attn_implementation="eager",
                                                             dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(hf_dir)
    ip = processor.image_processor
    if type(ip).__name__ != "Idefics3ImageProcessorPil" or processor.image_seq_len != SEQ_LEN:
        raise SystemExit(f"unexpected processor {type(ip).__name__} / {processor.image_seq_len}")

    refs: dict[str, np.ndarray] = {}
    for path in sorted(IMAGES.iterdir()):
        if path.suffix == ".npz":
            continue
        enc = ip(images=[[Image.open(path)]], return_tensors="np", return_row_col_info=True)
        refs[path.name] = enc["pixel_values"][0]
        refs[path.name + ".grid"] = np.array([enc["rows"][0][0], enc["cols"][0][0]])
    (out / "images").mkdir(exist_ok=True)
    np.savez_compressed(out / "images" / "pixels_ref.npz", **refs)

    for k, prompt in enumerate(PROMPTS):
        text = processor.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
        images = [Image.open(IMAGES / name) for name in prompt["images"]]
        kwargs = {} if "do_image_splitting" not in prompt else {"do_image_splitting": prompt["do_image_splitting"]}
        enc = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False, **kwargs)
        ids, pixels, mask = enc["input_ids"], enc["pixel_values"], enc["pixel_attention_mask"]
        if not bool(mask.all()):
            raise SystemExit(f"prompt {k}: padded tiles")
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=pixels, pixel_attention_mask=mask).logits[0]
            features = torch.cat(list(model.model.get_image_features(pixels, mask).pooler_output))
        np.save(out / f"input_ids_{k}.npy", ids[0].numpy().astype(np.int64))
        np.save(out / f"pixel_values_{k}.npy", pixels[0].numpy().astype(np.float32))
        np.save(out / f"image_features_{k}.npy", features.numpy().astype(np.float32))
        np.save(out / f"logits_{k}.npy", logits.numpy().astype(np.float32))
        (out / f"prompt_{k}.json").write_text(json.dumps({**prompt, "chat_text": text, "n_tokens": int(ids.shape[1]),
                                                          "decoded": tok.decode(ids[0])}, indent=1) + "\n")
    import transformers

    (out / "meta.json").write_text(json.dumps({"seed": SEED, "transformers": transformers.__version__,
                                               "torch": torch.__version__}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "smolvlm")
    make_fixture(ap.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
