"""Fast numba RoPE: rotation tables per geometry (:class:`RopeTable`) and the kernel that applies them.

The vector kernels' contract (what the reference computes, in place or not, errors checked in the
kernel) and their threads (serial, ``nogil``) are described in :mod:`~minfer.backends.cpu.elementwise`.

Numerics (what ``tests/test_vec_kernels.py`` holds): cos/sin tables computed by numpy with the reference's
own expressions (float64 angles cast to float32), the reference's float32 ``x0*c - x1*s`` /
``x0*s + x1*c``: bit-identical.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

from minfer.backends.cpu.reference import rope_cos_sin, rope_freqs
from minfer.backends.cpu.simd import F32, U
from minfer.graph.ir import RopeMeta, RopeStyle


@njit(cache=True, error_model="numpy", inline="always")
def _rope_head(src, dst, t, b, row, cos, sin, half, neox):
    """Rotate the head at column b of token t: the reference's float32 ``x0*c - x1*s``, ``x0*s + x1*c``.

    Inlined by numba, so that for in-place calls (``src`` and ``dst`` the same array) LLVM sees one array
    and vectorizes without the overlap check that would send it to the scalar loop."""
    if neox:  # pairs (i, i + n_rot/2)
        for i in range(half):
            x0 = src[t, U(b + i)]
            x1 = src[t, U(b + half + i)]
            c = cos[row, i]
            s = sin[row, i]
            dst[t, U(b + i)] = x0 * c - x1 * s
            dst[t, U(b + half + i)] = x0 * s + x1 * c
    else:  # pairs (2i, 2i + 1)
        for i in range(half):
            x0 = src[t, U(b + 2 * i)]
            x1 = src[t, U(b + 2 * i + 1)]
            c = cos[row, i]
            s = sin[row, i]
            dst[t, U(b + 2 * i)] = x0 * c - x1 * s
            dst[t, U(b + 2 * i + 1)] = x0 * s + x1 * c


@njit(cache=True, error_model="numpy")
def _rope_row(x, t, row, cos, sin, n_head, head_dim, n_rot, neox, inplace, out):
    """Rotate every head of token t by table row ``row``; dims from n_rot on are copied unchanged."""
    half = n_rot // 2
    for h in range(n_head):
        b = h * head_dim
        if inplace:
            _rope_head(x, x, t, b, row, cos, sin, half, neox)
        else:
            _rope_head(x, out, t, b, row, cos, sin, half, neox)
            for i in range(n_rot, head_dim):
                out[t, U(b + i)] = x[t, U(b + i)]


@njit(cache=True, error_model="numpy", nogil=True)
def _rope_kernel(x, positions, cos, sin, direct, n_head, head_dim, n_rot, neox, out):
    """Returns -1 when done, -2 on a geometry mismatch, else the first token whose table row is missing.

    ``direct``: the tables hold one row per token (row t) instead of one row per position (row pos[t]).
    Nothing is written unless every check passes, so the caller can grow the table and call again.
    """
    nt = x.shape[0]
    if (
        x.shape[1] != n_head * head_dim
        or out.shape[0] != nt
        or out.shape[1] != x.shape[1]
        or positions.shape[0] != nt
        or n_rot % 2
        or n_rot > head_dim
        or cos.shape[1] < n_rot // 2
    ):
        return -2
    for t in range(nt):
        row = np.int64(t) if direct else np.int64(positions[t])
        if row < 0 or row >= cos.shape[0]:
            return t
    inplace = x.ctypes.data == out.ctypes.data
    for t in range(nt):
        row = np.int64(t) if direct else np.int64(positions[t])
        _rope_row(x, t, row, cos, sin, n_head, head_dim, n_rot, neox, inplace, out)
    return -1


class RopeTable:
    """cos/sin of RoPE angles for positions ``0..n_pos-1`` of one geometry, shared by q and k of every layer.

    Computed by numpy with the reference's expressions (``reference.rope_freqs`` and
    ``reference.rope_cos_sin``: float64 angles ``pos * freq``, ``cos``/``sin`` times the YaRN magnitude,
    cast to float32), so a row is bit-identical to what the reference computes for that position. The
    table grows (doubling) when a position beyond it shows up. The keyword arguments are RoPE scaling
    (see :class:`~minfer.graph.ir.RopeMeta`).
    """

    def __init__(
        self,
        head_dim: int,
        n_rot: int,
        freq_base: float,
        freq_scale: float,
        n_pos: int = 4096,
        *,
        freq_factors: tuple[float, ...] | None = None,
        ext_factor: float = 0.0,
        corr_dims: tuple[float, float] = (0.0, 0.0),
        mscale: float = 1.0,
    ) -> None:
        if n_rot % 2 or not 0 < n_rot <= head_dim:
            raise ValueError(f"RoPE: n_rot {n_rot} must be even and in 1..head_dim ({head_dim})")
        if freq_factors is not None and len(freq_factors) != n_rot // 2:
            raise ValueError(f"RoPE: {len(freq_factors)} frequency factors for {n_rot // 2} rotating pairs")
        self.head_dim = head_dim
        self.n_rot = n_rot
        meta = RopeMeta(
            n_head=1, head_dim=head_dim, n_rot=n_rot, freq_base=freq_base, freq_scale=freq_scale, style=RopeStyle.NEOX,
            freq_factors=freq_factors, ext_factor=ext_factor, corr_dims=corr_dims, mscale=mscale,
        )
        self.freqs = rope_freqs(meta)  # float64 [n_rot/2]
        self.mscale = mscale
        self._lock = threading.Lock()
        self.cos, self.sin = self.cos_sin(np.arange(max(1, n_pos)))

    @staticmethod
    def key(meta: RopeMeta) -> tuple:
        """What decides a table's contents: metas with equal keys can share one table."""
        return (meta.head_dim, meta.n_rot, float(meta.freq_base), float(meta.freq_scale), meta.freq_factors,
                float(meta.ext_factor), tuple(meta.corr_dims), float(meta.mscale))

    @classmethod
    def from_meta(cls, meta: RopeMeta, n_pos: int = 4096) -> RopeTable:
        return cls(meta.head_dim, meta.n_rot, meta.freq_base, meta.freq_scale, n_pos, freq_factors=meta.freq_factors,
                   ext_factor=meta.ext_factor, corr_dims=tuple(meta.corr_dims), mscale=meta.mscale)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 cos/sin ``[len(positions), n_rot/2]`` for these positions, exactly as the reference computes."""
        return rope_cos_sin(self.freqs, self.mscale, positions)

    def _grow(self, positions: np.ndarray) -> None:
        need = int(positions.max()) + 1
        with self._lock:
            n = self.cos.shape[0]
            if need > n:
                while n < need:
                    n *= 2
                cos, sin = self.cos_sin(np.arange(n))
                self.cos, self.sin = cos, sin  # readers see either the old or the new pair, both valid

    def apply(self, x: np.ndarray, positions: np.ndarray, n_head: int, neox: bool, out: np.ndarray) -> None:
        """RoPE of ``x [tokens, n_head*head_dim]`` at ``positions`` into ``out`` (which may be ``x``)."""
        cos, sin = self.cos, self.sin
        code = _rope_kernel(x, positions, cos, sin, False, n_head, self.head_dim, self.n_rot, neox, out)
        if code == -1:
            return
        if code == -2:
            raise ValueError(
                f"rope: x {x.shape}, positions {positions.shape}, out {out.shape} do not fit n_head {n_head} "
                f"x head_dim {self.head_dim}, n_rot {self.n_rot}"
            )
        if int(positions.min()) < 0:
            # a negative position has no table row: use tables computed for exactly these positions
            cos, sin = self.cos_sin(positions)
            code = _rope_kernel(x, positions, cos, sin, True, n_head, self.head_dim, self.n_rot, neox, out)
        else:
            self._grow(positions)
            code = _rope_kernel(x, positions, self.cos, self.sin, False, n_head, self.head_dim, self.n_rot, neox, out)
        assert code == -1, code


def rope(
    x: np.ndarray,
    positions: np.ndarray,
    n_head: int,
    head_dim: int,
    n_rot: int,
    freq_base: float,
    freq_scale: float,
    neox: bool,
    out: np.ndarray,
) -> None:
    """RoPE in place or into ``out``; NEOX pairs (i, i + n_rot/2), otherwise (2i, 2i+1).

    Builds a table for these positions on every call; a caller that runs many RoPEs (the backend) keeps
    a :class:`RopeTable` and calls its ``apply``.
    """
    n_pos = int(np.abs(positions).max()) + 1 if positions.size else 1
    RopeTable(head_dim, n_rot, freq_base, freq_scale, n_pos=n_pos).apply(x, positions, n_head, neox, out)


def warmup() -> None:
    """Compile (or load from the on-disk cache) the signatures the engine uses: float32 C-contiguous 2-D
    activations, 1-D int32 positions."""
    x = np.ones((2, 16), F32)
    RopeTable(8, 8, 10000.0, 1.0, n_pos=2).apply(x, np.zeros(2, np.int32), 2, True, np.empty_like(x))
