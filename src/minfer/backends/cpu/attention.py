"""Fast numba attention (causal GQA, sliding windows) and the KV store that feeds it.

The vector kernels' contract (what the reference computes, errors checked in the kernel) is described in
:mod:`~minfer.backends.cpu.elementwise`. The KV store is row-wise: serial and ``nogil``, as the
elementwise kernels. Attention is the one vector op that is ``parallel=True``: the work (up to tens of ms
in a long prefill) dwarfs the ~1.3 µs a parallel call costs here.

Numerics (what ``tests/test_vec_kernels.py`` holds)
    * KV store: bit-identical (float16 cells rounded to nearest even, as numpy's astype rounds).
    * attention: float32 dot products, scores ``* f32(scale)``, row max subtracted, float32 exp, float64
      sum, weights ``e * f32(1/sum)``, float32 weighted sum of V rows in key order. Rows beyond a token's
      window ``pos[t] + 1`` are never read (nor, in a sliding-window layer of width W, rows before
      ``pos[t] - W + 1``): whatever sits there (NaN, garbage) cannot leak, and their weights are exactly
      0 as in the reference.
    * key ends: a token may read past its own position, up to its key end ``ends[t] >= pos[t]`` (Gemma 3's
      image tokens see their whole image: the rows after ``pos[t]`` are stored by the same pass before
      attention runs). The window is then ``[window_start(pos[t]), ends[t]]``; without key ends the kernels
      are handed ``ends = pos``, the causal window, so there is one code path and the same bits.

Determinism
    Every output element is computed by one fixed sequence of float operations, never by a reduction
    across threads. Attention splits the work into (kv head, query-head subset, token block) units that
    follow the thread count, and a decode step into (kv heads, key chunk) units; but a
    (token, head) result is the same operations whatever unit it falls in: its scores are computed one by
    one, its softmax by one thread over the whole row, and its weighted sum of V per key chunk of
    ``ATTN_KEY_CHUNK`` rows, the chunk sums then added in order by one thread. So the output is
    bit-identical at any thread count, and a decode step gives bit-identical output to the same token
    inside a prefill.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange, types
from numba.extending import intrinsic, overload

from minfer.backends.cpu.elementwise import exp32
from minfer.backends.cpu.simd import (
    F16C,
    F32,
    LL_F16,
    LL_I16,
    U,
    add_row_f64x4,
    hmax_f32x8,
    hsum_tree,
    is_f16_bits_rows,
    is_f32_rows,
    load_row_f32x8,
    max_f32x8,
    muladd_f32x8,
    row_value_f32,
    splat_f32x8,
    store_hsums4_scaled,
    store_row_f32x8,
    zeros_f32x8,
    zeros_f64x4,
)
from minfer.backends.cpu.simd512 import (
    broadcast_row_f32x16,
    high_f32x8,
    load_row_f32x16,
    load_rows_f32x16,
    low_f32x8,
    muladd_f32x16,
    splat_f32x16,
    store_row_f32x16,
    zeros_f32x16,
)
from minfer.errors import ContextOverflowError

# (module constants are compiled into the kernels: changing one at run time has no effect)
I64 = np.int64
# attention work unit: the query heads of one kv head (or a subset) over a multiple of this many consecutive
# tokens, as many as make about ATTN_UNIT_ROWS (token, head) rows: a unit copies each K/V block out of the
# cache once for all its rows (see _attn_unit), which 16 rows of one head (MHA) paid for ~10% of 1.7B's
# prefill attention
# a row map (key -> cache row) is consecutive within each aligned block of this many keys: the KV cache's
# blocks are a multiple of it
ROW_MAP_BLOCK = 32
ATTN_TOKEN_BLOCK = 16
ATTN_UNIT_ROWS = 64
# attention key block: K/V rows used by every (token, head) pair of a unit while they sit in L1
# (64 rows x 64 floats = 16 KiB of K, then of V)
ATTN_KEY_BLOCK = 64
# attention key chunk (a multiple of ATTN_KEY_BLOCK): the weighted sum of V rows is summed per chunk of
# this many keys, then the chunk sums are added in order. A decode step hands different chunks to
# different threads (one token has too few heads to keep two threads busy on whole heads); a prefill
# sums the same chunks the same way, so both give the same bits.
ATTN_KEY_CHUNK = 256
# a decode step split by keys walks its cache rows a few at a time, all of a unit's heads on them: as many
# rows as hold about this many bytes of the unit's heads, 8 to 64 (few rows stream a large model's K/V from
# memory in address order; more rows spare a small model's, read from cache, the per-step overheads)
ATTN_DECODE_STEP_BYTES = 8192
# ... in this many ranges of kv heads per thread (as far as there are kv heads), each over every key chunk
ATTN_DECODE_UNITS_PER_THREAD = 4


# ---------------------------------------------------------------------------------------------------------
# KV store


@intrinsic
def _as_cell(typingctx, region, x):
    """float32 ``x`` as a cell of ``region``: itself in a float32 region, its float16 bit pattern (rounded
    to nearest even, as numpy's astype rounds) in a uint16 one."""
    if is_f16_bits_rows(region) and x == types.float32:
        def codegen16(context, builder, sig, args):
            return builder.bitcast(builder.fptrunc(args[1], LL_F16), LL_I16)

        return types.uint16(region, x), codegen16
    if is_f32_rows(region) and x == types.float32:
        return types.float32(region, x), lambda context, builder, sig, args: args[1]
    return None


@njit(cache=True, error_model="numpy", nogil=True)
def _kv_store_kernel(k, v, positions, k_region, v_region):
    """Returns -1 when stored, -2 on a shape mismatch, else the first token whose position is outside the
    context (nothing is written then)."""
    nt = k.shape[0]
    n_ctx = k_region.shape[0]
    if (
        v.shape[0] != nt
        or positions.shape[0] != nt
        or k.shape[1] != k_region.shape[1]
        or v.shape[1] != v_region.shape[1]
        or v_region.shape[0] != n_ctx
    ):
        return -2
    for t in range(nt):
        if positions[t] < 0 or positions[t] >= n_ctx:
            return t
    for t in range(nt):
        p = positions[t]
        for i in range(k.shape[1]):
            k_region[p, i] = _as_cell(k_region, k[t, i])
        for i in range(v.shape[1]):
            v_region[p, i] = _as_cell(v_region, v[t, i])
    return -1


def _kv_store_numpy(k, v, positions, k_region, v_region) -> int:
    """``_kv_store_kernel`` in numpy, for float16 regions on a CPU without F16C."""
    n_ctx, nt = k_region.shape[0], k.shape[0]
    if v.shape[0] != nt or positions.shape[0] != nt or k.shape[1:] != k_region.shape[1:] or \
            v.shape[1:] != v_region.shape[1:] or v_region.shape[0] != n_ctx:
        return -2
    bad = np.flatnonzero((positions < 0) | (positions >= n_ctx))
    if bad.size:
        return int(bad[0])
    k_region[positions] = k
    v_region[positions] = v
    return -1


def kv_store(
    k: np.ndarray,
    v: np.ndarray,
    positions: np.ndarray,
    k_region: np.ndarray,
    v_region: np.ndarray,
    layer: int | None = None,
) -> None:
    """Write token t's K/V rows at row ``positions[t]`` of the layer's regions (positions are data).
    float16 regions (an f16 cache) get the rows rounded to nearest even, as numpy's astype rounds them."""
    k_cells, v_cells = _kv_cells(k_region, v_region, "kv_store")
    if k_cells.dtype == np.uint16 and not F16C:  # LLVM would call a runtime helper that numba does not link
        code = _kv_store_numpy(k, v, positions, k_region, v_region)
    else:
        code = _kv_store_kernel(k, v, positions, k_cells, v_cells)
    if code == -1:
        return
    where = "" if layer is None else f"layer {layer}: "
    if code == -2:
        raise ValueError(
            f"{where}kv_store: k {k.shape}, v {v.shape}, positions {positions.shape} do not fit the regions "
            f"{k_region.shape} / {v_region.shape}"
        )
    raise ContextOverflowError(
        f"{where}KV store position {int(positions[code])} (token {code}) is outside the context of "
        f"{k_region.shape[0]} positions"
    )


# ---------------------------------------------------------------------------------------------------------
# attention


@njit(cache=True, error_model="numpy", inline="always")
def _dot(a, ar, a0, b, br, b0, n):
    """float32 ``sum(a[ar, a0:a0+n] * b[br, b0:b0+n])``: lane l of an 8-wide vector sums the products at
    i = l mod 8 in order, the lanes are combined in a fixed tree, a scalar tail adds i >= n - n mod 8."""
    acc = zeros_f32x8()
    i = 0
    while i + 8 <= n:
        acc = muladd_f32x8(acc, load_row_f32x8(a, ar, a0 + i), load_row_f32x8(b, br, b0 + i))
        i += 8
    s = hsum_tree(acc)
    while i < n:
        s += a[ar, a0 + i] * row_value_f32(b, br, b0 + i)
        i += 1
    return s


@njit(cache=True, error_model="numpy")
def _attn_scores(q, t, qo, kr, ko, kbase, j0, j1, hdk, scale32, sc, row):
    """``sc[row, j] = dot(q[t, qo:qo+hdk], kr[j - kbase, ko:ko+hdk]) * scale`` for j in j0..j1-1.

    Four keys per pass share the q loads; a key's score is the same float operations (8 lanes over the
    head dim, then the fixed tree) whether it is computed in a group of four or alone.
    """
    j = j0
    if hdk % 8 == 0:
        while j + 4 <= j1:
            r = j - kbase
            a0 = a1 = a2 = a3 = zeros_f32x8()
            for c in range(0, hdk, 8):
                qv = load_row_f32x8(q, t, qo + c)
                a0 = muladd_f32x8(a0, qv, load_row_f32x8(kr, r, ko + c))
                a1 = muladd_f32x8(a1, qv, load_row_f32x8(kr, r + 1, ko + c))
                a2 = muladd_f32x8(a2, qv, load_row_f32x8(kr, r + 2, ko + c))
                a3 = muladd_f32x8(a3, qv, load_row_f32x8(kr, r + 3, ko + c))
            store_hsums4_scaled(sc, row, j, scale32, a0, a1, a2, a3)
            j += 4
    while j < j1:
        sc[row, j] = _dot(q, t, qo, kr, j - kbase, ko, hdk) * scale32
        j += 1


@njit(cache=True, error_model="numpy")
def _attn_scores2(q, ta, qa, tb, qb, kr, kbase, j0, j1, hdk, scale32, sc, ra, rb):
    """Two query rows' scores against the same keys j0..j1-1 of a packed block (``kr`` row ``j - kbase``,
    from column 0): rows ``(ta, qa)`` -> ``sc[ra]``, ``(tb, qb)`` -> ``sc[rb]``. Sixteen lanes: row a's
    eight in the low half, row b's in the high half against one K load in both, so each register
    operation does both rows' work (one instruction on AVX-512, two elsewhere); every lane is the float
    operations of :func:`_attn_scores`'s eight, so pairing never changes a bit."""
    j = j0
    if hdk % 8 == 0:
        while j + 4 <= j1:
            r = j - kbase
            a0 = a1 = a2 = a3 = zeros_f32x16()
            for c in range(0, hdk, 8):
                qv = load_rows_f32x16(q, ta, qa + c, tb, qb + c)
                a0 = muladd_f32x16(a0, qv, broadcast_row_f32x16(kr, r, c))
                a1 = muladd_f32x16(a1, qv, broadcast_row_f32x16(kr, r + 1, c))
                a2 = muladd_f32x16(a2, qv, broadcast_row_f32x16(kr, r + 2, c))
                a3 = muladd_f32x16(a3, qv, broadcast_row_f32x16(kr, r + 3, c))
            store_hsums4_scaled(sc, ra, j, scale32, low_f32x8(a0), low_f32x8(a1), low_f32x8(a2), low_f32x8(a3))
            store_hsums4_scaled(sc, rb, j, scale32, high_f32x8(a0), high_f32x8(a1), high_f32x8(a2), high_f32x8(a3))
            j += 4
    while j < j1:
        sc[ra, j] = _dot(q, ta, qa, kr, j - kbase, 0, hdk) * scale32
        sc[rb, j] = _dot(q, tb, qb, kr, j - kbase, 0, hdk) * scale32
        j += 1


@njit(cache=True, error_model="numpy")
def _attn_softmax(sc, row, lo, n):
    """Scores ``sc[row, lo:n]`` -> weights in place: the reference's row max, float32 exp, float64 sum,
    ``e * f32(1/sum)``. The sum takes four lanes (lane l adds j = lo + l mod 4 in order), then
    (l0 + l1) + (l2 + l3), then the tail in order."""
    m = sc[row, lo]
    j = lo + 1
    if j + 8 <= n:
        mv = load_row_f32x8(sc, row, j)
        j += 8
        while j + 8 <= n:
            mv = max_f32x8(load_row_f32x8(sc, row, j), mv)
            j += 8
        hm = hmax_f32x8(mv)
        m = hm if hm > m else m
    while j < n:
        m = sc[row, U(j)] if sc[row, U(j)] > m else m
        j += 1
    for j in range(lo, n):
        sc[row, U(j)] = exp32(sc[row, U(j)] - m)
    acc = zeros_f64x4()
    j = lo
    while j + 4 <= n:
        acc = add_row_f64x4(sc, row, j, acc)
        j += 4
    tot = hsum_tree(acc)
    while j < n:
        tot += np.float64(sc[row, U(j)])
        j += 1
    inv = F32(1.0 / tot)
    for j in range(lo, n):
        sc[row, U(j)] = sc[row, U(j)] * inv


@njit(cache=True, error_model="numpy")
def _attn_pv(sc, row, vr, vo, vbase, j0, j1, hdv, out, t, oo):
    """``out[t, oo:oo+hdv] += sum_{j0 <= j < j1} w_j * vr[j - vbase, vo:vo+hdv]``, each output value adding its
    products in key order (so splitting a chunk into key blocks changes nothing). 64 values per pass in
    eight vector accumulators (enough independent chains to hide the add latency), then 8, then 1."""
    d = 0
    while d + 64 <= hdv:
        c = oo + d
        o0 = load_row_f32x8(out, t, c)
        o1 = load_row_f32x8(out, t, c + 8)
        o2 = load_row_f32x8(out, t, c + 16)
        o3 = load_row_f32x8(out, t, c + 24)
        o4 = load_row_f32x8(out, t, c + 32)
        o5 = load_row_f32x8(out, t, c + 40)
        o6 = load_row_f32x8(out, t, c + 48)
        o7 = load_row_f32x8(out, t, c + 56)
        cv = vo + d
        for j in range(j0, j1):
            w = splat_f32x8(sc[row, j])
            o0 = muladd_f32x8(o0, w, load_row_f32x8(vr, j - vbase, cv))
            o1 = muladd_f32x8(o1, w, load_row_f32x8(vr, j - vbase, cv + 8))
            o2 = muladd_f32x8(o2, w, load_row_f32x8(vr, j - vbase, cv + 16))
            o3 = muladd_f32x8(o3, w, load_row_f32x8(vr, j - vbase, cv + 24))
            o4 = muladd_f32x8(o4, w, load_row_f32x8(vr, j - vbase, cv + 32))
            o5 = muladd_f32x8(o5, w, load_row_f32x8(vr, j - vbase, cv + 40))
            o6 = muladd_f32x8(o6, w, load_row_f32x8(vr, j - vbase, cv + 48))
            o7 = muladd_f32x8(o7, w, load_row_f32x8(vr, j - vbase, cv + 56))
        store_row_f32x8(out, t, c, o0)
        store_row_f32x8(out, t, c + 8, o1)
        store_row_f32x8(out, t, c + 16, o2)
        store_row_f32x8(out, t, c + 24, o3)
        store_row_f32x8(out, t, c + 32, o4)
        store_row_f32x8(out, t, c + 40, o5)
        store_row_f32x8(out, t, c + 48, o6)
        store_row_f32x8(out, t, c + 56, o7)
        d += 64
    while d + 8 <= hdv:
        o0 = load_row_f32x8(out, t, oo + d)
        for j in range(j0, j1):
            o0 = muladd_f32x8(o0, splat_f32x8(sc[row, j]), load_row_f32x8(vr, j - vbase, vo + d))
        store_row_f32x8(out, t, oo + d, o0)
        d += 8
    while d < hdv:
        acc = out[t, oo + d]
        for j in range(j0, j1):
            acc += sc[row, j] * row_value_f32(vr, j - vbase, vo + d)
        out[t, oo + d] = acc
        d += 1


@njit(cache=True, error_model="numpy")
def _attn_pv2(sc, ra, rb, vr, vbase, j0, j1, hdv, out, oa, ob):
    """:func:`_attn_pv` for two rows over the same keys of a packed block (``vr`` row ``j - vbase``, from
    column 0): ``out[oa] += Σ sc[ra, j] v_j`` and ``out[ob] += Σ sc[rb, j] v_j``, 64 values of both per
    pass in sixteen-lane registers, each V load serving both. Every output value adds its products in key
    order, as :func:`_attn_pv` does (a lane is an output value: the register width changes no bit)."""
    d = 0
    while d + 64 <= hdv:
        x0 = load_row_f32x16(out, oa, d)
        x1 = load_row_f32x16(out, oa, d + 16)
        x2 = load_row_f32x16(out, oa, d + 32)
        x3 = load_row_f32x16(out, oa, d + 48)
        y0 = load_row_f32x16(out, ob, d)
        y1 = load_row_f32x16(out, ob, d + 16)
        y2 = load_row_f32x16(out, ob, d + 32)
        y3 = load_row_f32x16(out, ob, d + 48)
        for j in range(j0, j1):
            r = j - vbase
            wa = splat_f32x16(sc[ra, j])
            wb = splat_f32x16(sc[rb, j])
            v = load_row_f32x16(vr, r, d)
            x0 = muladd_f32x16(x0, wa, v)
            y0 = muladd_f32x16(y0, wb, v)
            v = load_row_f32x16(vr, r, d + 16)
            x1 = muladd_f32x16(x1, wa, v)
            y1 = muladd_f32x16(y1, wb, v)
            v = load_row_f32x16(vr, r, d + 32)
            x2 = muladd_f32x16(x2, wa, v)
            y2 = muladd_f32x16(y2, wb, v)
            v = load_row_f32x16(vr, r, d + 48)
            x3 = muladd_f32x16(x3, wa, v)
            y3 = muladd_f32x16(y3, wb, v)
        store_row_f32x16(out, oa, d, x0)
        store_row_f32x16(out, oa, d + 16, x1)
        store_row_f32x16(out, oa, d + 32, x2)
        store_row_f32x16(out, oa, d + 48, x3)
        store_row_f32x16(out, ob, d, y0)
        store_row_f32x16(out, ob, d + 16, y1)
        store_row_f32x16(out, ob, d + 32, y2)
        store_row_f32x16(out, ob, d + 48, y3)
        d += 64
    if d < hdv:  # the rest of the values (fewer than 64), one row at a time: the same operations per value
        _attn_pv(sc, ra, vr, d, vbase, j0, j1, hdv - d, out, oa, d)
        _attn_pv(sc, rb, vr, d, vbase, j0, j1, hdv - d, out, ob, d)


@njit(cache=True, error_model="numpy", inline="always")
def _window_start(p, window):
    """First row a token at position p reads: 0, or p - window + 1 in a sliding-window layer."""
    if window > 0 and p + 1 > window:
        return p + 1 - window
    return 0


@njit(cache=True, error_model="numpy")
def _pack_block(src, rmap, col0, k0, k1, width, dst):
    """``dst[r, 0:width] = src[rmap[k0 + r], col0:col0+width]`` for r < k1 - k0, as float32 (f16 cells
    widened, exactly): keys k0..k1-1 of a sequence, wherever its row map puts them."""
    for r in range(k1 - k0):
        row = rmap[k0 + r]
        c = 0
        while c + 8 <= width:
            store_row_f32x8(dst, r, c, load_row_f32x8(src, row, col0 + c))
            c += 8
        while c < width:
            dst[r, c] = row_value_f32(src, row, col0 + c)
            c += 1


@njit(cache=True, error_model="numpy", inline="always")
def _run_end(rmap, j, k1):
    """The end of the run of keys j.. (before k1) that lie in consecutive cache rows: the rest of j's block
    of ``ROW_MAP_BLOCK`` keys, and the blocks after it that happen to follow it in the cache (a map is
    consecutive within each block: :func:`_map_fits`)."""
    r = rmap[j]
    e = j - j % ROW_MAP_BLOCK + ROW_MAP_BLOCK
    while e < k1 and rmap[e] == r + (e - j):
        e += ROW_MAP_BLOCK
    return min(e, k1)


@njit(cache=True, error_model="numpy", inline="always")
def _map_fits(rmap, j0, j1, n_rows):
    """Whether ``rmap[j0:j1]`` are all rows of a region of ``n_rows``, consecutive within each aligned block
    of ``ROW_MAP_BLOCK`` keys (what lets a decode step take a block's keys as one run)."""
    for j in range(j0, j1):
        r = rmap[j]
        if r < 0 or r >= n_rows or (j % ROW_MAP_BLOCK != 0 and j > j0 and r != rmap[j - 1] + 1):
            return False
    return True


@njit(cache=True, error_model="numpy", inline="always")
def _row_keys(p, e, window, k0, k1):
    """(j0, j1): the keys of block k0..k1-1 that the token at position p with key end e reads (none when
    j0 >= j1)."""
    return max(k0, _window_start(p, window)), min(k1, e + 1)


@njit(cache=True, error_model="numpy", inline="always")
def _pair_keys(pos, ends, window, k0, k1, t0, nh, i, nr):
    """Rows i and i + 1 of a unit (row r: token t0 + r // nh) in key block k0..k1-1: the keys each reads,
    (ja0, ja1) and (jb0, jb1), and those both read, (c0, c1). Without a row i + 1 (i + 1 == nr), or
    without common keys, c0 = c1 = ja1 and row i + 1 reads none."""
    ta = t0 + i // nh
    ja0, ja1 = _row_keys(pos[ta], ends[ta], window, k0, k1)
    jb0 = jb1 = ja1
    if i + 1 < nr:
        tb = t0 + (i + 1) // nh
        jb0, jb1 = _row_keys(pos[tb], ends[tb], window, k0, k1)
    c0, c1 = max(ja0, jb0), min(ja1, jb1)
    if i + 1 == nr or c0 >= c1:
        c0 = c1 = ja1
    return ja0, ja1, jb0, jb1, c0, c1


@njit(cache=True, error_model="numpy")
def _attn_unit(q, kr, vr, rmap, pos, ends, g, h0, h1, t0, t1, hdk, hdv, scale32, max_len, window, out):
    """Query heads h0..h1-1 (all reading kv head g) for tokens t0..t1-1: what one worker owns.

    Keys are taken in blocks of ``ATTN_KEY_BLOCK`` rows. Each block of K (then of V) is first copied
    out of the cache into a contiguous scratch block, then used there by every (token, head) row of the
    unit while it sits in L1. (In the cache a head's rows lie a whole cache row apart, a power of two
    bytes for most models: read in place, a block's rows fall into the same few L1 sets and evict each
    other.) Rows are taken in pairs that share each K and V load. Every (token, head) result is the same
    float operations whatever the unit's shape, the pairing or the copy, so the split into units (which
    follows the thread count) never changes a bit.

    ``window`` > 0 (sliding-window layers): token t reads only rows ``pos[t] - window + 1 .. pos[t]``;
    rows before are never read, as rows after ``pos[t]`` are not. Key blocks and chunks stay aligned to
    absolute rows, so a token's result is the same whichever other tokens share its unit.

    ``ends[t]`` (>= ``pos[t]``) is the last row token t reads: ``pos[t]`` for causal attention, further for
    a token that sees keys after its own (an image's); the window's start still follows ``pos[t]``.
    """
    nh = h1 - h0
    nr = (t1 - t0) * nh  # rows (token, head), row i = (t0 + i // nh, h0 + i % nh)
    ko = g * hdk
    vo = g * hdv
    kend = 0
    kbeg = max_len
    for t in range(t0, t1):
        kend = max(kend, ends[t] + 1)  # the window is the mask: rows beyond ends[t] are never read
        kbeg = min(kbeg, _window_start(pos[t], window))
    kbeg -= kbeg % ATTN_KEY_BLOCK
    sc = np.empty((nr, max_len), F32)
    blk = np.empty((ATTN_KEY_BLOCK, max(hdk, hdv)), F32)
    for k0 in range(kbeg, kend, ATTN_KEY_BLOCK):
        k1 = min(kend, k0 + ATTN_KEY_BLOCK)
        _pack_block(kr, rmap, ko, k0, k1, hdk, blk)
        for i in range(0, nr, 2):
            ja0, ja1, jb0, jb1, c0, c1 = _pair_keys(pos, ends, window, k0, k1, t0, nh, i, nr)
            ta, qa = t0 + i // nh, (h0 + i % nh) * hdk
            # per row: the keys before the common ones, those after, then the common ones (both rows at once)
            _attn_scores(q, ta, qa, blk, 0, k0, ja0, c0, hdk, scale32, sc, i)
            _attn_scores(q, ta, qa, blk, 0, k0, c1, ja1, hdk, scale32, sc, i)
            if i + 1 < nr:
                tb, qb = t0 + (i + 1) // nh, (h0 + (i + 1) % nh) * hdk
                _attn_scores(q, tb, qb, blk, 0, k0, jb0, min(c0, jb1), hdk, scale32, sc, i + 1)
                _attn_scores(q, tb, qb, blk, 0, k0, max(c1, jb0), jb1, hdk, scale32, sc, i + 1)
                _attn_scores2(q, ta, qa, tb, qb, blk, k0, c0, c1, hdk, scale32, sc, i, i + 1)
    for t in range(t0, t1):
        for h in range(h0, h1):
            _attn_softmax(sc, (t - t0) * nh + h - h0, _window_start(pos[t], window), ends[t] + 1)
            for d in range(h * hdv, (h + 1) * hdv):
                out[t, d] = F32(0.0)
    part = np.empty((nr, hdv), F32)  # this chunk's sum of w_j v_j, per (token, head)
    for k0 in range(kbeg, kend, ATTN_KEY_BLOCK):
        k1 = min(kend, k0 + ATTN_KEY_BLOCK)
        _pack_block(vr, rmap, vo, k0, k1, hdv, blk)
        for i in range(0, nr, 2):
            ja0, ja1, jb0, jb1, c0, c1 = _pair_keys(pos, ends, window, k0, k1, t0, nh, i, nr)
            for r in range(i, min(nr, i + 2)):
                t = t0 + r // nh
                j0, j1 = (ja0, ja1) if r == i else (jb0, jb1)
                if j0 < j1 and (k0 % ATTN_KEY_CHUNK == 0 or k0 <= _window_start(pos[t], window)):
                    for d in range(hdv):  # a chunk starts, or the token's first block
                        part[r, d] = F32(0.0)
            # per row: the keys before the common ones, the common ones (both rows at once), those after
            _attn_pv(sc, i, blk, 0, k0, ja0, min(c0, ja1), hdv, part, i, 0)
            if i + 1 < nr:
                _attn_pv(sc, i + 1, blk, 0, k0, jb0, min(c0, jb1), hdv, part, i + 1, 0)
                _attn_pv2(sc, i, i + 1, blk, k0, c0, c1, hdv, part, i, i + 1)
                _attn_pv(sc, i + 1, blk, 0, k0, max(c1, jb0), jb1, hdv, part, i + 1, 0)
            _attn_pv(sc, i, blk, 0, k0, max(c1, ja0), ja1, hdv, part, i, 0)
            for r in range(i, min(nr, i + 2)):
                t = t0 + r // nh
                j0, j1 = (ja0, ja1) if r == i else (jb0, jb1)
                if j0 < j1 and ((k0 + ATTN_KEY_BLOCK) % ATTN_KEY_CHUNK == 0 or j1 == ends[t] + 1):
                    o = (h0 + r % nh) * hdv  # the chunk or the window ends here
                    for d in range(hdv):
                        out[t, o + d] += part[r, d]


@njit(cache=True, error_model="numpy", inline="always")
def _unit_tokens(group):
    """Tokens per phase-0 unit of a model with ``group`` query heads per kv head."""
    return ATTN_TOKEN_BLOCK * max(1, ATTN_UNIT_ROWS // (ATTN_TOKEN_BLOCK * group))


@njit(cache=True, error_model="numpy", inline="always")
def _head_subsets(group, n_head_kv, n_blocks, n_threads):
    """(n_sub, per_sub): phase-0 units are (kv head, subset of its query heads, token block). A unit reads
    its K/V blocks once for all its heads; only when there are fewer (kv head, token block) pairs than
    threads are a group's heads split into ``n_sub`` subsets of ``per_sub``, so that every thread gets
    work. (Splitting sooner measured slower for decode, which is bound by reading K/V: a split reads them
    twice.)"""
    n_sub = 1
    if n_head_kv * n_blocks < n_threads:
        n_sub = min(group, (n_threads + n_head_kv * n_blocks - 1) // (n_head_kv * n_blocks))
    per_sub = (group + n_sub - 1) // n_sub
    return (group + per_sub - 1) // per_sub, per_sub


@njit(cache=True, error_model="numpy", inline="always")
def _unit_span(v, n_blocks, n_sub, per_sub, group):
    """(kv head g, query heads h0..h1-1, token block b) of phase-0 unit ``v`` of one run of tokens."""
    b = v % n_blocks
    s = (v // n_blocks) % n_sub
    g = v // (n_blocks * n_sub)
    # zigzag the token blocks (0, n-1, 1, n-2, ...): with causal windows their cost grows with the
    # token index, and any contiguous range of units (what a worker gets) then holds a balanced mix
    b = b // 2 if b % 2 == 0 else n_blocks - 1 - b // 2
    h0 = g * group + s * per_sub
    return g, h0, min(g * group + group, h0 + per_sub), b


@njit(cache=True, error_model="numpy")
def _attn_task(
    phase, u, n_blocks, n_sub, per_sub, n_chunks, n_split, group, n_head_kv, q, kr, vr, rmap, pos, ends, hdk, hdv,
    scale32, max_len, window, sc, part, out
):
    """Work unit u of a phase. Phase 0: everything for (kv head, head subset, token block) units.
    Phases 1-3 split one token's keys (see ``attention``): 1 scores of (kv heads, key chunk) units, 2
    softmax of one head, 3 the chunk sums of w_j v_j of (kv heads, key chunk) units, each unit computing
    exactly what ``_attn_unit`` computes for those keys. Phase 4, for a window of one key chunk: the
    three steps in one, each unit for its heads.

    A (kv heads, key chunk) unit walks its chunk's cache rows in order, a few at a time (see
    ``ATTN_DECODE_STEP_BYTES``), every head of its range on those rows before the next ones: the unit
    reads a run of its heads' cells per row, not one head's 64 values a whole cache row apart. The kv
    heads are cut into ``n_split`` contiguous ranges."""
    if phase == 0:
        g, h0, h1, b = _unit_span(u, n_blocks, n_sub, per_sub, group)
        t0 = b * _unit_tokens(group)
        t1 = min(q.shape[0], t0 + _unit_tokens(group))
        _attn_unit(q, kr, vr, rmap, pos, ends, g, h0, h1, t0, t1, hdk, hdv, scale32, max_len, window, out)
    elif phase == 2:
        _attn_softmax(sc, I64(u), I64(0), max_len)  # the signature _attn_unit's call compiles
    else:
        c = u % n_chunks  # units by kv heads first: a thread's contiguous range of units is whole head ranges
        per = (n_head_kv + n_split - 1) // n_split
        g0 = (u // n_chunks) * per
        g1 = min(n_head_kv, g0 + per)
        c0 = c * ATTN_KEY_CHUNK
        c1 = min(max_len, c0 + ATTN_KEY_CHUNK)
        rows = min(64, max(8, ATTN_DECODE_STEP_BYTES // max(1, (g1 - g0) * max(hdk, hdv) * kr.itemsize)))
        if phase != 3:  # 1, or 4: the three steps of a window of one chunk in one unit
            for k0 in range(c0, c1, rows):
                k1 = min(c1, k0 + rows)
                j = k0
                while j < k1:  # each run of consecutive cache rows (key j at row j - kb)
                    e = _run_end(rmap, j, k1)
                    kb = j - rmap[j]
                    for g in range(g0, g1):
                        for h in range(g * group, (g + 1) * group):
                            _attn_scores(q, I64(0), h * hdk, kr, g * hdk, kb, j, e, hdk, scale32, sc, h)
                    j = e
        if phase == 1:
            return
        for h in range(g0 * group, g1 * group):
            if phase == 4:
                _attn_softmax(sc, I64(h), I64(0), max_len)
            for d in range(hdv):
                part[h * n_chunks + c, d] = F32(0.0)
        for k0 in range(c0, c1, rows):
            k1 = min(c1, k0 + rows)
            j = k0
            while j < k1:  # each value still adds its keys' products in key order, run after run
                e = _run_end(rmap, j, k1)
                kb = j - rmap[j]
                for g in range(g0, g1):
                    for h in range(g * group, (g + 1) * group):
                        _attn_pv(sc, h, vr, g * hdv, kb, j, e, hdv, part, h * n_chunks + c, 0)
                j = e


def _key_ends(ends, positions):
    """The key ends a kernel reads: ``ends``, or the positions where it is None (chosen when numba compiles,
    so ``ends`` may have another integer type than the positions)."""
    return positions if ends is None else ends


@overload(_key_ends, inline="always")
def _key_ends_typed(ends, positions):
    if ends is None or isinstance(ends, (types.NoneType, types.Omitted)):
        return lambda ends, positions: positions
    return lambda ends, positions: ends


@njit(cache=True, error_model="numpy", inline="always")
def _attn_geometry(q, k_region, v_region, positions, ends, n_head, n_head_kv, hdk, hdv, window, out):
    """-1 when the operands fit each other, else the kernels' error code (-2, -3 or -4)."""
    nt = q.shape[0]
    if (
        n_head_kv < 1
        or window < 0
        or n_head % n_head_kv
        or hdk < 1
        or hdv < 1
        or q.shape[1] != n_head * hdk
        or out.shape[0] != nt
        or out.shape[1] != n_head * hdv
        or positions.shape[0] != nt
        or ends.shape[0] != nt
        or k_region.shape[1] != n_head_kv * hdk
        or v_region.shape[1] != n_head_kv * hdv
        or v_region.shape[0] != k_region.shape[0]
    ):
        return -2
    if q.strides[1] != 4 or out.strides[1] != 4 or k_region.strides[1] != k_region.itemsize or \
            v_region.strides[1] != v_region.itemsize:
        return -3  # the vector loads/stores move 8 consecutive values of a row
    if out.ctypes.data == q.ctypes.data:
        return -4  # out rows are accumulated in place while other workers still read q
    return -1


@njit(cache=True, error_model="numpy", parallel=True)
def _attn_kernel(
    q, k_region, v_region, rmap, positions, n_head, n_head_kv, hdk, hdv, scale, n_threads, phase, sc, part, window,
    out, ends=None
):
    """Returns -1 when done, -2 on a geometry mismatch, -3 when rows are not contiguous, -4 when out is q,
    -6 when the row map points outside the regions, else the first token whose position or key end is
    outside the row map, or whose key end is before its position (nothing is written then). Key j is region
    row ``rmap[j]``; token t reads keys up to ``ends[t]`` (None: ``positions[t]``, causal attention).

    ``phase`` 0 computes everything; 1, 2, 3 are the steps of a decode split by keys, which the caller
    runs in order (4 all three, for a window of one key chunk) with the scratch ``sc [n_head, window]``
    and ``part [n_head * n_chunks, head_dim_v]``
    (phase 0 ignores them; they read every row 0..ends[0], so a caller splits only a token whose sliding
    ``window`` covers them all)."""
    nt = q.shape[0]
    n_ctx = rmap.shape[0]
    # the engine always passes its key ends (the positions themselves for causal attention: one compiled
    # kernel); None, the tests' direct calls, is resolved when numba compiles
    kends = _key_ends(ends, positions)
    code = _attn_geometry(q, k_region, v_region, positions, kends, n_head, n_head_kv, hdk, hdv, window, out)
    if code != -1:
        return code
    # int64, not the literal 0: numba types the calls below before the loop widens it, and compiling
    # them once for Literal[int](0) and again for int64 cost ~30% of this kernel's compile time
    max_len = I64(0)
    for t in range(nt):
        p = positions[t]
        e = kends[t]
        if p < 0 or e < p or e >= n_ctx:
            return t
        max_len = max(max_len, e + 1)
    if (phase < 2 or phase == 4) and not _map_fits(rmap, 0, max_len, k_region.shape[0]):
        return -6  # (checked by a decode's first step: phases 2 and 3 follow phase 1 on the same map)
    group = n_head // n_head_kv
    n_blocks = (nt + _unit_tokens(group) - 1) // _unit_tokens(group)
    n_chunks = (max_len + ATTN_KEY_CHUNK - 1) // ATTN_KEY_CHUNK
    scale32 = F32(scale)
    # the thread count comes from the caller: numba's get_num_threads inside a kernel would keep it out of
    # the on-disk cache
    n_sub, per_sub = _head_subsets(group, n_head_kv, n_blocks, n_threads)
    # phases 1 and 3: units of (kv heads, key chunk), the kv heads in a few ranges per thread. prange hands
    # each thread a contiguous range of units, so that each gets whole head ranges over all the chunks
    # (the last chunk is partial: splitting by chunks first would load one thread with the full ones)
    n_split = min(n_head_kv, ATTN_DECODE_UNITS_PER_THREAD * n_threads)
    if phase == 0:
        n_units = n_head_kv * n_sub * n_blocks
    elif phase == 2:
        n_units = n_head
    else:
        if nt != 1 or sc.shape[0] != n_head or sc.shape[1] < max_len or part.shape[0] != n_head * n_chunks:
            return -2
        if part.shape[1] != hdv:
            return -2
        n_units = n_split * n_chunks
    for u in prange(n_units):
        # U(u): numba types a prange index int64 where it types the loop and uint64 where it compiles the
        # parallel body; the same type in both makes _attn_task (and all below it) compile once, not twice
        _attn_task(
            phase,
            U(u),
            n_blocks,
            n_sub,
            per_sub,
            n_chunks,
            n_split,
            group,
            n_head_kv,
            q,
            k_region,
            v_region,
            rmap,
            positions,
            kends,
            hdk,
            hdv,
            scale32,
            max_len,
            window,
            sc,
            part,
            out,
        )
    if phase >= 3:  # each head adds its chunk sums in chunk order, as _attn_unit does
        for h in range(n_head):
            for d in range(hdv):
                acc = F32(0.0)
                for c in range(n_chunks):
                    acc += part[h * n_chunks + c, d]
                out[0, h * hdv + d] = acc
    return -1


@njit(cache=True, error_model="numpy", parallel=True)
def _attn_rows_kernel(
    q, k_region, v_region, rmap, positions, rows, n_head, n_head_kv, hdk, hdv, scale, n_threads, window, out,
    ends=None
):
    """Attention for tokens of several sequences sharing regions, in one parallel loop: token t reads the
    virtual rows ``rows[t] - positions[t]`` (its sequence's position 0) up to ``rows[t]`` (up to its key end
    ``ends[t]``'s row where ``ends`` is given), each at region row ``rmap[row]``.

    Tokens are taken in runs that share their first row (a sequence's tokens, consecutive in the batch);
    each run is split into the same (kv head, head subset, token block) units as ``_attn_kernel``'s
    phase 0, on a view of the regions starting at the run's first row, so every (token, head) result is
    bit-identical to attending that sequence alone. Returns as ``_attn_kernel`` does (-1 when done), the
    first bad token when a row (its own or its key end's) is outside the regions or before its position, or
    its key end is before its position."""
    nt = q.shape[0]
    n_ctx = rmap.shape[0]
    kends = _key_ends(ends, positions)  # (see _attn_kernel)
    code = _attn_geometry(q, k_region, v_region, positions, kends, n_head, n_head_kv, hdk, hdv, window, out)
    if code != -1:
        return code
    if rows.shape[0] != nt:
        return -2
    run_start = np.empty(nt + 1, np.int64)  # runs of tokens with one first row: run_start[i]..run_start[i+1]
    n_runs = I64(0)
    max_len = I64(0)  # int64 from the start: see _attn_kernel
    for t in range(nt):
        p = positions[t]
        r = rows[t]
        e = kends[t]
        if p < 0 or r < p or e < p or r - p + e >= n_ctx:  # (r <= its key end's row r - p + e)
            return t
        max_len = max(max_len, e + 1)
        if t == 0 or r - p != rows[t - 1] - positions[t - 1]:
            run_start[n_runs] = t
            n_runs += 1
    run_start[n_runs] = nt
    for i in range(n_runs):  # every row a run reads maps into the regions (its keys count from its base)
        t = run_start[i]
        base = rows[t] - positions[t]
        last = base + kends[t]
        for u in range(t, run_start[i + 1]):
            last = max(last, base + kends[u])
        if not _map_fits(rmap[base:], 0, last + 1 - base, k_region.shape[0]):
            return -6
    group = n_head // n_head_kv
    tokens = _unit_tokens(group)
    n_blocks_all = I64(0)
    for i in range(n_runs):
        n_blocks_all += (run_start[i + 1] - run_start[i] + tokens - 1) // tokens
    n_sub, per_sub = _head_subsets(group, n_head_kv, n_blocks_all, n_threads)
    unit_end = np.empty(n_runs, np.int64)  # units of runs 0..i end before unit_end[i]
    n_units = I64(0)
    for i in range(n_runs):
        n_units += n_head_kv * n_sub * ((run_start[i + 1] - run_start[i] + tokens - 1) // tokens)
        unit_end[i] = n_units
    scale32 = F32(scale)
    for v in prange(n_units):
        u = U(v)  # one type for the loop's typing and its parallel body: _attn_unit compiles once (see above)
        i = 0
        while unit_end[i] <= u:
            i += 1
        t_first = run_start[i]
        n_blocks = (run_start[i + 1] - t_first + tokens - 1) // tokens
        g, h0, h1, b = _unit_span(u - (unit_end[i] - n_head_kv * n_sub * n_blocks), n_blocks, n_sub, per_sub, group)
        t0 = t_first + b * tokens
        t1 = min(run_start[i + 1], t0 + tokens)
        base = rows[t_first] - positions[t_first]
        _attn_unit(
            q, k_region, v_region, rmap[base:], positions, kends, g, h0, h1, t0, t1, hdk, hdv, scale32, max_len, window,
            out,
        )
    return -1


_NO_SCRATCH = np.zeros((1, 1), F32)


def _attention_split_by_keys(
    q, k_region, v_region, rmap, positions, n_head, n_head_kv, head_dim_k, head_dim_v, scale, n_threads, out,
    ends=None,
) -> int:
    """One token's attention as three kernel calls split by keys (one when its window fits a key chunk),
    keys 0..``ends[0]`` (None: ``positions[0]``); -5 when its key end is not valid (the single-step path
    then reports it), else the kernel's code."""
    if ends is None:
        ends = positions
    n = int(ends[0]) + 1
    n_chunks = (n + ATTN_KEY_CHUNK - 1) // ATTN_KEY_CHUNK
    if n > rmap.shape[0] or n < 1:
        return -5
    sc = np.empty((n_head, n), F32)
    part = np.empty((n_head * n_chunks, head_dim_v), F32)
    code = -1
    # a window of one chunk: one parallel step, each unit with all the keys of its heads
    for phase in (4,) if n_chunks == 1 else (1, 2, 3):
        code = _attn_kernel(
            q,
            k_region,
            v_region,
            rmap,
            positions,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            scale,
            n_threads,
            phase,
            sc,
            part,
            0,
            out,
            ends,
        )
        if code != -1:
            break
    return code


def attention(
    q: np.ndarray,
    k_region: np.ndarray,
    v_region: np.ndarray,
    positions: np.ndarray,
    n_head: int,
    n_head_kv: int,
    head_dim_k: int,
    head_dim_v: int,
    scale: float,
    out: np.ndarray,
    window: int = 0,
    row_map: np.ndarray | None = None,
    key_ends: np.ndarray | None = None,
) -> None:
    """Causal GQA attention: token t reads cached rows ``0..pos[t]``; query head h reads kv head h // group.
    With ``window`` > 0 (a sliding-window layer) only the rows ``pos[t] - window + 1 .. pos[t]``.
    ``row_map`` (int32): key j is region row ``row_map[j]`` (the KV cache's blocks); None: row j.
    ``key_ends`` (as ``positions``): token t reads up to row ``key_ends[t] >= pos[t]`` instead of
    ``pos[t]`` (an image token that sees its whole image; the window's start still follows ``pos[t]``);
    None: the positions, causal attention.

    ``out`` ``[tokens, n_head * head_dim_v]`` must not overlap ``q``. Runs on numba's threads (``numba.
    set_num_threads``); the result does not depend on their number.

    A decode step (one token, its window not sliding past row 0) runs as three parallel steps split by
    keys (scores, softmax, chunk sums), each walking the cache rows in address order: one token has too
    few heads to keep the threads busy on whole heads, and one head's keys alone lie a whole cache row
    apart (a stride the hardware prefetchers do not follow). Its result is bit-identical to the
    single-step path's.
    """
    k_region, v_region = _kv_cells(k_region, v_region)
    rmap = _row_map(row_map, k_region)
    ends = positions if key_ends is None else key_ends
    n_threads = get_num_threads()
    code = -5
    if q.shape[0] == 1 and (window == 0 or int(positions[0]) < window):
        code = _attention_split_by_keys(
            q, k_region, v_region, rmap, positions, n_head, n_head_kv, head_dim_k, head_dim_v, scale, n_threads, out,
            ends,
        )
    if code == -5:
        code = _attn_kernel(
            q,
            k_region,
            v_region,
            rmap,
            positions,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            scale,
            n_threads,
            0,
            _NO_SCRATCH,
            _NO_SCRATCH,
            window,
            out,
            ends,
        )
    if code != -1:
        _raise_attention_error(code, q, k_region, v_region, rmap, positions, n_head, n_head_kv, head_dim_k, head_dim_v,
                               out, ends)


def attention_rows(
    q: np.ndarray,
    k_region: np.ndarray,
    v_region: np.ndarray,
    positions: np.ndarray,
    rows: np.ndarray,
    n_head: int,
    n_head_kv: int,
    head_dim_k: int,
    head_dim_v: int,
    scale: float,
    out: np.ndarray,
    window: int = 0,
    row_map: np.ndarray | None = None,
    key_ends: np.ndarray | None = None,
) -> None:
    """:func:`attention` for a batch mixing sequences of one cache: token t sits at virtual row
    ``rows[t]`` and position ``positions[t]`` of a sequence whose position 0 is virtual row
    ``rows[t] - positions[t]``, and reads that sequence's rows only (up to its position, or its key end
    ``key_ends[t]``); virtual row r is region row ``row_map[r]`` (None: row r). One parallel call serves
    every sequence; each token's result is bit-identical to :func:`attention` on its sequence's rows alone."""
    if rows.shape != positions.shape:
        raise ValueError(f"attention: {rows.shape[0]} rows for {positions.shape[0]} positions")
    k_region, v_region = _kv_cells(k_region, v_region)
    rmap = _row_map(row_map, k_region)
    ends = positions if key_ends is None else key_ends
    code = _attn_rows_kernel(
        q, k_region, v_region, rmap, positions, rows, n_head, n_head_kv, head_dim_k, head_dim_v, scale,
        get_num_threads(), window, out, ends,
    )
    if code == -1:
        return
    if code >= 0 and int(ends[code]) >= int(positions[code]) and 0 <= int(rows[code]) < rmap.shape[0] and \
            int(rows[code]) < int(positions[code]):
        raise ValueError(f"attention: token {code} at row {int(rows[code])} has position {int(positions[code])} "
                         "before its sequence's first row")
    _raise_attention_error(code, q, k_region, v_region, rmap, positions, n_head, n_head_kv, head_dim_k, head_dim_v,
                           out, ends, rows)


def _row_map(row_map: np.ndarray | None, k_region: np.ndarray) -> np.ndarray:
    """The row map the kernels take: ``row_map`` as it is (1-D int32, checked), or the identity."""
    if row_map is None:
        return np.arange(k_region.shape[0], dtype=np.int32)
    if not isinstance(row_map, np.ndarray) or row_map.dtype != np.int32 or row_map.ndim != 1 or \
            row_map.strides[0] != 4:
        raise ValueError(f"attention: the row map must be a contiguous 1-D int32 array, got {row_map!r}")
    return row_map


def _kv_cells(k_region: np.ndarray, v_region: np.ndarray, what: str = "attention") -> tuple[np.ndarray, np.ndarray]:
    """The K/V regions as the kernels take them: float32, or float16 as uint16 bit patterns (converted in
    the kernels, so an f16 cache needs no float32 copy of its window); ``what`` names the caller in the
    error."""
    if k_region.dtype != v_region.dtype or k_region.dtype not in (np.float32, np.float16):
        raise ValueError(f"{what}: the K/V regions must both be float32 or both float16, got {k_region.dtype} "
                         f"and {v_region.dtype}")
    if k_region.dtype == np.float16:
        return k_region.view(np.uint16), v_region.view(np.uint16)
    return k_region, v_region


def _raise_attention_error(
    code: int, q, k_region, v_region, rmap, positions, n_head, n_head_kv, head_dim_k, head_dim_v, out, ends,
    rows=None,
) -> None:
    if code == -3:
        raise ValueError("attention: q, the K/V regions and out must have contiguous rows")
    if code == -4:
        raise ValueError("attention: out must not be q (it is written while q is read)")
    if code == -6:
        raise ValueError(f"attention: the row map points outside the KV regions of {k_region.shape[0]} rows, or "
                         f"is not consecutive within blocks of {ROW_MAP_BLOCK} keys")
    if code == -2:
        raise ValueError(
            f"attention: q {q.shape}, regions {k_region.shape} / {v_region.shape}, positions {positions.shape}, "
            f"key ends {ends.shape}, out {out.shape} do not fit n_head {n_head}, n_head_kv {n_head_kv}, head dims "
            f"{head_dim_k}/{head_dim_v}"
        )
    p, e = int(positions[code]), int(ends[code])
    if e < p:
        raise ValueError(f"attention: token {code}'s key end {e} is before its position {p}")
    first = 0 if rows is None else int(rows[code]) - p  # the virtual row of its sequence's position 0
    if 0 <= p and first + p < rmap.shape[0]:  # the position fits: its key end does not
        raise ContextOverflowError(
            f"attention: key end {e} (token {code}, position {p}) is outside the KV regions of "
            f"{rmap.shape[0] - first} positions"
        )
    raise ContextOverflowError(
        f"attention: position {p} (token {code}) is outside the KV regions of {rmap.shape[0]} positions"
    )


# ---------------------------------------------------------------------------------------------------------
# warmup


def warmup() -> None:
    """Compile (or load from the on-disk cache) every signature the engine uses: float32 C-contiguous 2-D
    activations and regions, 1-D int32 positions and rows, Python int/float scalars. Anything else (int64
    positions, non-contiguous views) still works but compiles its own specialization on first use."""
    x = np.ones((2, 16), F32)
    pos = np.zeros(2, np.int32)
    regions = np.zeros((4, 16), F32), np.zeros((4, 16), F32)
    kv_store(x, x, pos, *regions)
    attention(x, *regions, pos, 2, 2, 8, 8, 0.5, np.empty_like(x))
    attention(x, *regions, pos, 2, 2, 8, 8, 0.5, np.empty_like(x), window=1)
    for window in (0, 1):
        attention_rows(x, *regions, pos, np.array([0, 2], np.int32), 2, 2, 8, 8, 0.5, np.empty_like(x), window)
