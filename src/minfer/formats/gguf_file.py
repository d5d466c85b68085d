"""GGUF files: metadata and memory-mapped tensors, read with the ``gguf`` package.

Nothing here copies tensor data: every tensor is a read-only view into the file's memory map, so a
model costs page cache, not private RAM. Everything that can be wrong with a file (missing, not GGUF,
truncated, a key of the wrong type) becomes a :class:`FormatError` naming the file and the problem.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import FormatError
from minfer.formats.quants import GGMLType, row_nbytes

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file.

    ``shape`` is in numpy order (rows first): a GGUF matrix with ``ne = [n_in, n_out]`` has shape
    ``(n_out, n_in)``. ``data`` is the raw memory-mapped bytes, one row of ``shape[-1]`` values per
    row of the array: ``uint8[n_rows, row_nbytes]``.
    """

    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> python value) and ``tensors`` (name -> GGUFTensor)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.metadata: dict[str, Any]
        self.tensors: dict[str, GGUFTensor]
        self.version: int
        self._read()

    def _read(self) -> None:
        path = self.path
        if not path.exists():
            raise FormatError(f"{path}: no such file")
        if path.is_dir():
            raise FormatError(f"{path}: is a directory, not a GGUF file")
        try:
            with open(path, "rb") as f:
                head = f.read(8)
        except OSError as e:
            raise FormatError(f"{path}: cannot read: {e.strerror}") from None
        if head[:4] != GGUF_MAGIC:
            raise FormatError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
        if len(head) < 8:
            raise FormatError(f"{path}: truncated GGUF file (only {len(head)} bytes)")
        version = int.from_bytes(head[4:8], "little")
        if version not in SUPPORTED_VERSIONS:
            raise FormatError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
        self.version = version

        import gguf  # imported lazily: it pulls in a few modules the CLI's --help does not need

        try:
            reader = gguf.GGUFReader(path, "r")
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
            raise FormatError(f"{path}: truncated or corrupt GGUF file ({e})") from None
        file_size = os.path.getsize(path)

        metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                metadata[key] = field.contents()
            except (ValueError, IndexError, UnicodeDecodeError) as e:
                raise FormatError(f"{path}: metadata key {key!r} is corrupt ({e})") from None
        self.metadata = metadata

        tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            try:
                ggml_type = GGMLType(int(t.tensor_type))
            except ValueError:
                raise FormatError(
                    f"{path}: tensor {t.name!r} has ggml type {int(t.tensor_type)} which minfer does not know"
                ) from None
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            end = int(t.data_offset) + int(t.n_bytes)
            if end > file_size:
                raise FormatError(
                    f"{path}: truncated GGUF file: tensor {t.name!r} needs bytes up to {end}, "
                    f"file has {file_size}"
                )
            n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
            expected = n_rows * row_nbytes(ggml_type, shape[-1])
            if expected != int(t.n_bytes):
                raise FormatError(
                    f"{path}: tensor {t.name!r} ({ggml_type.name}, shape {shape}) has {int(t.n_bytes)} bytes, "
                    f"expected {expected}"
                )
            raw = reader.data[int(t.data_offset) : end].reshape(n_rows, expected // n_rows)
            tensors[t.name] = GGUFTensor(t.name, ggml_type, shape, raw)
        self.tensors = tensors

    # -- typed metadata access ------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str, kind: type | tuple[type, ...] | None = None) -> Any:
        """The value of ``key``; a FormatError naming the key when it is missing or of the wrong kind."""
        if key not in self.metadata:
            raise FormatError(f"{self.path}: missing metadata key {key!r}")
        value = self.metadata[key]
        if kind is not None and not _is_kind(value, kind):
            raise FormatError(
                f"{self.path}: metadata key {key!r} has value {value!r} of type {type(value).__name__}, "
                f"expected {_kind_name(kind)}"
            )
        return value

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: missing tensor {name!r}") from None

    def __iter__(self) -> Iterator[GGUFTensor]:
        return iter(self.tensors.values())

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture", str))

    def summary_metadata(self, max_list: int = 8) -> Mapping[str, Any]:
        """Metadata with long lists (vocabularies, merges) abbreviated, for display."""
        out: dict[str, Any] = {}
        for k, v in self.metadata.items():
            if isinstance(v, list) and len(v) > max_list:
                out[k] = f"[{len(v)} items: {', '.join(repr(x) for x in v[:3])}, ...]"
            elif isinstance(v, str) and len(v) > 200:
                out[k] = v[:200].replace("\n", "\\n") + f"... ({len(v)} chars)"
            else:
                out[k] = v
        return out


def _is_kind(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False
    if float in kinds and isinstance(value, int):
        return True
    return isinstance(value, kinds)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)
