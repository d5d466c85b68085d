"""Gemma 3 with images from GGUF files: the text model and the ``mmproj`` file that llama.cpp's own
``convert_hf_to_gguf.py`` made from the vision fixture (``tests/fixtures/gemma3_vision/gguf``, by
``scripts/make_vision_gguf.py``), against transformers' references for the HF folder.

Two facts of llama.cpp's files shape the checks:

- ``mm.input_projection.weight`` is F16 in the mmproj file even with ``--outtype f32`` (the converter forces it), so
  the file's image tokens differ from transformers' by the projection's rounding (~5e-4 here): they are held to 1e-5
  of transformers' tower output projected with the file's own weights, and, with the projection put back in F32
  (the same file rewritten), to 1e-5 of transformers' image tokens and 1e-4 of its logits;
- the text GGUF has no sliding-window pattern key: llama.cpp and minfer make every 6th layer global, which is why the
  fixture has Gemma 3's own pattern (5 sliding layers, then a full one).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import rewrite_gguf

import minfer
from minfer.errors import MinferError
from minfer.formats.gguf_file import GGUFFile
from minfer.models.mmproj import image_config_from_mmproj, vision_from_mmproj
from minfer.models.model import TransformerModel
from minfer.runtime.vision import PassImage, VisionRunner

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_vision"
TEXT, MMPROJ = FIXTURE / "gguf" / "model-f32.gguf", FIXTURE / "gguf" / "mmproj-f32.gguf"


def tokens_of(path: Path):
    tokens = GGUFFile(path).metadata["tokenizer.ggml.tokens"]
    index = {t: i for i, t in enumerate(tokens)}
    return index.get


def load(mmproj: Path = MMPROJ) -> minfer.Model:
    m = minfer.load(TEXT, n_ctx=256, mmproj=mmproj)
    assert m.transformer.hparams.swa_layers == (True,) * 5 + (False,)  # llama.cpp's rule, and the fixture's layers
    return m


def rewrite(dst: Path, src: Path = MMPROJ, **kw) -> Path:
    return rewrite_gguf(src, dst, **kw)


def hf_vision():
    return TransformerModel.from_path(FIXTURE / "hf").vision


def values(t) -> np.ndarray:
    return t.data.view(np.float32).reshape(t.shape)


def image_starts(ids: np.ndarray, image_token: int) -> list[int]:
    is_image = ids == image_token
    return [i for i in range(len(ids)) if is_image[i] and (i == 0 or not is_image[i - 1])]


def test_the_mmproj_tensors_are_the_hf_folders():
    """A direct layout check: every tensor, converted to the engine's conventions, equals the HF folder's; the
    projection only up to its F16 rounding, which the converter forces."""
    got, ref = vision_from_mmproj(MMPROJ, 32, tokens_of(TEXT)), hf_vision()
    assert got.hparams == dataclasses.replace(ref.hparams, eps=got.hparams.eps)
    assert got.hparams.eps == np.float32(1e-6)  # the file stores eps as float32
    assert set(got.tensors) == set(ref.tensors)
    for name, t in ref.tensors.items():
        expected = values(t)
        if name == "mm.input_projection.weight":
            assert GGUFFile(MMPROJ).tensors[name].ggml_type.name == "F16"
            expected = expected.astype(np.float16).astype(np.float32)
        assert np.array_equal(values(got.tensors[name]), expected), name


def _reference_tokens(k: int, vision) -> np.ndarray:
    """transformers' tower output (after post_layernorm), pooled, normalized and projected in float64 with the
    file's own projector weights."""
    hp = vision.hparams
    x = np.load(FIXTURE / f"vision_last_hidden_{k}.npy").astype(np.float64)  # [n, 64, 32]
    n, side, k2 = x.shape[0], hp.patches_per_side, hp.pool
    x = x.reshape(n, side // k2, k2, side // k2, k2, -1).mean(axis=(2, 4)).reshape(n, hp.tokens_per_image, -1)
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + hp.eps) * values(vision.tensors["mm.soft_emb_norm.weight"])
    return x @ values(vision.tensors["mm.input_projection.weight"]).T.astype(np.float64)


@pytest.mark.parametrize("k", [0, 1])
def test_gguf_text_and_mmproj_match_transformers(k, tmp_path):
    ids = np.load(FIXTURE / f"input_ids_{k}.npy")
    pixels = np.load(FIXTURE / f"pixel_values_{k}.npy")
    features_ref, logits_ref = (np.load(FIXTURE / f"{n}_{k}.npy") for n in ("image_features", "logits"))

    # the file as llama.cpp wrote it (F16 projection)
    m = load()
    vision = m.transformer.vision
    features = VisionRunner(vision, m.backend).encode(list(pixels))
    assert features.shape == features_ref.shape
    assert float(np.abs(features - _reference_tokens(k, vision)).max()) <= 1e-5
    assert 1e-5 < float(np.abs(features - features_ref).max()) <= 2e-3  # the projection's F16 rounding
    starts = image_starts(ids, vision.hparams.image_token_id)
    assert len(starts) == len(pixels)
    logits = m.runner.forward(ids, np.arange(len(ids)), images=[PassImage(s, f) for s, f in zip(starts, features,
                                                                                                strict=True)])
    assert float(np.abs(logits - logits_ref).max()) <= 1e-2

    # the same file with the projection in F32: transformers' numbers
    proj = values(hf_vision().tensors["mm.input_projection.weight"]).T  # back to the file's [vision, text]
    m = load(rewrite(tmp_path / "mmproj-proj-f32.gguf", tensors={"mm.input_projection.weight": proj}))
    features = VisionRunner(m.transformer.vision, m.backend).encode(list(pixels))
    assert float(np.abs(features - features_ref).max()) <= 1e-5
    logits = m.runner.forward(ids, np.arange(len(ids)), images=[PassImage(s, f) for s, f in zip(starts, features,
                                                                                                strict=True)])
    assert float(np.abs(logits - logits_ref).max()) <= 1e-4


def test_the_image_settings_come_from_the_file():
    cfg = image_config_from_mmproj(MMPROJ)
    assert (cfg.height, cfg.width, cfg.resample) == (32, 32, 2)
    assert cfg.image_mean == cfg.image_std == (0.5, 0.5, 0.5)
    assert cfg.rescale_factor == pytest.approx(1 / 255) and cfg.do_normalize and cfg.do_convert_rgb


def _bad(tmp_path: Path, **kw) -> Path:
    return rewrite(tmp_path / "bad.gguf", **kw)


@pytest.mark.parametrize("make, message", [
    (lambda p: _bad(p, kv={"clip.projector_type": "llava"}), "clip.projector_type is 'llava'; supported: gemma3"),
    (lambda p: _bad(p, drop=("v.blk.1.attn_q.weight",)), "'v.blk.1.attn_q.weight'"),
    (lambda p: _bad(p, tensors={"mm.input_projection.weight": np.zeros((32, 48), np.float32)}),
     "mm.input_projection.weight' has 48 outputs but the text model's embedding width is 32"),
    (lambda p: _bad(p, drop=("clip.vision.block_count",)), "'clip.vision.block_count'"),
    (lambda p: _bad(p, drop=("clip.projector_type",)), "missing metadata key 'clip.projector_type'"),
    (lambda p: TEXT, "general.architecture is 'gemma3', not 'clip': not an mmproj file"),
    (lambda p: FIXTURE / "hf" / "config.json", "not a GGUF file"),
])
def test_a_bad_mmproj_file_is_one_line_naming_the_key_or_tensor(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(MinferError) as err:
        vision_from_mmproj(path, 32, tokens_of(TEXT))
    text = str(err.value)
    assert message in text and str(path) in text and "\n" not in text


def test_a_text_model_without_the_image_tokens_is_refused():
    with pytest.raises(MinferError, match="no '<image_soft_token>' token") as err:
        vision_from_mmproj(MMPROJ, 32, lambda text: None)
    assert "\n" not in str(err.value)
