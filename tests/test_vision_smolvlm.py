"""SmolVLM (Idefics3) with its vision tower (tests/fixtures/smolvlm: transformers' random
Idefics3ForConditionalGeneration, scripts/make_smolvlm_fixture.py): the processor's tiles, the prompt's ids, the
connector's output and the logits at every position of prompts holding split and unsplit images, against
transformers."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import minfer
from minfer.errors import MinferError
from minfer.formats.images import Idefics3ProcessorConfig, load_image, preprocess_idefics3
from minfer.models.model import TransformerModel
from minfer.runtime.vision import PassImage, VisionRunner, extract_images

FIXTURE = Path(__file__).parent / "fixtures" / "smolvlm"
IMAGES = Path(__file__).parent / "fixtures" / "gemma3_vision" / "images"
TOL = 1e-4


def case(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Prompt ``k``'s token ids, pixels (one per tile), transformers' image features and logits."""
    return tuple(np.load(FIXTURE / f"{name}_{k}.npy")  # type: ignore[return-value]
                 for name in ("input_ids", "pixel_values", "image_features", "logits"))


def runs(ids: np.ndarray, image_token: int) -> list[int]:
    is_image = ids == image_token
    return [i for i in range(len(ids)) if is_image[i] and (i == 0 or not is_image[i - 1])]


def messages_of(k: int) -> list[dict]:
    p = json.loads((FIXTURE / f"prompt_{k}.json").read_text())
    names = iter(p["images"])
    return [{"role": m["role"], "content": [part if part["type"] != "image" else
                                            {"type": "image", "path": str(IMAGES / next(names))}
                                            for part in m["content"]]} for m in p["messages"]]


def unsplit(model: minfer.Model) -> None:
    model.images.processor = dataclasses.replace(model.images.processor, do_image_splitting=False)


@pytest.fixture(scope="module")
def vlm():
    return minfer.load(FIXTURE / "hf", n_ctx=256)


def test_the_processor_config_is_read_from_the_folder(vlm):
    cfg = vlm.transformer.vision.processor
    assert (cfg.longest_edge, cfg.tile, cfg.resample, cfg.do_image_splitting) == (64, 32, 1, True)
    assert vlm.transformer.vision.bidirectional is False


@pytest.mark.parametrize("name", sorted(p.name for p in IMAGES.iterdir() if p.suffix != ".npz"))
def test_tiles_equal_the_processors(name):
    refs = np.load(FIXTURE / "images" / "pixels_ref.npz")
    cfg = Idefics3ProcessorConfig.from_hf_folder(FIXTURE / "hf")
    tiles, rows, cols = preprocess_idefics3(load_image((IMAGES / name).read_bytes(), name), cfg)
    assert [rows, cols] == refs[name + ".grid"].tolist()
    got = np.stack(tiles)
    assert got.shape == refs[name].shape
    assert float(np.abs(got - refs[name]).max()) <= 1e-6


@pytest.mark.parametrize("k", [0, 1, 2])
def test_tiles_of_each_prompt_equal_the_processors(k):
    cfg = Idefics3ProcessorConfig.from_hf_folder(FIXTURE / "hf")
    if k == 2:
        cfg = dataclasses.replace(cfg, do_image_splitting=False)
    p = json.loads((FIXTURE / f"prompt_{k}.json").read_text())
    got = [t for name in p["images"] for t in preprocess_idefics3(Image.open(IMAGES / name), cfg)[0]]
    assert float(np.abs(np.stack(got) - case(k)[1]).max()) <= 1e-6


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_features_and_logits_match_transformers(k, threads, kernels):
    model = minfer.load(FIXTURE / "hf", n_ctx=256, threads=threads, kernels=kernels)
    vision = model.transformer.vision
    ids, pixels, features_ref, logits_ref = case(k)
    features = VisionRunner(vision, model.backend).encode(list(pixels))
    n = vision.hparams.tokens_per_image
    assert features.shape == (len(pixels), n, features_ref.shape[1])
    assert float(np.abs(features.reshape(features_ref.shape) - features_ref).max()) <= 1e-5
    starts = runs(ids, vision.hparams.image_token_id)
    assert len(starts) == len(pixels)
    images = [PassImage(s, f) for s, f in zip(starts, features, strict=True)]
    logits = model.runner.forward(ids, np.arange(len(ids)), images=images)
    assert float(np.abs(logits - logits_ref).max()) <= TOL


def test_image_rows_attend_causally():
    """Bidirectional image rows (Gemma 3's) would be far from transformers: the test above can fail."""
    model = minfer.load(FIXTURE / "hf", n_ctx=256)
    ids, pixels, _, logits_ref = case(0)
    features = VisionRunner(model.transformer.vision, model.backend).encode(list(pixels))
    starts = runs(ids, model.transformer.vision.hparams.image_token_id)
    model.transformer.vision.bidirectional = True  # this instance only
    try:
        logits = model.runner.forward(ids, np.arange(len(ids)),
                                      images=[PassImage(s, f) for s, f in zip(starts, features, strict=True)])
    finally:
        model.transformer.vision.bidirectional = False
    assert float(np.abs(logits - logits_ref).max()) > 0.01


@pytest.mark.parametrize("k", [0, 1, 2])
def test_chat_prompt_ids_equal_the_processors(vlm, k):
    if k == 2:
        unsplit(vlm)
    try:
        messages, images = extract_images(messages_of(k), allow_paths=True)
        ids, placed = vlm.image_prompt(vlm.render_chat(messages), images)
    finally:
        vlm.images.processor = vlm.transformer.vision.processor
    ref = np.load(FIXTURE / f"input_ids_{k}.npy")
    image_token = vlm.transformer.vision.hparams.image_token_id
    assert [p.first for p in placed] == runs(ref, image_token)
    _, _, features_ref, _ = case(k)
    got = np.concatenate([p.vectors for p in placed])
    assert float(np.abs(got - features_ref).max()) <= 1e-5
    for p in placed:  # a tile's rows carry its own id
        assert len(set(ids[p.first:p.end])) == 1 and ids[p.first] < 0
        ids[p.first:p.end] = [image_token] * (p.end - p.first)
    assert ids == ref.tolist()


@pytest.mark.parametrize("k", [0, 1])
def test_greedy_chat_starts_with_the_argmax_of_transformers_logits(vlm, k):
    vlm.chat(messages_of(k), max_tokens=4, temperature=0)
    assert vlm.last_stats.tokens[0] == int(np.argmax(case(k)[3][-1]))


def test_another_image_in_the_same_place_is_not_taken_from_the_cache(vlm):
    first = messages_of(0)
    vlm.chat(first, max_tokens=1, temperature=0)
    other = json.loads(json.dumps(first))
    other[0]["content"][1]["path"] = str(IMAGES / "rgb_45x20.png")
    alone = minfer.load(FIXTURE / "hf", n_ctx=256)
    assert vlm.chat(other, max_tokens=4, temperature=0) == alone.chat(other, max_tokens=4, temperature=0)
    assert vlm.last_stats.tokens == alone.last_stats.tokens


def _folder_with(tmp_path: Path, edit, file: str = "config.json") -> Path:
    out = tmp_path / "hf"
    shutil.copytree(FIXTURE / "hf", out)
    cfg = json.loads((out / file).read_text())
    edit(cfg)
    (out / file).write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["vision_config"].update(patch_size=5), "patch_size"),
    (lambda c: c.update(scale_factor=3), "scale_factor 3"),
    (lambda c: c.update(scale_factor="2"), "scale_factor"),
    (lambda c: c["vision_config"].update(hidden_act="relu"), "vision_config.hidden_act"),
    (lambda c: c["vision_config"].update(num_hidden_layers=1), "v.blk.1"),
    (lambda c: c["vision_config"].update(hidden_size=48), "has shape"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "Idefics3ForConditionalGeneration"),
])
def test_a_bad_config_is_one_line_naming_the_field(tmp_path, edit, message):
    with pytest.raises(MinferError) as err:
        TransformerModel.from_path(_folder_with(tmp_path, edit))
    text = str(err.value)
    assert message in text and "\n" not in text


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(max_image_size={"longest_edge": 48}), "tiles"),
    (lambda c: c.update(size={"height": 3}), "'size'"),
    (lambda c: c.update(do_image_splitting="yes"), "do_image_splitting"),
])
def test_a_bad_processor_config_is_one_line_naming_the_field(tmp_path, edit, message):
    with pytest.raises(MinferError) as err:
        TransformerModel.from_path(_folder_with(tmp_path, edit, "preprocessor_config.json"))
    text = str(err.value)
    assert message in text and "\n" not in text
