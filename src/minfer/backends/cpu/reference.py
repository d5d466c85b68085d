"""Plain numpy implementations of every op: the reference that fast kernels are tested against.

They follow the seeds' contracts: RMSNorm and softmax accumulate in float64; RoPE pairs dimensions by
the model's layout; the KV store writes rows at the positions it is given and refuses a position outside
the context; attention reads the window ``pos[t] + 1`` (up to a token's key end where one is given) with
masked scores at -inf (weights exactly 0).
"""

from __future__ import annotations

import numpy as np

from minfer.errors import ContextOverflowError
from minfer.formats.quants import GGMLType, dequantize_rows
from minfer.formats.tensors import WeightTensor
from minfer.graph.ir import AttnMeta, RopeMeta, RopeStyle

# values of W handled per matmul chunk: bounds the dequantized f32 scratch to 8 MB
MATMUL_CHUNK_VALUES = 1 << 21
GET_ROWS_CHUNK = 32  # rows of a quantized table dequantized at a time (get_rows)


def rms_norm(x: np.ndarray, eps: float, width: int, out: np.ndarray) -> None:
    g = x.reshape(-1, width)
    mean_sq = np.einsum("ij,ij->i", g, g, dtype=np.float64) / width
    scale = (1.0 / np.sqrt(mean_sq.astype(np.float32) + np.float32(eps))).astype(np.float32)
    np.multiply(g, scale[:, None], out=out.reshape(-1, width))


def mul(x: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    if y.shape == x.shape:
        np.multiply(x, y, out=out)
    else:
        np.multiply(x.reshape(-1, y.shape[0]), y, out=out.reshape(-1, y.shape[0]))


def add(x: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    if y.shape == x.shape:
        np.add(x, y, out=out)
    else:
        np.add(x.reshape(-1, y.shape[0]), y, out=out.reshape(-1, y.shape[0]))


def silu(x: np.ndarray, out: np.ndarray) -> None:
    with np.errstate(over="ignore"):  # exp(-x) = inf for x < -88: x / inf = -0, silu's limit
        np.divide(x, 1.0 + np.exp(-x), out=out)


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    silu(gate, out)
    np.multiply(out, up, out=out)


# GELU, tanh approximation (transformers' gelu_pytorch_tanh), in torch's float32 steps
GELU_BETA = np.float32(0.7978845608028654)  # sqrt(2 / pi)
GELU_KAPPA = np.float32(0.044715)


def gelu(x: np.ndarray, out: np.ndarray) -> None:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    u = GELU_BETA * (x + GELU_KAPPA * (x * x * x))
    np.multiply(np.float32(0.5) * x, np.float32(1.0) + np.tanh(u), out=out)


def geglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    gelu(gate, out)
    np.multiply(out, up, out=out)


def scale(x: np.ndarray, s: float, out: np.ndarray) -> None:
    """``x * s``, ``s`` as float32 (Gemma's embedding scale sqrt(n_embd), a float32 multiply as in llama.cpp)."""
    np.multiply(x, np.float32(s), out=out)


def softcap(x: np.ndarray, cap: float, out: np.ndarray) -> None:
    """``cap * tanh(x / cap)`` in float32 steps (Gemma 2's soft-capping, as transformers computes it)."""
    c = np.float32(cap)
    np.multiply(np.tanh(x / c), c, out=out)


def moe_route(logits: np.ndarray, n_used: int, normalize: bool, out: np.ndarray) -> None:
    """Each token's ``n_used`` experts and their weights from its router logits ``[tokens, n_expert]``: the
    softmax over every expert (row max subtracted, float64 sum), the highest probabilities first (a tie goes
    to the lower expert id), renormalized to sum to 1 over the chosen ones when ``normalize``.
    ``out[:, :k]`` gets the expert ids (exact in float32), ``out[:, k:]`` their weights."""
    probs = softmax_rows(logits.astype(np.float32, copy=False))
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :n_used]
    w = np.take_along_axis(probs, ids, axis=1)
    if normalize:
        w = (w / w.sum(axis=1, keepdims=True, dtype=np.float64)).astype(np.float32)
    out[:, :n_used] = ids
    out[:, n_used:] = w


def expert_assignments(route: np.ndarray, n_expert: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``(expert, token rows, weight of each)`` for every expert some token of the batch chose, in expert order:
    the batch grouped by expert, so each expert's weights are read once per pass."""
    k = route.shape[1] // 2
    ids = route[:, :k].astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= n_expert):
        raise ValueError(f"expert id out of range 0..{n_expert - 1}")
    out = []
    for e in np.unique(ids).tolist():
        rows, slot = np.nonzero(ids == e)
        out.append((int(e), rows, route[rows, k + slot]))
    return out


def moe_experts(x: np.ndarray, route: np.ndarray, gate, up, down, out: np.ndarray, matmul_fns=None,
                swiglu_fn=None) -> int:
    """``out[t] = sum over t's experts e (in expert order) of w_te * down_e(silu(gate_e x_t) * up_e x_t)``.

    ``gate``/``up``/``down`` hold one prepared matrix per expert; ``matmul_fns`` the three ``fn(x, w, out)`` that
    multiply by one of each kind (default: :func:`matmul`), ``swiglu_fn(gate, up, out)`` the activation (default:
    :func:`swiglu`).
    Only the chosen experts' matrices are read, each once for all the tokens that chose it. Returns the
    bytes of expert weights read."""
    out[:] = 0.0
    read = 0
    mm_gate, mm_up, mm_down = matmul_fns or (matmul, matmul, matmul)
    act = swiglu_fn or swiglu
    n_ff = getattr(gate[0], "tensor", gate[0]).shape[0]  # a matrix as the fast kernels prepared it holds its tensor
    for e, rows, w in expert_assignments(route, len(gate)):
        xe = np.ascontiguousarray(x[rows])
        g = np.empty((len(rows), n_ff), np.float32)
        u = np.empty_like(g)
        mm_gate(xe, gate[e], g)
        mm_up(xe, up[e], u)
        act(g, u, g)
        d = np.empty((len(rows), out.shape[1]), np.float32)
        mm_down(g, down[e], d)
        out[rows] += w[:, None] * d
        read += sum(int(getattr(getattr(m, "tensor", m), "nbytes", 0)) for m in (gate[e], up[e], down[e]))
    return read


def shared_expert(x: np.ndarray, gate, up, down, gate_inp, out: np.ndarray, matmul_fns=None, swiglu_fn=None) -> int:
    """``out += sigmoid(gate_inp · x) * down(silu(gate x) * up x)`` for every token (Qwen2-MoE's shared expert,
    in float32 as transformers computes it); returns the bytes of weights read."""
    mm_gate, mm_up, mm_down, mm_inp = matmul_fns or (matmul, matmul, matmul, matmul)
    n_tok, n_ff = x.shape[0], getattr(gate, "tensor", gate).shape[0]
    g = np.empty((n_tok, n_ff), np.float32)
    u = np.empty_like(g)
    mm_gate(x, gate, g)
    mm_up(x, up, u)
    (swiglu_fn or swiglu)(g, u, g)
    d = np.empty_like(out)
    mm_down(g, down, d)
    s = np.empty((n_tok, 1), np.float32)
    mm_inp(x, gate_inp, s)
    with np.errstate(over="ignore"):
        s = np.float32(1.0) / (np.float32(1.0) + np.exp(-s))
    out += s * d
    return sum(int(getattr(getattr(m, "tensor", m), "nbytes", 0)) for m in (gate, up, down, gate_inp))


def lora(y: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray, scales: np.ndarray, factor: float,
         out: np.ndarray) -> None:
    """``out = y + factor * scales[row] * (x @ A^T) @ B^T`` (A ``[rank, n_in]``, B ``[n_out, rank]``), in PEFT's
    order: the low-rank product, scaled, then added. Rows with scale 0 (no adapter) keep ``y``'s values exactly."""
    if not np.shares_memory(out, y):  # in place (the allocator's choice) or into a buffer of its own
        np.copyto(out, y)
    rows = np.flatnonzero(scales)
    if rows.size == 0:
        return
    every = rows.size == scales.shape[0]
    xs = x if every else x[rows]
    update = (xs @ a.T) @ b.T
    update *= ((scales if every else scales[rows]) * np.float32(factor))[:, None]
    if every:
        out += update
    else:
        out[rows] += update


def rms_norm_mul(x: np.ndarray, gain: np.ndarray, eps: float, width: int, out: np.ndarray) -> None:
    rms_norm(x, eps, width, out)
    mul(out, gain, out)


def get_rows(table: np.ndarray | WeightTensor, ids: np.ndarray, out: np.ndarray) -> None:
    if isinstance(table, WeightTensor):
        # a few rows at a time: the dequantizers' numpy temporaries are ~3x their output, 12 MiB at the top of
        # a 512-token pass of a 2048-wide model otherwise; each row's values do not depend on the others'
        for r0 in range(0, len(ids), GET_ROWS_CHUNK):
            chunk = ids[r0 : r0 + GET_ROWS_CHUNK]
            out[r0 : r0 + len(chunk)] = dequantize_rows(table.rows(chunk), table.ggml_type, table.shape[-1])
    else:
        np.take(table, ids, axis=0, out=out)


def round_activations_q8(x: np.ndarray) -> np.ndarray:
    """``x`` after a round trip through Q8 blocks of 32 (``d = amax / 127``, ``q = round(x / d)``, half
    away from zero), as llama.cpp and the fast kernels quantize matmul inputs for block-quantized weights.
    The reference kernel set ``reference-q8`` uses it to reproduce the fast kernels' arithmetic in numpy."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127.0)
    inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d != 0)
    v = (blocks * inv).astype(np.float64)
    q = np.copysign(np.floor(np.abs(v) + 0.5), v).astype(np.float32)
    return (q * d).reshape(x.shape)


def matmul_row_chunks(w_shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Fixed row ranges of W that a matmul computes independently.

    They depend on the shape only, never on the thread count: workers may take the chunks in any
    order and the result is bit-identical to the serial loop.
    """
    n_out, n_in = w_shape
    rows = max(1, MATMUL_CHUNK_VALUES // n_in)
    return [(r0, min(n_out, r0 + rows)) for r0 in range(0, n_out, rows)]


def matmul_chunk(x: np.ndarray, w: np.ndarray | WeightTensor, out: np.ndarray, r0: int, r1: int) -> None:
    """``out[:, r0:r1] = x @ W[r0:r1]^T``; a quantized W is dequantized for these rows only."""
    if isinstance(w, np.ndarray):
        np.matmul(x, w[r0:r1].T, out=out[:, r0:r1])
    else:
        wf = dequantize_rows(w.data[r0:r1], w.ggml_type, w.shape[1])
        np.matmul(x, wf.T, out=out[:, r0:r1])


def matmul(x: np.ndarray, w: np.ndarray | WeightTensor, out: np.ndarray) -> None:
    """``out = x @ W^T``, W ``[out, in]``; never dequantizes the whole of a quantized W."""
    for r0, r1 in matmul_row_chunks(w.shape):
        matmul_chunk(x, w, out, r0, r1)


def rope_freqs(meta: RopeMeta) -> np.ndarray:
    """Angular speed of each rotating pair i, float64: ``freq_scale / base^(2i / n_rot)``.

    With RoPE scaling (llama.cpp's ``ggml_rope_ext``): each base frequency is first divided by its factor
    (``freq_factors``, Llama 3); with YaRN (``ext_factor`` != 0) pair i mixes the scaled and the unscaled
    frequency by a ramp that is 1 (unscaled) below ``corr_dims[0]`` and 0 (scaled) above ``corr_dims[1]``.
    """
    i = np.arange(meta.n_rot // 2, dtype=np.float64)
    if meta.freq_factors is None and not meta.ext_factor:
        return meta.freq_scale / meta.freq_base ** (2.0 * i / meta.n_rot)
    extrap = 1.0 / meta.freq_base ** (2.0 * i / meta.n_rot)
    if meta.freq_factors is not None:
        extrap = extrap / np.asarray(meta.freq_factors, dtype=np.float64)
    interp = meta.freq_scale * extrap
    if not meta.ext_factor:
        return interp
    low, high = meta.corr_dims
    ramp = (1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)) * meta.ext_factor
    return interp * (1.0 - ramp) + extrap * ramp


def rope_cos_sin(freqs: np.ndarray, mscale: float, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``mscale * cos`` / ``mscale * sin`` of the angles ``pos * freq`` (computed in float64)."""
    theta = np.asarray(positions).astype(np.float64)[:, None] * freqs[None, :]
    cos, sin = np.cos(theta), np.sin(theta)
    if mscale != 1.0:
        cos *= mscale
        sin *= mscale
    return cos.astype(np.float32), sin.astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, meta: RopeMeta, out: np.ndarray) -> None:
    nt = x.shape[0]
    if out is not x:
        out[:] = x
    heads = out.reshape(nt, meta.n_head, meta.head_dim)
    cos, sin = rope_cos_sin(rope_freqs(meta), meta.mscale, positions)  # [nt, n_rot/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = meta.n_rot // 2
    if meta.style is RopeStyle.NEOX:
        i0, i1 = slice(0, half), slice(half, meta.n_rot)
    else:
        i0, i1 = slice(0, meta.n_rot, 2), slice(1, meta.n_rot, 2)
    x0 = heads[:, :, i0].copy()
    x1 = heads[:, :, i1].copy()
    heads[:, :, i0] = x0 * cos - x1 * sin
    heads[:, :, i1] = x0 * sin + x1 * cos


def kv_store(
    k: np.ndarray, v: np.ndarray, positions: np.ndarray, k_region: np.ndarray, v_region: np.ndarray, layer: int
) -> None:
    n_ctx = k_region.shape[0]
    bad = np.flatnonzero((positions < 0) | (positions >= n_ctx))
    if bad.size:
        t = int(bad[0])
        raise ContextOverflowError(
            f"layer {layer}: KV store position {int(positions[t])} (token {t}) is outside the context "
            f"of {n_ctx} positions"
        )
    k_region[positions] = k
    v_region[positions] = v


def softmax_rows(scores: np.ndarray) -> np.ndarray:
    """Stable softmax over the last axis: subtract the row max, exp, normalize by a float64 sum."""
    m = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - m)
    s = e.sum(axis=-1, keepdims=True, dtype=np.float64)
    return e * (1.0 / s).astype(np.float32)


def attention(
    q: np.ndarray,
    k_region: np.ndarray,
    v_region: np.ndarray,
    positions: np.ndarray,
    meta: AttnMeta,
    out: np.ndarray,
    key_ends: np.ndarray | None = None,
) -> None:
    """Causal GQA attention: token t reads cached rows ``0..pos[t]``; query head h reads kv head h // group.
    In a sliding-window layer (``meta.window`` W > 0) only rows ``pos[t] - W + 1 .. pos[t]``: key j is
    visible to query i iff i - j < W, itself included. ``key_ends``: token t reads up to row ``key_ends[t]
    >= pos[t]`` instead (Gemma 3's image tokens see their whole image), from the same window start."""
    if meta.head_dim_k < 1 or meta.n_head % meta.n_head_kv:
        raise ValueError(f"bad head geometry {meta}")
    ends = positions
    if key_ends is not None:
        if key_ends.shape != positions.shape:
            raise ValueError(f"attention: key ends {key_ends.shape} for positions {positions.shape}")
        bad = np.flatnonzero(key_ends < positions)
        if bad.size:
            t = int(bad[0])
            raise ValueError(f"attention: token {t}'s key end {int(key_ends[t])} is before its position "
                             f"{int(positions[t])}")
        ends = key_ends
    nt = q.shape[0]
    nkv = int(ends.max()) + 1
    # rows before every token's sliding window are never read (they may hold anything)
    lo = max(0, int(positions.min()) - meta.window + 1) if meta.window > 0 else 0
    n = nkv - lo
    group = meta.n_head // meta.n_head_kv
    qh = q.reshape(nt, meta.n_head_kv, group, meta.head_dim_k).transpose(1, 2, 0, 3)  # [hk, g, t, d]
    kh = k_region[lo:nkv].reshape(n, meta.n_head_kv, meta.head_dim_k).transpose(1, 2, 0)  # [hk, d, s]
    vh = v_region[lo:nkv].reshape(n, meta.n_head_kv, meta.head_dim_v).transpose(1, 0, 2)  # [hk, s, dv]
    scores = np.matmul(qh, kh[:, None]) * np.float32(meta.scale)  # [hk, g, t, s]
    if meta.softcap > 0:
        softcap(scores, meta.softcap, scores)
    rows = np.arange(lo, nkv)[None, :]
    masked = rows > ends[:, None]  # [t, s]: the window is the mask
    if meta.window > 0:
        masked |= positions[:, None] - rows >= meta.window
    scores[:, :, masked] = -np.inf
    weights = softmax_rows(scores)
    o = np.matmul(weights, vh[:, None])  # [hk, g, t, dv]
    out.reshape(nt, meta.n_head_kv, group, meta.head_dim_v)[:] = o.transpose(2, 0, 1, 3)


def layer_norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray, eps: float, out: np.ndarray) -> None:
    """``(x - mean) / sqrt(var + eps) * gain + bias`` per row: mean and (biased) variance summed in float64,
    the rest in float32 steps, as torch's LayerNorm."""
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float64)
    d = x.astype(np.float64) - mean
    var = np.einsum("ij,ij->i", d, d)[:, None] / x.shape[-1]
    inv = (1.0 / np.sqrt(var + eps)).astype(np.float32)
    np.multiply((x - mean.astype(np.float32)) * inv, gain, out=out)
    np.add(out, bias, out=out)


SQRT_HALF = 0.7071067811865476


def gelu_erf(x: np.ndarray, out: np.ndarray) -> None:
    """The exact GELU ``x/2 (1 + erf(x / sqrt 2))``, erf in float64 (numpy has none in float32), rounded once."""
    from math import erf

    flat = x.reshape(-1).astype(np.float64)
    e = np.frompyfunc(erf, 1, 1)(flat * SQRT_HALF).astype(np.float64)
    out.reshape(-1)[:] = (0.5 * flat * (1.0 + e)).astype(np.float32)


def sequence_spans(spans: np.ndarray) -> list[tuple[int, int]]:
    """``[(first, end), ...]`` of the sequences of a pass whose tokens carry their sequence's first row
    (``spans``: an encoder's input); a sequence's rows must be consecutive and start where ``spans`` says."""
    out: list[tuple[int, int]] = []
    t, n = 0, spans.shape[0]
    while t < n:
        start = int(spans[t])
        if start != t:
            raise ValueError(f"token {t} says its sequence starts at row {start}: sequences must be consecutive")
        end = t + 1
        while end < n and spans[end] == start:
            end += 1
        out.append((t, end))
        t = end
    return out


def encoder_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, spans: np.ndarray, meta: AttnMeta,
                      out: np.ndarray) -> None:
    """Bidirectional GQA attention within each sequence of the pass (see :func:`sequence_spans`)."""
    group = meta.n_head // meta.n_head_kv
    for a, b in sequence_spans(spans):
        n = b - a
        qh = q[a:b].reshape(n, meta.n_head_kv, group, meta.head_dim_k).transpose(1, 2, 0, 3)  # [hk, g, t, d]
        kh = k[a:b].reshape(n, meta.n_head_kv, meta.head_dim_k).transpose(1, 2, 0)  # [hk, d, s]
        vh = v[a:b].reshape(n, meta.n_head_kv, meta.head_dim_v).transpose(1, 0, 2)  # [hk, s, dv]
        weights = softmax_rows(np.matmul(qh, kh[:, None]) * np.float32(meta.scale))
        o = np.matmul(weights, vh[:, None])  # [hk, g, t, dv]
        out[a:b].reshape(n, meta.n_head_kv, group, meta.head_dim_v)[:] = o.transpose(2, 0, 1, 3)


def dequantize_tensor(t: WeightTensor) -> np.ndarray:
    """The whole tensor as float32 in its numpy shape (for small tensors: norms, biases)."""
    if t.ggml_type == GGMLType.F32:
        return t.data.view(np.float32).reshape(t.shape)
    return dequantize_rows(t.data, t.ggml_type, t.shape[-1]).reshape(t.shape)
