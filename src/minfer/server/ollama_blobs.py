"""ollama's blob store for ``POST /api/blobs/sha256:<hex>`` and ``HEAD /api/blobs/sha256:<hex>``: the bodies a
client uploads before ``/api/create`` names them, each in a file of one server-owned folder.

The folder is ``--ollama-blobs DIR``, else a temporary one made when the server starts (and removed when it
exits). A blob is written to a temporary file in that folder while its sha256 is computed, and moved to its name
(``sha256-<hex>``, as ollama names them) only when the digest matches: a reader never sees half a blob, and a
mismatch leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from minfer.pull import sha256_file
from minfer.server.errors import ApiError

_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")


def blob_hex(digest: str, field: str = "digest") -> str:
    """The 64 hex digits of ``sha256:<hex>`` (ollama also writes ``sha256-<hex>``); a 400 naming ``field``
    otherwise."""
    m = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if m is None:
        raise ApiError(f"{field}: {digest!r:.80} is not a blob digest (expected \"sha256:\" and 64 lowercase hex "
                       "digits)", param=field)
    return m.group(1)


class BlobStore:
    """Blobs by digest in ``folder`` (None: a temporary folder of this store's own, removed with it)."""

    def __init__(self, folder: str | os.PathLike[str] | None = None) -> None:
        self._owned: tempfile.TemporaryDirectory[str] | None = None
        if folder is None:
            self._owned = tempfile.TemporaryDirectory(prefix="minfer-ollama-blobs-")
            folder = self._owned.name
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str, field: str = "digest") -> Path:
        """Where the blob ``digest`` is (or would be) stored."""
        return self.folder / f"sha256-{blob_hex(digest, field)}"

    def has(self, digest: str, field: str = "digest") -> bool:
        return self.path(digest, field).is_file()

    async def write(self, digest: str, chunks: AsyncIterator[bytes]) -> bool:
        """Store the body ``chunks`` as blob ``digest`` once its sha256 is checked: whether it was new (a blob
        already held is replaced by the same bytes). A 400 naming the digest when the body's differs."""
        target = self.path(digest)
        want = blob_hex(digest)
        h = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(prefix=".upload-", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in chunks:
                    h.update(chunk)
                    await asyncio.to_thread(f.write, chunk)  # (a disk write must not hold up the event loop)
                await asyncio.to_thread(os.fsync, f.fileno())
            got = h.hexdigest()
            if got != want:
                raise ApiError(f"digest: the body's sha256 is {got}, not the sha256:{want} the path names",
                               param="digest")
            existed = target.is_file()
            os.replace(tmp, target)
            return not existed
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def close(self) -> None:
        """Remove the folder when this store made it (a ``--ollama-blobs`` folder stays)."""
        if self._owned is not None:
            self._owned.cleanup()
            self._owned = None


def model_size(path: Path) -> int:
    """ollama's ``size`` of a model: its file's bytes (of a folder: its files')."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def model_sha256(path: Path) -> str:
    """ollama's ``digest`` of a model: its file's sha256 (of a folder: of its files' names and sha256s, sorted)."""
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(path)}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()
