"""SmolVLM (Idefics3) with images from GGUF files: the text model and the ``mmproj`` file that llama.cpp's own
``convert_hf_to_gguf.py`` made from the SmolVLM fixture (``tests/fixtures/smolvlm/gguf``, by
``scripts/make_smolvlm_gguf.py``), against transformers' references for the HF folder.

Both files are all F32 (the converter forces no idefics3 tensor to F16), so the GGUF pair is held to the HF folder's
tolerances: 1e-5 for the connector's output, 1e-4 for the logits at every position.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import rewrite_gguf

import minfer
from minfer.errors import MinferError
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.images import Idefics3ProcessorConfig
from minfer.models.idefics3_vision import Idefics3VisionModel
from minfer.models.mmproj import idefics3_config_from_mmproj, image_config_from_mmproj, vision_from_mmproj
from minfer.models.model import TransformerModel
from minfer.runtime.vision import PassImage, VisionRunner, extract_images

FIXTURE = Path(__file__).parent / "fixtures" / "smolvlm"
IMAGES = Path(__file__).parent / "fixtures" / "gemma3_vision" / "images"
TEXT, MMPROJ = FIXTURE / "gguf" / "model-f32.gguf", FIXTURE / "gguf" / "mmproj-f32.gguf"
TOL = 1e-4


def tokens_of(path: Path):
    tokens = GGUFFile(path).metadata["tokenizer.ggml.tokens"]
    index = {t: i for i, t in enumerate(tokens)}
    return index.get


def case(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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


def values(t) -> np.ndarray:
    return t.data.view(np.float32).reshape(t.shape)


def rewrite(dst: Path, src: Path = MMPROJ, **kw) -> Path:
    return rewrite_gguf(src, dst, **kw)


@pytest.fixture(scope="module")
def vlm():
    return minfer.load(TEXT, n_ctx=256, mmproj=MMPROJ)


def test_the_mmproj_tensors_are_the_hf_folders():
    """Every tensor, in the engine's conventions (the connector cut into its scale_factor^2 column blocks), equals
    the HF folder's bit for bit: the file is all F32."""
    got = vision_from_mmproj(MMPROJ, 64, tokens_of(TEXT))
    ref = TransformerModel.from_path(FIXTURE / "hf").vision
    assert isinstance(got, Idefics3VisionModel)
    assert got.hparams == dataclasses.replace(ref.hparams, eps=got.hparams.eps)
    assert got.hparams.eps == np.float32(1e-6)  # the file stores eps as float32
    assert {t.ggml_type.name for t in GGUFFile(MMPROJ).tensors.values()} == {"F32"}
    assert set(got.tensors) == set(ref.tensors)
    for name, t in ref.tensors.items():
        assert np.array_equal(values(got.tensors[name]), values(t)), name


def test_the_image_settings_come_from_the_file():
    """tile = clip.vision.image_size, longest_edge = clip.vision.preproc_image_size, mean / std: the HF folder's
    processor; the rest are transformers' defaults, which the fixture's processor also has."""
    assert idefics3_config_from_mmproj(MMPROJ) == Idefics3ProcessorConfig.from_hf_folder(FIXTURE / "hf")
    with pytest.raises(MinferError, match="idefics3"):
        image_config_from_mmproj(MMPROJ)


def test_without_preproc_image_size_the_longest_edge_is_four_tiles(tmp_path):
    cfg = idefics3_config_from_mmproj(rewrite(tmp_path / "m.gguf", drop=("clip.vision.preproc_image_size",)))
    assert (cfg.tile, cfg.longest_edge, cfg.resample, cfg.do_image_splitting) == (32, 128, 1, True)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_gguf_text_and_mmproj_match_transformers(vlm, k):
    vision = vlm.transformer.vision
    ids, pixels, features_ref, logits_ref = case(k)
    features = VisionRunner(vision, vlm.backend).encode(list(pixels))
    assert float(np.abs(features.reshape(features_ref.shape) - features_ref).max()) <= 1e-5
    starts = runs(ids, vision.hparams.image_token_id)
    assert len(starts) == len(pixels)
    logits = vlm.runner.forward(ids, np.arange(len(ids)), images=[PassImage(s, f) for s, f in zip(starts, features,
                                                                                                  strict=True)])
    assert logits.shape == logits_ref.shape
    assert float(np.abs(logits - logits_ref).max()) <= TOL


@pytest.mark.parametrize("k", [0, 1, 2])
def test_chat_prompt_ids_equal_the_processors(vlm, k):
    """The GGUF's chat template and vocabulary give the processor's ids, image tags included."""
    if k == 2:
        vlm.images.processor = dataclasses.replace(vlm.images.processor, do_image_splitting=False)
    try:
        messages, images = extract_images(messages_of(k), allow_paths=True)
        ids, placed = vlm.image_prompt(vlm.render_chat(messages), images)
    finally:
        vlm.images.processor = vlm.transformer.vision.processor
    ref = np.load(FIXTURE / f"input_ids_{k}.npy")
    image_token = vlm.transformer.vision.hparams.image_token_id
    assert [p.first for p in placed] == runs(ref, image_token)
    got = np.concatenate([p.vectors for p in placed])
    assert float(np.abs(got - case(k)[2]).max()) <= 1e-5
    for p in placed:
        ids[p.first:p.end] = [image_token] * (p.end - p.first)
    assert ids == ref.tolist()


def test_greedy_chat_starts_with_the_argmax_of_transformers_logits(vlm):
    vlm.chat(messages_of(0), max_tokens=2, temperature=0)
    assert vlm.last_stats.tokens[0] == int(np.argmax(case(0)[3][-1]))


def _bad(tmp_path: Path, **kw) -> Path:
    return rewrite(tmp_path / "bad.gguf", **kw)


@pytest.mark.parametrize("make, message", [
    (lambda p: _bad(p, kv={"clip.projector_type": "llava"}),
     "clip.projector_type is 'llava'; supported: gemma3, idefics3"),
    (lambda p: _bad(p, drop=("mm.model.fc.weight",)), "no tensor 'mm.model.fc.weight'"),
    (lambda p: _bad(p, drop=("v.blk.1.attn_q.weight",)), "'v.blk.1.attn_q.weight'"),
    (lambda p: _bad(p, tensors={"mm.model.fc.weight": np.zeros((64, 96), np.float32)}),
     "'mm.model.fc.weight' has shape (64, 96), expected (64, 128)"),
    (lambda p: _bad(p, drop=("clip.vision.projector.scale_factor",)),
     "missing metadata key 'clip.vision.projector.scale_factor'"),
    (lambda p: _bad(p, tensors={"mm.input_projection.weight": np.zeros((32, 64), np.float32)}),
     "'mm.input_projection.weight' has no place"),
])
def test_a_bad_mmproj_file_is_one_line_naming_the_key_or_tensor(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(MinferError) as err:
        vision_from_mmproj(path, 64, tokens_of(TEXT))
    text = str(err.value)
    assert message in text and str(path) in text and "\n" not in text


@pytest.mark.parametrize("missing", ["<image>", "<global-img>", "<row_2_col_2>"])
def test_a_text_model_without_the_image_tokens_is_refused(missing):
    lookup = tokens_of(TEXT)
    with pytest.raises(MinferError, match=f"no '{missing}' token") as err:
        vision_from_mmproj(MMPROJ, 64, lambda text: None if text == missing else lookup(text))
    assert "\n" not in str(err.value)
