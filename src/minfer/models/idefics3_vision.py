"""Idefics3's vision side (SmolVLM): the SigLIP vision tower (:func:`~minfer.models.gemma3_vision.siglip_tower`, the
same recipe as Gemma 3's) and the connector, as one compute graph per batch of tiles, and the rules that place its
output in the text model's prompt.

    x = siglip_tower(tile)                                       ([n_patches, n_embd] per tile; a whole tile's
                                                                  position ids are 0 .. n_patches - 1)
    s = pixel_shuffle(x, scale_factor)                           ([n_patches / f^2, n_embd * f^2])
    image tokens = s · W_proj^T                                  (modality_projection: one Linear, no bias)

The pixel shuffle concatenates, for each image token, the tower's rows of an f x f window of patches in (ky, kx)
order (``Idefics3Connector.pixel_shuffle``); the projection of that concatenation is the sum of f^2 products of
those rows with the matching column blocks of W_proj, so the graph selects the rows (the ``pool.<i>`` inputs, the
same windows as Gemma 3's pooling) and sums ``get_rows(x, pool.i) · W_i^T``, ``W_i`` being block ``i`` of W_proj
(``mm.proj.<i>.weight``, cut at load): equal up to the order of the float sums.

In the text model an image split into ``rows`` x ``cols`` tiles is, as Idefics3Processor writes it, for each tile
``<fake_token_around_image><row_r_col_c>`` and ``image_seq_len`` ``<image>`` placeholders, a ``"\\n"`` after each
row, then ``"\\n<fake_token_around_image><global-img>"``, the whole image's placeholders and
``<fake_token_around_image>``; an unsplit image is the last part alone (without the ``"\\n"``). Every row, image rows
included, attends causally (``bidirectional`` is False).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import FormatError, ModelError
from minfer.formats.images import Idefics3ProcessorConfig
from minfer.formats.tensors import WeightTensor
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import Graph
from minfer.models.gemma3_vision import (
    TowerHParams,
    _f32,
    check_tensors,
    f32_tensor,
    siglip_tower,
    tower_engine_name,
)

# the HF module paths: transformers' module tree (model.vision_model.*, model.connector.*) and older folders' (no
# "model." prefix)
_TOWER = re.compile(r"(?:model\.)?vision_model\.(.+)")
_CONNECTOR = re.compile(r"(?:model\.)?connector\.(.+)")
_PROJ = "modality_projection.proj.weight"

FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TAG = "<global-img>"


def is_vision_tensor(hf_name: str) -> bool:
    """Whether an HF tensor belongs to the vision tower or the connector (not to the text model)."""
    return _TOWER.fullmatch(hf_name) is not None or _CONNECTOR.fullmatch(hf_name) is not None


@dataclass(frozen=True)
class Idefics3HParams(TowerHParams):  # (image_size: a tile's side)
    scale_factor: int  # the pixel shuffle's window side, in patches
    text_n_embd: int
    image_token_id: int  # the placeholder token whose rows take a tile's tokens

    @property
    def tokens_per_side(self) -> int:
        return self.patches_per_side // self.scale_factor

    @property
    def tokens_per_image(self) -> int:
        """A tile's tokens (the processor's ``image_seq_len``)."""
        return self.tokens_per_side ** 2

    @property
    def pool(self) -> int:
        return self.scale_factor


class Idefics3VisionModel:
    """The vision tower and connector's tensors (engine names) and hyperparameters; its graph per tile count."""

    bidirectional = False  # the text model attends causally over image rows too

    def __init__(self, hparams: Idefics3HParams, tensors: dict[str, WeightTensor], where: Path,
                 processor: Idefics3ProcessorConfig | None = None) -> None:
        self.hparams = hparams
        self.tensors = tensors
        self.path = where
        hp = hparams
        check_geometry(hp, where)
        proj = {f"mm.proj.{i}.weight": (hp.text_n_embd, hp.n_embd) for i in range(hp.scale_factor ** 2)}
        check_tensors(hp, tensors, proj, where)
        self.processor = processor or Idefics3ProcessorConfig(tile=hp.image_size)
        if self.processor.tile != hp.image_size:
            raise ModelError(f"{where}: the image processor cuts {self.processor.tile}x{self.processor.tile} tiles "
                             f"(max_image_size.longest_edge) but the vision tower takes {hp.image_size}x"
                             f"{hp.image_size} images")

    def tensor(self, name: str) -> WeightTensor:
        return self.tensors[name]

    def build_graph(self, n_images: int) -> Graph:
        return build_idefics3_graph(self, n_images)

    def pool_rows(self, n_images: int) -> list[np.ndarray]:
        """The ``pool.<i>`` inputs: for each member ``i = ky * f + kx`` of a pixel-shuffle window, the row of the
        tower's output that member is, for every token of ``n_images`` tiles in order."""
        hp = self.hparams
        side, k, n = hp.tokens_per_side, hp.scale_factor, hp.patches_per_side
        ty, tx = np.divmod(np.arange(side * side), side)
        base = (np.arange(n_images)[:, None] * hp.n_patches).astype(np.int64)
        return [(base + (ty * k + ky) * n + tx * k + kx).reshape(-1).astype(np.int32)
                for ky in range(k) for kx in range(k)]

    def image_text(self, token_text: Callable[[int], str], rows: int = 0, cols: int = 0) -> str:
        """What an image's media marker becomes in the prompt text (Idefics3Processor's ``replace_image_token``)
        for an image cut into ``rows`` x ``cols`` tiles (0 x 0: unsplit); ``token_text`` gives a token id's text."""
        tile = token_text(self.hparams.image_token_id) * self.hparams.tokens_per_image
        whole = FAKE_TOKEN + GLOBAL_TAG + tile + FAKE_TOKEN
        if rows == 0 and cols == 0:
            return whole
        grid = "".join("".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return grid + "\n" + whole


def build_idefics3_graph(model: Idefics3VisionModel, n_images: int) -> Graph:
    """``n_images`` tiles' tokens ``[n_images * tokens_per_image, text n_embd]`` from the inputs ``patches``,
    ``patch_positions``, ``spans`` (:func:`~minfer.models.gemma3_vision.siglip_tower`) and ``pool.<i>``."""
    hp = model.hparams
    b = GraphBuilder()
    x = siglip_tower(b, model, n_images)
    out = None
    for i in range(hp.scale_factor ** 2):
        rows = b.get_rows(x, b.input(f"pool.{i}", n_images * hp.tokens_per_image), name=f"mm.shuffle.{i}")
        y = b.matmul(rows, b.weight(model.tensor(f"mm.proj.{i}.weight")), name=f"mm.proj.{i}", whole_sequences=True)
        out = y if out is None else b.add(out, y, name=f"mm.proj.sum{i}")
    assert out is not None
    return b.build(out)


def check_geometry(hp: Idefics3HParams, where: Path) -> None:
    """One-line errors for tile, patch and token counts the graph cannot compute."""
    if hp.image_size % hp.patch_size:
        raise ModelError(f"{where}: image_size {hp.image_size} is not a multiple of patch_size {hp.patch_size}")
    if hp.patches_per_side % hp.scale_factor:
        raise ModelError(f"{where}: scale_factor {hp.scale_factor} does not divide the {hp.patches_per_side} "
                         "patches per side")
    if hp.n_embd % hp.n_head:
        raise ModelError(f"{where}: vision hidden_size {hp.n_embd} is not a multiple of its {hp.n_head} heads")


# -- HF folders ---------------------------------------------------------------------------------------------


def vision_from_hf(cfg: Mapping[str, Any], text_n_embd: int, tensors: Mapping[str, tuple[WeightTensor, Path]],
                   where: Path) -> Idefics3VisionModel:
    """The vision model of an ``Idefics3ForConditionalGeneration`` folder (SmolVLM): ``cfg`` its config.json
    (``where``), ``tensors`` its vision tower's and connector's tensors by HF name (with the file each is in); the
    folder's image processor (``preprocessor_config.json``) where it has one."""
    vc = cfg.get("vision_config")
    if not isinstance(vc, dict):
        raise FormatError(f"{where}: field 'vision_config' must be an object")

    def field(name: str, kind: Any, default: Any = None, src: Mapping[str, Any] = vc,
              prefix: str = "vision_config.") -> Any:
        v = src.get(name, default)
        if v is None or isinstance(v, bool) or not isinstance(v, kind) or v <= 0:
            raise FormatError(f"{where}: field '{prefix}{name}' must be a positive number, got {v!r}")
        return v

    hidden_act = vc.get("hidden_act", "gelu_pytorch_tanh")
    if hidden_act not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ModelError(f"{where}: field 'vision_config.hidden_act' is {hidden_act!r}; the vision tower computes "
                         "tanh-approximated GELU (gelu_pytorch_tanh) only")
    if vc.get("num_channels", 3) != 3:
        raise ModelError(f"{where}: field 'vision_config.num_channels' is {vc.get('num_channels')!r}; images are RGB")
    hp = Idefics3HParams(
        image_size=field("image_size", int, 224), patch_size=field("patch_size", int, 32),
        n_embd=field("hidden_size", int, 1152), n_layer=field("num_hidden_layers", int, 12),
        n_head=field("num_attention_heads", int, 16), n_ff=field("intermediate_size", int, 3072),
        eps=float(field("layer_norm_eps", (int, float), 1e-6)),
        scale_factor=field("scale_factor", int, 2, cfg, ""), text_n_embd=text_n_embd,
        image_token_id=field("image_token_id", int, 128257, cfg, ""),
    )
    check_geometry(hp, where)
    out: dict[str, WeightTensor] = {}
    for hf_name, (t, file) in tensors.items():
        m = _TOWER.fullmatch(hf_name)
        name = tower_engine_name(m.group(1)) if m is not None else None
        c = _CONNECTOR.fullmatch(hf_name)
        if name is None and (c is None or c.group(1) != _PROJ):
            raise ModelError(f"{file}: tensor {hf_name!r} has no place in Idefics3's vision tower or connector")
        arr = _f32(t, hf_name, file)
        if name is None:  # the connector's projection [text, n_embd * f^2]: its f^2 column blocks
            f2 = hp.scale_factor ** 2
            if arr.shape != (text_n_embd, hp.n_embd * f2):
                raise ModelError(f"{file}: tensor {hf_name!r} has shape {arr.shape}, expected ({text_n_embd}, "
                                 f"{hp.n_embd * f2}): the text model's width by the vision width x scale_factor^2")
            for i in range(f2):
                out[f"mm.proj.{i}.weight"] = f32_tensor(f"mm.proj.{i}.weight",
                                                        arr[:, i * hp.n_embd:(i + 1) * hp.n_embd])
            continue
        if name == "v.patch_embd.weight":
            if arr.ndim != 4 or arr.shape[1:] != (3, hp.patch_size, hp.patch_size):
                raise ModelError(f"{file}: tensor {hf_name!r} has shape {arr.shape}, expected "
                                 f"({hp.n_embd}, 3, {hp.patch_size}, {hp.patch_size})")
            arr = arr.reshape(arr.shape[0], -1)
        out[name] = f32_tensor(name, arr)
    folder = where.parent
    has_processor = (folder / "preprocessor_config.json").is_file() or (folder / "processor_config.json").is_file()
    return Idefics3VisionModel(hp, out, where, Idefics3ProcessorConfig.from_hf_folder(folder) if has_processor
                               else None)
