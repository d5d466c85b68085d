"""The logit lens's arithmetic: a residual through the model's final norm and output matrix, and the top
tokens it gives with their probabilities.

The norm's gain and the output matmul go through the backend object (its exact float32 dequantization
and matmul), so this layer imports no kernels.
"""

from __future__ import annotations

import numpy as np

from minfer.formats.tensors import WeightTensor
from minfer.graph.ir import Backend, Node, Op


def final_norm(x: np.ndarray, node: Node, default_eps: float, backend: Backend) -> np.ndarray:
    """``x`` through the final norm ``node`` (an RMS norm, with its gain if it has one), in float64 and
    returned as float32; ``default_eps`` where the node carries no meta."""
    x64 = np.asarray(x, np.float64)
    eps = node.meta.eps if node.meta is not None else default_eps
    y = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)
    if node.op is Op.RMS_NORM_MUL:
        gain = node.inputs[1].source
        y = y * (backend.dequantize(gain) if isinstance(gain, WeightTensor) else np.asarray(gain))
    return y.astype(np.float32)


def top_tokens(x: np.ndarray, w: WeightTensor | np.ndarray, backend: Backend,
               top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``top`` tokens of each row of ``x @ W^T`` (normed residuals against the output matrix), best
    first: their ids, logits and softmax probabilities over the whole vocabulary."""
    logits = np.empty((x.shape[0], w.shape[0]), np.float32)
    backend.float_matmul(x, w, logits)
    k = min(top, logits.shape[1])
    best = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(logits, best, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    best, vals = np.take_along_axis(best, order, axis=1), np.take_along_axis(vals, order, axis=1)
    z = logits - logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=1))
    probs = np.exp(vals - logits.max(axis=1, keepdims=True) - lse[:, None])
    return best, vals, probs
