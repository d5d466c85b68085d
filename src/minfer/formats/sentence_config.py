"""sentence-transformers' configuration of an embedding model folder: which pooling follows the encoder, whether
a ``Normalize`` module L2-normalizes the result, and the longest input (``max_seq_length``).

Read as sentence-transformers reads it: ``modules.json`` lists the modules in order (``Transformer``, then
``Pooling`` from its folder's ``config.json``, then ``Normalize``); ``sentence_bert_config.json`` holds
``max_seq_length``. A folder without ``modules.json`` (a plain transformers checkpoint) gets the defaults the
caller passes (mean pooling, normalized, the position embeddings' length), as llama.cpp's converter does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minfer.errors import FormatError, ModelError
from minfer.formats.safetensors_file import read_json

# 1_Pooling/config.json's flags -> the pooling's name here
POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weighted_mean",
    "pooling_mode_lasttoken": "last",
}


@dataclass(frozen=True)
class SentenceConfig:
    pooling: str
    normalize: bool
    max_seq_length: int
    declared: bool  # the folder has modules.json (False: the defaults)


def _module_type(entry: Any, where: Path) -> tuple[str, str]:
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
        raise FormatError(f"{where}: each module must be an object with a string 'type', got {entry!r}")
    path = entry.get("path", "")
    if not isinstance(path, str) or Path(path).is_absolute() or ".." in Path(path).parts:
        raise FormatError(f"{where}: module path {path!r} is not a folder inside the model")
    return entry["type"].rsplit(".", 1)[-1], path


def _pooling(config_path: Path) -> str:
    cfg = read_json(config_path)
    if not isinstance(cfg, dict):
        raise FormatError(f"{config_path}: expected a JSON object")
    modes = [name for flag, name in POOLING_FLAGS.items() if cfg.get(flag) is True]
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str) and not modes:  # newer sentence-transformers write the name itself
        modes = [{"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max", "lasttoken": "last",
                  "weightedmean": "weighted_mean", "mean_sqrt_len_tokens": "mean_sqrt_len"}.get(mode, mode)]
    if len(modes) != 1 or modes[0] not in POOLING_FLAGS.values():
        raise ModelError(f"{config_path}: expected exactly one pooling mode (one of {', '.join(POOLING_FLAGS)}), "
                         f"got {modes or 'none'}")
    return modes[0]


def read_sentence_config(directory: str | os.PathLike[str], default_pooling: str,
                         default_max_length: int) -> SentenceConfig:
    """The folder's sentence-transformers modules (see the module docstring); one-line errors naming the file."""
    directory = Path(directory)
    modules_path = directory / "modules.json"
    max_length = default_max_length
    st_config = directory / "sentence_bert_config.json"
    if st_config.is_file():
        content = read_json(st_config)
        value = content.get("max_seq_length") if isinstance(content, dict) else None
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise FormatError(f"{st_config}: field 'max_seq_length' must be a positive integer, got {value!r}")
            max_length = min(value, default_max_length)
    if not modules_path.is_file():
        return SentenceConfig(default_pooling, True, max_length, declared=False)
    modules = read_json(modules_path)
    if not isinstance(modules, list):
        raise FormatError(f"{modules_path}: expected a list of modules")
    pooling, normalize = None, False
    for entry in modules:
        kind, path = _module_type(entry, modules_path)
        if kind == "Pooling":
            pooling = _pooling(directory / path / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind not in ("Transformer",):
            raise ModelError(f"{modules_path}: module {kind!r} is not supported (minfer runs Transformer, "
                             "Pooling and Normalize)")
    return SentenceConfig(pooling or default_pooling, normalize, max_length, declared=True)
