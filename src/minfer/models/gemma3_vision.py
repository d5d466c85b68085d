"""Gemma 3's vision side: the SigLIP vision tower and the multimodal projector, as one compute graph per batch
of images, and the rules that place its output in the text model's prompt.

    x = patches · W_patch^T + b_patch + position_embd            (the stride-p convolution as a matmul of the
                                                                  image's p x p patches, :func:`~minfer.formats.
                                                                  images.patches`)
    per layer:  x = x + W_o · attn(ln1(x)) (+ biases)            (every patch sees every patch of its image)
                x = x + W_down · gelu_tanh(W_up · ln2(x))
    x = post_ln(x)
    t = avg_pool(x, k x k patches)                               (the patch grid pooled to tokens_per_side^2)
    image tokens = rms_norm(t) * (1 + w_norm) · W_proj           ([tokens_per_image, text n_embd] per image)

The pooling is k^2 row selections summed in (ky, kx) order and scaled by 1/k^2 (the ``pool.<i>`` inputs name the
rows), so the graph needs no op of its own for it. Tensor names are llama.cpp's mmproj names (``v.blk.0.attn_q``,
``mm.input_projection``), so an HF folder and an mmproj GGUF file give one model.

In the text model an image is ``<start_of_image>``, ``tokens_per_image`` placeholder tokens whose embeddings are the
image tokens (not scaled by sqrt(n_embd) as text embeddings are), and ``<end_of_image>``; the chat template writes
the ``<start_of_image>`` and the prompt is expanded around it as Gemma3Processor does (``"\\n\\n"`` on each side). The
placeholder tokens attend to each other both ways (the ATTN node's ``key_ends``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import FormatError, ModelError
from minfer.formats.images import ImageProcessorConfig
from minfer.formats.quants import GGMLType
from minfer.formats.tensors import WeightTensor
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import AttnMeta, Graph, Node

# the HF module paths of the vision side, as the hub's folders (vision_tower.vision_model.*), transformers 5's
# save_pretrained (vision_tower.*) and its module tree (model.vision_tower.vision_model.*) name them
_TOWER = re.compile(r"(?:model\.)?vision_tower\.(?:vision_model\.)?(.+)")
_PROJECTOR = re.compile(r"(?:model\.)?multi_modal_projector\.(.+)")
_TOWER_LAYER = re.compile(r"encoder\.layers\.(\d+)\.(.+)")
_TOWER_GLOBAL = {
    "embeddings.patch_embedding.weight": "v.patch_embd.weight",
    "embeddings.patch_embedding.bias": "v.patch_embd.bias",
    "embeddings.position_embedding.weight": "v.position_embd.weight",
    "post_layernorm.weight": "v.post_ln.weight",
    "post_layernorm.bias": "v.post_ln.bias",
}
_TOWER_LAYER_TENSORS = {
    "layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
}
_PROJECTOR_TENSORS = {"mm_input_projection_weight": "mm.input_projection.weight",
                      "mm_soft_emb_norm.weight": "mm.soft_emb_norm.weight"}


def is_vision_tensor(hf_name: str) -> bool:
    """Whether an HF tensor belongs to the vision tower or the projector (not to the text model)."""
    return _TOWER.fullmatch(hf_name) is not None or _PROJECTOR.fullmatch(hf_name) is not None


@dataclass(frozen=True)
class TowerHParams:
    """A SigLIP tower's sizes (the fields every vision model here starts with) and its patch geometry."""

    image_size: int  # the square an image (a tile) is resized to
    patch_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    eps: float  # the tower's LayerNorms (and Gemma 3's projector RMSNorm)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def patch_width(self) -> int:
        return 3 * self.patch_size ** 2


@dataclass(frozen=True)
class VisionHParams(TowerHParams):
    tokens_per_image: int
    text_n_embd: int
    image_token_id: int  # the placeholder token whose rows take an image's tokens
    boi_token_id: int  # <start_of_image>
    eoi_token_id: int  # <end_of_image>

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.tokens_per_image)

    @property
    def pool(self) -> int:
        """The pooling kernel's side, in patches."""
        return self.patches_per_side // self.tokens_per_side


class VisionModel:
    """The vision tower and projector's tensors (engine names) and hyperparameters; its graph per image count."""

    def __init__(self, hparams: VisionHParams, tensors: dict[str, WeightTensor], where: Path,
                 processor: ImageProcessorConfig | None = None) -> None:
        self.hparams = hparams
        self.tensors = tensors
        self.path = where
        _check(hparams, tensors, where)
        # how an image becomes pixels: the checkpoint's image processor, else Gemma3ImageProcessor's defaults
        size = hparams.image_size
        self.processor = processor or ImageProcessorConfig(height=size, width=size)
        if (self.processor.height, self.processor.width) != (size, size):
            raise ModelError(f"{where}: the image processor resizes to {self.processor.height}x{self.processor.width} "
                             f"but the vision tower takes {size}x{size} images")

    # an image's tokens attend to each other both ways in the text model
    bidirectional = True

    def tensor(self, name: str) -> WeightTensor:
        return self.tensors[name]

    def build_graph(self, n_images: int) -> Graph:
        return build_vision_graph(self, n_images)

    def image_text(self, token_text: Callable[[int], str], rows: int = 0, cols: int = 0) -> str:
        """What an image's media marker becomes in the prompt text (Gemma3Processor's ``full_image_sequence``;
        ``token_text`` gives a token id's text; Gemma 3 does not split images: ``rows`` and ``cols`` are 0)."""
        hp = self.hparams
        return ("\n\n" + token_text(hp.boi_token_id) + token_text(hp.image_token_id) * hp.tokens_per_image
                + token_text(hp.eoi_token_id) + "\n\n")

    def pool_rows(self, n_images: int) -> list[np.ndarray]:
        """The ``pool.<i>`` inputs: for each of the k^2 members of a pooling window (in (ky, kx) order), the row of
        the tower's output that member is, for every image token of ``n_images`` images in order."""
        hp = self.hparams
        side, k, n = hp.tokens_per_side, hp.pool, hp.patches_per_side
        ty, tx = np.divmod(np.arange(side * side), side)
        base = (np.arange(n_images)[:, None] * hp.n_patches).astype(np.int64)
        return [(base + (ty * k + ky) * n + tx * k + kx).reshape(-1).astype(np.int32)
                for ky in range(k) for kx in range(k)]


def build_vision_graph(model: VisionModel, n_images: int) -> Graph:
    """``n_images`` images' tokens ``[n_images * tokens_per_image, text n_embd]`` from the inputs ``patches``
    (``[n_images * n_patches, 3 p^2]``), ``patch_positions`` (each patch's index in its image), ``spans`` (each
    patch's image's first row) and ``pool.<i>``."""
    hp = model.hparams
    b = GraphBuilder()
    w = lambda name: b.weight(model.tensor(name))  # noqa: E731
    x = siglip_tower(b, model, n_images)
    members = [b.get_rows(x, b.input(f"pool.{i}", n_images * hp.tokens_per_image), name=f"mm.pool.{i}")
               for i in range(hp.pool ** 2)]
    pooled = members[0]
    for i, m in enumerate(members[1:], 1):
        pooled = b.add(pooled, m, name=f"mm.pool.sum{i}")
    if len(members) > 1:
        pooled = b.scale(pooled, 1.0 / len(members), name="mm.pool")
    normed = b.mul(b.rms_norm(pooled, hp.eps, name="mm.soft_emb_norm"), w("mm.soft_emb_norm.weight"),
                   name="mm.soft_emb_norm.gain")
    return b.build(b.matmul(normed, w("mm.input_projection.weight"), name="mm.input_projection",
                            whole_sequences=True))


def siglip_tower(b: GraphBuilder, model: Any, n_images: int) -> Node:
    """The SigLIP tower's output (after ``post_layernorm``), ``[n_images * n_patches, n_embd]``, added to ``b`` from
    the inputs ``patches`` (``[n_images * n_patches, 3 p^2]``), ``patch_positions`` (each patch's index in its image)
    and ``spans`` (each patch's image's first row); ``model`` has the ``v.*`` tensors and ``hparams`` with the
    tower's geometry (Gemma 3's and Idefics3's vision models)."""
    hp = model.hparams
    n = n_images * hp.n_patches
    w = lambda name: b.weight(model.tensor(name))  # noqa: E731
    patches = b.input("patches", n, "f32", width=hp.patch_width)
    positions = b.input("patch_positions", n)
    spans = b.input("spans", n)

    def linear(x, p: str, name: str, layer: int | None):
        y = b.matmul(x, w(p + ".weight"), name=name, layer=layer, whole_sequences=True)
        return b.add(y, w(p + ".bias"), name=name + ".bias", layer=layer)

    def norm(x, p: str, name: str, layer: int | None):
        return b.layer_norm(x, w(p + ".weight"), w(p + ".bias"), hp.eps, name=name, layer=layer)

    x = linear(patches, "v.patch_embd", "v.patch_embd", None)
    x = b.add(x, b.get_rows(w("v.position_embd.weight"), positions, name="v.position_embd"),
              name="v.embd.plus_position")
    for il in range(hp.n_layer):
        p = f"v.blk.{il}."
        h = norm(x, p + "ln1", p + "ln1", il)
        q, k, v = (linear(h, p + f"attn_{c}", p + c, il) for c in "qkv")
        meta = AttnMeta(il, hp.n_head, hp.n_head, hp.head_dim, hp.head_dim, 1.0 / math.sqrt(hp.head_dim))
        a = b.encoder_attn(q, k, v, spans, meta, name=p + "attn")
        x = b.add(x, linear(a, p + "attn_out", p + "attn_out", il), name=p + "attn_residual", layer=il)
        h = norm(x, p + "ln2", p + "ln2", il)
        up = b.gelu(linear(h, p + "ffn_up", p + "ffn_up", il), name=p + "ffn_gelu", layer=il)
        x = b.add(x, linear(up, p + "ffn_down", p + "ffn_down", il), name=p + "ffn_residual", layer=il)
    return norm(x, "v.post_ln", "v.post_ln", None)


# -- HF folders ---------------------------------------------------------------------------------------------


def vision_from_hf(cfg: Mapping[str, Any], text_n_embd: int, tensors: Mapping[str, tuple[WeightTensor, Path]],
                   where: Path) -> VisionModel:
    """The vision model of a ``Gemma3ForConditionalGeneration`` folder: ``cfg`` its config.json (``where``), ``tensors``
    its vision tower's and projector's tensors by HF name (with the file each is in); the folder's image processor
    (``preprocessor_config.json``) where it has one."""
    vc = cfg.get("vision_config")
    if not isinstance(vc, dict):
        raise FormatError(f"{where}: field 'vision_config' must be an object")

    def field(name: str, kind: Any, default: Any = None, src: Mapping[str, Any] = vc,
              prefix: str = "vision_config.") -> Any:
        v = src.get(name, default)
        if v is None or isinstance(v, bool) or not isinstance(v, kind) or (kind is int and v <= 0):
            raise FormatError(f"{where}: field '{prefix}{name}' must be a positive number, got {v!r}")
        return v

    hidden_act = vc.get("hidden_act", "gelu_pytorch_tanh")
    if hidden_act not in ("gelu_pytorch_tanh", "gelu_new"):
        raise ModelError(f"{where}: field 'vision_config.hidden_act' is {hidden_act!r}; the vision tower computes "
                         "tanh-approximated GELU (gelu_pytorch_tanh) only")
    hp = VisionHParams(
        image_size=field("image_size", int), patch_size=field("patch_size", int), n_embd=field("hidden_size", int),
        n_layer=field("num_hidden_layers", int), n_head=field("num_attention_heads", int),
        n_ff=field("intermediate_size", int), eps=float(field("layer_norm_eps", (int, float), 1e-6)),
        tokens_per_image=field("mm_tokens_per_image", int, 256, cfg, ""), text_n_embd=text_n_embd,
        image_token_id=field("image_token_id", int, cfg.get("image_token_index"), cfg, ""),
        boi_token_id=field("boi_token_id", int, cfg.get("boi_token_index"), cfg, ""),
        eoi_token_id=field("eoi_token_id", int, cfg.get("eoi_token_index"), cfg, ""),
    )
    check_geometry(hp, where)
    out: dict[str, WeightTensor] = {}
    for hf_name, (t, file) in tensors.items():
        name = _engine_name(hf_name)
        if name is None:
            raise ModelError(f"{file}: tensor {hf_name!r} has no place in Gemma 3's vision tower or projector")
        arr = _f32(t, hf_name, file)
        if name == "v.patch_embd.weight":
            if arr.ndim != 4 or arr.shape[1:] != (3, hp.patch_size, hp.patch_size):
                raise ModelError(f"{file}: tensor {hf_name!r} has shape {arr.shape}, expected "
                                 f"({hp.n_embd}, 3, {hp.patch_size}, {hp.patch_size})")
            arr = arr.reshape(arr.shape[0], -1)
        elif name == "mm.input_projection.weight":
            if arr.shape != (hp.n_embd, text_n_embd):
                raise ModelError(f"{file}: tensor {hf_name!r} has shape {arr.shape}, expected ({hp.n_embd}, "
                                 f"{text_n_embd}): the vision width by the text model's embedding width")
            arr = np.ascontiguousarray(arr.T)  # stored [in, out]; the matmul reads [out, in]
        elif name == "mm.soft_emb_norm.weight":
            arr = arr + np.float32(1.0)  # Gemma's RMSNorm multiplies by 1 + w
        out[name] = f32_tensor(name, arr)
    folder = where.parent
    has_processor = (folder / "preprocessor_config.json").is_file() or (folder / "processor_config.json").is_file()
    return VisionModel(hp, out, where, ImageProcessorConfig.from_hf_folder(folder) if has_processor else None)


def tower_engine_name(rest: str) -> str | None:
    """The engine name of a SigLIP tower tensor named ``rest`` below the tower's module (``encoder.layers.0...``)."""
    if rest in _TOWER_GLOBAL:
        return _TOWER_GLOBAL[rest]
    lm = _TOWER_LAYER.fullmatch(rest)
    if lm is not None:
        module, _, kind = lm.group(2).rpartition(".")
        if module in _TOWER_LAYER_TENSORS and kind in ("weight", "bias"):
            return f"v.blk.{lm.group(1)}.{_TOWER_LAYER_TENSORS[module]}.{kind}"
    return None


def _engine_name(hf_name: str) -> str | None:
    m = _TOWER.fullmatch(hf_name)
    if m is not None:
        return tower_engine_name(m.group(1))
    m = _PROJECTOR.fullmatch(hf_name)
    return _PROJECTOR_TENSORS.get(m.group(1)) if m is not None else None


def _f32(t: WeightTensor, hf_name: str, file: Path) -> np.ndarray:
    """A float tensor's values as float32 (its own shape)."""
    if t.ggml_type == GGMLType.F32:
        return t.data.view(np.float32).reshape(t.shape)
    if t.ggml_type == GGMLType.F16:
        return t.data.view(np.float16).reshape(t.shape).astype(np.float32)
    if t.ggml_type == GGMLType.BF16:
        bits = t.data.view(np.uint16).reshape(t.shape).astype(np.uint32) << 16
        return bits.view(np.float32)
    raise ModelError(f"{file}: tensor {hf_name!r} has type {t.ggml_type.name}; the vision tower reads F32, F16 "
                     "and BF16 tensors")


def f32_tensor(name: str, values: np.ndarray) -> WeightTensor:
    """A float32 array as a weight tensor (rows of its last dimension, as the formats give them)."""
    a = np.ascontiguousarray(values, dtype=np.float32)
    rows = a.reshape(-1, a.shape[-1]) if a.ndim > 1 else a.reshape(1, -1)
    return WeightTensor(name, GGMLType.F32, tuple(a.shape), rows.view(np.uint8))


def check_geometry(hp: VisionHParams, where: Path) -> None:
    """One-line errors for image, patch and token counts the graph cannot compute."""
    if hp.image_size % hp.patch_size:
        raise ModelError(f"{where}: image_size {hp.image_size} is not a multiple of patch_size {hp.patch_size}")
    side = hp.tokens_per_side
    if side * side != hp.tokens_per_image or hp.patches_per_side % side:
        raise ModelError(f"{where}: mm_tokens_per_image {hp.tokens_per_image} is not a square whose side divides "
                         f"the {hp.patches_per_side} patches per side")
    if hp.n_embd % hp.n_head:
        raise ModelError(f"{where}: vision hidden_size {hp.n_embd} is not a multiple of its {hp.n_head} heads")


def _check(hp: VisionHParams, tensors: Mapping[str, WeightTensor], where: Path) -> None:
    """One-line errors for tensors the recipe does not expect (a missing one, a wrong shape, an extra one)."""
    check_geometry(hp, where)
    expected = {"mm.soft_emb_norm.weight": (hp.n_embd,), "mm.input_projection.weight": (hp.text_n_embd, hp.n_embd)}
    check_tensors(hp, tensors, expected, where)


def check_tensors(hp: Any, tensors: Mapping[str, WeightTensor], projector: Mapping[str, tuple[int, ...]],
                  where: Path) -> None:
    """One-line errors unless ``tensors`` are the SigLIP tower's of ``hp`` (``v.*``) and the ``projector``'s shapes."""
    expected = {
        "v.patch_embd.weight": (hp.n_embd, hp.patch_width), "v.patch_embd.bias": (hp.n_embd,),
        "v.position_embd.weight": (hp.n_patches, hp.n_embd), "v.post_ln.weight": (hp.n_embd,),
        "v.post_ln.bias": (hp.n_embd,), **projector,
    }
    for il in range(hp.n_layer):
        p = f"v.blk.{il}."
        for c in ("attn_q", "attn_k", "attn_v", "attn_out"):
            expected[p + c + ".weight"], expected[p + c + ".bias"] = (hp.n_embd, hp.n_embd), (hp.n_embd,)
        for c in ("ln1", "ln2"):
            expected[p + c + ".weight"], expected[p + c + ".bias"] = (hp.n_embd,), (hp.n_embd,)
        expected[p + "ffn_up.weight"], expected[p + "ffn_up.bias"] = (hp.n_ff, hp.n_embd), (hp.n_ff,)
        expected[p + "ffn_down.weight"], expected[p + "ffn_down.bias"] = (hp.n_embd, hp.n_ff), (hp.n_embd,)
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            raise FormatError(f"{where}: the vision model has no tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ModelError(f"{where}: vision tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ModelError(f"{where}: vision tensor {extra[0]!r} has no place in the recipe "
                         f"({hp.n_layer} layers)")
