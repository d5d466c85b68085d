"""A checkpoint's tensors as the engine reads them, whatever file they come from: rows of blocks of one
ggml type, memory-mapped (:class:`WeightTensor`), a mixture of experts' matrices of one kind
(:class:`ExpertTensors`), and where the rows lie in their file, to read a few without the map
(:class:`FileRows`). GGUF files (:mod:`minfer.formats.gguf_file`) and safetensors folders
(:mod:`minfer.formats.safetensors_file`) both give these."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minfer.errors import FormatError
from minfer.formats.block_types import GGMLType


class OpenFile:
    """A file kept open for reading at offsets (``os.preadv``), closed when the last holder is gone."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = os.dup(fd)  # the very file that was mapped, even if the path is replaced later
        weakref.finalize(self, os.close, self.fd)


@dataclass(frozen=True)
class FileRows:
    """Where a tensor's rows lie in its file, to read a few of them without touching the memory map.

    Reading scattered rows through the map (an embedding lookup) maps the kernel's fault-around window
    (64 KiB) around each into the process: 512 random tokens of a 1.7B model's embeddings made 55 MiB of
    the file resident. Read with ``preadv``, the rows go through the page cache only."""

    file: OpenFile
    offset: int  # of row 0
    row_bytes: int
    n_rows: int

    def sub(self, r0: int, r1: int) -> FileRows:
        """Rows ``r0..r1`` as rows of their own."""
        return FileRows(self.file, self.offset + r0 * self.row_bytes, self.row_bytes, r1 - r0)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """``uint8[len(ids), row_bytes]``: the rows ``ids`` (each in ``0 .. n_rows - 1``)."""
        ids = np.asarray(ids).reshape(-1)
        out = np.empty((ids.size, self.row_bytes), np.uint8)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.n_rows):
            raise IndexError(f"row ids {int(ids.min())}..{int(ids.max())} outside 0..{self.n_rows - 1}")
        fd, offset, rb = self.file.fd, self.offset, self.row_bytes
        for i, r in enumerate(ids.tolist()):
            if os.preadv(fd, [out[i]], offset + r * rb) != rb:
                raise FormatError(f"{self.file.path}: shorter than when it was loaded (changed on disk?)")
        return out


@dataclass(frozen=True)
class WeightTensor:
    """One tensor of a checkpoint (a GGUF file's, or a safetensors file's under its engine name).

    ``shape`` is in numpy order (rows first): a GGUF matrix with ``ne = [n_in, n_out]`` has shape
    ``(n_out, n_in)``. ``data`` is the raw memory-mapped bytes, one row of ``shape[-1]`` values per
    row of the array: ``uint8[n_rows, row_nbytes]``. ``file_rows``, where the rows come straight from a
    file, reads some of them without the map (see :class:`FileRows`).
    """

    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]
    data: np.ndarray
    file_rows: FileRows | None = field(default=None, compare=False, repr=False)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """``data[ids]`` (a copy), read from the file where it can be, so that no page is mapped for it."""
        if self.file_rows is not None:
            return self.file_rows.read(ids)
        return self.data[ids]

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def tensor_rows(t: WeightTensor, r0: int, r1: int, name: str, shape: tuple[int, ...] | None = None) -> WeightTensor:
    """Rows ``r0..r1`` of ``t.data`` as a tensor of its own: a view of the same bytes (a fused projection's
    part; ``shape``, where the rows are not those of a matrix: one expert of a stacked tensor)."""
    rows = t.file_rows.sub(r0, r1) if t.file_rows is not None else None
    return WeightTensor(name, t.ggml_type, shape or (r1 - r0, *t.shape[1:]), t.data[r0:r1], rows)


@dataclass(frozen=True)
class ExpertTensors:
    """A mixture-of-experts layer's matrices of one kind, one ``[rows, cols]`` matrix per expert, with the
    numpy shape ``(n_expert, rows, cols)`` of GGUF's stacked ``ffn_*_exps`` tensors. From a GGUF file each
    expert is a view of its rows of the stacked tensor; from an HF folder, each expert's own tensor."""

    name: str
    experts: tuple[WeightTensor, ...]

    @classmethod
    def from_stacked(cls, t: WeightTensor) -> ExpertTensors:
        if len(t.shape) != 3:
            raise FormatError(f"tensor {t.name!r} has shape {t.shape}, expected 3-D (experts, rows, columns)")
        n, rows = t.shape[0], t.shape[1]
        return cls(t.name, tuple(tensor_rows(t, e * rows, (e + 1) * rows, f"{t.name}[{e}]", t.shape[1:])
                                 for e in range(n)))

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.experts), *self.experts[0].shape)

    @property
    def ggml_type(self) -> GGMLType:
        return self.experts[0].ggml_type

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.experts)
