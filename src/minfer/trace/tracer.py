"""The trace: one JSON line per executed node, and the top tokens of every forward call's logits.

Enabled with ``MINFER_TRACE=path`` or ``minfer run --trace path`` (``load(..., trace=path)``). A node
line: ``{"call", "node", "op", "name", "layer", "shape", "dtype", "us", "min", "max", "mean", "rms",
"nan", "inf"}``, the statistics of the node's output computed in one compiled pass, 7 significant digits (the K/V store
reports the K rows this call wrote; matmuls the backend runs as one loop, q/k/v or gate/up, report their whole
time on the first of them and about 0 on the others). After each call: ``{"call", "tokens", "positions",
"top5": [[id, text, logit], ...]}`` for the last output row.
"""

from __future__ import annotations

import json
import math
import os
from typing import IO, Any

import numpy as np
from numba import njit

from minfer.graph.ir import Op
from minfer.graph.plan import Step


@njit(cache=True)
def _stats(flat):
    lo, hi = np.inf, -np.inf
    total = 0.0
    squares = 0.0
    nan = 0
    inf = 0
    for v in flat:
        if np.isnan(v):
            nan += 1
        elif np.isinf(v):
            inf += 1
        else:
            x = np.float64(v)
            lo = min(lo, x)
            hi = max(hi, x)
            total += x
            squares += x * x
    return lo, hi, total, squares, nan, inf


def array_stats(a: np.ndarray) -> dict[str, Any]:
    """min, max, mean, rms over the finite values, and the NaN / Inf counts."""
    flat = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
    lo, hi, total, squares, nan, inf = _stats(flat)
    n = flat.size - nan - inf
    if n == 0:
        return {"min": None, "max": None, "mean": None, "rms": None, "nan": int(nan), "inf": int(inf)}
    return {"min": float(lo), "max": float(hi), "mean": total / n, "rms": math.sqrt(squares / n),
            "nan": int(nan), "inf": int(inf)}


class Tracer:
    """Writes the trace of every forward call a runner makes to one JSON-lines file."""

    def __init__(self, path: str | os.PathLike[str], tokenizer: Any = None) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self.call = 0
        self._prefix: dict[int, str] = {}
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the tracer

    def step(self, s: Step, seconds: float) -> None:
        node = s.node
        prefix = self._prefix.get(id(node))
        if prefix is None:  # the static part of a node's line, formatted once per node
            prefix = self._prefix[id(node)] = json.dumps({
                "node": node.id, "op": str(node.op), "name": node.name, "layer": node.layer,
                "shape": list(node.shape), "dtype": node.dtype,
            })[1:-1]
        if node.op is Op.KV_STORE:
            data = s.args[0]  # the K rows this call stored
        elif node.op is Op.KV_LOAD:
            data = None
        elif node.op is Op.QUANTIZE:
            data = s.out.q
        else:
            data = s.out
        stats = ""
        if data is not None:
            flat = data.reshape(-1) if data.dtype == np.float32 and data.flags.c_contiguous else \
                np.ascontiguousarray(data, dtype=np.float32).reshape(-1)
            lo, hi, total, squares, nan, inf = _stats(flat)
            n = flat.size - nan - inf
            if n:
                stats = (f', "min": {lo:.7g}, "max": {hi:.7g}, "mean": {total / n:.7g}, '
                         f'"rms": {math.sqrt(squares / n):.7g}, "nan": {nan}, "inf": {inf}')
            else:
                stats = f', "min": null, "max": null, "mean": null, "rms": null, "nan": {nan}, "inf": {inf}'
        if node.op is Op.MOE_ROUTE:  # the routing itself: each token's experts (best first) and their weights
            k = node.meta.n_used
            stats += (f', "experts": {json.dumps(s.out[:, :k].astype(int).tolist())}, '
                      f'"expert_weights": {json.dumps([[round(float(w), 7) for w in row] for row in s.out[:, k:]])}')
        self._file.write(f'{{"call": {self.call}, {prefix}, "us": {seconds * 1e6:.2f}{stats}}}\n')

    def logits(self, tokens: np.ndarray, positions: np.ndarray, logits: np.ndarray) -> None:
        last = logits[-1]
        best = np.argpartition(-last, 4)[:5]  # a partition, not a sort of the whole vocabulary
        top = best[np.lexsort((best, -last[best]))]
        text = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        self._file.write(json.dumps({
            "call": self.call, "tokens": [int(t) for t in tokens], "positions": [int(p) for p in positions],
            "top5": [[int(t), text(int(t)), float(last[t])] for t in top],
        }) + "\n")
        self._file.flush()
        self.call += 1

    def close(self) -> None:
        self._file.close()
