"""LoRA adapters: low-rank updates ``W' = W + s·B·A`` of a model's matrices, read from llama.cpp's GGUF adapter
files and from PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``).

An adapter is a set of :class:`LoraPair` (A ``[r, n_in]``, B ``[n_out, r]``, float32) under the engine names of
the matrices they adapt, each with the scale its format gives it: ``alpha / r`` (GGUF: ``adapter.lora.alpha``;
PEFT: ``lora_alpha``, per-module ``rank_pattern`` / ``alpha_pattern``), or ``alpha / sqrt(r)`` with PEFT's
rsLoRA. A user's scale multiplies it at run time: it is graph data, not part of the adapter.

Where the base model and the adapter store Llama's W_q/W_k rows in different orders (llama.cpp's converter
permutes them for GGUF; HF weights and PEFT adapters are as trained), B's rows are put in the base's order
here, so ``B·A`` lines up with the base matrix's rows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from minfer.errors import FormatError, ModelError
from minfer.formats.gguf_file import GGUFFile
from minfer.formats.quants import dequantize_rows
from minfer.formats.safetensors_file import SafetensorsFile, read_json
from minfer.formats.tensors import ExpertTensors, WeightTensor
from minfer.graph.ir import RopeStyle
from minfer.models.architecture import Architecture
from minfer.models.hparams import HParams

# PEFT's LoraConfig fields that change what the adapter computes and that the engine does not compute: refused
# by name (a silently ignored DoRA magnitude would give another model's outputs)
_UNSUPPORTED_PEFT = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
}


@dataclass(frozen=True)
class LoraPair:
    """One adapted matrix: ``W·x`` becomes ``W·x + scale·user_scale·B·(A·x)``."""

    target: str  # the engine name of the base matrix ("blk.0.attn_q.weight")
    a: np.ndarray  # float32 [rank, n_in]
    b: np.ndarray  # float32 [n_out, rank]
    scale: float  # the format's own scale (alpha / rank, or alpha / sqrt(rank) with rsLoRA)


@dataclass(frozen=True)
class LoraAdapter:
    path: Path
    format: str  # "gguf" or "peft"
    pairs: Mapping[str, LoraPair]  # by target
    # what llama.cpp's adapter files may say of their use (adapter.lora.task_name / prompt_prefix)
    task_name: str = ""
    prompt_prefix: str = ""


class LoraBase(Protocol):
    """What an adapter is checked against: the base model's architecture, hyperparameters, matrices and the
    order of its W_q/W_k rows (a :class:`minfer.models.model.TransformerModel` has all of them)."""

    arch: Architecture
    hparams: HParams
    rope_style: RopeStyle
    tensors: Mapping[str, WeightTensor | ExpertTensors]


def load_lora(path: str | os.PathLike[str], base: LoraBase) -> LoraAdapter:
    """A GGUF adapter file or a PEFT adapter folder, checked against ``base``; a one-line error otherwise."""
    path = Path(path)
    if path.is_dir():
        return _check(path, "peft", _read_peft(path, base), base, permuted=False)
    if not path.exists():
        raise FormatError(f"{path}: no such adapter file or folder")
    f = GGUFFile(path)
    kind = f.get("general.type")
    if kind != "adapter" or f.get("adapter.type") != "lora":
        raise FormatError(f"{path}: not a LoRA adapter (general.type is {kind!r}, adapter.type is "
                          f"{f.get('adapter.type')!r}; expected 'adapter' and 'lora')")
    arch = f.architecture
    if arch != base.arch.name:
        raise ModelError(f"{path}: a LoRA adapter for architecture {arch!r}, but the model is {base.arch.name!r}")
    alpha = float(f.require("adapter.lora.alpha", (int, float))) if "adapter.lora.alpha" in f.metadata else 0.0
    raw: dict[str, dict[str, np.ndarray]] = {}
    for t in f:
        target, dot, part = t.name.rpartition(".")
        if not dot or part not in ("lora_a", "lora_b"):
            raise ModelError(f"{path}: tensor {t.name!r} is neither a '.lora_a' nor a '.lora_b' tensor "
                             "(adapters that replace norms or embeddings are not supported)")
        raw.setdefault(target, {})[part] = _float32(t)
    pairs = []
    for target, ab in raw.items():
        a, b = _both(path, target, ab.get("lora_a"), ab.get("lora_b"), ".lora_a", ".lora_b")
        rank = a.shape[0]
        # llama.cpp: alpha 0 means no alpha (the scale is the user's alone)
        pairs.append(LoraPair(target, a, b, alpha / rank if alpha else 1.0))
    # llama.cpp's converter writes W_q/W_k's B rows in the order it writes the base's rows
    adapter = _check(path, "gguf", pairs, base, permuted=base.arch.rope_style is RopeStyle.NORMAL)
    return replace(adapter, task_name=str(f.get("adapter.lora.task_name", "")),
                   prompt_prefix=str(f.get("adapter.lora.prompt_prefix", "")))


def _read_peft(folder: Path, base: LoraBase) -> list[LoraPair]:
    cfg = read_json(folder / "adapter_config.json")
    where = folder / "adapter_config.json"
    if not isinstance(cfg, dict):
        raise FormatError(f"{where}: expected a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ModelError(f"{where}: peft_type is {peft_type!r}; only LORA adapters are supported")
    for key, what in _UNSUPPORTED_PEFT.items():
        if cfg.get(key):
            raise ModelError(f"{where}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ModelError(f"{where}: bias is {cfg['bias']!r}; adapters that train biases are not supported")
    if cfg.get("modules_to_save"):
        raise ModelError(f"{where}: modules_to_save {cfg['modules_to_save']!r} is not supported (the adapter "
                         "replaces whole modules, not only low-rank updates)")
    rank, alpha = _number(cfg, "r", where), _number(cfg, "lora_alpha", where)
    rs = bool(cfg.get("use_rslora", False))
    rank_pattern = _patterns(cfg, "rank_pattern", where)
    alpha_pattern = _patterns(cfg, "alpha_pattern", where)
    files = [folder / "adapter_model.safetensors"]
    if not files[0].is_file():
        if (folder / "adapter_model.bin").is_file():
            raise FormatError(f"{folder}: adapter_model.bin (a pickle) is not read; save the adapter as "
                              "safetensors (PEFT's default)")
        raise FormatError(f"{files[0]}: missing")
    st = SafetensorsFile(files[0])
    spec = base.arch.hf
    if spec is None:
        raise ModelError(f"{folder}: PEFT adapters need the HF tensor names of {base.arch.name!r}, which has none")
    raw: dict[str, dict[str, np.ndarray]] = {}
    module_of: dict[str, str] = {}
    for name, info in st.infos.items():
        module, part = _peft_part(name)
        if part is None:
            raise ModelError(f"{files[0]}: tensor {name!r} is not a lora_A/lora_B weight (embedding adapters and "
                             "saved modules are not supported)")
        if name not in st.tensors:
            raise ModelError(f"{files[0]}: tensor {name!r} has dtype {info.dtype}, not supported")
        target = _engine_name(module, spec)
        if target is None:
            raise ModelError(f"{files[0]}: tensor {name!r} adapts {module!r}, which has no place in the "
                             f"{spec.model_type} recipe")
        raw.setdefault(target, {})[part] = _float32(st.tensors[name])
        module_of[target] = module
    pairs = []
    for target, ab in raw.items():
        a, b = _both(files[0], module_of[target], ab.get("A"), ab.get("B"), ".lora_A.weight", ".lora_B.weight")
        module = module_of[target]
        r = _pattern_value(rank_pattern, module, rank)
        al = _pattern_value(alpha_pattern, module, alpha)
        if a.shape[0] != r:
            raise ModelError(f"{files[0]}: {module}.lora_A.weight has rank {a.shape[0]}, but adapter_config.json "
                             f"says r = {r:g}")
        pairs.append(LoraPair(target, a, b, al / math.sqrt(r) if rs else al / r))
    return pairs


def _peft_part(name: str) -> tuple[str, str | None]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> (``model.layers.0.self_attn.q_proj``,
    ``"A"``); the part is None for any other tensor."""
    for suffix, part in ((".lora_A.weight", "A"), (".lora_B.weight", "B")):
        if name.endswith(suffix):
            module = name[: -len(suffix)].removesuffix(".default")
            return module.removeprefix("base_model.model."), part
    return name, None


def _engine_name(module: str, spec: Any) -> str | None:
    hf_name = module + ".weight"
    name = spec.global_tensors.get(hf_name)
    if name is not None:
        return name
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        suffix = spec.layer_tensors.get(parts[3])
        if suffix is not None:
            return f"blk.{int(parts[2])}.{suffix}"
    return None


def _patterns(cfg: Mapping[str, Any], key: str, where: Path) -> dict[str, float]:
    value = cfg.get(key) or {}
    if not isinstance(value, dict) or not all(_is_number(v) for v in value.values()):
        raise FormatError(f"{where}: {key} must map module names to numbers")
    return {str(k): float(v) for k, v in value.items()}


def _pattern_value(patterns: Mapping[str, float], module: str, default: float) -> float:
    # PEFT matches a pattern key against the module's full name or its dotted tail
    for key, value in patterns.items():
        if module == key or module.endswith("." + key):
            return value
    return default


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _number(cfg: Mapping[str, Any], key: str, where: Path) -> float:
    value = cfg.get(key)
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise FormatError(f"{where}: {key} is {value!r}, expected a positive number")
    return float(value)


def _float32(t: WeightTensor) -> np.ndarray:
    if len(t.shape) != 2:
        raise ModelError(f"tensor {t.name!r} has shape {t.shape}, expected 2-D")
    return np.ascontiguousarray(dequantize_rows(t.data, t.ggml_type, t.shape[-1]).reshape(t.shape), np.float32)


def _both(where: Path, name: str, a: np.ndarray | None, b: np.ndarray | None, a_suffix: str,
          b_suffix: str) -> tuple[np.ndarray, np.ndarray]:
    if a is None or b is None:
        missing = name + (a_suffix if a is None else b_suffix)
        raise ModelError(f"{where}: tensor {missing!r} is missing (each adapted matrix needs both A and B)")
    if a.shape[0] != b.shape[1]:
        raise ModelError(f"{where}: {name}{a_suffix} has rank {a.shape[0]} but {name}{b_suffix} has rank "
                         f"{b.shape[1]} (shapes {a.shape} and {b.shape})")
    return a, b


def _check(path: Path, fmt: str, pairs: Iterable[LoraPair], base: LoraBase, permuted: bool) -> LoraAdapter:
    hp = base.hparams
    base_permuted = base.rope_style is RopeStyle.NORMAL and base.arch.rope_style is RopeStyle.NORMAL
    out: dict[str, LoraPair] = {}
    for p in pairs:
        w = base.tensors.get(p.target)
        if w is None and p.target == "output.weight":  # tied embeddings: the output projection is token_embd's
            w = base.tensors.get("token_embd.weight")
        if w is None or isinstance(w, ExpertTensors) or len(w.shape) != 2:
            raise ModelError(f"{path}: adapts {p.target!r}, which the model has no matrix of")
        if p.target == "token_embd.weight":
            raise ModelError(f"{path}: adapts the token embeddings, which is not supported")
        n_out, n_in = w.shape
        if p.a.shape[1] != n_in or p.b.shape[0] != n_out:
            raise ModelError(f"{path}: the adapter of {p.target!r} is [{p.b.shape[0]}, {p.a.shape[1]}] (B {p.b.shape}"
                             f" · A {p.a.shape}), but the matrix is [{n_out}, {n_in}]")
        if not (np.isfinite(p.a).all() and np.isfinite(p.b).all()):
            raise ModelError(f"{path}: the adapter of {p.target!r} has NaN or infinite weights")
        b = p.b
        if permuted != base_permuted and p.target.endswith(("attn_q.weight", "attn_k.weight")):
            n_head = hp.n_head if p.target.endswith("attn_q.weight") else hp.n_head_kv
            b = _permuted_rows(b, n_head) if base_permuted else _unpermuted_rows(b, n_head)
        out[p.target] = LoraPair(p.target, p.a, np.ascontiguousarray(b), p.scale)
    if not out:
        raise ModelError(f"{path}: the adapter has no tensors")
    return LoraAdapter(path, fmt, out)


def _permuted_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of an HF W_q/W_k (RoPE pairs (i, i + d/2) within each head) in llama.cpp's GGUF order (pairs (2i, 2i+1))."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermuted_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def merged_weight(w: WeightTensor, pair: LoraPair, user_scale: float) -> WeightTensor:
    """``W + scale·user_scale·B·A`` as a float32 matrix (``--lora-merge``): only float bases, whose values the
    merge keeps exact; a quantized matrix would be rounded again, so it is refused by name."""
    from minfer.formats.block_types import GGMLType

    if w.ggml_type not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        raise ModelError(f"--lora-merge: {w.name!r} is {w.ggml_type.name}; merging needs float weights (F32, F16, "
                         "BF16). Leave the adapter unmerged on a quantized model")
    # in float64, rounded once: the merged matrix is W + s·B·A to float32's precision
    merged = dequantize_rows(w.data, w.ggml_type, w.shape[-1]).reshape(w.shape).astype(np.float64)
    merged += (pair.scale * user_scale) * (pair.b.astype(np.float64) @ pair.a.astype(np.float64))
    return WeightTensor(w.name, GGMLType.F32, w.shape, np.ascontiguousarray(merged, np.float32).view(np.uint8))
