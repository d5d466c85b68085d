"""Hugging Face model folders: ``config.json`` -> hyperparameters, safetensors names -> the engine's names.

The engine's layer recipe reads GGUF-style tensor names (``blk.0.attn_q.weight``). An HF folder names the
same tensors after its transformers module tree (``model.layers.0.self_attn.q_proj.weight``). Each
architecture module declares the ``model_type`` of its family's folders (its ``ARCH.hf``, an
:class:`~minfer.models.architecture.HFArchitecture`): a table from HF names to engine names, the
transformers config class's defaults for optional fields, and the config keys only that family reads.

HF weights are stored as trained: Llama's W_q/W_k rows are not permuted the way llama.cpp's converter
permutes them for GGUF, so every HF checkpoint rotates pairs (i, i + n_rot/2) (NEOX), Llama included.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minfer.errors import FormatError, ModelError
from minfer.formats.safetensors_file import SAFETENSORS_TYPES, SafetensorsFolder, read_json
from minfer.formats.tensors import ExpertTensors, WeightTensor
from minfer.graph.ir import RopeStyle
from minfer.models import gemma3_vision, idefics3_vision
from minfer.models.architecture import Architecture, HFArchitecture
from minfer.models.gemma3_vision import VisionModel
from minfer.models.hparams import HParams, check_layer_count, hf_field_name, layer_indices
from minfer.models.idefics3_vision import Idefics3VisionModel
from minfer.models.registry import architecture_of_model_type
from minfer.models.rope_scaling import hf_rope_parameters, rope_scaling_from_hf

if TYPE_CHECKING:
    from minfer.formats.chat_template import ChatTemplate
    from minfer.formats.tokenizer import Tokenizer

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")  # .match: the layer number first (check_layer_count)
# buffers some older checkpoints saved, that the recipe recomputes
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def get_hf_architecture(cfg: Mapping[str, Any], where: Path) -> Architecture:
    """The architecture that runs a ``config.json``: its ``model_type``, checked against its ``architectures``."""
    model_type = cfg.get("model_type")
    if model_type is None:
        raise FormatError(f"{where}: missing field 'model_type'")
    if not isinstance(model_type, str):
        raise FormatError(f"{where}: field 'model_type' must be a string, got {model_type!r}")
    arch = architecture_of_model_type(model_type, str(where))
    classes = cfg.get("architectures")
    if isinstance(classes, list) and classes and not any(c in arch.hf.classes for c in classes):
        raise ModelError(f"{where}: architectures {classes} is not a causal LM minfer runs for model_type "
                         f"{model_type!r} (supported: {', '.join(arch.hf.classes)})")
    return arch


class _Config:
    """Typed access to config.json fields with one-line errors naming the file and field."""

    def __init__(self, cfg: Mapping[str, Any], spec: HFArchitecture, where: Path) -> None:
        self.cfg, self.spec, self.where = cfg, spec, where

    def get(self, name: str, default: Any = None) -> Any:
        value = self.cfg.get(name)
        if value is None:
            value = self.spec.defaults.get(name, default)
        return value

    def int(self, name: str, default: int | None = None) -> int:
        value = self.get(name, default)
        if value is None:
            raise FormatError(f"{self.where}: missing field {name!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise FormatError(f"{self.where}: field {name!r} must be a positive integer, got {value!r}")
        return value

    def float(self, name: str, default: float | None = None) -> float:
        value = self.get(name, default)
        if value is None:
            raise FormatError(f"{self.where}: missing field {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise FormatError(f"{self.where}: field {name!r} must be a number, got {value!r}")
        return float(value)


def hparams_from_hf_config(cfg: Mapping[str, Any], arch: Architecture, n_vocab: int, where: Path) -> HParams:
    """Hyperparameters from ``config.json``, read as the transformers config class reads them."""
    spec = arch.hf
    c = _Config(cfg, spec, where)
    n_embd = c.int("hidden_size")
    n_layer = c.int("num_hidden_layers")
    n_head = c.int("num_attention_heads")
    n_ff = c.int("intermediate_size")
    vocab_size = c.int("vocab_size")
    if vocab_size != n_vocab:
        raise ModelError(f"{where}: vocab_size is {vocab_size} but model.embed_tokens.weight has {n_vocab} rows")
    n_head_kv = c.int("num_key_value_heads", default=n_head)
    if n_head % n_head_kv:
        raise ModelError(f"{where}: num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_head_kv}")
    if c.get("head_dim") is None and n_embd % n_head:
        raise ModelError(f"{where}: hidden_size {n_embd} is not divisible by {n_head} heads and no head_dim is given")
    head_dim = c.int("head_dim", default=n_embd // n_head)
    activation = c.get(spec.activation_key, spec.activation)
    if activation != spec.activation:
        raise ModelError(f"{where}: {spec.activation_key} {activation!r} is not supported for {spec.model_type} "
                         f"(the recipe computes {spec.activation!r})")
    rope = hf_rope_parameters(cfg, str(where))
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise FormatError(f"{where}: partial_rotary_factor must be in (0, 1], got {partial!r}")
    n_rot = int(head_dim * partial)
    if n_rot % 2:
        raise ModelError(f"{where}: {n_rot} rotary dims (head_dim x partial_rotary_factor) is odd")
    theta = rope.get("rope_theta", spec.defaults.get("rope_theta"))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
        raise FormatError(f"{where}: rope_theta must be a number > 1, got {theta!r}")
    scaling = rope_scaling_from_hf(rope, cfg, n_rot, float(theta), str(where))
    hp = HParams(
        arch=arch.name,
        n_vocab=n_vocab,
        n_ctx_train=c.int("max_position_embeddings"),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=n_ff,
        head_dim_k=head_dim,
        head_dim_v=head_dim,
        n_rot=n_rot,
        rope_freq_base=float(theta),
        rope_freq_scale=scaling.freq_scale,
        rms_eps=c.float("rms_norm_eps"),
        attn_scale=1.0 / math.sqrt(head_dim),
        rope_scaling=scaling,
        sliding_window=0 if arch.sliding_window else _sliding_window(cfg, n_layer, spec, where),
        embd_scale=arch.embedding_scale(n_embd),
    )
    return hp if spec.extra_hparams is None else spec.extra_hparams(cfg, hp, where)


def _sliding_window(cfg: Mapping[str, Any], n_layer: int, spec: HFArchitecture, where: Path) -> int:
    """The attention window of the config's sliding layers; an error if a recipe without windows would need one."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    elif cfg.get("use_sliding_window") and window:
        first = cfg.get("max_window_layers", 0)
        sliding = [i for i in range(n_layer) if i >= first]
    else:
        sliding = []
    if not sliding:
        return 0
    raise ModelError(f"{where}: sliding-window attention (window {window}, layers {sliding[0]}..{sliding[-1]}) is "
                     f"not supported for {spec.model_type}")


@dataclass
class HFCheckpoint:
    """An HF folder opened for the engine (a :class:`~minfer.models.tensor_source.TensorSource`): its files,
    hyperparameters and tensors under engine names."""

    directory: Path
    config: dict[str, Any]
    tokenizer_config: dict[str, Any] | None
    generation_config: dict[str, Any] | None
    arch: Architecture
    folder: SafetensorsFolder
    hparams: HParams
    tensors: dict[str, WeightTensor | ExpertTensors]  # engine names
    origin: dict[str, tuple[str, Path]]  # engine name -> (HF name, file)
    vision: VisionModel | Idefics3VisionModel | None = None  # a vision-language folder's vision tower and projector

    metadata_title = "config.json"
    chat_template_field = "tokenizer_config.json chat_template"

    @property
    def path(self) -> Path:
        return self.directory

    @property
    def spec(self) -> HFArchitecture:
        """How the family names and configures its HF folders."""
        return self.arch.hf

    @property
    def rope_style(self) -> RopeStyle:
        return RopeStyle.NEOX  # unpermuted HF weights: pairs (i, i + n_rot/2), for every architecture

    @property
    def format_name(self) -> str:
        n = len(self.folder.files)
        shards = f", {n} shards ({self.folder.index_path.name})" if self.folder.sharded else ""  # type: ignore[union-attr]
        return f"HF safetensors folder{shards}"

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.config

    def shown_metadata(self) -> Mapping[str, Any]:
        return self.config

    def field_name(self, field: str) -> str:
        return hf_field_name(field)

    def describe_tensor(self, name: str) -> str:
        hf_name, file = self.origin.get(name, (name, self.directory))
        return f"{file}: tensor {hf_name!r}"

    def stored_name(self, name: str) -> str:
        return hf_tensor_name(self.spec, name)

    def expert_count_field(self) -> str:
        return f"{self.directory / 'config.json'}: {self.spec.expert_count_key}"

    def load_tokenizer(self, n_vocab: int) -> Tokenizer:
        from minfer.formats.hf_tokenizer import load_hf_tokenizer

        return load_hf_tokenizer(self.directory, self.config, self.tokenizer_config, self.generation_config,
                                 n_model_vocab=n_vocab)

    def load_chat_template(self, tokenizer: Tokenizer) -> ChatTemplate | None:
        from minfer.formats.hf_tokenizer import load_hf_chat_template

        return load_hf_chat_template(self.directory, self.tokenizer_config)

    def generation_defaults(self) -> dict[str, Any]:
        from minfer.formats.hf_tokenizer import generation_defaults

        return generation_defaults(self.generation_config)

    def pooling_type(self) -> int | None:
        return None  # a causal LM's folder declares no pooling (sentence-transformers' modules.json is not read)

    def vocab_summary(self) -> dict[str, Any]:
        from minfer.formats.hf_tokenizer import load_hf_tokenizer

        tok = load_hf_tokenizer(self.directory, self.config, self.tokenizer_config, self.generation_config)
        spec = json.loads((self.directory / "tokenizer.json").read_text(encoding="utf-8"))
        kind = (spec.get("model") or {}).get("type") or "?"
        return {"type": f"HF tokenizer.json ({kind}, {tok.decoder_kind})", "size": tok.vocab_size,
                "bos_id": tok.bos_id, "eos_id": tok.eos_id, "add_bos": tok.add_bos}

    def source_summary(self) -> dict[str, Any]:
        return {"format": self.format_name, "hf_model_type": self.spec.model_type,
                "hf_architectures": self.config.get("architectures"), "files": [f.path.name for f in self.folder.files]}


def _json_object(path: Path, required: bool) -> dict[str, Any] | None:
    content = read_json(path, required=required)
    if content is not None and not isinstance(content, dict):
        raise FormatError(f"{path}: expected a JSON object, got {type(content).__name__}")
    return content


# over 80 lines on purpose: a folder's checks in the order a user's mistakes show up, each naming its file
def open_hf_folder(directory: str | os.PathLike[str]) -> HFCheckpoint:
    """Open an HF model folder: config, weights (memory-mapped) under engine names, hyperparameters.

    Raises a one-line :class:`FormatError` / :class:`ModelError` naming the file and the field or tensor.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FormatError(f"{directory}: not a folder")
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise FormatError(f"{cfg_path}: missing (an HF model folder needs config.json)")
    cfg = _json_object(cfg_path, required=True)
    assert cfg is not None
    full_cfg = cfg
    vlm = _vision_language_text_config(cfg, cfg_path)
    # Gemma 3 / Idefics3 with its vision tower: the text model is configured by text_config
    vision_module = None if vlm is None else _VISION_MODULES[full_cfg["model_type"]]
    if vlm is not None:
        cfg = vlm
    arch = get_hf_architecture(cfg, cfg_path)
    spec = arch.hf
    folder = SafetensorsFolder(directory)

    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        tied = spec.defaults.get("tie_word_embeddings", True)
    n_layer = _Config(cfg, spec, cfg_path).int("num_hidden_layers")
    # before anything is sized by it: a corrupt count of 2**31 layers would be looped over
    text_names = folder.infos if vlm is None else {_text_model_name(k): v for k, v in folder.infos.items()}
    check_layer_count(n_layer, layer_indices(text_names, _LAYER), str(cfg_path), "num_hidden_layers")
    tensors: dict[str, WeightTensor | ExpertTensors] = {}
    origin: dict[str, tuple[str, Path]] = {}
    expert_patterns = [(re.compile(re.escape(k).replace(re.escape("{e}"), r"(\d+)")), k, v)
                       for k, v in spec.expert_tensors.items()]
    experts: dict[str, dict[int, WeightTensor]] = {}  # engine name of a layer's stack -> expert -> its matrix
    vision_tensors: dict[str, tuple[WeightTensor, Path]] = {}
    for stored_name, info in folder.infos.items():
        hf_name = stored_name
        if vlm is not None:
            if vision_module.is_vision_tensor(stored_name):  # type: ignore[union-attr]
                vision_tensors[stored_name] = (folder.tensors[stored_name], info.file)
                continue
            hf_name = _text_model_name(stored_name)
        if hf_name.endswith(_IGNORED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
            continue  # tied: transformers reads the output projection from the embeddings
        name = spec.global_tensors.get(hf_name)
        m = _LAYER.fullmatch(hf_name)
        if name is None and m is not None:
            il, rest = int(m.group(1)), m.group(2)
            suffix = spec.layer_tensors.get(rest)
            if suffix is not None and il < n_layer:
                name = f"blk.{il}.{suffix}"
            if name is None and il < n_layer and _add_expert(hf_name, rest, il, expert_patterns, folder, experts,
                                                              origin):
                continue
        if name is None:
            raise ModelError(f"{info.file}: tensor {hf_name!r} has no place in the {spec.model_type} recipe")
        if info.dtype not in SAFETENSORS_TYPES:
            raise ModelError(f"{info.file}: tensor {hf_name!r} has dtype {info.dtype}, not supported "
                             f"(supported: {', '.join(SAFETENSORS_TYPES)})")
        t = folder.tensors[stored_name]
        tensors[name] = WeightTensor(name, t.ggml_type, t.shape, t.data, t.file_rows)
        origin[name] = (stored_name, info.file)

    for stack, by_expert in experts.items():
        n = len(by_expert)
        if sorted(by_expert) != list(range(n)):
            missing = sorted(set(range(max(by_expert) + 1)) - set(by_expert))
            raise FormatError(f"{origin[stack][1]}: tensor {origin[stack][0].replace('{e}', str(missing[0]))!r} "
                              f"is missing (experts of one layer are numbered 0..{max(by_expert)})")
        shapes = {t.shape for t in by_expert.values()}
        if len(shapes) != 1 or len({t.ggml_type for t in by_expert.values()}) != 1:
            raise ModelError(f"{origin[stack][1]}: the experts' {origin[stack][0]!r} tensors differ in shape or "
                             f"dtype ({sorted(shapes)})")
        tensors[stack] = ExpertTensors(stack, tuple(by_expert[e] for e in range(n)))

    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise FormatError(f"{directory}: missing tensor 'model.embed_tokens.weight'")
    if len(embd.shape) != 2:
        raise ModelError(f"{origin['token_embd.weight'][1]}: tensor 'model.embed_tokens.weight' has shape "
                         f"{embd.shape}, expected 2-D")
    if not tied and "output.weight" not in tensors:
        raise FormatError(f"{directory}: missing tensor 'lm_head.weight' (config.json tie_word_embeddings is false)")
    hparams = hparams_from_hf_config(cfg, arch, embd.shape[0], cfg_path)
    if spec.norm_gain_offset:
        for name, t in tensors.items():
            if name.endswith("norm.weight") and len(t.shape) == 1:
                tensors[name] = _plus_one(t)
    vision = None if vision_module is None else vision_module.vision_from_hf(full_cfg, hparams.n_embd, vision_tensors,
                                                                             cfg_path)
    return HFCheckpoint(
        directory=directory,
        config=cfg,
        tokenizer_config=_json_object(directory / "tokenizer_config.json", required=False),
        generation_config=_json_object(directory / "generation_config.json", required=False),
        arch=arch,
        folder=folder,
        hparams=hparams,
        tensors=tensors,
        origin=origin,
        vision=vision,
    )


# the vision-language classes whose text model minfer runs with its vision tower (models/gemma3_vision.py,
# models/idefics3_vision.py: SmolVLM)
_VISION_LANGUAGE = {"gemma3": ("Gemma3ForConditionalGeneration", "gemma3_text"),
                    "idefics3": ("Idefics3ForConditionalGeneration", "llama")}
_VISION_MODULES: dict[str, Any] = {"gemma3": gemma3_vision, "idefics3": idefics3_vision}


def is_vision_language_folder(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` is an HF vision-language folder minfer runs with its vision tower (its ``config.json``
    names a known family and has a ``vision_config``), read from the config alone: nothing loaded."""
    try:
        cfg = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and _is_vision_language(cfg)


def _is_vision_language(cfg: dict[str, Any]) -> bool:
    """A vision-language family minfer runs with its tower: a known ``model_type`` with a ``vision_config``."""
    return isinstance(cfg.get("model_type"), str) and cfg["model_type"] in _VISION_LANGUAGE and "vision_config" in cfg


def _vision_language_text_config(cfg: dict[str, Any], where: Path) -> dict[str, Any] | None:
    """The text model's config of a vision-language folder (None for any other folder): its ``text_config`` with the
    text family's ``model_type``, and the fields the outer config holds for it (``tie_word_embeddings``)."""
    if not _is_vision_language(cfg):
        return None
    known = _VISION_LANGUAGE[cfg["model_type"]]
    classes = cfg.get("architectures")
    if isinstance(classes, list) and classes and known[0] not in classes:
        raise ModelError(f"{where}: architectures {classes} is not a model minfer runs for model_type "
                         f"{cfg['model_type']!r} (supported: {known[0]})")
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise FormatError(f"{where}: field 'text_config' must be an object")
    out = {**text, "model_type": known[1], "architectures": None}
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in cfg:
        out["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return out


def _text_model_name(hf_name: str) -> str:
    """A vision-language folder's text tensor under the text model's own name (``model.language_model.layers.0...``
    of transformers >= 4.52 and ``language_model.model.layers.0...`` before it -> ``model.layers.0...``)."""
    for prefix, to in (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head."), ("model.text_model.", "model.")):
        if hf_name.startswith(prefix):
            return to + hf_name[len(prefix):]
    return hf_name


def _add_expert(hf_name: str, rest: str, il: int, patterns: list, folder: SafetensorsFolder,
                experts: dict[str, dict[int, WeightTensor]], origin: dict[str, tuple[str, Path]]) -> bool:
    """File a per-expert tensor (``mlp.experts.3.gate_proj.weight``) under its layer's stack; False if it is none."""
    info = folder.infos[hf_name]
    for pattern, hf_pattern, stacked in patterns:
        e = pattern.fullmatch(rest)
        if e is None:
            continue
        if info.dtype not in SAFETENSORS_TYPES:
            raise ModelError(f"{info.file}: tensor {hf_name!r} has dtype {info.dtype}, not supported "
                             f"(supported: {', '.join(SAFETENSORS_TYPES)})")
        stack = f"blk.{il}.{stacked}"
        t = folder.tensors[hf_name]
        experts.setdefault(stack, {})[int(e.group(1))] = WeightTensor(f"{stack}[{e.group(1)}]", t.ggml_type, t.shape,
                                                                      t.data)
        origin[stack] = (f"model.layers.{il}.{hf_pattern}", info.file)
        return True
    return False


def _plus_one(t: WeightTensor) -> WeightTensor:
    """An RMSNorm gain stored as w (HF Gemma) as the 1 + w the recipe multiplies by (in float32, as GGUF stores it)."""
    import numpy as np

    from minfer.formats.quants import GGMLType, dequantize_rows

    w = dequantize_rows(t.data, t.ggml_type, t.shape[-1]).reshape(-1) + np.float32(1.0)
    return WeightTensor(t.name, GGMLType.F32, t.shape, w.astype(np.float32).view(np.uint8).reshape(1, -1))


def hf_tensor_name(spec: HFArchitecture, name: str) -> str:
    """The HF name of an engine tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    for hf_name, ours in spec.global_tensors.items():
        if ours == name:
            return hf_name
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m:
        for hf_name, ours in spec.layer_tensors.items():
            if ours == m.group(2):
                return f"model.layers.{m.group(1)}.{hf_name}"
    return name
