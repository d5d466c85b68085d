"""Many sequences sampled at once (a server's batch): the rows whose chain compiles in one parallel call.

8 rows take 0.2-0.45 ms this way against ~1.2 ms one after the other; in a server step at 8 clients,
sampling and the tokens' bookkeeping went from 6.5% of the time to 2.9%.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from minfer.runtime.sampling import chain_kernel
from minfer.runtime.sampling.compiled import CompiledChain
from minfer.runtime.sampling.pickers import search


class Row(Protocol):
    """What ``sample_rows`` reads of a row's sampler (:class:`~.chain.Sampler`)."""

    @property
    def compiled_chain(self) -> CompiledChain | None: ...

    @property
    def draw_rng(self) -> np.random.Generator: ...


def sample_rows(samplers: Sequence[Row], logits: np.ndarray) -> list[int | None]:
    """``samplers[i].sample(logits[i])`` for every row at once, where the sampler's chain compiles (see
    ``CompiledChain``): one parallel call for those rows, then each sampler's draw from its own random
    stream. None for a row it leaves to ``sample``: another chain, or logits that fail a check (``sample``
    then raises the error)."""
    out: list[int | None] = [None] * len(samplers)
    if logits.ndim != 2 or logits.dtype != np.float32 or not logits.flags.c_contiguous:
        return out
    n_vocab = logits.shape[1]
    rows, chains = [], []
    for i, s in enumerate(samplers):
        chain = s.compiled_chain
        if chain is not None and chain.fits(n_vocab):
            rows.append(i)
            chains.append(chain)
    if not rows:
        return out
    args = chains[0].alone if len(chains) == 1 else CompiledChain.arguments(chains)
    codes, counts, ids, cum = chain_kernel.truncate_rows(logits, np.array(rows, np.int64), *args)
    for j, i in enumerate(rows):
        if codes[j]:
            continue
        n = int(counts[j])  # no number drawn for a single candidate, as the steps' draw
        out[i] = int(ids[j, 0 if n == 1 else search(cum[j, :n], samplers[i].draw_rng)])
    return out
