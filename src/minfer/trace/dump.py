"""Dumps: the full output tensors of chosen nodes as ``.npy`` files with a manifest, and their comparison.

``MINFER_DUMP_DIR=dir`` (``minfer run --dump-dir``, ``load(dump_dir=)``) writes, for every forward call,
``dir/call0000/0042-blk.0.q_rope.npy`` for each node whose name matches ``MINFER_DUMP_FILTER`` (shell
patterns separated by commas; default every node) and ``dir/manifest.json`` listing them. Comparing two
dump folders node by node (:func:`compare_dumps`, ``minfer compare-dumps A B``) corners the first op
where two runs part: the way a wrong RoPE layout or attention scale is found.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import BadRequestError, FormatError, MinferError
from minfer.formats.atomic import write_atomically
from minfer.graph.ir import Op
from minfer.graph.plan import Step


class Dumper:
    """Saves the outputs of matching nodes of every forward call (an observer of :meth:`Plan.run`)."""

    def __init__(self, directory: str | os.PathLike[str], patterns: str | None = None,
                 announce: bool = True) -> None:
        self.dir = Path(directory)
        if (self.dir / "manifest.json").exists():
            # another run's dump (someone's reference for compare-dumps): never overwritten silently
            raise BadRequestError(f"{self.dir} already holds a dump (manifest.json); choose another folder or "
                                  "remove that one")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MinferError(f"cannot create the dump folder {self.dir}: {e.strerror or e}") from None
        self.patterns = [p.strip() for p in (patterns or "*").split(",") if p.strip()]
        if announce:
            what = "every node's output" if patterns is None else f"the outputs of nodes matching {patterns!r}"
            hint = " (--dump-filter 'blk.0.*,result_output' to choose)" if patterns is None else ""
            print(f"minfer: dumping {what} of every forward pass to {self.dir}/ as .npy files{hint}",
                  file=sys.stderr)
        self.call = 0
        self.bytes = 0
        self.entries: list[dict[str, Any]] = []
        self._wanted: dict[int, bool] = {}

    def _matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def step(self, s: Step, seconds: float) -> None:
        node = s.node
        wanted = self._wanted.get(id(node))
        if wanted is None:
            wanted = self._wanted[id(node)] = node.op not in (Op.KV_STORE, Op.KV_LOAD, Op.QUANTIZE) and \
                self._matches(node.name)
        if not wanted:
            return
        folder = self.dir / f"call{self.call:04d}"
        folder.mkdir(exist_ok=True)
        file = folder / f"{node.id:04d}-{node.name or node.op}.npy"
        try:
            np.save(file, np.array(s.out, copy=True))  # a copy now: in-place ops overwrite the buffer later
        except OSError as e:
            raise MinferError(f"cannot write the dump file {file}: {e.strerror or e}") from None
        self.bytes += file.stat().st_size
        self.entries.append({"call": self.call, "node": node.id, "name": node.name, "op": str(node.op),
                             "layer": node.layer, "shape": list(node.shape), "file": str(file.relative_to(self.dir))})

    def logits(self, tokens: np.ndarray, positions: np.ndarray, logits: np.ndarray) -> None:
        self.call += 1
        write_atomically(self.dir / "manifest.json", json.dumps({"entries": self.entries}, indent=1).encode(),
                         what="dump manifest")

    def close(self) -> None:
        pass


def load_manifest(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(directory) / "manifest.json"
    try:
        return json.loads(path.read_text())["entries"]
    except FileNotFoundError:
        raise FormatError(f"{directory}: no manifest.json (not a minfer dump folder)") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise FormatError(f"{path}: not a minfer dump manifest ({e})") from None


def compare_dumps(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Per node present in both folders (matched by call and node name): max abs and relative difference
    and the cosine similarity of the two tensors, in execution order."""
    left = {(e["call"], e["name"]): e for e in load_manifest(a)}
    rows = []
    for e in load_manifest(b):
        other = left.get((e["call"], e["name"]))
        if other is None:
            continue
        x = np.load(Path(a) / other["file"]).astype(np.float64).reshape(-1)
        y = np.load(Path(b) / e["file"]).astype(np.float64).reshape(-1)
        if x.shape != y.shape:
            rows.append({**_key(e), "shape_mismatch": [other["shape"], e["shape"]]})
            continue
        diff = np.abs(x - y)
        scale = max(float(np.abs(x).max()), 1e-30)
        norm = float(np.linalg.norm(x) * np.linalg.norm(y))
        rows.append({**_key(e), "max_abs": float(diff.max()), "max_rel": float(diff.max()) / scale,
                     "cosine": float(x @ y) / norm if norm else 1.0})
    return rows


def _key(e: dict[str, Any]) -> dict[str, Any]:
    return {"call": e["call"], "node": e["node"], "name": e["name"], "op": e["op"], "layer": e["layer"]}


def first_divergence(rows: list[dict[str, Any]], tol: float = 1e-4) -> dict[str, Any] | None:
    """The first compared node (in execution order) whose max relative difference exceeds ``tol``."""
    for r in sorted(rows, key=lambda r: (r["call"], r["node"])):
        if "shape_mismatch" in r or r["max_rel"] > tol:
            return r
    return None
