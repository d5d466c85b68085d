"""Two runs side by side: a traced forward pass against another (another cache type, say) or against a
dump folder (``minfer run --dump-dir``), node by node, to find where they part."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from minfer.errors import FormatError
from minfer.graph.ir import Op
from minfer.trace.dump import load_manifest
from minfer.trace.explorer import ForwardTrace


class DumpRun:
    """A dump folder (``minfer run --dump-dir``) as the other side of a comparison: its first call's nodes
    by name."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.entries = {e["name"]: e for e in load_manifest(directory) if e["call"] == 0}
        self.description = f"dump {self.dir}"

    def tensor_by_name(self, name: str) -> np.ndarray | None:
        e = self.entries.get(name)
        if e is None:
            return None
        try:
            return np.load(self.dir / e["file"])
        except (OSError, ValueError) as err:
            raise FormatError(f"{self.dir / e['file']}: cannot read ({err})") from None


def _trace_tensor_by_name(trace: ForwardTrace, name: str) -> np.ndarray | None:
    node = trace.by_name.get(name)
    return None if node is None else trace.tensor(node)


def compare(a: ForwardTrace, b: ForwardTrace | DumpRun, tol: float = 1e-4, all_nodes: bool = False) -> dict[str, Any]:
    """Node by node in ``a``'s execution order (matched by name): max abs, max relative (to ``a``'s largest
    value) and cosine; the first node past ``tol`` is where the runs part. Stops there unless ``all_nodes``."""
    get_b = b.tensor_by_name if isinstance(b, DumpRun) else (lambda name: _trace_tensor_by_name(b, name))
    rows: list[dict[str, Any]] = []
    first: dict[str, Any] | None = None
    for node in a.graph.nodes:
        if node.op in (Op.INPUT, Op.WEIGHT, Op.KV_LOAD, Op.QUANTIZE) or not node.name or node.name == "output":
            continue
        x = a.tensor(node)
        y = get_b(node.name)
        if x is None or y is None:
            continue
        entry: dict[str, Any] = {"node": node.id, "name": node.name, "op": str(node.op), "layer": node.layer}
        if x.size != y.size:
            entry["shape_mismatch"] = [list(x.shape), list(y.shape)]
        else:
            x64, y64 = x.astype(np.float64).reshape(-1), y.astype(np.float64).reshape(-1)
            diff = np.abs(x64 - y64)
            scale = max(float(np.abs(x64).max()), 1e-30)
            norm = float(np.linalg.norm(x64) * np.linalg.norm(y64))
            entry.update(max_abs=float(diff.max()), max_rel=float(diff.max()) / scale,
                         cosine=float(x64 @ y64) / norm if norm else 1.0)
        entry["parts"] = "shape_mismatch" in entry or entry["max_rel"] > tol
        rows.append(entry)
        if entry["parts"] and first is None:
            first = entry
            if not all_nodes:
                break
    return {"rows": rows, "first": first, "tol": tol,
            "a": a.description or f"{a.model_name} ({a.cache_type} cache)",
            "b": b.description or (f"{b.model_name} ({b.cache_type} cache)" if isinstance(b, ForwardTrace) else "")}
