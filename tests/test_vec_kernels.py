"""The numba vector kernels against the numpy reference (``backends/cpu/reference.py``).

Tolerances, and why:
* add, mul, RoPE, KV store: bit-identical (one float32 operation per element in the same order; RoPE's
  tables come from the reference's own numpy expressions).
* RMSNorm (+ gain): at most 1 ulp (measured: identical on 2 million values): only the float64 sum of
  squares is added in a different order than numpy's, which can move the float32 mean only when it lies
  within ~1e-16 relative of a rounding boundary.
* SiLU / SwiGLU: at most 5 ulp: both sides use a float32 exp (ours within 1 ulp of the correctly rounded
  value, numpy's within 2, so up to 3 apart), and the quotient and the product round once more each.
  Measured on random data: 84% identical, 12% 1 ulp, 3.7% 2, 0.2% 3, 0.01% 4.
* GELU / GEGLU (tanh form): the reference computes 0.5 x (1 + tanh(u)) as torch does, the kernel the same
  function as x / (1 + exp(-2u)); they agree within 4e-7 max(1, |x|) (measured 2e-7), and within 8 ulp
  where x >= 0 (nothing cancels there; where x < 0, 1 + tanh(u) cancels in the reference's form).
* scale: bit-identical (one float32 multiply).
* attention: 1e-5 absolute on O(1) data: dot products, softmax sum and weighted sum of V are summed in a
  different order than BLAS does (all float32 except the float64 softmax sum), and exp differs by up to
  3 ulp. Measured: at most 7e-7 at decode (context up to 4096), 3e-6 for prefills of 128-512 tokens.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from minfer.backends.cpu import attention, elementwise, norms
from minfer.backends.cpu import reference as ref
from minfer.backends.cpu import rope as rope_kernels
from minfer.errors import ContextOverflowError
from minfer.graph.ir import AttnMeta, RopeMeta, RopeStyle

F32 = np.float32
MAX_THREADS = numba.config.NUMBA_NUM_THREADS


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in float32 units in the last place (signed values mapped onto one integer line)."""
    assert a.shape == b.shape and a.dtype == b.dtype == F32
    assert np.array_equal(np.isnan(a), np.isnan(b))

    def line(x):
        i = x.view(np.int32).astype(np.int64)
        return np.where(i < 0, np.int64(-(2**31)) - i, i)

    ok = ~np.isnan(a)
    return int(np.abs(line(a[ok]) - line(b[ok])).max(initial=0))


def at_threads(n: int, fn):
    old = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        return fn()
    finally:
        numba.set_num_threads(old)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_warmup_compiles_everything():
    for kernels in (norms, elementwise, rope_kernels, attention):
        kernels.warmup()


# ----------------------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize(
    ("shape", "width"),
    [((1, 576), 576), ((7, 576), 576), ((5, 9 * 64), 64), ((3, 60), 20), ((2, 13), 13), ((64, 576), 576)],
)
def test_rms_norm_mul_matches_reference(rng, shape, width):
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 100, (shape[0], 1))).astype(F32)
    gain = rng.standard_normal(width).astype(F32)
    expect, got, plain_expect, plain = (np.empty_like(x) for _ in range(4))
    ref.rms_norm_mul(x, gain, 1e-5, width, expect)
    norms.rms_norm_mul(x, gain, 1e-5, width, got)
    assert ulps(got, expect) <= 1
    ref.rms_norm(x, 1e-6, width, plain_expect)
    norms.rms_norm(x, 1e-6, width, plain)
    assert ulps(plain, plain_expect) <= 1
    # in place: out is x
    y = x.copy()
    norms.rms_norm_mul(y, gain, 1e-5, width, y)
    np.testing.assert_array_equal(y, got)
    y = x.copy()
    norms.rms_norm(y, 1e-6, width, y)
    np.testing.assert_array_equal(y, plain)


def test_rms_norm_known_answer_and_float64_sum(rng):
    x = np.array([[1, 2, 3, 4]], F32)
    out = np.empty_like(x)
    norms.rms_norm(x, 0.0, 4, out)
    np.testing.assert_allclose(out[0], x[0] / math.sqrt(7.5), rtol=2.5e-7)
    big = (rng.standard_normal((3, 4096)) * 1e4).astype(F32)
    out = np.empty_like(big)
    norms.rms_norm(big, 1e-5, 4096, out)
    expect = big.astype(np.float64) / np.sqrt((big.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, expect, rtol=2e-7)


def test_rms_norm_rejects_bad_shapes():
    x = np.ones((2, 10), F32)
    with pytest.raises(ValueError, match="multiple of 4"):
        norms.rms_norm(x, 1e-5, 4, np.empty_like(x))
    with pytest.raises(ValueError, match="gain"):
        norms.rms_norm_mul(x, np.ones(5, F32), 1e-5, 10, np.empty_like(x))


# ----------------------------------------------------------------------------------------- elementwise


@pytest.mark.parametrize("shape", [(1, 576), (3, 13), (128, 576)])
def test_add_and_mul_match_reference_exactly(rng, shape):
    x = rng.standard_normal(shape).astype(F32)
    y = rng.standard_normal(shape).astype(F32)
    bias = rng.standard_normal(shape[1]).astype(F32)
    for vk_op, ref_op in ((elementwise.add, ref.add), (elementwise.mul, ref.mul)):
        for other in (y, bias):
            expect, got = np.empty_like(x), np.empty_like(x)
            ref_op(x, other, expect)
            vk_op(x, other, got)
            np.testing.assert_array_equal(got, expect)
            inplace = x.copy()
            vk_op(inplace, other, inplace)  # out is x
            np.testing.assert_array_equal(inplace, expect)


def test_mul_broadcasts_a_per_head_gain(rng):
    x = rng.standard_normal((4, 3 * 20)).astype(F32)
    gain = rng.standard_normal(20).astype(F32)
    expect, got = np.empty_like(x), np.empty_like(x)
    ref.mul(x, gain, expect)
    elementwise.mul(x, gain, got)
    np.testing.assert_array_equal(got, expect)
    with pytest.raises(ValueError, match="do not fit"):
        elementwise.add(x, np.ones(7, F32), got)


def _silu_inputs(rng, shape):
    x = (rng.standard_normal(shape) * 4).astype(F32)
    special = np.array([0, -0.0, 1e-30, -1e-30, 88, -88, 88.7, -88.7, 89, -89, 100, -100, 1e30, -1e30], F32)
    x.reshape(-1)[: special.size] = special[: x.size]
    return x


@pytest.mark.parametrize("shape", [(1, 1536), (3, 21), (64, 1536)])
def test_swiglu_and_silu_match_reference(rng, shape):
    gate = _silu_inputs(rng, shape)
    up = rng.standard_normal(shape).astype(F32)
    expect, got = np.empty_like(gate), np.empty_like(gate)
    with np.errstate(over="ignore"):
        ref.swiglu(gate, up, expect)
    elementwise.swiglu(gate, up, got)
    assert ulps(got, expect) <= 5
    with np.errstate(over="ignore"):
        ref.silu(gate, expect)
    elementwise.silu(gate, got)
    assert ulps(got, expect) <= 5
    # in place into either operand
    g2, u2 = gate.copy(), up.copy()
    elementwise.swiglu(g2, up, g2)
    elementwise.swiglu(gate, u2, u2)
    ref_sw = np.empty_like(gate)
    elementwise.swiglu(gate, up, ref_sw)
    np.testing.assert_array_equal(g2, ref_sw)
    np.testing.assert_array_equal(u2, ref_sw)
    g2 = gate.copy()
    elementwise.silu(g2, g2)
    np.testing.assert_array_equal(g2, got)


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_a_prompts_rows_on_every_thread_give_each_rows_bits_alone(rng, op):
    """From ``PARALLEL_ROWS`` rows on the gated activations share the rows among the threads: each row is
    the same bits as that row computed alone (the serial kernel), in place or not."""
    n = elementwise.PARALLEL_ROWS + 5
    gate, up = _silu_inputs(rng, (n, 1000)), rng.standard_normal((n, 1000)).astype(F32)
    fn = getattr(elementwise, op)
    alone = np.empty_like(gate)
    for r in range(n):
        fn(gate[r : r + 1], up[r : r + 1], alone[r : r + 1])
    together, g2, u2 = np.empty_like(gate), gate.copy(), up.copy()
    fn(gate, up, together)
    fn(g2, up, g2)
    fn(gate, u2, u2)
    for got in (together, g2, u2):
        assert got.view(np.uint32).tolist() == alone.view(np.uint32).tolist()
    with pytest.raises(ValueError, match="must be equal"):
        fn(gate, up[:-1], together)


def test_silu_special_values():
    x = np.array([[np.nan, np.inf, -np.inf, 0.0, -0.0, -200.0, 200.0]], F32)
    out, expect = np.empty_like(x), np.empty_like(x)
    elementwise.silu(x, out)
    with np.errstate(over="ignore", invalid="ignore"):
        ref.silu(x, expect)
    np.testing.assert_array_equal(out, expect)  # NaN where the reference has NaN (-inf / inf)
    assert out[0, 5] == 0.0 and out[0, 6] == 200.0  # -200 / inf is a zero, not NaN


# ------------------------------------------------------------------------------------------ GELU, scale


def _gelu_exact(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("shape", [(1, 2048), (3, 21), (64, 2048)])
def test_geglu_and_gelu_match_reference(rng, shape):
    gate = _silu_inputs(rng, shape)
    up = rng.standard_normal(shape).astype(F32)
    expect, got = np.empty_like(gate), np.empty_like(gate)
    with np.errstate(over="ignore", invalid="ignore"):
        ref.gelu(gate, expect)
    elementwise.gelu(gate, got)
    bound = 4e-7 * np.maximum(1, np.abs(gate))
    assert (np.abs(got.astype(np.float64) - expect) <= bound).all()
    assert ulps(got[gate >= 0], expect[gate >= 0]) <= 8
    ok = np.abs(gate) < 1e18  # x^3 overflows beyond: both sides give x (or -0), checked below
    assert (np.abs(got - _gelu_exact(gate))[ok] <= 1e-6 * np.maximum(1, np.abs(gate[ok]))).all()
    assert got[gate == 1e30][0] == F32(1e30) and got[gate == -1e30][0] == 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        ref.geglu(gate, up, expect)
    elementwise.geglu(gate, up, got)
    assert (np.abs(got.astype(np.float64) - expect) <= bound * np.abs(up) + 1e-30).all()
    # in place into either operand
    g2, u2 = gate.copy(), up.copy()
    elementwise.geglu(g2, up, g2)
    elementwise.geglu(gate, u2, u2)
    np.testing.assert_array_equal(g2, got)
    np.testing.assert_array_equal(u2, got)
    g2 = gate.copy()
    elementwise.gelu(g2, g2)
    single = np.empty_like(gate)
    elementwise.gelu(gate, single)
    np.testing.assert_array_equal(g2, single)


def test_gelu_known_values():
    x = np.array([[0.0, 1.0, -1.0, 3.0, -3.0, 10.0, -10.0]], F32)
    out = np.empty_like(x)
    elementwise.gelu(x, out)
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), float64
    expect = [0.0, 0.8411919906, -0.1588080094, 2.9963626079, -0.0036373921, 10.0, -1.2e-37]
    np.testing.assert_allclose(out[0], expect, rtol=1e-6, atol=1e-12)
    with pytest.raises(ValueError, match="gelu"):
        elementwise.gelu(x, np.empty((1, 3), F32))


def test_scale_matches_reference_exactly(rng):
    x = rng.standard_normal((7, 640)).astype(F32)
    expect, got = np.empty_like(x), np.empty_like(x)
    s = math.sqrt(640)
    ref.scale(x, s, expect)
    elementwise.scale(x, s, got)
    np.testing.assert_array_equal(got, expect)
    np.testing.assert_array_equal(got, x * F32(s))
    y = x.copy()
    elementwise.scale(y, s, y)
    np.testing.assert_array_equal(y, expect)


# ------------------------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("style", [RopeStyle.NORMAL, RopeStyle.NEOX])
@pytest.mark.parametrize(
    ("n_head", "head_dim", "n_rot", "positions"),
    [
        (9, 64, 64, [0]),  # first token
        (9, 64, 64, [517]),  # decode of a continued sequence
        (2, 20, 20, list(range(40, 47))),  # head_dim not a multiple of 8, positions not from 0
        (3, 64, 32, [3, 1, 4, 1, 5]),  # partial rotary, any order, repeats
        (9, 64, 64, list(range(0, 128))),  # prefill (the parallel path)
    ],
)
def test_rope_matches_reference_exactly(rng, style, n_head, head_dim, n_rot, positions):
    pos = np.array(positions, np.int32)
    x = rng.standard_normal((len(pos), n_head * head_dim)).astype(F32)
    meta = RopeMeta(n_head, head_dim, n_rot, 10000.0, 1.0, style)
    expect, got = np.empty_like(x), np.empty_like(x)
    ref.rope(x, pos, meta, expect)
    neox = style is RopeStyle.NEOX
    rope_kernels.rope(x, pos, n_head, head_dim, n_rot, 10000.0, 1.0, neox, got)
    np.testing.assert_array_equal(got, expect)
    inplace = x.copy()
    rope_kernels.rope(inplace, pos, n_head, head_dim, n_rot, 10000.0, 1.0, neox, inplace)
    np.testing.assert_array_equal(inplace, expect)


def test_rope_table_grows_and_handles_negative_positions(rng):
    table = rope_kernels.RopeTable(head_dim=16, n_rot=16, freq_base=1e6, freq_scale=0.25, n_pos=8)
    meta = RopeMeta(2, 16, 16, 1e6, 0.25, RopeStyle.NEOX)
    for positions in ([3, 7], [100, 5000], [-3, 2]):
        pos = np.array(positions, np.int32)
        x = rng.standard_normal((len(pos), 32)).astype(F32)
        expect, got = np.empty_like(x), np.empty_like(x)
        ref.rope(x, pos, meta, expect)
        table.apply(x, pos, 2, True, got)
        np.testing.assert_array_equal(got, expect)
    assert table.cos.shape[0] >= 5001
    cos, sin = table.cos_sin(np.array([5000]))
    np.testing.assert_array_equal(cos[0], table.cos[5000])
    with pytest.raises(ValueError, match="do not fit"):
        table.apply(np.ones((1, 30), F32), np.zeros(1, np.int32), 2, True, np.ones((1, 30), F32))


def test_rope_worked_example():
    x = np.array([[1.0, 2.0, 3.0, 4.0]], F32)
    out = np.empty_like(x)
    rope_kernels.rope(x, np.array([2], np.int32), 1, 4, 4, 1e4, 1.0, False, out)
    for (i0, i1), angle in zip([(0, 1), (2, 3)], [2.0, 0.02], strict=True):
        assert out[0, i0] == pytest.approx(x[0, i0] * math.cos(angle) - x[0, i1] * math.sin(angle), abs=1e-6)
        assert out[0, i1] == pytest.approx(x[0, i0] * math.sin(angle) + x[0, i1] * math.cos(angle), abs=1e-6)


# --------------------------------------------------------------------------------------------- KV store


def test_kv_store_matches_reference_and_refuses_overflow(rng):
    n_ctx, kw, vw = 16, 3 * 20, 3 * 24
    k_ref, v_ref = np.zeros((n_ctx, kw), F32), np.zeros((n_ctx, vw), F32)
    k_reg, v_reg = k_ref.copy(), v_ref.copy()
    for positions in ([0, 1, 2], [9], [15, 4]):
        pos = np.array(positions, np.int32)
        k = rng.standard_normal((len(pos), kw)).astype(F32)
        v = rng.standard_normal((len(pos), vw)).astype(F32)
        ref.kv_store(k, v, pos, k_ref, v_ref, 0)
        attention.kv_store(k, v, pos, k_reg, v_reg, layer=0)
        np.testing.assert_array_equal(k_reg, k_ref)
        np.testing.assert_array_equal(v_reg, v_ref)
    before = k_reg.copy()
    with pytest.raises(ContextOverflowError, match="layer 3: KV store position 16 \\(token 1\\)"):
        attention.kv_store(np.ones((2, kw), F32), np.ones((2, vw), F32), np.array([5, 16], np.int32), k_reg, v_reg, 3)
    np.testing.assert_array_equal(k_reg, before)  # nothing written: the check runs before any row moves
    with pytest.raises(ValueError, match="do not fit"):
        attention.kv_store(np.ones((1, kw + 1), F32), np.ones((1, vw), F32), np.array([0], np.int32), k_reg, v_reg)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_kv_store_into_f16_cells_rounds_as_numpy(rng):
    """float16 regions: the kernel rounds each value to the bits numpy's astype gives (ties to even,
    overflow to inf, subnormals, signed zeros), and so does the numpy path of CPUs without F16C."""
    n_ctx, kw, vw = 64, 2 * 36, 2 * 20
    k = (rng.standard_normal((40, kw)) * np.exp(rng.uniform(-20, 12, (40, kw)))).astype(F32)
    k[0, :8] = [np.inf, -np.inf, 0.0, -0.0, 65520.0, 65519.0, 6e-8, 2.0 ** -25]  # edges and a tie to 0
    v = rng.standard_normal((40, vw)).astype(F32)
    pos = rng.permutation(n_ctx)[:40].astype(np.int32)
    k16, v16 = np.zeros((n_ctx, kw), np.float16), np.zeros((n_ctx, vw), np.float16)
    attention.kv_store(k, v, pos, k16, v16)
    np.testing.assert_array_equal(k16[pos].view(np.uint16), k.astype(np.float16).view(np.uint16))
    np.testing.assert_array_equal(v16[pos].view(np.uint16), v.astype(np.float16).view(np.uint16))
    k_np, v_np = np.zeros_like(k16), np.zeros_like(v16)
    assert attention._kv_store_numpy(k, v, pos, k_np, v_np) == -1
    np.testing.assert_array_equal(k_np.view(np.uint16), k16.view(np.uint16))
    with pytest.raises(ContextOverflowError, match="position 64 \\(token 1\\)"):
        attention.kv_store(k[:2], v[:2], np.array([0, 64], np.int32), k16, v16)
    assert attention._kv_store_numpy(k[:2], v[:2], np.array([0, 64], np.int32), k_np, v_np) == 1
    with pytest.raises(ValueError, match="both be float32 or both float16, got float16 and float32"):
        attention.kv_store(k, v, pos, k16, v16.astype(F32))


# -------------------------------------------------------------------------------------------- attention


def _attn_case(rng, n_head, n_head_kv, hdk, hdv, positions, n_ctx):
    """q, K/V regions with this call's rows stored, and garbage (NaN, 1e30) beyond the attended window."""
    pos = np.array(positions, np.int32)
    q = rng.standard_normal((len(pos), n_head * hdk)).astype(F32)
    k_reg = rng.standard_normal((n_ctx, n_head_kv * hdk)).astype(F32)
    v_reg = rng.standard_normal((n_ctx, n_head_kv * hdv)).astype(F32)
    end = int(pos.max()) + 1
    k_reg[end::2], v_reg[end::2] = np.nan, np.nan
    k_reg[end + 1 :: 2], v_reg[end + 1 :: 2] = 1e30, -1e30
    return q, k_reg, v_reg, pos


def _ref_attention(q, k_reg, v_reg, pos, n_head, n_head_kv, hdk, hdv, scale, window=0):
    out = np.empty((len(pos), n_head * hdv), F32)
    ref.attention(q, k_reg, v_reg, pos, AttnMeta(0, n_head, n_head_kv, hdk, hdv, scale, window), out)
    return out


def _vk_attention(q, k_reg, v_reg, pos, n_head, n_head_kv, hdk, hdv, scale, window=0):
    out = np.full((len(pos), n_head * hdv), np.nan, F32)
    attention.attention(q, k_reg, v_reg, pos, n_head, n_head_kv, hdk, hdv, scale, out, window)
    return out


@pytest.mark.parametrize(
    ("n_head", "n_head_kv", "hdk", "hdv", "positions"),
    [
        (9, 3, 64, 64, [0]),  # first token: window of one row
        (9, 3, 64, 64, [700]),  # decode deep into a sequence
        (4, 4, 20, 20, list(range(0, 33))),  # group 1, head dim not a multiple of 8, prefill
        (6, 3, 64, 64, list(range(50, 90))),  # group 2, prefill continuing a sequence
        (6, 2, 24, 20, [5, 6, 7]),  # group 3, head_dim_v != head_dim_k
        (2, 1, 8, 8, [3, 0, 9, 9]),  # positions in any order (attention only reads the window)
        (2, 1, 72, 136, list(range(0, 70))),  # head dims 64 + 8 and 2 x 64 + 8, two key blocks
    ],
)
def test_attention_matches_reference(rng, n_head, n_head_kv, hdk, hdv, positions):
    args = _attn_case(rng, n_head, n_head_kv, hdk, hdv, positions, n_ctx=max(positions) + 9)
    geometry = (n_head, n_head_kv, hdk, hdv, 1 / math.sqrt(hdk))
    expect = _ref_attention(*args, *geometry)
    got = _vk_attention(*args, *geometry)
    assert np.isfinite(got).all()  # the garbage beyond the window never leaks
    np.testing.assert_allclose(got, expect, rtol=0, atol=1e-5)


def test_attention_known_answers():
    # the learning page's 2x2 causal example
    K = np.zeros((2, 2), F32)
    V = np.zeros((2, 2), F32)
    q = np.eye(2, dtype=F32)
    attention.kv_store(q, np.array([[10, 0], [0, 20]], F32), np.array([0, 1], np.int32), K, V)
    out = np.empty((2, 2), F32)
    attention.attention(q, K, V, np.array([0, 1], np.int32), 1, 1, 2, 2, 1 / math.sqrt(2), out)
    np.testing.assert_allclose(out, [[10, 0], [3.3023846, 13.395231]], rtol=1e-6)
    # the Rust chapter's decode step: window grows to 3
    K = np.zeros((3, 4), F32)
    V = np.zeros((3, 4), F32)
    attention.kv_store(
        np.array([[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0]], F32),
        np.array([[1, 2, 0, 0], [3, 4, 0, 0], [5, 0, 0, 0]], F32),
        np.array([0, 1, 2], np.int32),
        K,
        V,
    )
    out = np.empty((1, 4), F32)
    attention.attention(np.array([[0, 1, 1, 0]], F32), K, V, np.array([2], np.int32), 1, 1, 4, 4, 0.5, out)
    np.testing.assert_allclose(out[0], [3.301906, 2.0, 0, 0], atol=1e-5)


@pytest.mark.parametrize(("n_head", "n_head_kv"), [(9, 3), (4, 4)])  # (4, 4): units of 64 tokens of one head
def test_attention_decode_equals_prefill_row_and_threads_do_not_matter(rng, n_head, n_head_kv):
    # a token's output does not depend on the other tokens in the call nor on the thread count
    hd = 64
    q, k_reg, v_reg, pos = _attn_case(rng, n_head, n_head_kv, hd, hd, list(range(200)), n_ctx=256)
    geometry = (n_head, n_head_kv, hd, hd, 0.125)
    runs = [at_threads(n, lambda: _vk_attention(q, k_reg, v_reg, pos, *geometry)) for n in (1, MAX_THREADS)]
    np.testing.assert_array_equal(runs[0], runs[1])
    for t in (0, 17, 199):
        one = _vk_attention(q[t : t + 1], k_reg, v_reg, pos[t : t + 1], *geometry)
        np.testing.assert_array_equal(one[0], runs[0][t])
        # the work split follows the thread count the kernel is told: with 4 or 16 threads a decode splits
        # each kv group's heads over several units (2 or 3 heads per unit, then 1)
        for n_threads in (4, 16):
            split = np.empty_like(one)
            code = attention._attn_kernel(
                q[t : t + 1],
                k_reg,
                v_reg,
                np.arange(len(k_reg), dtype=np.int32),
                pos[t : t + 1],
                *geometry,
                n_threads,
                0,
                attention._NO_SCRATCH,
                attention._NO_SCRATCH,
                0,
                split,
            )
            assert code == -1
            np.testing.assert_array_equal(split, one)


@pytest.mark.parametrize(("hdk", "hdv"), [(12, 12), (40, 72), (100, 36), (128, 128)])
def test_head_dims_off_the_vector_width_pair_and_split_alike(rng, hdk, hdv):
    # a prefill unit's rows go in pairs of 64-value passes, with 8-value and single-value tails; a decode
    # step walks the rows by steps that follow the head dims: every shape gives the reference's values and
    # a decode row equal to its prefill row at 1 and 2 threads
    n_head, n_head_kv = 6, 2
    q, k_reg, v_reg, pos = _attn_case(rng, n_head, n_head_kv, hdk, hdv, list(range(300)), n_ctx=304)
    geometry = (n_head, n_head_kv, hdk, hdv, 0.1)
    prefill = _vk_attention(q, k_reg, v_reg, pos, *geometry)
    np.testing.assert_allclose(prefill, _ref_attention(q, k_reg, v_reg, pos, *geometry), rtol=0, atol=1e-5)
    for t in (0, 7, 255, 299):
        for n in (1, MAX_THREADS):
            one = at_threads(n, lambda t=t: _vk_attention(q[t : t + 1], k_reg, v_reg, pos[t : t + 1], *geometry))
            np.testing.assert_array_equal(one[0], prefill[t])


def test_long_decode_split_by_keys_equals_prefill_row(rng):
    # a decode step runs split by keys (called directly here, at 1 to 16 threads as the kernel is told):
    # same bits as the token's row in a prefill, inside the first key chunk or past it
    n_head, n_head_kv, hd = 6, 2, 64
    n = 2 * attention.ATTN_KEY_CHUNK + 37
    q, k_reg, v_reg, pos = _attn_case(rng, n_head, n_head_kv, hd, hd, list(range(n)), n_ctx=n + 5)
    geometry = (n_head, n_head_kv, hd, hd, 0.125)
    prefill = _vk_attention(q, k_reg, v_reg, pos, *geometry)
    np.testing.assert_allclose(prefill, _ref_attention(q, k_reg, v_reg, pos, *geometry), rtol=0, atol=1e-5)
    for t in (0, 5, attention.ATTN_KEY_CHUNK - 1, attention.ATTN_KEY_CHUNK, n - 1):
        one = _vk_attention(q[t : t + 1], k_reg, v_reg, pos[t : t + 1], *geometry)
        np.testing.assert_array_equal(one[0], prefill[t])
        for n_threads in (1, 2, 3, 16):
            split = np.full_like(one, np.nan)
            code = attention._attention_split_by_keys(
                q[t : t + 1], k_reg, v_reg, np.arange(len(k_reg), dtype=np.int32), pos[t : t + 1], *geometry,
                n_threads, split
            )
            assert code == -1
            np.testing.assert_array_equal(split[0], prefill[t])


@pytest.mark.parametrize("window", [1, 3, 64, 65, 300])
@pytest.mark.parametrize("positions", [list(range(0, 200)), list(range(350, 420)), [5], [299], [300], [700]])
def test_sliding_window_attention_matches_reference(rng, window, positions):
    """Key j is visible to the query at position i iff i - j < window (itself included). Rows before the
    window hold NaN and 1e30 here: they are never read."""
    n_head, n_head_kv, hd = 4, 1, 32
    q, k_reg, v_reg, pos = _attn_case(rng, n_head, n_head_kv, hd, hd, positions, n_ctx=max(positions) + 9)
    start = max(0, min(positions) - window + 1)
    k_reg[: start : 2], v_reg[: start : 2] = np.nan, np.nan
    k_reg[1:start:2], v_reg[1:start:2] = 1e30, -1e30
    geometry = (n_head, n_head_kv, hd, hd, 1 / math.sqrt(hd))
    expect = _ref_attention(q, k_reg, v_reg, pos, *geometry, window)
    assert np.isfinite(expect).all()
    got = _vk_attention(q, k_reg, v_reg, pos, *geometry, window)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expect, rtol=0, atol=1e-5)
    if window == 1:  # each token sees itself only: its own V row
        np.testing.assert_array_equal(got.reshape(len(pos), n_head, hd), np.repeat(v_reg[pos][:, None], n_head, 1))
    # a window covering everything is plain causal attention, bit for bit
    wide = _vk_attention(q, k_reg, v_reg, pos, *geometry, max(positions) + 1)
    if start == 0 and max(positions) < window:
        np.testing.assert_array_equal(got, wide)
    # each token's row alone (a decode step), at 1 and more threads: the same bits
    for t in (0, len(pos) // 2, len(pos) - 1):
        for n in (1, MAX_THREADS):
            args = (q[t : t + 1], k_reg, v_reg, pos[t : t + 1], *geometry, window)
            one = at_threads(n, lambda args=args: _vk_attention(*args))
            np.testing.assert_array_equal(one[0], got[t])



@pytest.mark.parametrize("window", [0, 40, 300])
def test_attention_rows_mixing_sequences_equals_each_sequence_alone(rng, window):
    """One call over a batch that mixes sequences (decode tokens, prefill chunks, a sequence split into two
    runs, 20 padding tokens at one position) gives every token the bits it gets attending its own
    sequence's rows alone: the view the per-sequence path uses. Garbage in other sequences' rows (NaN) is
    never read."""
    n_head, n_head_kv, hd = 6, 2, 32
    cap = 2 * attention.ATTN_KEY_CHUNK + 64  # rows per sequence: decodes past two key chunks
    n_seq = 5
    k_reg = np.full((cap * n_seq, n_head_kv * hd), np.nan, F32)
    v_reg = np.full_like(k_reg, np.nan)
    # (sequence, positions) in batch order
    batch = [(0, [530]), (1, [3]), (2, list(range(100, 131))), (3, [0]), (1, [4]), (2, [131, 132]),
             (4, [0] * 20)]
    seq = np.concatenate([[s] * len(p) for s, p in batch])
    pos = np.concatenate([p for _, p in batch]).astype(np.int32)
    rows = (seq * cap + pos).astype(np.int32)
    for s in range(n_seq):  # each sequence's rows 0..its last position hold data
        n = int(pos[seq == s].max()) + 1
        k_reg[s * cap : s * cap + n] = rng.standard_normal((n, n_head_kv * hd)).astype(F32)
        v_reg[s * cap : s * cap + n] = rng.standard_normal((n, n_head_kv * hd)).astype(F32)
    q = rng.standard_normal((len(pos), n_head * hd)).astype(F32)
    geometry = (n_head, n_head_kv, hd, hd, 1 / math.sqrt(hd))
    for n_threads in (1, MAX_THREADS):
        got = np.full((len(pos), n_head * hd), np.nan, F32)
        at_threads(
            n_threads, lambda got=got: attention.attention_rows(q, k_reg, v_reg, pos, rows, *geometry, got, window)
        )
        for t in range(len(pos)):
            s = int(seq[t])
            k_seq, v_seq = k_reg[s * cap : (s + 1) * cap], v_reg[s * cap : (s + 1) * cap]
            alone = _vk_attention(q[t : t + 1], k_seq, v_seq, pos[t : t + 1], *geometry, window)
            np.testing.assert_array_equal(got[t], alone[0], err_msg=f"token {t} at {n_threads} threads")
        expect = _ref_attention(q[:1], k_reg[:cap], v_reg[:cap], pos[:1], *geometry, window)
        np.testing.assert_allclose(got[:1], expect, rtol=0, atol=1e-5)
    # told of 64 threads, the kernel splits each kv group's heads over units: still the same bits
    split = np.full_like(got, np.nan)
    identity = np.arange(len(k_reg), dtype=np.int32)
    assert attention._attn_rows_kernel(q, k_reg, v_reg, identity, pos, rows, *geometry, 64, window, split) == -1
    np.testing.assert_array_equal(split, got)


def _scatter_blocks(rng, regions, n_seq, cap, block=32):
    """The rows of ``regions`` (each ``[n_seq * cap, width]``, sequence s at rows s * cap ..) moved into
    blocks of ``block`` rows taken in a shuffled order from a pool with spare blocks of NaN, as the paged KV
    cache places them: (the pooled regions, the row map: virtual row -> pooled row)."""
    per_seq = -(-cap // block)
    order = rng.permutation(n_seq * per_seq + 3) + 1  # block 0 and the spare ones never hold a row
    row_map = np.empty(n_seq * cap, np.int32)
    for s in range(n_seq):
        for b in range(per_seq):
            n = min(block, cap - b * block)
            start = int(order[s * per_seq + b]) * block
            row_map[s * cap + b * block : s * cap + b * block + n] = np.arange(start, start + n)
    pooled = []
    for region in regions:
        p = np.full(((len(order) + 1) * block, region.shape[1]), np.nan, region.dtype)
        p[row_map] = region
        pooled.append(p)
    return pooled, row_map


@pytest.mark.parametrize("cells", [np.float32, np.float16])
@pytest.mark.parametrize("window", [0, 40])
def test_attention_through_a_row_map_equals_consecutive_rows(rng, cells, window):
    """The KV cache's blocks: a sequence's rows scattered over a pool in blocks of 32 (in any order, NaN
    between them) and read through the row map give the bits of the same rows stored consecutively: a
    prefill, each decode step (split by keys, inside the first key chunk and past it, at several thread
    counts) and a batch mixing sequences."""
    n_head, n_head_kv, hd = 6, 2, 64
    cap = 2 * attention.ATTN_KEY_CHUNK + 45
    n = cap - 3
    q, k_reg, v_reg, pos = _attn_case(rng, n_head, n_head_kv, hd, hd, list(range(n)), n_ctx=cap)
    with np.errstate(over="ignore"):  # the garbage beyond the window (1e30) turns into inf: never read
        k_reg, v_reg = k_reg.astype(cells), v_reg.astype(cells)
    (k_pool, v_pool), row_map = _scatter_blocks(rng, [k_reg, v_reg], 1, cap)
    geometry = (n_head, n_head_kv, hd, hd, 0.125)

    def paged(q, pos, n_threads=MAX_THREADS):
        out = np.full((len(pos), n_head * hd), np.nan, F32)
        at_threads(n_threads, lambda: attention.attention(q, k_pool, v_pool, pos, *geometry, out, window, row_map))
        return out

    prefill = _vk_attention(q, k_reg, v_reg, pos, *geometry, window)
    np.testing.assert_array_equal(paged(q, pos), prefill)
    for t in (0, 31, 32, 300, n - 1):
        for n_threads in (1, MAX_THREADS):
            np.testing.assert_array_equal(paged(q[t : t + 1], pos[t : t + 1], n_threads)[0], prefill[t])
    # several sequences in one call, through one row map
    n_seq = 3
    big_k = np.concatenate([k_reg] * n_seq)
    big_v = np.concatenate([v_reg[::-1]] * n_seq)  # another sequence's V differs: a wrong row would show
    (k_pool, v_pool), row_map = _scatter_blocks(rng, [big_k, big_v], n_seq, cap)
    batch = [(0, [n - 1]), (1, list(range(100, 140))), (2, [3])]
    seq = np.concatenate([[s] * len(p) for s, p in batch])
    bpos = np.concatenate([p for _, p in batch]).astype(np.int32)
    rows = (seq * cap + bpos).astype(np.int32)
    bq = rng.standard_normal((len(bpos), n_head * hd)).astype(F32)
    got = np.full((len(bpos), n_head * hd), np.nan, F32)
    attention.attention_rows(bq, k_pool, v_pool, bpos, rows, *geometry, got, window, row_map)
    for t in range(len(bpos)):
        s = int(seq[t])
        alone = _vk_attention(bq[t : t + 1], big_k[s * cap : (s + 1) * cap], big_v[s * cap : (s + 1) * cap],
                              bpos[t : t + 1], *geometry, window)
        np.testing.assert_array_equal(got[t], alone[0], err_msg=f"token {t}")


def test_a_row_map_outside_the_regions_is_refused(rng):
    q, k_reg, v_reg, pos = _attn_case(rng, 2, 1, 8, 8, [5], n_ctx=8)
    bad = np.arange(8, dtype=np.int32)
    bad[3] = 8
    out = np.empty((1, 16), F32)
    with pytest.raises(ValueError, match="row map points outside the KV regions of 8 rows"):
        attention.attention(q, k_reg, v_reg, pos, 2, 1, 8, 8, 0.5, out, 0, bad)
    swapped = np.array([0, 1, 3, 2, 4, 5, 6, 7], np.int32)  # in bounds, but not consecutive inside a block
    with pytest.raises(ValueError, match=f"not consecutive within blocks of {attention.ROW_MAP_BLOCK} keys"):
        attention.attention(q, k_reg, v_reg, pos, 2, 1, 8, 8, 0.5, out, 0, swapped)
    with pytest.raises(ValueError, match="row map must be a contiguous 1-D int32"):
        attention.attention(q, k_reg, v_reg, pos, 2, 1, 8, 8, 0.5, out, 0, bad.astype(np.int64))


@pytest.mark.parametrize(
    ("n_head", "n_head_kv", "hd", "positions"),
    [
        (9, 3, 64, [700]),  # a decode step split by keys
        (4, 2, 20, list(range(0, 33))),  # head dim not a multiple of 8: the scalar tails read halves too
        (6, 3, 64, list(range(50, 90))),  # prefill continuing a sequence
    ],
)
def test_attention_on_f16_cells_equals_their_float32_copy(rng, n_head, n_head_kv, hd, positions):
    """float16 K/V regions (an f16 cache) are widened as the kernels load them: the result is bit for bit
    the one on a float32 copy of the same cells, for one sequence and for a batch mixing sequences."""
    q, k_reg, v_reg, pos = _attn_case(rng, n_head, n_head_kv, hd, hd, positions, n_ctx=max(positions) + 9)
    with np.errstate(over="ignore"):  # the garbage beyond the window (1e30) turns into inf: still never read
        k16, v16 = k_reg.astype(np.float16), v_reg.astype(np.float16)
    geometry = (n_head, n_head_kv, hd, hd, 1 / math.sqrt(hd))
    np.testing.assert_array_equal(_vk_attention(q, k16, v16, pos, *geometry),
                                  _vk_attention(q, k16.astype(F32), v16.astype(F32), pos, *geometry))
    # two sequences side by side in one region pair
    cap = k16.shape[0]
    k2, v2 = np.concatenate([k16, k16[::-1]]), np.concatenate([v16, v16[::-1]])
    rows = np.concatenate([pos, pos + cap]).astype(np.int32)
    q2, pos2 = np.concatenate([q, q[::-1]]), np.concatenate([pos, pos]).astype(np.int32)
    got16, got32 = np.empty((len(rows), n_head * hd), F32), np.empty((len(rows), n_head * hd), F32)
    attention.attention_rows(q2, k2, v2, pos2, rows, *geometry, got16)
    attention.attention_rows(q2, k2.astype(F32), v2.astype(F32), pos2, rows, *geometry, got32)
    np.testing.assert_array_equal(got16, got32)
    with pytest.raises(ValueError, match="both be float32 or both float16, got float16 and float32"):
        attention.attention(q, k16, v_reg, pos, *geometry, np.empty_like(got16[: len(pos)]))


def test_attention_rows_errors(rng):
    q, k_reg, v_reg, pos = _attn_case(rng, 4, 2, 8, 8, [0, 1], n_ctx=8)
    out = np.empty((2, 32), F32)
    with pytest.raises(ContextOverflowError, match="position 3 \\(token 1\\)"):
        attention.attention_rows(
            q, k_reg, v_reg, np.array([0, 3], np.int32), np.array([4, 8], np.int32), 4, 2, 8, 8, 1.0, out
        )
    with pytest.raises(ValueError, match="token 1 at row 2 has position 5 before its sequence's first row"):
        attention.attention_rows(
            q, k_reg, v_reg, np.array([0, 5], np.int32), np.array([4, 2], np.int32), 4, 2, 8, 8, 1.0, out
        )
    with pytest.raises(ValueError, match="1 rows for 2 positions"):
        attention.attention_rows(q, k_reg, v_reg, pos, np.array([0], np.int32), 4, 2, 8, 8, 1.0, out)

def test_sliding_window_reference_mask():
    # 1 head, head dim 1, q = k = 0: uniform weights over exactly the visible keys
    n = 6
    v = np.arange(n, dtype=F32)[:, None]
    out = np.empty((n, 1), F32)
    ref.attention(np.zeros((n, 1), F32), np.zeros((n, 1), F32), v, np.arange(n, dtype=np.int32),
                  AttnMeta(0, 1, 1, 1, 1, 1.0, window=3), out)
    # position i averages v over max(0, i - 2) .. i
    np.testing.assert_allclose(out[:, 0], [0, 0.5, 1, 2, 3, 4], rtol=1e-6)


def test_attention_errors(rng):
    q, k_reg, v_reg, pos = _attn_case(rng, 4, 2, 8, 8, [0, 1], n_ctx=4)
    out = np.empty((2, 32), F32)
    with pytest.raises(ContextOverflowError, match="position 4 \\(token 1\\)"):
        attention.attention(q, k_reg, v_reg, np.array([3, 4], np.int32), 4, 2, 8, 8, 1.0, out)
    with pytest.raises(ValueError, match="do not fit"):
        attention.attention(q, k_reg, v_reg, pos, 4, 3, 8, 8, 1.0, out)  # 4 heads cannot share 3 kv heads
    with pytest.raises(ValueError, match="must not be q"):
        attention.attention(q, k_reg, v_reg, pos, 4, 2, 8, 8, 1.0, q)
    with pytest.raises(ValueError, match="do not fit"):
        attention.attention(q, k_reg, v_reg, pos, 4, 2, 8, 8, 1.0, out, -1)  # a negative window


# ------------------------------------------------------------------------------------------ row blocks


def test_rowwise_ops_give_the_same_bits_on_row_blocks_in_threads(rng):
    # the row-wise kernels are serial and release the GIL: a caller may run blocks of rows on its own
    # threads, and rows are independent, so the result is the same as one call over all rows
    from concurrent.futures import ThreadPoolExecutor

    x = rng.standard_normal((128, 576)).astype(F32)
    gain = rng.standard_normal(576).astype(F32)
    up = rng.standard_normal((128, 576)).astype(F32)
    pos = np.arange(300, 428, dtype=np.int32)
    table = rope_kernels.RopeTable(64, 64, 10000.0, 1.0)

    def run(r0: int, r1: int, outs: list[np.ndarray]) -> None:
        norms.rms_norm_mul(x[r0:r1], gain, 1e-5, 576, outs[0][r0:r1])
        elementwise.add(x[r0:r1], gain, outs[1][r0:r1])
        elementwise.swiglu(x[r0:r1], up[r0:r1], outs[2][r0:r1])
        table.apply(x[r0:r1], pos[r0:r1], 9, True, outs[3][r0:r1])

    whole = [np.empty_like(x) for _ in range(4)]
    run(0, 128, whole)
    blocks = [np.empty_like(x) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda r0: run(r0, r0 + 16, blocks), range(0, 128, 16)))
    for a, b in zip(whole, blocks, strict=True):
        np.testing.assert_array_equal(a, b)
