"""One head's attention recomputed in float64, every intermediate kept, and how far the engine's fused
kernel is from it.

The fused kernel never materializes the scores or the softmax weights; the explorer recomputes them from
the engine's Q (after QK-norm and RoPE) and the K/V the kernel read, and shows the kernel's own output
beside the reference's, so what a page shows is what the engine did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

ATTENTION_CHECK_TOL = 1e-5  # reference vs fused kernel, relative to the largest |O| of the head (at least 1)


def attention_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, positions: np.ndarray, window: int = 0,
    key_ends: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """One head's attention in float64 from the engine's float32 inputs: q ``[t, d]`` at ``positions``,
    k ``[s, d]`` and v ``[s, dv]`` for key positions 0..s-1. Query t sees keys 0..positions[t], or
    0..key_ends[t] where given (Gemma 3's image rows see their whole image); in a sliding-window layer,
    ``window`` > 0, only keys less than ``window`` before its own position. Returns the scaled scores
    ``[t, s]``, the visibility mask, the softmax weights (masked cells exactly 0) and the output ``[t, dv]``."""
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = q64 @ k64.T * scale
    keys = np.arange(k64.shape[0])[None, :]
    pos = np.asarray(positions, np.int64)[:, None]
    ends = pos if key_ends is None else np.asarray(key_ends, np.int64)[:, None]
    visible = keys <= ends
    if window > 0:
        visible &= pos - keys < window
    masked = np.where(visible, scores, -np.inf)
    e = np.exp(masked - masked.max(axis=1, keepdims=True))
    weights = e / e.sum(axis=1, keepdims=True)
    return {"scores": scores, "visible": visible, "weights": weights, "output": weights @ v64}


def image_key_ends(n: int, images: Sequence[Any], bidirectional: bool) -> np.ndarray:
    """Each of ``n`` prompt rows' last visible key position: its own, or, with ``bidirectional`` (Gemma 3), on an
    image's rows (``images``: objects with ``first`` and ``end``, a prompt's ``PassImage`` s) the image's last."""
    ends = np.arange(n, dtype=np.int64)
    if bidirectional:
        for img in images:
            ends[img.first:img.end] = img.end - 1
    return ends


def label_image_rows(labels: list[str], images: Sequence[Any]) -> list[str]:
    """``labels`` (one per prompt row) with each image's rows labelled ``<image k>``."""
    out = list(labels)
    for k, img in enumerate(images):
        out[img.first:img.end] = [f"<image {k}>"] * (img.end - img.first)
    return out


def attention_check(reference: np.ndarray, engine: np.ndarray) -> dict[str, Any]:
    """How far the fused kernel's output is from the reference: max abs, and whether it is within
    :data:`ATTENTION_CHECK_TOL` of the head's largest value (at least 1)."""
    diff = float(np.abs(np.asarray(reference, np.float64) - engine).max()) if engine.size else 0.0
    scale = max(1.0, float(np.abs(reference).max()) if reference.size else 1.0)
    return {"max_abs": diff, "tol": ATTENTION_CHECK_TOL * scale, "equal": diff <= ATTENTION_CHECK_TOL * scale}
