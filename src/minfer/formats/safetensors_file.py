"""Safetensors files and sharded folders: tensors memory-mapped in place, never copied.

A safetensors file is an 8-byte little-endian header length, a JSON header (``name -> {dtype, shape,
data_offsets}``, plus ``__metadata__``) and the raw tensor bytes. The ``safetensors`` package validates the
header (offsets in order, no overlap, sizes matching dtype x shape, within the file): every file is opened
with ``safetensors.safe_open`` first, and its names, dtypes and shapes are what we use. The bytes are then
mapped ourselves, because the package's numpy API copies each tensor into private memory
(``get_tensor`` reads it out) and has no numpy dtype for bf16, while its torch API needs torch. Our
tensors are read-only ``uint8[rows, row_bytes]`` views of one ``mmap`` per file, the same
:class:`~minfer.formats.tensors.WeightTensor` records a GGUF file gives, so the kernels cannot tell the
formats apart: F32, F16 and BF16 map onto the engine's own F32/F16/BF16 block types.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import FormatError
from minfer.formats.block_types import GGMLType
from minfer.formats.tensors import FileRows, OpenFile, WeightTensor

# safetensors dtype -> the engine's type; other dtypes are listed, and refused when a model needs them
SAFETENSORS_TYPES: dict[str, GGMLType] = {"F32": GGMLType.F32, "F16": GGMLType.F16, "BF16": GGMLType.BF16}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, whether or not the engine can use its dtype."""

    name: str
    dtype: str  # safetensors dtype name ("BF16", "F8_E4M3", ...)
    shape: tuple[int, ...]
    file: Path


class SafetensorsFile:
    """One ``.safetensors`` file: ``infos`` for every tensor, ``tensors`` for those in F32/F16/BF16."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.metadata: dict[str, str] = {}
        self.infos: dict[str, TensorInfo] = {}
        self.tensors: dict[str, WeightTensor] = {}
        self._read()

    def _read(self) -> None:
        import safetensors

        path = self.path
        if not path.is_file():
            raise FormatError(f"{path}: no such file")
        try:
            with safetensors.safe_open(str(path), framework="numpy") as st:
                keys = list(st.keys())
                declared = {k: (st.get_slice(k).get_dtype(), tuple(st.get_slice(k).get_shape())) for k in keys}
                self.metadata = dict(st.metadata() or {})
        except Exception as e:  # SafetensorError and the Rust side's own errors (truncated, bad JSON, ...)
            raise FormatError(f"{path}: not a valid safetensors file ({_first_line(e)})") from None
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
                opened = OpenFile(path, f.fileno()) if size and hasattr(os, "preadv") else None
        except (OSError, ValueError, struct.error) as e:
            raise FormatError(f"{path}: cannot read the safetensors header ({e})") from None
        self._mmap = mm
        buffer = np.frombuffer(mm, dtype=np.uint8) if mm is not None else np.zeros(0, np.uint8)
        data_start = 8 + n
        for name in keys:
            entry = header[name]
            dtype, shape = declared[name]
            if entry.get("dtype") != dtype or tuple(entry.get("shape", ())) != shape:
                raise FormatError(f"{path}: tensor {name!r}: header and safetensors disagree")
            self.infos[name] = TensorInfo(name, dtype, shape, path)
            if dtype not in SAFETENSORS_TYPES:
                continue
            begin, end = (data_start + int(o) for o in entry["data_offsets"])
            n_cols = shape[-1] if shape else 1
            n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
            row_bytes = n_cols * _ITEMSIZE[dtype]
            data = buffer[begin:end]
            rows = FileRows(opened, begin, row_bytes, n_rows) if opened is not None else None
            if begin % _ITEMSIZE[dtype]:
                data = data.copy()  # a misaligned tensor (no writer we know makes one): aligned private copy
            self.tensors[name] = WeightTensor(name, SAFETENSORS_TYPES[dtype], shape, data.reshape(n_rows, row_bytes),
                                            rows)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def read_json(path: Path, required: bool = True) -> Any:
    """A JSON file's content; None for a missing optional file; a one-line FormatError otherwise."""
    if not path.is_file():
        if required:
            raise FormatError(f"{path}: missing")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise FormatError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise FormatError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise FormatError(f"{path}: nested too deeply to be a configuration") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise FormatError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror})") from None


class SafetensorsFolder:
    """The weights of an HF model folder: ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` names. ``infos`` / ``tensors`` are keyed by tensor name."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.index_path: Path | None = None
        self.files: list[SafetensorsFile] = []
        self.infos: dict[str, TensorInfo] = {}
        self.tensors: dict[str, WeightTensor] = {}
        index = self.directory / INDEX_NAME
        if index.is_file():
            self._read_index(index)
        elif (self.directory / SINGLE_NAME).is_file():
            self._add(SafetensorsFile(self.directory / SINGLE_NAME))
        else:
            others = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if others:
                raise FormatError(f"{self.directory}: {len(others)} .safetensors files ({others[0]}, ...) but no "
                                  f"{INDEX_NAME} naming which tensor is in which")
            bins = sorted(p.name for p in self.directory.glob("*.bin"))
            hint = f" (PyTorch {bins[0]} weights are not supported: convert them to safetensors)" if bins else ""
            raise FormatError(f"{self.directory}: no {SINGLE_NAME} or {INDEX_NAME}{hint}")

    @property
    def sharded(self) -> bool:
        return self.index_path is not None

    def _add(self, f: SafetensorsFile) -> None:
        for name, info in f.infos.items():
            if name in self.infos:
                raise FormatError(f"{f.path}: tensor {name!r} is also in {self.infos[name].file.name}")
            self.infos[name] = info
        self.tensors.update(f.tensors)
        self.files.append(f)

    def _read_index(self, index: Path) -> None:
        self.index_path = index
        content = read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise FormatError(f"{index}: field 'weight_map' must be a non-empty object (tensor name -> shard file)")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or Path(shard).name != shard:
                raise FormatError(f"{index}: weight_map[{name!r}] = {shard!r} is not a file name in the folder")
            by_shard.setdefault(shard, []).append(name)
        for shard, names in by_shard.items():
            path = self.directory / shard
            if not path.is_file():
                raise FormatError(f"{index}: shard {shard!r} (holding {names[0]!r} and {len(names) - 1} more) "
                                  f"does not exist")
            f = SafetensorsFile(path)
            missing = [n for n in names if n not in f.infos]
            if missing:
                raise FormatError(f"{path}: tensor {missing[0]!r} that {INDEX_NAME} puts here is missing")
            self._add(f)
        unlisted = sorted(set(self.infos) - set(weight_map))
        if unlisted:
            raise FormatError(f"{index}: tensor {unlisted[0]!r} of {self.infos[unlisted[0]].file.name} is not "
                              f"in weight_map")
