"""The VNNI prefill paths (vpdpbusd / vpdpwssd on 256-bit registers: AVX-512 VNNI + VL, or AVX-VNNI).

They are chosen when the kernels compile, from the CPU's features; a CPU without them never runs them.
Where this CPU has them, the prefill matmuls of every integer block type here run them: checked against
the dequantize-then-matmul reference, and bit for bit against the AVX2 sequences (``MINFER_VNNI=0``, in
a fresh interpreter with its own numba cache), since both compute the same exact integers. Where it has
not, the tests that need VNNI skip and say so; the AVX2 or generic path then runs everywhere (and the
other kernel tests cover it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import quants as gq
from test_iquants import _random_rows

from minfer.backends.cpu import iquant_matmul as iq
from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import quant_matmul as qm
from minfer.backends.cpu import simd
from minfer.formats.block_types import GGMLType, block_size, type_size
from minfer.formats.kquants import KQUANT_DEQUANTIZERS
from minfer.formats.quants import DEQUANTIZERS
from minfer.formats.tensors import WeightTensor

# byte offsets of each K-quant block's f16 fields (set to sane values in random blocks)
F16_AT = {GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2),
          GGMLType.Q6_K: (208,)}

NO_VNNI = "no AVX-512 VNNI+VL nor AVX-VNNI on this CPU (or MINFER_VNNI=0): the VNNI paths cannot run here"
K_TYPES = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q5_0, GGMLType.Q5_1]
Q_TYPES = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1]
# 13: whole tiles of 8 and a tail; 70: past one 64-token pass of the row-group kernels
TOKENS = (13, 70)
N_OUT, N_IN = 27, 512  # rows: not a multiple of 8 (row groups) nor of 16 (work items)


def weight(t: GGMLType, seed: int, n_out: int = N_OUT) -> WeightTensor:
    """Random valid blocks (K-quants: random bytes, sane f16 scales of either sign; gguf quantizes the
    rest from Gaussian values with one block of a clear offset)."""
    rng = np.random.default_rng(seed)
    if t in F16_AT:
        nb = N_IN // block_size(t)
        raw = rng.integers(0, 256, (n_out, nb, type_size(t)), dtype=np.uint8)
        for off in F16_AT[t]:
            v = rng.uniform(0.25, 1.0, (n_out, nb)) * rng.choice([-1.0, 1.0], (n_out, nb)) * 1e-2
            raw[:, :, off : off + 2] = v.astype(np.float16).view(np.uint8).reshape(n_out, nb, 2)
        raw = raw.reshape(n_out, -1)
    else:
        w = rng.standard_normal((n_out, N_IN)).astype(np.float32) * 0.1
        w[0, :32] += 0.5
        raw = gq.quantize(w, t).view(np.uint8).reshape(n_out, -1)
    return WeightTensor("w", t, (n_out, N_IN), raw)


def acts(n_tok: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n_tok, N_IN)).astype(np.float32)
    x[:, 256:288] *= 30.0  # blocks of very different scales
    x[0, :256] = 0.0  # an all-zero block
    return x


def _weights() -> dict[str, WeightTensor]:
    ws = {t.name: weight(t, seed=3 + i) for i, t in enumerate(K_TYPES + Q_TYPES)}
    for t in (GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_0, GGMLType.Q4_1):  # whole groups of eight: block32_rows8's
        ws[f"{t.name}@40"] = weight(t, seed=20, n_out=40)
    for t in (GGMLType.IQ4_NL, GGMLType.IQ4_XS):  # and its IQ4 layouts (random blocks: gguf cannot quantize IQ4)
        ws[f"{t.name}@40"] = WeightTensor("w", t, (40, N_IN), _random_rows(t, 40, N_IN, seed=21))
    return ws


def _matmul(x: np.ndarray, w: WeightTensor) -> np.ndarray:
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    (km if km.supports(w.ggml_type) else iq if iq.supports(w.ggml_type) else qm).matmul(x, w, out)
    return out


def test_selection_follows_the_cpu_features():
    has = simd.target_has("avxvnni") or (simd.target_has("avx512vnni") and simd.target_has("avx512vl"))
    wanted = simd.AVX2 and has and os.environ.get("MINFER_VNNI", "1") != "0"
    assert simd.VNNI == wanted
    print(f"VNNI prefill paths in use here: {simd.VNNI}")


@pytest.mark.skipif(not simd.VNNI, reason=NO_VNNI)
@pytest.mark.parametrize("name", [t.name for t in K_TYPES + Q_TYPES] + [f"{n}@40" for n in ("Q5_0", "Q5_1", "Q4_0",
                                                                                          "Q4_1", "IQ4_NL", "IQ4_XS")])
def test_vnni_prefill_parity_with_the_reference(name):
    """The VNNI kernels against the float64 product of the dequantized weights and of the activations as
    they are quantized (the integer parts are exact; what is left is float32 rounding)."""
    w = _weights()[name]
    t = w.ggml_type
    x = acts(TOKENS[1], seed=5)
    out = _matmul(x, w)
    deq = KQUANT_DEQUANTIZERS.get(t) or DEQUANTIZERS[t]
    wd = deq(w.data, N_IN).astype(np.float64)
    if name.endswith("_K"):
        xr = km.quantize_activations_q8_k(x).dequantize().astype(np.float64)
    else:
        xq = qm.quantize_activations(x)
        xr = (xq.q.reshape(x.shape[0], -1, 32) * xq.ds[:, :, :1]).reshape(x.shape).astype(np.float64)
    exact = xr @ wd.T
    scale = np.abs(xr) @ np.abs(wd).T + 1e-30
    # the min/offset parts can cancel: bound by the magnitude of every term, (2 blocks + 8) roundings
    terms = 2 * N_IN // block_size(t) + 8
    assert np.max(np.abs(out - exact) / scale) < terms * 2.0**-24 * 8


_SCRIPT = """
import sys
import numpy as np
from gguf import quants as gq

from minfer.backends.cpu import iquant_matmul as iq
from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import quant_matmul as qm
from minfer.backends.cpu import simd
from minfer.formats.tensors import WeightTensor
from minfer.formats.quants import GGMLType

data = np.load(sys.argv[1])
res = {"vnni": np.array(simd.VNNI)}
for name in sys.argv[3].split(","):
    w = WeightTensor("w", GGMLType[name.split("@")[0]], tuple(data[name + "_shape"]), data[name])
    mod = km if km.supports(w.ggml_type) else iq if iq.supports(w.ggml_type) else qm
    for n in (13, 70):
        out = np.empty((n, w.shape[0]), np.float32)
        mod.matmul(data["x"][:n], w, out)
        res[f"{name}_{n}"] = out
np.savez(sys.argv[2], **res)
"""


@pytest.mark.slow
@pytest.mark.skipif(not simd.VNNI, reason=NO_VNNI)
def test_vnni_and_avx2_give_the_same_bits(tmp_path, request):
    """MINFER_VNNI=0 (pmaddubsw + pmaddwd + adds) and the VNNI instructions: the same integers, so the
    same float32 results bit for bit, for every integer block type and both prefill loop shapes."""
    x = acts(max(TOKENS), seed=6)
    ws = _weights()
    arrays: dict[str, np.ndarray] = {"x": x}
    for name, w in ws.items():
        arrays[name], arrays[name + "_shape"] = np.ascontiguousarray(w.data), np.array(w.shape)
    np.savez(tmp_path / "in.npz", **arrays)
    env = dict(os.environ, MINFER_VNNI="0", NUMBA_CACHE_DIR=str(request.config.cache.mkdir("numba-no-vnni")))
    env["PYTHONPATH"] = str(Path(km.__file__).parents[3]) + os.pathsep + env.get("PYTHONPATH", "")
    (tmp_path / "run.py").write_text(_SCRIPT)
    cmd = [sys.executable, str(tmp_path / "run.py"), str(tmp_path / "in.npz"), str(tmp_path / "out.npz"), ",".join(ws)]
    subprocess.run(cmd, env=env, check=True, timeout=600)
    got = np.load(tmp_path / "out.npz")
    assert not got["vnni"]
    for name, w in ws.items():
        for n in TOKENS:
            ours = _matmul(x[:n], w)
            assert got[f"{name}_{n}"].view(np.uint32).tolist() == ours.view(np.uint32).tolist(), (name, n)
