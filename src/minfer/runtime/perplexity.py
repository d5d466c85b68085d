"""Perplexity, the llama-perplexity way.

The text is tokenized once (with BOS when the model adds one) and cut into chunks of ``n_ctx`` tokens;
the tail that does not fill a chunk is dropped. Each chunk is evaluated from position 0 (its first token
replaced by BOS when the model uses one, as llama.cpp does), in batches of ``n_batch`` tokens, and only
the second half is scored: the logits at positions ``n_ctx/2 .. n_ctx-2`` predict the next token. The
estimate is ``exp(mean NLL)``, its error ``ppl * stddev(NLL) / sqrt(count - 1)`` as llama.cpp reports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from minfer.errors import BadRequestError
from minfer.runtime.forward import ForwardRunner


@dataclass
class PerplexityResult:
    ppl: float
    error: float  # one standard error of the estimate
    n_chunks: int
    n_ctx: int
    tokens_scored: int
    chunk_ppl: list[float] = field(default_factory=list)  # running estimate after each chunk

    def __str__(self) -> str:
        return f"PPL = {self.ppl:.4f} +/- {self.error:.5f}"


NLL_BLOCK_VALUES = 1 << 22  # logits converted to float64 at a time (32 MB): a 262k vocabulary's 127 rows
# at once would take 266 MB per temporary


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of ``targets[i]`` under ``softmax(logits[i])``, computed in float64."""
    out = np.empty(len(targets), dtype=np.float64)
    rows = max(1, NLL_BLOCK_VALUES // max(1, logits.shape[1]))
    for r0 in range(0, len(targets), rows):
        x = logits[r0 : r0 + rows].astype(np.float64)
        t = np.asarray(targets[r0 : r0 + rows])
        m = x.max(axis=1, keepdims=True)
        log_z = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
        out[r0 : r0 + len(t)] = log_z - x[np.arange(len(t)), t]
    return out


def perplexity(
    runner: ForwardRunner,
    tokens: Sequence[int],
    n_ctx: int,
    n_batch: int | None = None,
    bos_id: int | None = None,
    on_chunk: Callable[[int, int, float], None] | None = None,
) -> PerplexityResult:
    """Score ``tokens`` (already tokenized); ``on_chunk(i, n_chunks, running_ppl)`` reports progress."""
    if n_ctx < 4:
        raise BadRequestError(f"the perplexity context must be at least 4 tokens, got {n_ctx}")
    if n_ctx > runner.kv.n_ctx:
        raise BadRequestError(f"perplexity context {n_ctx} is larger than the model's context {runner.kv.n_ctx}")
    n_batch = n_ctx if n_batch is None else n_batch
    if n_batch < 1:
        raise BadRequestError(f"the batch size must be >= 1, got {n_batch}")
    n_batch = min(n_batch, n_ctx)
    tokens = np.asarray(tokens, dtype=np.int64)
    n_chunks = len(tokens) // n_ctx
    if n_chunks == 0:
        raise BadRequestError(f"the text has {len(tokens)} tokens, fewer than one chunk of {n_ctx}")
    first = n_ctx // 2
    nll_sum = nll2_sum = 0.0
    count = 0
    running: list[float] = []
    for c in range(n_chunks):
        chunk = tokens[c * n_ctx : (c + 1) * n_ctx].copy()
        targets = chunk[first + 1 :]
        if bos_id is not None:
            chunk[0] = bos_id
        scored: list[np.ndarray] = []
        for b0 in range(0, n_ctx, n_batch):
            b1 = min(n_ctx, b0 + n_batch)
            # only positions first .. n_ctx-2 are scored: ask the graph for those rows alone
            rows = [j - b0 for j in range(max(b0, first), min(b1, n_ctx - 1))]
            if rows:
                scored.append(runner.forward(chunk[b0:b1], range(b0, b1), output_rows=rows))
            else:
                runner.forward(chunk[b0:b1], range(b0, b1), output_rows=[b1 - b0 - 1])
        nll = token_nll(np.concatenate(scored), targets)
        nll_sum += float(nll.sum())
        nll2_sum += float((nll * nll).sum())
        count += len(nll)
        running.append(math.exp(nll_sum / count))
        if on_chunk is not None:
            on_chunk(c, n_chunks, running[-1])
    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    ppl = math.exp(mean)
    error = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    return PerplexityResult(ppl, error, n_chunks, n_ctx, count, running)
