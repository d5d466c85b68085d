"""The session file: a conversation saved by one process and resumed by another.

A session holds what the next turn needs without recomputing the prompt: the tokens already in the KV
cache, the sampler's state, free metadata (system prompt, messages, sampling parameters), the KV cells
in their stored type, and the identity fields that say which model and cache they belong to.

File layout (format version 1; all integers little-endian)::

    offset      size  field
    0           10    magic b"MINFERSESS"
    10          4     u32 format version (1)
    14          32    sha256 of every byte from offset 46 to the end of the file (all that follows this field)
    46          8     u64 header length H
    54          8     u64 data length D
    62          H     header: a UTF-8 JSON object (below)
    62 + H      P     zero bytes up to the next multiple of 64 (P < 64)
    S = 62+H+P  D     data: each array's raw C-order little-endian bytes at S + its offset (a multiple of 64),
                      zero bytes between arrays; the file ends at S + D

The header::

    {"model_fingerprint": str, "cache_type": str, "n_ctx": int,
     "tokens": [int, ...], "sampler_state": {...}, "meta": {...},
     "arrays": [{"name": str, "dtype": "float32" | "float16" | "uint8", "shape": [int, ...],
                 "offset": int, "nbytes": int}, ...]}

Why this shape: the magic and version come first so that a reader can tell "not a session" and "written by
a newer minfer" apart from corruption before trusting anything else; the lengths let it tell truncation
(or trailing garbage) apart from a flipped bit; the checksum covers the lengths, the header and every data
byte, so a single damaged byte anywhere after the version field is caught before the header is parsed.
The version field itself is not hashed: a reader must act on it before it knows the hashing scheme (a
damaged version reads as an unknown or newer version, still an error). 64-byte alignment lets a later
reader map the arrays in place.

Saving is atomic: the file is written under a temporary name in the same directory, flushed and fsynced,
then renamed over ``path`` (``os.replace``), and the directory is fsynced. ``path`` therefore holds either
the old file or the complete new one, never a half-written file. ``save_session`` refuses to replace a
file that is not a whole, intact minfer session (anything the user owns is safe); an empty file may be
replaced. The temporary name carries the writer's pid: a save killed midway (SIGKILL) leaves one behind,
and the next save to the same path removes it (:func:`~minfer.formats.atomic.remove_stale_temps`).

Loading verifies magic, version, lengths, checksum and the header's structure before returning anything:
a damaged or truncated file raises :class:`~minfer.errors.FormatError` naming the file and the problem,
never partial data. Identity checks against the running model come next and raise
:class:`~minfer.errors.BadRequestError`. Whether the arrays fit the model (one row per token, the right
widths) is the caller's check: only it knows the cache layout.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from minfer.errors import BadRequestError, FormatError, MinferError
from minfer.formats.atomic import atomic_writer

FORMAT_VERSION = 1
MAGIC = b"MINFERSESS"

_VERSION = struct.Struct("<I")
_LENGTHS = struct.Struct("<QQ")
_DIGEST_SIZE = 32
_VERSION_AT = len(MAGIC)  # 10
_DIGEST_AT = _VERSION_AT + _VERSION.size  # 14
_HASHED_FROM = _DIGEST_AT + _DIGEST_SIZE  # 46: everything from here on is covered by the checksum
_HEADER_AT = _HASHED_FROM + _LENGTHS.size  # 62
_ALIGN = 64
_CHUNK = 1 << 20

# On-disk dtypes, always little-endian. The KV cells are stored as f32, f16 or packed uint8 blocks.
_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "uint8": np.dtype("u1"),
}
_HEADER_KEYS = ("model_fingerprint", "cache_type", "n_ctx", "tokens", "sampler_state", "meta", "arrays")
_ARRAY_KEYS = ("name", "dtype", "shape", "offset", "nbytes")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@dataclass
class SessionData:
    """Everything a session file holds.

    ``sampler_state`` and ``meta`` are JSON-able dicts (string keys; tuples come back as lists).
    ``arrays`` maps names (for instance ``"k.0"``, ``"v.0"``) to numpy arrays of dtype float32, float16
    or uint8: the KV cells of the used positions in their stored type.
    """

    model_fingerprint: str
    cache_type: str
    n_ctx: int
    tokens: list[int]
    sampler_state: dict
    meta: dict
    arrays: dict[str, np.ndarray]


# ---------------------------------------------------------------------------------------------------------
# saving


def save_session(path: str | os.PathLike[str], data: SessionData) -> None:
    """Write ``data`` to ``path`` atomically (see the module docstring for the layout).

    Raises :class:`BadRequestError` when ``data`` cannot be stored as given (a non-JSON value, an
    unsupported dtype, ...) or when ``path`` exists and is not a minfer session file (it is left alone),
    and :class:`MinferError` when the file cannot be written; ``path`` is unchanged in every error case.
    """
    shown = os.fspath(path)
    header, arrays = _encode(data)
    # Replace what a symlink points to, not the link: the user's link keeps working.
    _refuse_foreign_file(os.path.realpath(shown), shown)
    with atomic_writer(shown, f"cannot save session to {shown}") as f:
        _write(f, header, arrays)


def _encode(data: SessionData) -> tuple[bytes, list[tuple[dict[str, Any], np.ndarray]]]:
    """The JSON header and the arrays to write (C order, little-endian), checking every field."""
    if not isinstance(data, SessionData):
        raise BadRequestError(f"save_session needs a SessionData, got {type(data).__name__}")
    for key in ("model_fingerprint", "cache_type"):
        if not isinstance(getattr(data, key), str):
            raise BadRequestError(f"session {key} must be a string, got {type(getattr(data, key)).__name__}")
    if isinstance(data.n_ctx, bool) or not isinstance(data.n_ctx, int | np.integer) or data.n_ctx < 1:
        raise BadRequestError(f"session n_ctx must be a positive integer, got {data.n_ctx!r}")
    if not isinstance(data.tokens, list | tuple | np.ndarray):
        raise BadRequestError(f"session tokens must be a list of int32 values, got {type(data.tokens).__name__}")
    tokens = []
    for t in data.tokens:
        if isinstance(t, bool) or not isinstance(t, int | np.integer) or not _INT32_MIN <= t <= _INT32_MAX:
            raise BadRequestError(f"session tokens must be int32 values, got {t!r}")
        tokens.append(int(t))
    for key in ("sampler_state", "meta"):
        value = getattr(data, key)
        if not isinstance(value, dict):
            raise BadRequestError(f"session {key} must be a dict, got {type(value).__name__}")
        _check_json(value, key)
    if not isinstance(data.arrays, dict):
        raise BadRequestError(f"session arrays must be a dict of numpy arrays, got {type(data.arrays).__name__}")

    entries: list[dict[str, Any]] = []
    arrays: list[tuple[dict[str, Any], np.ndarray]] = []
    offset = 0
    for name, a in data.arrays.items():
        if not isinstance(name, str) or not name:
            raise BadRequestError(f"session array names must be non-empty strings, got {name!r}")
        if not isinstance(a, np.ndarray):
            raise BadRequestError(f"session array {name!r} must be a numpy array, got {type(a).__name__}")
        # any byte order: stored little-endian
        dtype_name = next(
            (k for k, v in _DTYPES.items() if (a.dtype.kind, a.dtype.itemsize) == (v.kind, v.itemsize)), None
        )
        if dtype_name is None:
            supported = ", ".join(_DTYPES)
            raise BadRequestError(f"session array {name!r} has dtype {a.dtype}; supported: {supported}")
        a = np.asarray(a, dtype=_DTYPES[dtype_name], order="C")  # (ascontiguousarray would make 0-d 1-d)
        offset = _aligned(offset)
        entry = {"name": name, "dtype": dtype_name, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes}
        entries.append(entry)
        arrays.append((entry, a))
        offset += a.nbytes
    header = {
        "model_fingerprint": data.model_fingerprint,
        "cache_type": data.cache_type,
        "n_ctx": int(data.n_ctx),
        "tokens": tokens,
        "sampler_state": data.sampler_state,
        "meta": data.meta,
        "arrays": entries,
    }
    # ASCII JSON: any str (even one holding a lone surrogate) encodes, and the header stays readable.
    return json.dumps(header, ensure_ascii=True, separators=(",", ":")).encode("ascii"), arrays


def _check_json(value: Any, where: str) -> None:
    """Refuse what JSON would not give back as it was: non-string keys (JSON turns 1 into "1"), objects."""
    if value is None or isinstance(value, str | int):
        return
    if isinstance(value, float):  # NaN and +-inf too: Python's json writes and reads them back
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise BadRequestError(f"session {where} has a non-string key {k!r} (JSON keys are strings)")
            _check_json(v, f"{where}[{k!r}]")
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]")
        return
    raise BadRequestError(f"session {where} holds a {type(value).__name__}, which is not JSON")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _refuse_foreign_file(target: str, shown: str) -> None:
    """Only an empty file or a whole, intact session may be replaced: a file that merely starts with the
    magic (a damaged session, or the user's own file) is left alone."""
    try:
        with open(target, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return
            try:
                _read_prelude(f, size, shown)
                _verify_checksum(f, shown)
            except FormatError:
                raise BadRequestError(
                    f"refusing to overwrite {shown}: it exists and is not a minfer session file (or not an "
                    "intact one); choose another path (or remove it)"
                ) from None
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise BadRequestError(f"cannot save session to {shown}: it is a directory") from None
    except OSError as e:
        raise MinferError(f"cannot save session to {shown}: {e.strerror or e}") from e


def _write(f: BinaryIO, header: bytes, arrays: list[tuple[dict[str, Any], np.ndarray]]) -> None:
    data_len = _aligned(arrays[-1][0]["offset"] + arrays[-1][1].nbytes) if arrays else 0
    digest = hashlib.sha256()

    def out(b: bytes | memoryview | np.ndarray) -> None:
        digest.update(b)
        f.write(b)

    f.write(MAGIC + _VERSION.pack(FORMAT_VERSION) + bytes(_DIGEST_SIZE))  # digest filled in at the end
    out(_LENGTHS.pack(len(header), data_len))
    out(header)
    out(bytes(_aligned(_HEADER_AT + len(header)) - _HEADER_AT - len(header)))
    pos = 0
    for entry, a in arrays:
        out(bytes(entry["offset"] - pos))
        if a.nbytes:
            out(a.reshape(-1).view(np.uint8))
        pos = entry["offset"] + a.nbytes
    out(bytes(data_len - pos))
    f.seek(_DIGEST_AT)
    f.write(digest.digest())


# ---------------------------------------------------------------------------------------------------------
# loading


def load_session(
    path: str | os.PathLike[str], expect_fingerprint: str | None = None, expect_cache_type: str | None = None
) -> SessionData:
    """Read a session file written by :func:`save_session`, verifying it entirely first.

    Raises :class:`FormatError` (naming the file and the problem) for a missing, unreadable, truncated,
    damaged or foreign file or one written by a newer minfer, then :class:`BadRequestError` when
    ``expect_fingerprint`` / ``expect_cache_type`` are given and differ from the saved ones. The arrays
    come back as independent, writable, native-endian numpy arrays.
    """
    shown = os.fspath(path)
    try:
        with open(shown, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header_len, data_len = _read_prelude(f, size, shown)
            _verify_checksum(f, shown)
            f.seek(_HEADER_AT)
            header = _parse_header(_read_exact(f, header_len, shown), data_len, shown)
            _check_identity(header, expect_fingerprint, expect_cache_type, shown)
            data_at = _aligned(_HEADER_AT + header_len)
            arrays = {e["name"]: _read_array(f, data_at, e, shown) for e in header["arrays"]}
    except FileNotFoundError:
        raise FormatError(f"session file {shown} does not exist") from None
    except IsADirectoryError:
        raise FormatError(f"session file {shown} is a directory") from None
    except OSError as e:
        raise FormatError(f"cannot read session file {shown}: {e.strerror or e}") from e
    return SessionData(
        model_fingerprint=header["model_fingerprint"],
        cache_type=header["cache_type"],
        n_ctx=header["n_ctx"],
        tokens=header["tokens"],
        sampler_state=header["sampler_state"],
        meta=header["meta"],
        arrays=arrays,
    )


def _read_exact(f: BinaryIO, n: int, shown: str) -> bytes:
    b = f.read(n)
    if len(b) != n:  # the file shrank after its size was checked
        raise FormatError(f"session file {shown} is truncated (changed while being read)")
    return b


def _read_prelude(f: BinaryIO, size: int, shown: str) -> tuple[int, int]:
    head = f.read(_HEADER_AT)
    if head[: len(MAGIC)] != MAGIC[: len(head)] or not head:
        raise FormatError(f"{shown} is not a minfer session file (it does not start with {MAGIC!r})")
    if len(head) < _DIGEST_AT:
        raise FormatError(f"session file {shown} is truncated: {size} bytes, not even a format version")
    (version,) = _VERSION.unpack_from(head, _VERSION_AT)
    if version > FORMAT_VERSION:
        raise FormatError(
            f"session file {shown} has format version {version}, written by a newer minfer; "
            f"this minfer reads format version {FORMAT_VERSION}"
        )
    if version < 1:
        raise FormatError(f"session file {shown} has an unknown format version {version}")
    if len(head) < _HEADER_AT:
        raise FormatError(f"session file {shown} is truncated: {size} bytes, the fixed prelude takes {_HEADER_AT}")
    header_len, data_len = _LENGTHS.unpack_from(head, _HASHED_FROM)
    expected = _aligned(_HEADER_AT + header_len) + data_len
    if size < expected:
        raise FormatError(
            f"session file {shown} is truncated or damaged: {size} bytes, its prelude announces {expected}"
        )
    if size > expected:
        raise FormatError(
            f"session file {shown} is damaged: {size - expected} unexpected bytes after the {expected} its "
            "prelude announces"
        )
    return header_len, data_len


def _verify_checksum(f: BinaryIO, shown: str) -> None:
    f.seek(_DIGEST_AT)
    stored = _read_exact(f, _DIGEST_SIZE, shown)
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
    if not hmac.compare_digest(digest.digest(), stored):
        raise FormatError(f"session file {shown} is corrupted: its sha256 checksum does not match its contents")


def _parse_header(raw: bytes, data_len: int, shown: str) -> dict[str, Any]:
    """The header as a dict, its structure checked (a valid checksum only says the bytes are as written)."""

    def bad(problem: str) -> FormatError:
        return FormatError(f"session file {shown} has a malformed header: {problem}")

    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("not a JSON object")
    missing = [k for k in _HEADER_KEYS if k not in header]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    for key in ("model_fingerprint", "cache_type"):
        if not isinstance(header[key], str):
            raise bad(f"{key} is not a string")
    if not _is_int(header["n_ctx"]) or header["n_ctx"] < 1:
        raise bad("n_ctx is not a positive integer")
    tokens = header["tokens"]
    if not isinstance(tokens, list) or not all(_is_int(t) and _INT32_MIN <= t <= _INT32_MAX for t in tokens):
        raise bad("tokens is not a list of int32 values")
    for key in ("sampler_state", "meta"):
        if not isinstance(header[key], dict):
            raise bad(f"{key} is not an object")
    if not isinstance(header["arrays"], list):
        raise bad("arrays is not a list")
    names: set[str] = set()
    end = 0
    for i, e in enumerate(header["arrays"]):
        if not isinstance(e, dict) or any(k not in e for k in _ARRAY_KEYS):
            raise bad(f"array entry {i} lacks one of {', '.join(_ARRAY_KEYS)}")
        name = e["name"]
        if not isinstance(name, str) or not name or name in names:
            raise bad(f"array entry {i} has an empty, non-string or repeated name {name!r}")
        names.add(name)
        if not isinstance(e["dtype"], str) or e["dtype"] not in _DTYPES:
            raise bad(f"array {name!r} has an unsupported dtype {e['dtype']!r}")
        shape = e["shape"]
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise bad(f"array {name!r} has an invalid shape {shape!r}")
        offset, nbytes = e["offset"], e["nbytes"]
        if not _is_int(offset) or not _is_int(nbytes) or offset % _ALIGN:
            raise bad(f"array {name!r} has an invalid offset or length")
        if nbytes != math.prod(shape) * _DTYPES[e["dtype"]].itemsize:
            raise bad(f"array {name!r}: {nbytes} bytes do not hold shape {shape} of {e['dtype']}")
        if offset < end or offset + nbytes > data_len:  # arrays are stored in order, without overlap
            raise bad(f"array {name!r} at bytes {offset}..{offset + nbytes} overlaps another or leaves the data")
        end = offset + nbytes
    return header


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_identity(header: dict[str, Any], fingerprint: str | None, cache_type: str | None, shown: str) -> None:
    if fingerprint is not None and header["model_fingerprint"] != fingerprint:
        raise BadRequestError(
            f"session {shown} was saved with model fingerprint {header['model_fingerprint']!r}, "
            f"this model is {fingerprint!r}"
        )
    if cache_type is not None and header["cache_type"] != cache_type:
        raise BadRequestError(
            f"session {shown} was saved with cache type {header['cache_type']}, this model uses {cache_type} "
            f"(load it with --cache-type {header['cache_type']}, or cache_type={header['cache_type']!r} in Python)"
        )


def _read_array(f: BinaryIO, data_at: int, entry: dict[str, Any], shown: str) -> np.ndarray:
    # One allocation per array and a read straight into it: independent, writable, no second copy.
    a = np.empty(entry["shape"], _DTYPES[entry["dtype"]])
    if a.nbytes:
        f.seek(data_at + entry["offset"])
        if f.readinto(a.reshape(-1).view(np.uint8)) != a.nbytes:
            raise FormatError(f"session file {shown} is truncated (changed while being read)")
    return a.astype(a.dtype.newbyteorder("="), copy=False)  # native order: a no-op on little-endian hosts
