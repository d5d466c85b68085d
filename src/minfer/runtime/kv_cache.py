"""The KV cache: two persistent regions per layer, rows addressed by position.

Regions are allocated zeroed (``np.zeros`` maps untouched pages lazily), so a large ``n_ctx`` costs
memory only as positions are written. Writes happen in the graph's ``kv_store`` nodes at the positions
given as input; this object only owns the memory and reports its size.
"""

from __future__ import annotations

import numpy as np

from minfer.models.hparams import HParams


class KVCache:
    def __init__(self, hparams: HParams, n_ctx: int) -> None:
        self.n_ctx = n_ctx
        self.n_layer = hparams.n_layer
        self.regions: list[tuple[np.ndarray, np.ndarray]] = [
            (
                np.zeros((n_ctx, hparams.k_width), dtype=np.float32),
                np.zeros((n_ctx, hparams.v_width), dtype=np.float32),
            )
            for _ in range(hparams.n_layer)
        ]

    @property
    def bytes_per_position(self) -> int:
        return sum(k[0].nbytes + v[0].nbytes for k, v in self.regions)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_position * self.n_ctx
