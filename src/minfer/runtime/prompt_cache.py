"""A host-memory cache of KV blocks that left the pool (llama-server's ``--cache-ram``), found again by the
tokens they hold.

A block of a sequence is named by a hash chain: the hash of the previous block's name and its own
``KV_BLOCK`` tokens, from a root that names what else decides its cells (the adapter scales it was
computed with). Equal names mean equal tokens at equal positions after an equal prefix, so the cells are
the ones a fresh evaluation would write (the engine's prefill and decode rows are bit-identical). When a
slot's cached tokens are about to be overwritten or dropped, its full blocks are copied here; a later
prompt that starts with them gets its cells copied back instead of evaluated. Bounded by bytes; the least
recently used blocks go first: to a :class:`DiskBlocks` folder where there is one (``--cache-disk``), whose
files are written atomically and read back only when their checksum, name and fingerprint (the weights,
the adapters, the cell type) are the ones asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from minfer.errors import MinferError
from minfer.formats.atomic import write_atomically
from minfer.runtime.kv_cache import KV_BLOCK

if TYPE_CHECKING:
    from minfer.models.model import TransformerModel

BlockCells = list[tuple[np.ndarray, np.ndarray]]  # per layer: K and V rows of one block, in the stored type


def block_names(tokens: Sequence[int], n_blocks: int, root: bytes) -> list[bytes]:
    """The names of the first ``n_blocks`` full blocks of ``tokens`` (see the module's text)."""
    names = []
    prev = hashlib.blake2b(root, digest_size=16).digest()
    ids = np.asarray(tokens[: n_blocks * KV_BLOCK], dtype=np.int64)
    for b in range(n_blocks):
        prev = hashlib.blake2b(prev + ids[b * KV_BLOCK : (b + 1) * KV_BLOCK].tobytes(), digest_size=16).digest()
        names.append(prev)
    return names


def cells_fingerprint(model: TransformerModel, cache_type: str) -> str:
    """What a block's cells depend on besides its tokens and the adapter scales: the weights, the adapters
    applied (by index), the cell type and the block size."""
    h = hashlib.sha256()
    model.digest_weights(h)
    for adapter in model.loras:
        h.update(f"applied:{adapter.path.name};".encode())
    h.update(f"cells:{cache_type}:{KV_BLOCK}".encode())
    return f"{model.arch.name}:{model.path.name}:{h.hexdigest()[:24]}"


def _nbytes(cells: BlockCells) -> int:
    return sum(k.nbytes + v.nbytes for k, v in cells)


class DiskBlocks:
    """Blocks' cells in files of one folder, at most ``max_bytes`` of this ``fingerprint``'s (the oldest
    files go first). A file is ``MAGIC``, a header's length and JSON (fingerprint, name, each array's shape
    and type), the arrays, and a blake2b checksum of all before it; it is written atomically, and read back
    only when every part checks out (anything else is deleted and counts as a miss)."""

    MAGIC = b"MINFERKV1\n"

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int, fingerprint: str) -> None:
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MinferError(f"--cache-disk {self.folder}: {e.strerror or e}") from None
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self._prefix = hashlib.blake2b(fingerprint.encode(), digest_size=8).hexdigest() + "-"
        self._sizes: OrderedDict[bytes, int] = OrderedDict()  # name -> file bytes, oldest first
        mine = [p for p in self.folder.glob(self._prefix + "*.kvb")]
        for path in sorted(mine, key=lambda p: p.stat().st_mtime):
            try:
                self._sizes[bytes.fromhex(path.stem[len(self._prefix):])] = path.stat().st_size
            except (ValueError, OSError):
                continue
        self.nbytes = sum(self._sizes.values())
        self.rejected = 0  # files that did not check out
        self.failed_writes = 0

    def __contains__(self, name: bytes) -> bool:
        return name in self._sizes

    def _path(self, name: bytes) -> Path:
        return self.folder / f"{self._prefix}{name.hex()}.kvb"

    def put(self, name: bytes, cells: BlockCells) -> None:
        if name in self._sizes:
            return
        header = json.dumps({"fingerprint": self.fingerprint, "name": name.hex(),
                             "arrays": [[list(a.shape), a.dtype.str] for pair in cells for a in pair]}).encode()
        body = b"".join([self.MAGIC, struct.pack("<I", len(header)), header,
                         *(np.ascontiguousarray(a).tobytes() for pair in cells for a in pair)])
        data = body + hashlib.blake2b(body, digest_size=32).digest()
        if len(data) > self.max_bytes:
            return
        while self._sizes and self.nbytes + len(data) > self.max_bytes:
            old, size = self._sizes.popitem(last=False)
            self.nbytes -= size
            self._path(old).unlink(missing_ok=True)
        try:
            write_atomically(self._path(name), data, "KV cache block")
        except MinferError:  # a full or read-only disk: the block is simply not kept
            self.failed_writes += 1
            return
        self._sizes[name] = len(data)
        self.nbytes += len(data)

    def get(self, name: bytes) -> BlockCells | None:
        if name not in self._sizes:
            return None
        path = self._path(name)
        try:
            cells = self._parse(path.read_bytes(), name)
        except OSError:
            cells = None
        if cells is None:  # missing, damaged, or not what was asked for: never used
            self.rejected += 1
            self.nbytes -= self._sizes.pop(name)
            path.unlink(missing_ok=True)
        return cells

    def _parse(self, data: bytes, name: bytes) -> BlockCells | None:
        body, checksum = data[:-32], data[-32:]
        if not body.startswith(self.MAGIC) or hashlib.blake2b(body, digest_size=32).digest() != checksum:
            return None
        at = len(self.MAGIC)
        (n,) = struct.unpack_from("<I", body, at)
        try:
            header = json.loads(body[at + 4 : at + 4 + n])
            if header["fingerprint"] != self.fingerprint or header["name"] != name.hex():
                return None
            arrays, at = [], at + 4 + n
            for shape, dtype in header["arrays"]:
                count = int(np.prod(shape))
                a = np.frombuffer(body, np.dtype(dtype), count, at).reshape(shape).copy()
                at += a.nbytes
                arrays.append(a)
        except (ValueError, KeyError, TypeError, struct.error):
            return None
        if at != len(body) or len(arrays) % 2:
            return None
        return [(arrays[i], arrays[i + 1]) for i in range(0, len(arrays), 2)]


class PromptCache:
    """Blocks' cells by name, at most ``max_bytes`` of them in memory, and the ones that leave it in
    ``disk`` (if any)."""

    def __init__(self, max_bytes: int, disk: DiskBlocks | None = None) -> None:
        self.max_bytes = max_bytes
        self.disk = disk
        self._blocks: OrderedDict[bytes, BlockCells] = OrderedDict()
        self.nbytes = 0
        self.stored = 0  # blocks copied in
        self.restored = 0  # blocks copied back out

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, name: bytes) -> bool:
        return name in self._blocks or (self.disk is not None and name in self.disk)

    def put(self, name: bytes, cells: BlockCells) -> None:
        """Keep ``cells`` under ``name`` (the least recently used blocks leave to make room: to disk)."""
        if name in self._blocks:
            self._blocks.move_to_end(name)
            return
        size = _nbytes(cells)
        if size > self.max_bytes:
            if self.disk is not None:
                self.disk.put(name, cells)
            return
        while self.nbytes + size > self.max_bytes:
            old_name, old = self._blocks.popitem(last=False)
            self.nbytes -= _nbytes(old)
            if self.disk is not None:
                self.disk.put(old_name, old)
        self._blocks[name] = cells
        self.nbytes += size
        self.stored += 1

    def get(self, name: bytes) -> BlockCells | None:
        cells = self._blocks.get(name)
        if cells is not None:
            self._blocks.move_to_end(name)
        elif self.disk is not None:
            cells = self.disk.get(name)
        return cells
