"""Gemma 3's vision tower and projector from an ``mmproj`` GGUF file, as llama.cpp's ``convert_hf_to_gguf.py --mmproj``
writes it (``Gemma3VisionModel``) and ``tools/mtmd/clip.cpp`` reads it.

Metadata (``general.architecture`` "clip"):

    clip.projector_type                     "gemma3" (the only one read here; ``clip.vision.projector_type`` in
                                            files with several encoders)
    clip.has_vision_encoder                 true
    clip.use_gelu                           true (tanh GELU in the tower's FFN)
    clip.vision.image_size / patch_size / embedding_length / block_count / feed_forward_length /
      attention.head_count                  the tower's sizes
    clip.vision.attention.layer_norm_epsilon  the LayerNorms' and the projector's RMSNorm's eps (default 1e-6)
    clip.vision.projection_dim              the text model's embedding width (optional)
    clip.vision.image_mean / image_std      the normalization of the pixels (optional: 0.5)
    clip.vision.projector.scale_factor      the average pool's kernel, in patches per side (optional: 4, clip.cpp's
                                            default for gemma3; the converter writes it only when it is not 4)

The file has no tokens-per-image: clip.cpp derives it, ``(image_size / patch_size / scale_factor)^2`` (256 for the
published models: 896 / 14 / 4 = 16 per side). The image / ``<start_of_image>`` / ``<end_of_image>`` token ids are
the text model's: they are looked up in its vocabulary by their texts.

Tensors (numpy order, as :class:`~minfer.formats.gguf_file.GGUFFile` gives shapes) and the engine's conventions
(:mod:`minfer.models.gemma3_vision`):

- ``v.patch_embd.weight``: the conv weight ``[n_embd, 3, p, p]``, F32; flattened to ``[n_embd, 3 p^2]``;
- ``mm.input_projection.weight``: HF's ``mm_input_projection_weight`` as it is, ``[vision n_embd, text n_embd]``
  (clip.cpp multiplies by its transpose); F16 even in an ``--outtype f32`` file (the converter forces it);
  transposed to ``[text n_embd, vision n_embd]``;
- ``mm.soft_emb_norm.weight``: already ``1 + w`` (the converter adds the 1); taken as it is;
- the rest (``v.position_embd``, ``v.blk.N.{ln1,ln2,attn_q,attn_k,attn_v,attn_out,ffn_up,ffn_down}``, ``v.post_ln``)
  have the engine's names and shapes already.

Every tensor is widened to float32 (F32, F16 and BF16 are read).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import FormatError, ModelError
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.images import ImageProcessorConfig
from minfer.formats.tensors import WeightTensor
from minfer.models.gemma3_vision import VisionHParams, VisionModel, _f32, check_geometry, f32_tensor

SUPPORTED_PROJECTORS = ("gemma3",)
DEFAULT_SCALE_FACTOR = 4  # clip.cpp's n_merge for gemma3 when the file has no clip.vision.projector.scale_factor
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = "<image_soft_token>", "<start_of_image>", "<end_of_image>"


def open_mmproj(path: str | os.PathLike[str]) -> GGUFFile:
    """The mmproj file, checked to be a CLIP file with a vision encoder and a supported projector."""
    f = GGUFFile(path)
    arch = f.get("general.architecture")
    if arch != "clip":
        raise FormatError(f"{f.path}: general.architecture is {arch!r}, not 'clip': not an mmproj file")
    key = "clip.projector_type"
    if key not in f.metadata and "clip.vision.projector_type" in f.metadata:
        key = "clip.vision.projector_type"  # a file with several encoders names each one's projector
    kind = f.require(key, str)
    if kind not in SUPPORTED_PROJECTORS:
        raise ModelError(f"{f.path}: {key} is {kind!r}; supported: {', '.join(SUPPORTED_PROJECTORS)}")
    if f.get("clip.has_vision_encoder") is not True:
        raise ModelError(f"{f.path}: clip.has_vision_encoder is {f.get('clip.has_vision_encoder')!r}, expected true "
                         "(a file without a vision encoder)")
    return f


def _positive(f: GGUFFile, key: str, default: int | None = None) -> int:
    v = f.get(key, default)
    if v is None:
        raise FormatError(f"{f.path}: missing metadata key {key!r}")
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise FormatError(f"{f.path}: metadata key {key!r} must be a positive integer, got {v!r}")
    return v


def _triple(f: GGUFFile, key: str, positive: bool) -> tuple[float, float, float] | None:
    v = f.get(key)
    if v is None:
        return None
    ok = isinstance(v, list) and len(v) == 3 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and (x > 0 or not positive)
        for x in v)
    if not ok:
        raise FormatError(f"{f.path}: metadata key {key!r} must be 3 finite{' positive' if positive else ''} numbers, "
                          f"got {v!r}")
    return (float(v[0]), float(v[1]), float(v[2]))


def image_config_from_mmproj(path: str | os.PathLike[str] | GGUFFile) -> ImageProcessorConfig:
    """The image preprocessing an mmproj file carries: a square resize to ``clip.vision.image_size`` (bilinear, as
    llama.cpp resizes Gemma 3's images), ``clip.vision.image_mean`` / ``image_std`` (0.5 where absent), the rest
    Gemma3ImageProcessor's defaults (rescale by 1/255, RGB conversion)."""
    f = path if isinstance(path, GGUFFile) else open_mmproj(path)
    return ImageProcessorConfig.square(_positive(f, "clip.vision.image_size"),
                                       _triple(f, "clip.vision.image_mean", positive=False),
                                       _triple(f, "clip.vision.image_std", positive=True))


def vision_from_mmproj(path: str | os.PathLike[str], text_n_embd: int,
                       token_id: Callable[[str], int | None]) -> VisionModel:
    """The vision model of an mmproj GGUF file for a text model of embedding width ``text_n_embd``.

    ``token_id(text)`` is the text model's vocabulary lookup (e.g. ``tokenizer.backend.token_to_id``), ``None`` for
    a text it lacks: the image placeholder, ``<start_of_image>`` and ``<end_of_image>`` ids are the ids of
    ``<image_soft_token>``, ``<start_of_image>`` and ``<end_of_image>``. Every bad key or tensor is a one-line
    ``FormatError`` / ``ModelError`` naming the file and the key or tensor."""
    f = open_mmproj(path)
    where = f.path
    if f.get("clip.use_gelu") is not True or f.get("clip.use_silu") is True:
        raise ModelError(f"{where}: clip.use_gelu is {f.get('clip.use_gelu')!r} (clip.use_silu "
                         f"{f.get('clip.use_silu')!r}); the vision tower computes tanh GELU only (clip.use_gelu true)")
    n_head = _positive(f, "clip.vision.attention.head_count")
    kv = f.get("clip.vision.attention.head_count_kv")
    if kv is not None and kv != n_head:
        raise ModelError(f"{where}: clip.vision.attention.head_count_kv is {kv!r}, expected {n_head} (the tower's "
                         "attention has as many key heads as query heads)")
    eps = f.get("clip.vision.attention.layer_norm_epsilon", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise FormatError(f"{where}: metadata key 'clip.vision.attention.layer_norm_epsilon' must be a number in "
                          f"(0, 1), got {eps!r}")
    image_size = _positive(f, "clip.vision.image_size")
    patch_size = _positive(f, "clip.vision.patch_size")
    scale = _positive(f, "clip.vision.projector.scale_factor", DEFAULT_SCALE_FACTOR)
    per_side = image_size // patch_size
    if image_size % patch_size or per_side % scale:
        raise ModelError(f"{where}: clip.vision.projector.scale_factor {scale} does not divide the "
                         f"{image_size} / {patch_size} = {image_size / patch_size:g} patches per side")
    proj_dim = f.get("clip.vision.projection_dim")
    if proj_dim is not None and proj_dim != text_n_embd:
        raise ModelError(f"{where}: clip.vision.projection_dim is {proj_dim!r} but the text model's embedding width "
                         f"is {text_n_embd}")
    ids = {}
    for text in (IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN):
        i = token_id(text)
        if i is None:
            raise ModelError(f"{where}: the text model's vocabulary has no {text!r} token, which Gemma 3's images need")
        ids[text] = int(i)
    hp = VisionHParams(
        image_size=image_size, patch_size=patch_size, n_embd=_positive(f, "clip.vision.embedding_length"),
        n_layer=_positive(f, "clip.vision.block_count"), n_head=n_head,
        n_ff=_positive(f, "clip.vision.feed_forward_length"), eps=float(eps),
        tokens_per_image=(per_side // scale) ** 2, text_n_embd=text_n_embd, image_token_id=ids[IMAGE_TOKEN],
        boi_token_id=ids[BOI_TOKEN], eoi_token_id=ids[EOI_TOKEN],
    )
    check_geometry(hp, where)
    return VisionModel(hp, {name: _engine_tensor(hp, name, t, where) for name, t in f.tensors.items()}, where,
                       image_config_from_mmproj(f))


def _engine_tensor(hp: VisionHParams, name: str, t: WeightTensor, where: Path) -> WeightTensor:
    arr: Any = _f32(t, name, where)
    if name == "v.patch_embd.weight":
        expected = (hp.n_embd, 3, hp.patch_size, hp.patch_size)
        if arr.shape != expected:
            raise ModelError(f"{where}: tensor {name!r} has shape {arr.shape}, expected {expected} (the patch "
                             "convolution's weight)")
        arr = arr.reshape(hp.n_embd, -1)
    elif name == "mm.input_projection.weight":
        if arr.ndim != 2 or arr.shape[0] != hp.n_embd:
            raise ModelError(f"{where}: tensor {name!r} has shape {arr.shape}, expected ({hp.n_embd}, "
                             f"{hp.text_n_embd}): the vision width by the text model's embedding width")
        if arr.shape[1] != hp.text_n_embd:
            raise ModelError(f"{where}: tensor {name!r} has {arr.shape[1]} outputs but the text model's embedding "
                             f"width is {hp.text_n_embd}")
        arr = np.ascontiguousarray(arr.T)  # stored [in, out] (clip.cpp transposes it); the matmul reads [out, in]
    # mm.soft_emb_norm.weight: the converter stored 1 + w already
    return f32_tensor(name, arr)
