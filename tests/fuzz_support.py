"""What the fuzz tests share: a tally of outcomes per kind of mutation, and GGUF rewriting.

Every case ends one of three ways: a clean ``MinferError`` (the user sees one line naming the problem), a
load that works and gives finite logits, or something else: an *unclean* outcome (any other exception) or
a *NaN-accepting* load (loaded, then non-finite logits). The tests assert the last two never happen, and
record their figures in pytest's cache (``minfer/fuzz/<name>``) and on stdout (``pytest -s``).
"""

from __future__ import annotations

import json
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from minfer.errors import MinferError

SEED = 20261201


@dataclass
class Tally:
    name: str
    counts: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    failures: list[str] = field(default_factory=list)

    def run(self, kind: str, case: str, attempt: Callable[[], Any]) -> str:
        """Run one case; ``attempt`` returns normally (accepted) or raises. Returns the outcome."""
        c = self.counts[kind]
        c["tried"] += 1
        try:
            result = attempt()
        except MinferError as e:
            if "\n" in str(e) or not str(e):
                c["unclean"] += 1
                self.failures.append(f"{kind} {case}: a MinferError that is not one line: {str(e)[:200]!r}")
                return "unclean"
            c["clean_error"] += 1
            return "clean"
        except Exception as e:  # noqa: BLE001 - what the fuzzer hunts
            c["unclean"] += 1
            tb = traceback.format_exception(e)[-3:]
            self.failures.append(f"{kind} {case}: {type(e).__name__}: {str(e)[:200]} | {''.join(tb)[-400:]}")
            return "unclean"
        if result == "nan":
            c["nan_accepted"] += 1
            self.failures.append(f"{kind} {case}: loaded, then non-finite logits")
            return "nan"
        c["accepted"] += 1
        return "accepted"

    def count(self, kind: str, outcome: str) -> None:
        """Record an outcome decided by the caller (the server fuzzers: a status code)."""
        self.counts[kind]["tried"] += 1
        self.counts[kind][outcome] += 1

    def figures(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.counts.items()}

    def report(self, config: Any) -> None:
        figures = self.figures()
        total = {key: sum(v.get(key, 0) for v in figures.values())
                 for key in ("tried", "clean_error", "accepted", "unclean", "nan_accepted", "status_500")}
        if config is not None:
            config.cache.set(f"minfer/fuzz/{self.name}", {"kinds": figures, "total": total})
        print(f"\nfuzz {self.name}: {json.dumps(total)}\n  " + "\n  ".join(f"{k}: {json.dumps(v)}"
                                                                    for k, v in figures.items()))

    def assert_clean(self) -> None:
        assert not self.failures, f"{len(self.failures)} unclean outcomes:\n" + "\n".join(self.failures[:15])


# -- GGUF files ---------------------------------------------------------------------------------------


def gguf_fields(path: Path) -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    """Every metadata key of a GGUF file with its value and types (``GGUF.*`` header fields left out)."""
    r = GGUFReader(path)
    out = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        out[key] = (f.contents(), vtype, sub)
    return out


def scalar_offsets(path: Path) -> dict[str, tuple[int, np.dtype[Any], GGUFValueType]]:
    """Where each scalar numeric metadata value sits in the file: offset, numpy type, GGUF type (mutating it
    in place is much faster than rewriting the file)."""
    r = GGUFReader(path)
    base = r.data.ctypes.data
    out = {}
    for key, f in r.fields.items():
        vtype = f.types[0] if f.types else None
        if key.startswith("GGUF.") or vtype in (None, GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.BOOL):
            continue
        part = f.parts[f.data[0]]
        out[key] = (part.ctypes.data - base, part.dtype, vtype)
    return out


def patched(data: bytes, offset: int, dtype: np.dtype[Any], value: Any) -> bytes:
    blob = bytearray(data)
    raw = np.array([value], dtype=dtype).tobytes()
    blob[offset:offset + len(raw)] = raw
    return bytes(blob)


def rewrite_gguf(src: Path, dst: Path, overrides: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]],
                 drop: frozenset[str] = frozenset()) -> None:
    """``src`` with some metadata values replaced, added (``overrides``) or removed (``drop``)."""
    r = GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = GGUFWriter(dst, arch)
    w.kv_data[0].clear()  # the writer pre-adds general.architecture; the copy below has it
    fields = gguf_fields(src)
    fields.update(overrides)
    for key, (value, vtype, sub) in fields.items():
        if key in drop:
            continue
        w.add_key_value(key, value, vtype, sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def numeric_mutations(vtype: GGUFValueType) -> Iterator[tuple[str, Any]]:
    """The probe's kinds for one numeric value: NaN and infinities for floats, zero, negatives and huge
    counts for integers (as big as the type holds)."""
    if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        yield from [("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf")), ("neg", -1.0),
                        ("zero", 0.0), ("tiny", 1e-38), ("huge", 3e38)]
        return
    signed = vtype in (GGUFValueType.INT8, GGUFValueType.INT16, GGUFValueType.INT32, GGUFValueType.INT64)
    bits = {GGUFValueType.UINT8: 8, GGUFValueType.INT8: 8, GGUFValueType.UINT16: 16, GGUFValueType.INT16: 16,
            GGUFValueType.UINT32: 32, GGUFValueType.INT32: 32, GGUFValueType.UINT64: 64,
            GGUFValueType.INT64: 64}.get(vtype, 32)
    top = (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1
    yield "zero", 0
    if signed:
        yield "neg", -1
    yield "2^24", min(1 << 24, top)
    yield "max", top
