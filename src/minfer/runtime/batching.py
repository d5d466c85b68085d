"""What one forward pass of the engine carries, and the arithmetic of a padded engine's pass shapes.

Batch shapes of a padded engine (the server's): every new (tokens, outputs) shape costs a graph build
and its own buffers, and a mixed step's token count would otherwise be new almost every time. So a pass
evaluates a bucketed number of tokens (1..4, 8, then steps of about 1.5x up to the batch size): the spare
rows are padding tokens at position 0 of the cache's scratch sequence, which nothing reads, and spare
output rows repeat a real one. An unpadded engine (the API's) evaluates exactly what it has: a whole
prompt in one pass, then one token per step.

This is the scheduler's arithmetic and its records of a pass, kept apart from its decisions: nothing here
imports the slots or a sequence's speculation, which :mod:`minfer.runtime.scheduler` alone holds (the
import-linter contract in pyproject.toml), so a :class:`Batch` carries the scheduler's records of its
sequences as a type of their own (``R``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from minfer.runtime.speculative.draft import Draft
from minfer.runtime.vision import PassImage

R = TypeVar("R")  # the scheduler's record of a running sequence


def batch_buckets(batch_size: int) -> list[int]:
    """Token counts a padded pass is padded to: 1..4, then 8 and about 1.5x apart, and ``batch_size``.

    5..7 tokens go to 8. A pass of 7 costs a little less than one of 8 (SmolLM2: 17.5 against 18.1 ms; 5
    tokens 13.6 ms), but exact buckets there multiply the (tokens, outputs) shapes of mixed passes, each
    a plan built while serving (17-40 ms), and a paired server run with them showed no gain."""
    sizes = [1, 2, 3, 4, 8]
    while sizes[-1] < batch_size:
        nxt = sizes[-1] * 3 // 2 if len(sizes) % 2 else sizes[-1] * 4 // 3
        sizes.append(nxt)
    return sorted({x for x in sizes if x < batch_size} | {batch_size})


def bucket_of(buckets: list[int], n: int) -> int:
    """The token count a padded pass of ``n`` tokens evaluates: the first of ``buckets`` that holds them."""
    return next(b for b in buckets if b >= n)


def prompt_budget(waiting: int, n_decode: int, batch_size: int | None, buckets: list[int]) -> int:
    """Prompt tokens a pass takes beside its ``n_decode`` decodes, of the ``waiting`` ones: as many as wait
    (up to the batch size), or fewer when that ends the pass exactly on a bucket instead of padding it to
    the next one. The tokens left out go first in the next pass, so nothing is computed twice; a cut of
    more than a quarter of the prompt tokens is not worth the delay (it would also starve a small pass)."""
    if batch_size is None:
        return waiting
    take = min(waiting, batch_size - n_decode)
    n = n_decode + take
    if take == 0 or bucket_of(buckets, n) == n:
        return take
    fit = max(b for b in buckets if b <= n)
    return fit - n_decode if 4 * (fit - n_decode) >= 3 * take else take


@dataclass
class Batch(Generic[R]):
    """One forward pass's inputs: token i of sequence ``seqs[i]`` at ``positions[i]`` (one int: every
    token is that sequence's); the rows of ``outputs`` are sampled for ``sampled`` (in order), sequence j's
    first row at ``rows[j]``; ``n_real`` tokens are not padding (a padded engine's first ones; an unpadded
    one pads a draft's verifying rows after it). ``drafts``: for each sampled
    sequence its draft, verified by 1 + its length rows (None: one row each). ``pooled``: the embedding
    sequences' chunks, (sequence, first token index, length): the pass keeps every token's hidden state
    for them."""

    tokens: list[int]
    positions: list[int]
    seqs: list[int] | int
    outputs: list[int]
    sampled: list[R]
    rows: list[int]
    n_real: int
    drafts: list[Draft | None] | None = None  # None: no sequence has a draft this pass
    pooled: list[tuple[R, int, int]] = field(default_factory=list)
    n_prompt: int = 0  # prompt tokens (the rest decode or verify)
    images: list[PassImage] = field(default_factory=list)  # the rows that take images' tokens


def pad_to_buckets(batch: Batch[R], buckets: list[int], pad_seq: int) -> Batch[R]:
    """``batch`` (of a padded engine, its ``seqs`` a list) with its tokens padded to their bucket by padding
    tokens at position 0 of the scratch sequence ``pad_seq``, and its output rows to theirs by repeats."""
    assert isinstance(batch.seqs, list)
    n_real, n_out, outputs = batch.n_real, len(batch.outputs), batch.outputs
    pad = bucket_of(buckets, n_real) - n_real
    batch.tokens += [0] * pad
    batch.positions += [0] * pad
    batch.seqs += [pad_seq] * pad
    if n_out or not batch.pooled:
        # a pass of prompt chunks only still gets one (unused) output row; one with embeddings needs none
        spare = outputs[-1] if outputs else 0
        outputs += [spare] * (bucket_of(buckets, max(n_out, 1)) - n_out)
    return batch


@dataclass
class PassOutput:
    """What a forward pass gave a batch: the output rows' logits, every token's hidden state (only when the
    batch pools), and when the pass started and ended (``time.perf_counter``)."""

    logits: np.ndarray
    hidden: np.ndarray | None
    started: float
    ended: float
