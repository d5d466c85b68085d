"""Gemma 3's and SmolVLM's (Idefics3's) vision tower and projector from an ``mmproj`` GGUF file, as llama.cpp's
``convert_hf_to_gguf.py --mmproj`` writes it (``Gemma3VisionModel``, ``SmolVLMModel``) and ``tools/mtmd/clip.cpp``
reads it.

Metadata (``general.architecture`` "clip"):

    clip.projector_type                     "gemma3" or "idefics3" (``clip.vision.projector_type`` in files with
                                            several encoders)
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

Idefics3 (SmolVLM; ``SmolVLMModel`` writes it, clip.cpp's siglip graph with ``build_patch_merge_permute`` reads it):
the same tower keys and ``v.*`` tensors, and

    clip.vision.projector.scale_factor      the pixel shuffle's window side (required here: the converter always
                                            writes it, the HF config's ``scale_factor``, default 2)
    clip.vision.preproc_image_size          the image processor's ``size.longest_edge`` (optional)
    clip.vision.projection_dim              the text model's embedding width (optional)

- ``mm.model.fc.weight``: HF's ``connector.modality_projection.proj.weight`` as it is, ``[text n_embd, n_embd *
  f^2]`` (numpy order), F32 in an ``--outtype f32`` file; cut into its ``f^2`` column blocks ``mm.proj.<i>.weight``
  (:mod:`minfer.models.idefics3_vision`);
- ``v.patch_embd.weight``: ``[n_embd, 3, p, p]``, F32 even in an f16 file (``tensor_force_quant``: ``.embeddings.``);
  flattened as Gemma 3's.

The image processor is HF's ``Idefics3ImageProcessor`` as :class:`~minfer.formats.images.Idefics3ProcessorConfig`
implements it, with the file's values where it has them: tile (``max_image_size.longest_edge``) =
``clip.vision.image_size``, ``size.longest_edge`` = ``clip.vision.preproc_image_size``, ``image_mean`` /
``image_std``; transformers' defaults otherwise: ``size.longest_edge`` 4 tiles (its 4 x 364), LANCZOS, image
splitting on, rescale by 1/255, mean = std = 0.5, RGB conversion. (clip.cpp resizes with its own LANCZOS and always
cuts tiles, also for an image that fits one tile, where HF's processor does not.) The ``<image>``,
``<fake_token_around_image>``, ``<global-img>`` and ``<row_r_col_c>`` tokens are looked up in the text model's
vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import FormatError, ModelError
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.images import Idefics3ProcessorConfig, ImageProcessorConfig
from minfer.formats.tensors import WeightTensor
from minfer.models.gemma3_vision import VisionHParams, VisionModel, _f32, check_geometry, f32_tensor
from minfer.models.idefics3_vision import FAKE_TOKEN, GLOBAL_TAG, Idefics3HParams, Idefics3VisionModel

SUPPORTED_PROJECTORS = ("gemma3", "idefics3")
DEFAULT_SCALE_FACTOR = 4  # clip.cpp's n_merge for gemma3 when the file has no clip.vision.projector.scale_factor
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = "<image_soft_token>", "<start_of_image>", "<end_of_image>"
IDEFICS3_IMAGE_TOKEN = "<image>"
IDEFICS3_FC = "mm.model.fc.weight"


def projector_type(f: GGUFFile) -> str:
    """The file's projector type (``clip.projector_type``, or ``clip.vision.projector_type`` in a file with several
    encoders, which names each one's projector)."""
    key = "clip.projector_type"
    if key not in f.metadata and "clip.vision.projector_type" in f.metadata:
        key = "clip.vision.projector_type"
    return f.require(key, str)


def open_mmproj(path: str | os.PathLike[str]) -> GGUFFile:
    """The mmproj file, checked to be a CLIP file with a vision encoder and a supported projector."""
    f = GGUFFile(path)
    arch = f.get("general.architecture")
    if arch != "clip":
        raise FormatError(f"{f.path}: general.architecture is {arch!r}, not 'clip': not an mmproj file")
    kind = projector_type(f)
    if kind not in SUPPORTED_PROJECTORS:
        key = "clip.projector_type" if "clip.projector_type" in f.metadata else "clip.vision.projector_type"
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
    """The image preprocessing of a Gemma 3 mmproj file: a square resize to ``clip.vision.image_size`` (bilinear, as
    llama.cpp resizes Gemma 3's images), ``clip.vision.image_mean`` / ``image_std`` (0.5 where absent), the rest
    Gemma3ImageProcessor's defaults (rescale by 1/255, RGB conversion)."""
    f = path if isinstance(path, GGUFFile) else open_mmproj(path)
    if projector_type(f) == "idefics3":
        raise ModelError(f"{f.path}: an idefics3 mmproj file; its images are cut into tiles "
                         "(idefics3_config_from_mmproj)")
    return ImageProcessorConfig.square(_positive(f, "clip.vision.image_size"),
                                       _triple(f, "clip.vision.image_mean", positive=False),
                                       _triple(f, "clip.vision.image_std", positive=True))


def idefics3_config_from_mmproj(path: str | os.PathLike[str] | GGUFFile) -> Idefics3ProcessorConfig:
    """The image processor of an idefics3 mmproj file (see the module's docstring for where each value comes from)."""
    f = path if isinstance(path, GGUFFile) else open_mmproj(path)
    tile = _positive(f, "clip.vision.image_size")
    mean = _triple(f, "clip.vision.image_mean", positive=False)
    std = _triple(f, "clip.vision.image_std", positive=True)
    d = Idefics3ProcessorConfig()
    return Idefics3ProcessorConfig(longest_edge=_positive(f, "clip.vision.preproc_image_size", 4 * tile), tile=tile,
                                   image_mean=mean or d.image_mean, image_std=std or d.image_std)


def vision_from_mmproj(path: str | os.PathLike[str], text_n_embd: int,
                       token_id: Callable[[str], int | None]) -> VisionModel | Idefics3VisionModel:
    """The vision model of an mmproj GGUF file for a text model of embedding width ``text_n_embd``.

    ``token_id(text)`` is the text model's vocabulary lookup (e.g. ``tokenizer.backend.token_to_id``), ``None`` for
    a text it lacks: Gemma 3's image placeholder, ``<start_of_image>`` and ``<end_of_image>`` ids are the ids of
    ``<image_soft_token>``, ``<start_of_image>`` and ``<end_of_image>``; Idefics3's placeholder is ``<image>`` (and
    the text model must have ``<fake_token_around_image>``, ``<global-img>`` and the ``<row_r_col_c>`` tags of the
    largest grid). Every bad key or tensor is a one-line ``FormatError`` / ``ModelError`` naming the file and the
    key or tensor."""
    f = open_mmproj(path)
    where = f.path
    kind = projector_type(f)
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
    scale = _positive(f, "clip.vision.projector.scale_factor", DEFAULT_SCALE_FACTOR if kind == "gemma3" else None)
    per_side = image_size // patch_size
    if image_size % patch_size or per_side % scale:
        raise ModelError(f"{where}: clip.vision.projector.scale_factor {scale} does not divide the "
                         f"{image_size} / {patch_size} = {image_size / patch_size:g} patches per side")
    proj_dim = f.get("clip.vision.projection_dim")
    if proj_dim is not None and proj_dim != text_n_embd:
        raise ModelError(f"{where}: clip.vision.projection_dim is {proj_dim!r} but the text model's embedding width "
                         f"is {text_n_embd}")
    n_embd, n_layer = _positive(f, "clip.vision.embedding_length"), _positive(f, "clip.vision.block_count")
    n_ff = _positive(f, "clip.vision.feed_forward_length")
    if kind == "idefics3":
        return _idefics3(f, Idefics3HParams(
            image_size=image_size, patch_size=patch_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_ff=n_ff,
            eps=float(eps), scale_factor=scale, text_n_embd=text_n_embd, image_token_id=-1), token_id)
    ids = {}
    for text in (IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN):
        i = token_id(text)
        if i is None:
            raise ModelError(f"{where}: the text model's vocabulary has no {text!r} token, which Gemma 3's images need")
        ids[text] = int(i)
    hp = VisionHParams(
        image_size=image_size, patch_size=patch_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_ff=n_ff,
        eps=float(eps), tokens_per_image=(per_side // scale) ** 2, text_n_embd=text_n_embd,
        image_token_id=ids[IMAGE_TOKEN], boi_token_id=ids[BOI_TOKEN], eoi_token_id=ids[EOI_TOKEN],
    )
    check_geometry(hp, where)
    return VisionModel(hp, {name: _engine_tensor(hp, name, t, where) for name, t in f.tensors.items()}, where,
                       image_config_from_mmproj(f))


def _idefics3(f: GGUFFile, hp: Idefics3HParams, token_id: Callable[[str], int | None]) -> Idefics3VisionModel:
    where = f.path
    processor = idefics3_config_from_mmproj(f)
    grid = -(-processor.longest_edge // processor.tile)  # the most tiles per side
    tags = [f"<row_{r}_col_{c}>" for r in range(1, grid + 1) for c in range(1, grid + 1)]
    image_id = None
    for text in (IDEFICS3_IMAGE_TOKEN, FAKE_TOKEN, GLOBAL_TAG, *tags):
        i = token_id(text)
        if i is None:
            raise ModelError(f"{where}: the text model's vocabulary has no {text!r} token, which SmolVLM's images "
                             "need")
        image_id = int(i) if image_id is None else image_id
    assert image_id is not None
    hp = dataclasses.replace(hp, image_token_id=image_id)
    tensors: dict[str, WeightTensor] = {}
    for name, t in f.tensors.items():
        if name != IDEFICS3_FC:
            tensors[name] = _engine_tensor(hp, name, t, where)
            continue
        arr = _f32(t, name, where)
        f2 = hp.scale_factor ** 2
        if arr.shape != (hp.text_n_embd, hp.n_embd * f2):
            raise ModelError(f"{where}: tensor {name!r} has shape {arr.shape}, expected ({hp.text_n_embd}, "
                             f"{hp.n_embd * f2}): the text model's embedding width by the vision width x "
                             "scale_factor^2")
        for i in range(f2):  # the pixel shuffle's f^2 column blocks (idefics3_vision's mm.proj.<i>)
            tensors[f"mm.proj.{i}.weight"] = f32_tensor(f"mm.proj.{i}.weight",
                                                        arr[:, i * hp.n_embd:(i + 1) * hp.n_embd])
    if IDEFICS3_FC not in f.tensors:
        raise FormatError(f"{where}: the vision model has no tensor {IDEFICS3_FC!r} (the connector's projection)")
    return Idefics3VisionModel(hp, tensors, where, processor)


def _engine_tensor(hp: VisionHParams | Idefics3HParams, name: str, t: WeightTensor, where: Path) -> WeightTensor:
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
