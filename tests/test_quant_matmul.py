"""Fast quantized matmul (numba) against the numpy reference.

Two bounds, both derived rather than tuned (every float op rounds with relative error u = 2^-24):

* against the *exact* product of the dequantized weights and the Q8-rounded activations (float64): the
  kernel's integer block sums are exact, so its only errors are float32 roundings, each at most u times
  the value rounded. Per-term roundings (the scale ``d_w * d_x``; for Q4_1 ``d_x Σq`` and ``m * d_x Σq``)
  add up to at most u * S each, where ``S = Σ_k |term_k|``; every accumulation (one per block, twice for
  Q4_1, plus the horizontal sum and the final add) rounds a partial sum bounded by S. Hence
  ``|out - exact| <= (3 * n_blocks + 8) * u * S``, with room to spare.
* against the unquantized f32 product: rounding an activation to a multiple of ``d = amax / 127``
  moves it by at most ``d / 2``, so ``|out - x @ W^T| <= Σ_k |w_k| * d_{block(k)} / 2`` plus the
  roundings above and those of the reference itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from gguf import quants

from minfer.backends.cpu import quant_matmul as qm
from minfer.backends.cpu import reference as ref
from minfer.backends.cpu import simd
from minfer.errors import ModelError
from minfer.formats.quants import GGMLType, dequantize_rows
from minfer.formats.tensors import WeightTensor

U = 2.0**-24
INT_TYPES = [GGMLType.Q4_1, GGMLType.Q4_0, GGMLType.Q8_0]
FLOAT_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16]
# 1 token: decode kernel; 3: prefill tail only; 8: one whole tile; 21: tiles + tail
TOKENS = [1, 3, 8, 21]


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    qm.warmup()


def make_weight(t: GGMLType, n_out: int, n_in: int, seed: int = 0) -> WeightTensor:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.1
    w[0, :32] += 0.5  # one block with a clear offset (Q4_1's m far from 0)
    raw = quants.quantize(w, t).view(np.uint8).reshape(n_out, -1)
    return WeightTensor("w", t, (n_out, n_in), raw)


def make_x(n_tok: int, n_in: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[:, 32:64] *= 30.0  # blocks of very different scales
    if n_in >= 96:
        x[0, 64:96] = 0.0  # an all-zero block: d = 0
    return x


def llama_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A numpy transcription of llama.cpp's quantize_row_q8_0_ref (scale kept in f32)."""
    b = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    v = (b * inv[..., None]).astype(np.float64)  # x * id in f32, widened exactly
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)  # roundf: half away from zero
    return q.astype(np.int8).reshape(x.shape), d


def term_scale(w: WeightTensor) -> np.ndarray:
    """|W| as the kernel sums it: for Q4_1 the d*n and m parts are separate terms."""
    n_out, n_in = w.shape
    if w.ggml_type != GGMLType.Q4_1:
        return np.abs(dequantize_rows(w.data, w.ggml_type, n_in).astype(np.float64))
    blocks = w.data.reshape(n_out, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)
    n = np.concatenate([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], axis=-1).astype(np.float64)
    return (np.abs(d * n) + np.abs(m)).reshape(n_out, n_in)


def fast(x: np.ndarray, w: WeightTensor, xq=None) -> np.ndarray:
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    qm.matmul(x, w, out, xq)
    return out


def test_supports():
    for t in INT_TYPES + FLOAT_TYPES:
        assert qm.supports(t)
    assert not qm.supports(GGMLType.Q5_0)
    assert not qm.supports(GGMLType.Q4_K)


def test_quantize_activations_is_llama_q8():
    x = make_x(5, 128)
    x[1, :32] = np.linspace(-127, 127, 32).astype(np.float32)
    x[1, 0] = -127.0
    x[1, 1:5] = [2.5, -2.5, 0.5, -0.5]  # amax 127: d = 1, ties that roundf sends away from zero
    xq = qm.quantize_activations(x)
    q, d = llama_q8(x)
    np.testing.assert_array_equal(xq.q, q)
    np.testing.assert_array_equal(xq.ds[..., 0], d)
    assert list(xq.q[1, 1:5]) == [3, -3, 1, -1]
    s = (d * xq.q.reshape(5, -1, 32).astype(np.int32).sum(-1).astype(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(xq.ds[..., 1], s)
    assert not xq.q[0, 64:96].any() and xq.ds[0, 2, 0] == 0
    # the parallel path (many tokens) gives the same blocks
    big = make_x(40, 64)
    np.testing.assert_array_equal(qm.quantize_activations(big).q, llama_q8(big)[0])
    # reuse of buffers
    again = qm.quantize_activations(x, out=xq)
    assert again is xq


@pytest.mark.parametrize("t", INT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", TOKENS)
def test_integer_types_parity(t, n_tok):
    n_out, n_in = 37, 128  # rows not a multiple of 4 (decode pass) nor of 16 (prefill work item)
    w = make_weight(t, n_out, n_in)
    x = make_x(n_tok, n_in)
    out = fast(x, w)

    q, d = llama_q8(x)
    xq = (q.reshape(n_tok, -1, 32).astype(np.float64) * d[..., None]).reshape(n_tok, n_in)
    wd = dequantize_rows(w.data, t, n_in).astype(np.float64)
    exact = xq @ wd.T
    scale = np.abs(xq) @ term_scale(w).T
    nb = n_in // 32
    assert np.all(np.abs(out - exact) <= (3 * nb + 8) * U * scale + 1e-30)

    # against the unquantized product: activation rounding moves each x by at most d/2
    expected = np.empty_like(out)
    ref.matmul(x, w, expected)
    half_d = np.repeat(d / 2, 32, axis=1).astype(np.float64)
    bound = half_d @ np.abs(wd).T + (3 * nb + 8) * U * scale + 2 * n_in * U * (np.abs(x) @ np.abs(wd).T)
    err = np.abs(out - expected)
    assert np.all(err <= bound)
    # typical size: a rounding error uniform in ±d/2 has variance d²/12, so the RMS error should be
    # sqrt(mean(Σ_k w_k² d_k² / 12)), far below the worst case
    predicted = np.sqrt(np.mean((half_d**2 / 3) @ (wd**2).T))
    assert 0.5 < np.sqrt(np.mean(err.astype(np.float64) ** 2)) / predicted < 2


@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", TOKENS)
def test_float_types_parity(t, n_tok):
    n_out, n_in = 37, 100  # n_in % 8 != 0: exercises the scalar tail
    rng = np.random.default_rng(2)
    wf = rng.standard_normal((n_out, n_in)).astype(np.float32)
    raw = quants.quantize(wf, t) if t != GGMLType.F32 else wf
    w = WeightTensor("w", t, (n_out, n_in), np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, -1))
    x = make_x(n_tok, n_in)
    out = fast(x, w)
    wd = dequantize_rows(w.data, t, n_in).astype(np.float64)
    exact = x.astype(np.float64) @ wd.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(wd).T
    assert np.all(np.abs(out - exact) <= (n_in // 8 + n_in % 8 + 8) * 2 * U * scale)
    expected = np.empty_like(out)
    ref.matmul(x, w, expected)
    np.testing.assert_allclose(out, expected, rtol=0, atol=float(1e-5 * scale.max()))


@pytest.mark.parametrize("t", INT_TYPES + FLOAT_TYPES, ids=lambda t: t.name)
def test_prefill_rows_equal_decode_rows(t):
    """A token's output is bit-identical alone (GEMV) and inside a prompt (GEMM tile or tail)."""
    n_out, n_in = 21, 96
    w = make_weight(t, n_out, n_in, seed=3)
    x = make_x(19, n_in, seed=4)
    many = fast(x, w)
    for i in (0, 5, 7, 8, 16, 18):
        one = fast(x[i : i + 1], w)
        assert one.view(np.uint32).tolist() == many[i : i + 1].view(np.uint32).tolist(), i


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 threads")
@pytest.mark.parametrize("t", INT_TYPES + FLOAT_TYPES, ids=lambda t: t.name)
def test_bit_identical_at_1_and_2_threads(t):
    w = make_weight(t, 203, 192, seed=5)
    x = make_x(13, 192, seed=6)
    saved = numba.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            numba.set_num_threads(n)
            results.append((fast(x[:1], w), fast(x, w)))
    finally:
        numba.set_num_threads(saved)
    for a, b in zip(results[0], results[1], strict=True):
        assert a.view(np.uint32).tolist() == b.view(np.uint32).tolist()


def test_shared_quantized_activations_and_layouts():
    w = make_weight(GGMLType.Q4_1, 40, 64)
    x = make_x(9, 64)
    xq = qm.quantize_activations(x)
    np.testing.assert_array_equal(fast(x, w, xq), fast(x, w))
    # non-contiguous activations and output are accepted
    xs = np.asfortranarray(x)
    out = np.zeros((40, 9), np.float32).T
    qm.matmul(xs, w, out)
    np.testing.assert_array_equal(out, fast(x, w))



def test_q4_1_row_groups_and_tail_rows_do_the_same_arithmetic():
    """Q4_1 runs whole groups of eight rows on a repacked copy and the last 1..7 rows on the raw blocks:
    a row gives the same bits in either, and the repacked copy holds exactly the file's values."""
    w = make_weight(GGMLType.Q4_1, 29, 160, seed=11)
    x = make_x(11, 160, seed=12)
    full = fast(x, w)  # rows 24..28 take the tail path
    shifted = WeightTensor("w", GGMLType.Q4_1, (24, 160), w.data[5:])  # rows 5..28, all in groups
    assert full[:, 5:].view(np.uint32).tolist() == fast(x, shifted).view(np.uint32).tolist()
    packed = qm._repack_q4_1(w.data, 29, 160).reshape(3, 5, 160)  # [group, block, bytes]
    values = packed[..., :128].reshape(3, 5, 4, 8, 4)  # [group, block, chunk, row, i]
    n = np.concatenate([values & 15, values >> 4], axis=-1)  # [..., chunk c, row, value 8c + (0..7)]
    n = n.transpose(0, 3, 1, 2, 4).reshape(24, 160)
    blocks = w.data[:24].reshape(24, 5, 20)
    expected = np.concatenate([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], axis=-1).reshape(24, 160)
    np.testing.assert_array_equal(n, expected)
    halves = packed[..., 128:].copy().view(np.float16).reshape(3, 5, 2, 8)  # [group, block, d | m, row]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].reshape(3, 8, 5).transpose(0, 2, 1)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].reshape(3, 8, 5).transpose(0, 2, 1)
    np.testing.assert_array_equal(halves[:, :, 0], d)
    np.testing.assert_array_equal(halves[:, :, 1], m)


def test_q8_0_row_groups_and_tail_rows_do_the_same_arithmetic():
    """Q8_0, as Q4_1: whole groups of eight rows on a repacked copy, the last rows on the raw blocks; a row
    gives the same bits in either, and the repacked copy holds exactly the file's values and scales."""
    w = make_weight(GGMLType.Q8_0, 29, 160, seed=13)
    w.data[1, 2:34] = np.array([-128, 127] * 16, np.int8).view(np.uint8)  # the extremes of the sign trick
    x = make_x(11, 160, seed=14)
    full = fast(x, w)
    q, d = llama_q8(x)
    xq = (q.reshape(11, -1, 32).astype(np.float64) * d[..., None]).reshape(11, 160)
    wd = dequantize_rows(w.data, GGMLType.Q8_0, 160).astype(np.float64)
    assert np.all(np.abs(full - xq @ wd.T) <= (3 * 5 + 8) * U * (np.abs(xq) @ np.abs(wd).T) + 1e-30)
    shifted = WeightTensor("w", GGMLType.Q8_0, (24, 160), w.data[5:])
    assert full[:, 5:].view(np.uint32).tolist() == fast(x, shifted).view(np.uint32).tolist()
    packed = qm._repack_q8_0(w.data, 29, 160).reshape(3, 5, 272)  # [group, block, bytes]
    values = packed[..., :256].reshape(3, 5, 8, 8, 4).transpose(0, 3, 1, 2, 4).reshape(24, 160)  # [row, value]
    blocks = w.data[:24].reshape(24, 5, 34)
    np.testing.assert_array_equal(values, blocks[..., 2:].reshape(24, 160))
    d = packed[..., 256:].copy().view(np.float16).transpose(0, 2, 1).reshape(24, 5)
    np.testing.assert_array_equal(d, blocks[..., 0:2].copy().view(np.float16)[..., 0])


@pytest.mark.parametrize("t", [GGMLType.Q4_1, GGMLType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(8, 32), (29, 160), (64, 576), (1543, 96)])
def test_compiled_repack_equals_the_numpy_reference(t, shape):
    """The load-time repack (a compiled kernel) gives the numpy reference's bytes, tail rows left out."""
    w = make_weight(t, *shape, seed=17)
    fast_repack, reference = ((qm._repack_q4_1, qm.repack_q4_1_reference) if t is GGMLType.Q4_1
                              else (qm._repack_q8_0, qm.repack_q8_0_reference))
    got = fast_repack(w.data, *shape)
    assert got.dtype == np.uint8 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, reference(w.data, *shape))


@pytest.mark.parametrize("t", [GGMLType.Q4_1, GGMLType.Q8_0], ids=lambda t: t.name)
def test_row_groups_past_one_token_pass(t):
    """More tokens than one pass over a group's weights holds (ROWS8_TOKENS): every row still equals the
    token alone, bit for bit."""
    w = make_weight(t, 24, 96, seed=15)
    n = qm.ROWS8_TOKENS + 6
    x = make_x(n, 96, seed=16)
    many = fast(x, w)
    for i in (0, qm.ROWS8_TOKENS - 1, qm.ROWS8_TOKENS, n - 1):
        assert fast(x[i : i + 1], w).view(np.uint32).tolist() == many[i : i + 1].view(np.uint32).tolist(), i


@pytest.mark.parametrize("n", [2, 5, 8, 9])
def test_q4_1_token_quads_and_tail(n):
    """Up to ROWS8_REGISTER_TOKENS tokens go through a group's blocks ROWS8_QUAD at a time, the last n % 4
    one at a time; more take the accumulators-in-memory path. Every token, in a quad, in the tail or past
    the register path, equals that token alone, bit for bit (for rows in groups and the tail rows)."""
    w = make_weight(GGMLType.Q4_1, 29, 96, seed=17)
    x = make_x(n, 96, seed=18)
    many = fast(x, w)
    for i in range(n):
        assert fast(x[i : i + 1], w).view(np.uint32).tolist() == many[i : i + 1].view(np.uint32).tolist(), i


def test_file_pages_of_a_repacked_weight_are_given_back(tmp_path):
    """Preparing a Q4_1 weight read from a file mapping drops the mapping's resident pages (its values
    live in the repacked copy); a weight in ordinary memory is left alone."""
    import mmap

    w = make_weight(GGMLType.Q4_1, 256, 1024, seed=13)
    path = tmp_path / "w.bin"
    path.write_bytes(w.data.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped = np.frombuffer(mm, np.uint8).reshape(w.data.shape)
    x = make_x(3, 1024, seed=14)
    before = fast(x, w)
    assert int(mapped.sum()) > 0  # every page of the mapping read in

    def resident_kib() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile:"))

    held = resident_kib()
    tensor = WeightTensor("w", GGMLType.Q4_1, w.shape, mapped)
    after = fast(x, tensor)
    assert held - resident_kib() > 0.8 * w.data.nbytes / 1024  # ~160 KiB of the file given back
    assert after.view(np.uint32).tolist() == before.view(np.uint32).tolist()
    assert int(mapped[-1].sum()) == int(w.data[-1].sum())  # still readable: the file is still there
    copy = w.data.copy()
    qm.prepare(WeightTensor("w", GGMLType.Q4_1, w.shape, copy))
    np.testing.assert_array_equal(copy, w.data)

def test_errors_name_the_problem():
    w = make_weight(GGMLType.Q4_1, 8, 64)
    x = make_x(2, 64)
    with pytest.raises(ModelError, match="do not match"):
        qm.matmul(make_x(2, 96), w, np.zeros((2, 8), np.float32))
    with pytest.raises(ModelError, match="output must be"):
        qm.matmul(x, w, np.zeros((2, 9), np.float32))
    with pytest.raises(ModelError, match="quantized activations"):
        qm.matmul(x, w, np.zeros((2, 8), np.float32), qm.quantize_activations(make_x(3, 64)))
    bad = WeightTensor("blk.0.attn_q.weight", GGMLType.Q5_0, (8, 64), np.zeros((8, 44), np.uint8))
    with pytest.raises(ModelError, match="blk.0.attn_q.weight.*Q5_0"):
        qm.matmul(x, bad, np.zeros((2, 8), np.float32))
    with pytest.raises(ModelError, match="multiple of 32"):
        qm.quantize_activations(make_x(1, 40))


@pytest.mark.slow
def test_real_smollm2_weights(smollm2_path):
    """The real model's Q4_1 projections and Q8_0 output head, decode and prefill, within the bound."""
    from minfer.formats.gguf_file import GGUFFile

    f = GGUFFile(smollm2_path)
    head = f.tensors["token_embd.weight"]
    tensors = [f.tensors["blk.0.attn_q.weight"], f.tensors["blk.29.ffn_down.weight"]]
    tensors.append(WeightTensor("token_embd[:4096]", head.ggml_type, (4096, head.shape[1]), head.data[:4096]))
    for w in tensors:
        n_out, n_in = w.shape
        wd = dequantize_rows(w.data, w.ggml_type, n_in).astype(np.float64)
        for n_tok in (1, 11):
            x = make_x(n_tok, n_in, seed=9)
            q, d = llama_q8(x)
            xq = (q.reshape(n_tok, -1, 32).astype(np.float64) * d[..., None]).reshape(n_tok, n_in)
            out = fast(x, w)
            scale = np.abs(xq) @ term_scale(w).T
            assert np.all(np.abs(out - xq @ wd.T) <= (3 * n_in // 32 + 8) * U * scale), w.name


_SUBPROCESS_SCRIPT = """
import numpy as np, sys
from numba import njit
from minfer.backends.cpu import quant_matmul as qm
from minfer.backends.cpu import simd
from minfer.formats.tensors import WeightTensor
from minfer.formats.quants import GGMLType

@njit
def all_halves(raw, out):
    for i in range(out.shape[0]):
        out[i] = simd.load_half(raw, 2 * i)

data = np.load(sys.argv[1])
res = {"avx2": np.array(simd.AVX2), "f16c": np.array(simd.F16C)}
raw = np.zeros(2 * 65536 + 8, np.uint8)  # load_half reads 8 bytes
raw[: 2 * 65536] = np.arange(65536, dtype=np.uint16).view(np.uint8)
res["halves"] = np.empty(65536, np.float32)
all_halves(raw, res["halves"])
for name in sys.argv[3].split(","):
    w = WeightTensor("w", GGMLType[name], tuple(data[name + "_shape"]), data[name])
    for n in (1, 13):
        out = np.empty((n, w.shape[0]), np.float32)
        qm.matmul(data["x"][:n], w, out)
        res[f"{name}_{n}"] = out
np.savez(sys.argv[2], **res)
"""


def _run_elsewhere(tmp_path, cache: Path, env_extra: dict[str, str], types: list[GGMLType]):
    """Run the kernels in a fresh interpreter with other SIMD settings; return its results and ours."""
    x = make_x(13, 128, seed=7)
    arrays: dict[str, np.ndarray] = {"x": x}
    ours = {}
    for t in types:
        w = make_weight(t, 23, 128, seed=8) if t in INT_TYPES else _float_weight(t, 23, 128)
        arrays[t.name], arrays[t.name + "_shape"] = w.data, np.array(w.shape)
        ours.update({f"{t.name}_{n}": fast(x[:n], w) for n in (1, 13)})
    np.savez(tmp_path / "in.npz", **arrays)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), **env_extra)  # its own cache: compiled once
    env["PYTHONPATH"] = str(Path(qm.__file__).parents[3]) + os.pathsep + env.get("PYTHONPATH", "")
    script = tmp_path / "run.py"
    script.write_text(_SUBPROCESS_SCRIPT)
    names = ",".join(t.name for t in types)
    subprocess.run(
        [sys.executable, str(script), str(tmp_path / "in.npz"), str(tmp_path / "out.npz"), names], env=env, check=True
    )
    return np.load(tmp_path / "out.npz"), ours


def _float_weight(t: GGMLType, n_out: int, n_in: int) -> WeightTensor:
    wf = np.random.default_rng(2).standard_normal((n_out, n_in)).astype(np.float32)
    raw = quants.quantize(wf, t) if t != GGMLType.F32 else wf
    return WeightTensor("w", t, (n_out, n_in), np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, -1))


@pytest.mark.slow
@pytest.mark.skipif(not simd.AVX2, reason="this host already runs the generic path")
def test_generic_simd_path_gives_the_same_bits(tmp_path, request):
    """The portable LLVM vectors (non-x86 CPUs) compute the same integer lanes as the AVX2 instructions."""
    cache = request.config.cache.mkdir("numba-generic-simd")
    got, ours = _run_elsewhere(tmp_path, cache, {"MINFER_GENERIC_SIMD": "1"}, INT_TYPES)
    assert not got["avx2"]
    for key, value in ours.items():
        assert got[key].view(np.uint32).tolist() == value.view(np.uint32).tolist(), key


@pytest.mark.slow
@pytest.mark.skipif(not simd.X86, reason="x86 only")
def test_baseline_x86_target(tmp_path, request):
    """NUMBA_CPU_NAME=generic (plain x86-64: no AVX2, FMA nor F16C) compiles and agrees.

    Without FMA the per-block multiply-add rounds twice, so agreement is to float32 rounding, not bits.
    The software f16 conversion is checked on all 65536 bit patterns against numpy.
    """
    cache = request.config.cache.mkdir("numba-generic-x86")
    types = [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.F16]
    got, ours = _run_elsewhere(tmp_path, cache, {"NUMBA_CPU_NAME": "generic"}, types)
    assert not got["avx2"] and not got["f16c"]
    expected = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got["halves"]), nan)
    assert got["halves"][~nan].view(np.uint32).tolist() == expected[~nan].view(np.uint32).tolist()
    for key, value in ours.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5 * float(np.abs(value).max()), err_msg=key)
