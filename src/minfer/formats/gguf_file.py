"""GGUF files: metadata and memory-mapped tensors (layout and types as the ``gguf`` package defines them).

Nothing here copies tensor data: every tensor is a read-only view into the file's memory map, so a
model costs page cache, not private RAM. Everything that can be wrong with a file (missing, not GGUF,
truncated, a key of the wrong type) becomes a :class:`FormatError` naming the file and the problem.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from minfer.errors import FormatError, MinferError
from minfer.formats.block_types import GGMLType, row_nbytes
from minfer.formats.tensors import FileRows, OpenFile, WeightTensor

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)


class GGUFFile:
    """A parsed GGUF file: ``metadata`` (key -> python value) and ``tensors`` (name -> WeightTensor)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.metadata: dict[str, Any]
        self.tensors: dict[str, WeightTensor]
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
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise FormatError(f"{path}: empty file, not a GGUF file")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                opened = OpenFile(path, f.fileno()) if hasattr(os, "preadv") else None
        except OSError as e:
            raise FormatError(f"{path}: cannot read: {e.strerror}") from None
        self._mmap = mm
        header = _HeaderParser(mm, path)
        self.version, metadata, infos = header.parse()
        self.metadata = metadata

        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise FormatError(f"{path}: general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-header.offset // alignment) * alignment
        buffer = np.frombuffer(mm, dtype=np.uint8)  # read-only, zero-copy view of the whole file
        tensors: dict[str, WeightTensor] = {}
        for name, dims, type_id, offset in infos:
            try:
                ggml_type = GGMLType(type_id)
            except ValueError:
                raise FormatError(f"{path}: tensor {name!r} has unknown ggml type {type_id}") from None
            shape = tuple(reversed(dims))
            n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
            try:
                row_bytes = row_nbytes(ggml_type, shape[-1])
            except MinferError as e:
                raise FormatError(f"{path}: tensor {name!r}: {e}") from None
            begin = data_start + offset
            end = begin + n_rows * row_bytes
            if end > size:
                raise FormatError(
                    f"{path}: truncated GGUF file: tensor {name!r} needs bytes up to {end}, the file has {size}"
                )
            file_rows = FileRows(opened, begin, row_bytes, n_rows) if opened is not None else None
            data = buffer[begin:end].reshape(n_rows, row_bytes)
            tensors[name] = WeightTensor(name, ggml_type, shape, data, file_rows)
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
                f"{self.path}: metadata key {key!r} has value {_short_repr(value)} of type {type(value).__name__}, "
                f"expected {_kind_name(kind)}"
            )
        return value

    def tensor(self, name: str) -> WeightTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: missing tensor {name!r}") from None

    def __iter__(self) -> Iterator[WeightTensor]:
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


class _HeaderParser:
    """Reads the GGUF header (metadata and tensor infos) from the memory map.

    The layout and value types are the ``gguf`` package's (``GGUFValueType``); this parser exists because
    ``gguf.GGUFReader`` builds a numpy view per array element, which takes seconds on a real vocabulary
    (~100k strings). ``tests/test_gguf_file.py`` checks that both read every file identically.
    """

    _SCALARS = {
        GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
        GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
        GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
        GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
    }
    _NUMPY = {
        GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
        GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
        GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
        GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
    }

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.offset = 0
        self.where = "header"

    def _need(self, n: int) -> int:
        start = self.offset
        if n < 0 or start + n > self.size:
            raise FormatError(
                f"{self.path}: truncated GGUF file: {self.where} needs bytes up to {start + n}, "
                f"the file has {self.size}"
            )
        self.offset = start + n
        return start

    def _unpack(self, fmt: str) -> Any:
        start = self._need(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def _string(self) -> str:
        n = self._unpack("<Q")
        start = self._need(n)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self.path}: {self.where}: a string is not valid UTF-8") from None

    def _string_array(self, count: int) -> list[str]:
        # the hot loop of loading a vocabulary: kept free of method calls per element
        buf, size, off = self.buf, self.size, self.offset
        unpack = struct.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                if off + 8 > size:
                    raise IndexError
                (n,) = unpack("<Q", buf, off)
                off += 8
                if off + n > size:
                    raise IndexError
                append(buf[off : off + n].decode("utf-8"))
                off += n
        except IndexError:
            raise FormatError(f"{self.path}: truncated GGUF file: {self.where} runs past the end ({size} B)") from None
        except UnicodeDecodeError:
            raise FormatError(f"{self.path}: {self.where}: a string is not valid UTF-8") from None
        self.offset = off
        return out

    def _value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            etype = self._unpack("<I")
            count = self._unpack("<Q")
            if etype == GGUFValueType.STRING:
                return self._string_array(count)
            if etype in self._NUMPY:
                dt = np.dtype(self._NUMPY[GGUFValueType(etype)])
                start = self._need(count * dt.itemsize)
                return np.frombuffer(self.buf, dtype=dt, count=count, offset=start).tolist()
            if etype == GGUFValueType.ARRAY:
                return [self._value(GGUFValueType.ARRAY) for _ in range(count)]
            raise FormatError(f"{self.path}: {self.where}: unknown array element type {etype}")
        try:
            fmt = self._SCALARS[GGUFValueType(vtype)]
        except (ValueError, KeyError):
            raise FormatError(f"{self.path}: {self.where}: unknown value type {vtype}") from None
        return self._unpack(fmt)

    def parse(self) -> tuple[int, dict[str, Any], list[tuple[str, tuple[int, ...], int, int]]]:
        if self.size < 4 or self.buf[:4] != GGUF_MAGIC:
            raise FormatError(f"{self.path}: not a GGUF file (magic {bytes(self.buf[:4])!r}, expected b'GGUF')")
        self.offset = 4
        version = self._unpack("<I")
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0:
                raise FormatError(f"{self.path}: big-endian GGUF files are not supported")
            raise FormatError(f"{self.path}: GGUF version {version} is not supported (supported: 2, 3)")
        n_tensors = self._unpack("<Q")
        n_kv = self._unpack("<Q")
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            self.where = f"metadata entry {i}"
            key = self._string()
            self.where = f"metadata key {key!r}"
            metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for i in range(n_tensors):
            self.where = f"tensor info {i}"
            name = self._string()
            self.where = f"tensor info {name!r}"
            n_dims = self._unpack("<I")
            if not 1 <= n_dims <= 4:
                raise FormatError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (1 to 4 allowed)")
            dims = tuple(self._unpack("<Q") for _ in range(n_dims))
            type_id = self._unpack("<I")
            offset = self._unpack("<Q")
            infos.append((name, dims, type_id, offset))
        return version, metadata, infos


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
