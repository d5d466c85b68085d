"""µs per call of the numba vector kernels (``backends/cpu``: ``norms``, ``elementwise``, ``rope``, ``attention``)
against the numpy reference.

SmolLM2-135M shapes: n_embd 576, 9 query heads, 3 kv heads, head_dim 64, n_ff 1536. Row-wise ops at
decode (1 token) and prefill (128 / 512 tokens); attention at decode with 128 / 1024 / 4096 cached rows
and prefill of 128 / 512 tokens from position 0. BLAS runs on one thread, as during plan execution.

    python bench/vec_kernels_bench.py [--threads N] [--batches B]

Each figure is the median over B batches (each the mean of enough calls to last ~50 µs): robust to the
noise of a shared machine. Only attention uses numba's threads; the other kernels are serial.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from minfer.backends.cpu import attention, elementwise, norms
from minfer.backends.cpu import reference as ref
from minfer.backends.cpu import rope as rope_kernels
from minfer.graph.ir import AttnMeta, RopeMeta, RopeStyle

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF = 576, 9, 3, 64, 1536
F32 = np.float32


def median_us(fn: Callable[..., None], *args, batches: int) -> float:
    """Median over ``batches`` batches of the mean time of ``fn(*args)`` in a batch of ~50 µs, in µs.

    Batches are short and the median ignores the few that a scheduler stall hits: on a shared 2-vCPU
    machine a parallel call now and then waits a whole time slice (4-16 ms) for its second thread.
    """
    fn(*args)
    t0 = time.perf_counter()
    fn(*args)
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(1, min(1000, int(50e-6 / one)))
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        times.append((time.perf_counter() - t0) / n)
    return float(np.median(times)) * 1e6


def row(name: str, ref_us: float, vk_us: float) -> None:
    print(f"{name:<40} {ref_us:>10.1f} {vk_us:>10.1f} {ref_us / vk_us:>8.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--batches", type=int, default=101, help="timed batches per case (median reported)")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    t0 = time.perf_counter()
    for kernels in (norms, elementwise, rope_kernels, attention):
        kernels.warmup()
    print(
        f"warmup (compile or cache load): {time.perf_counter() - t0:.2f} s; numba threads {args.threads}, "
        f"layer {numba.threading_layer()}"
    )
    rng = np.random.default_rng(0)
    rope_meta = RopeMeta(N_HEAD, HEAD_DIM, HEAD_DIM, 10000.0, 1.0, RopeStyle.NEOX)
    table = rope_kernels.RopeTable(HEAD_DIM, HEAD_DIM, 10000.0, 1.0)
    attn_meta = AttnMeta(0, N_HEAD, N_HEAD_KV, HEAD_DIM, HEAD_DIM, HEAD_DIM**-0.5)
    r = args.batches
    print(f"{'op [shape]':<40} {'ref µs':>10} {'numba µs':>10} {'speedup':>9}")
    with threadpool_limits(limits=1, user_api="blas"):
        for nt in (1, 128, 512):
            x = rng.standard_normal((nt, N_EMBD)).astype(F32)
            y = rng.standard_normal((nt, N_EMBD)).astype(F32)
            gain = rng.standard_normal(N_EMBD).astype(F32)
            out = np.empty_like(x)
            gate = rng.standard_normal((nt, N_FF)).astype(F32)
            up = rng.standard_normal((nt, N_FF)).astype(F32)
            ff = np.empty_like(gate)
            pos = np.arange(nt, dtype=np.int32) + 100
            kw = N_HEAD_KV * HEAD_DIM
            k = rng.standard_normal((nt, kw)).astype(F32)
            k_reg, v_reg = np.zeros((4096, kw), F32), np.zeros((4096, kw), F32)
            cases = [
                (
                    f"rms_norm_mul [{nt}, {N_EMBD}]",
                    ref.rms_norm_mul,
                    (x, gain, 1e-5, N_EMBD, out),
                    norms.rms_norm_mul,
                    (x, gain, 1e-5, N_EMBD, out),
                ),
                (
                    f"rms_norm_mul in place [{nt}, {N_EMBD}]",
                    ref.rms_norm_mul,
                    (y, gain, 1e-5, N_EMBD, y),
                    norms.rms_norm_mul,
                    (y, gain, 1e-5, N_EMBD, y),
                ),
                (f"add residual in place [{nt}, {N_EMBD}]", ref.add, (y, x, y), elementwise.add, (y, x, y)),
                (f"add bias [{nt}, {N_EMBD}]", ref.add, (x, gain, out), elementwise.add, (x, gain, out)),
                (f"swiglu [{nt}, {N_FF}]", ref.swiglu, (gate, up, ff), elementwise.swiglu, (gate, up, ff)),
                (
                    f"rope in place, held table [{nt}, {N_EMBD}]",
                    ref.rope,
                    (y, pos, rope_meta, y),
                    table.apply,
                    (y, pos, N_HEAD, True, y),
                ),
                (
                    f"rope(), table looked up [{nt}, {N_EMBD}]",
                    ref.rope,
                    (x, pos, rope_meta, out),
                    rope_kernels.rope,
                    (x, pos, N_HEAD, HEAD_DIM, HEAD_DIM, 10000.0, 1.0, True, out),
                ),
                (
                    f"kv_store [{nt}, 2 x {kw}]",
                    ref.kv_store,
                    (k, k, pos, k_reg, v_reg, 0),
                    attention.kv_store,
                    (k, k, pos, k_reg, v_reg, 0),
                ),
            ]
            for label, ref_fn, ref_args, vk_fn, vk_args in cases:
                row(label, median_us(ref_fn, *ref_args, batches=r), median_us(vk_fn, *vk_args, batches=r))
        for nt, ctx in [(1, 128), (1, 1024), (1, 4096), (128, 128), (512, 512)]:
            kw = N_HEAD_KV * HEAD_DIM
            k_reg = rng.standard_normal((4096, kw)).astype(F32)
            v_reg = rng.standard_normal((4096, kw)).astype(F32)
            q = rng.standard_normal((nt, N_HEAD * HEAD_DIM)).astype(F32)
            pos = np.arange(ctx - nt, ctx, dtype=np.int32)
            out = np.empty_like(q)
            label = f"attention decode, ctx {ctx}" if nt == 1 else f"attention prefill {nt} tokens"
            row(
                label,
                median_us(ref.attention, q, k_reg, v_reg, pos, attn_meta, out, batches=r),
                median_us(
                    attention.attention,
                    q,
                    k_reg,
                    v_reg,
                    pos,
                    N_HEAD,
                    N_HEAD_KV,
                    HEAD_DIM,
                    HEAD_DIM,
                    HEAD_DIM**-0.5,
                    out,
                    batches=r,
                ),
            )


if __name__ == "__main__":
    main()
