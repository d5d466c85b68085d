"""The kernels on 512-bit registers (AVX-512 VNNI, ``simd512.WIDE``): two groups of eight rows per zmm
register, for the repacked K-quants (``kquant_rows16``, prefill and decode) and Q8_0 (prefill; Q4_0's, Q4_1's,
Q5_0's and IQ4's: ``test_block32_rows8``).

Where the CPU has them, the matmuls run them, so the parity, prefill = decode and threads tests of
``test_kquant_rows8`` and ``test_quant_matmul`` run them too. Here: they are chosen exactly where the CPU
has what they need, and they give the eight-row kernels' bits for every type, token count (whole quads,
a tail, past one 64-token pass), odd and even group counts, rows past the last group, and q/k/v-style
calls of several weights. Where the CPU has no AVX-512 VNNI these skip, saying so; the eight-row kernels
then run everywhere.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import quants as gq
from test_kquants import acts, weight

from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import kquant_rows8 as r8
from minfer.backends.cpu import kquant_rows16 as r16
from minfer.backends.cpu import quant_matmul as qm
from minfer.backends.cpu import simd, simd512
from minfer.formats.block_types import GGMLType
from minfer.formats.tensors import WeightTensor

TYPES = [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
NO_WIDE = "no AVX-512 F+BW+VNNI on this CPU (or MINFER_AVX512=0 / MINFER_VNNI=0): the 512-bit prefill cannot run here"


def test_selection_follows_the_cpu_features():
    has = all(simd.target_has(f) for f in ("avx512f", "avx512bw", "avx512vnni"))
    wanted = simd.VNNI and has and os.environ.get("MINFER_AVX512", "1") != "0"
    assert simd512.WIDE == wanted
    assert (r16.REPACKED is r8.REPACKED) == (not wanted)
    print(f"512-bit K-quant prefill in use here: {simd512.WIDE}")


def _operands(xs: np.ndarray):
    q = km.quantize_activations_q8_k(xs)
    return q._q.reshape(-1), q._d.reshape(-1), q._bs.reshape(-1)


@pytest.mark.skipif(not simd512.WIDE, reason=NO_WIDE)
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 2, 3, 4, 7, 13, 64])
def test_the_same_bits_as_the_eight_row_kernel(t, n_tok):
    """One weight and three (groups 5, 2 and 3: a pair of one at the end of two of them) in one call."""
    x = acts(n_tok, 512)
    ws = [weight(t, n_out, 512, seed=40 + i) for i, n_out in enumerate((40, 16, 24))]
    repack, wide = r16.REPACKED[t][0], r16.PAIRS[t]
    _, narrow = r8.REPACKED[t]
    packed = [repack(np.ascontiguousarray(w.data), w.shape[0], 512) for w in ws]
    q, d, bs = _operands(x)
    for members in (1, 3):
        outs = {}
        for name, kernel in (("wide", wide), ("narrow", narrow)):
            o = [np.full((n_tok, w.shape[0]), np.nan, np.float32) for w in ws[:members]]
            args = [a for pair in zip(packed[1:members], o[1:], strict=True) for a in pair]
            kernel(packed[0], q, d, bs, o[0], *args)
            outs[name] = o
        for a, b in zip(outs["wide"], outs["narrow"], strict=True):
            assert not np.isnan(a).any()
            assert a.view(np.uint32).tolist() == b.view(np.uint32).tolist()


@pytest.mark.skipif(not simd512.WIDE, reason=NO_WIDE)
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_few_token_passes_take_the_eight_row_kernels_where_512_bits_are_split(monkeypatch, t):
    """On a CPU that splits 512-bit operations (Zen 4) a decode streams its weights faster on the eight-row
    kernels: matmul and a plan's bound call run them for passes of up to FEW_TOKENS_ON_EIGHT_ROWS tokens of
    Q4_K/Q5_K and FEW_Q6_TOKENS_ON_EIGHT_ROWS of Q6_K, the pairs from there on."""
    znver4 = simd.target_cpu_name() == "znver4"
    assert r16.FEW_TOKENS_ON_EIGHT_ROWS == (3 if znver4 else 0)
    assert r16.FEW_Q6_TOKENS_ON_EIGHT_ROWS == (2 if znver4 else 0)
    ran = []
    eight, eight_q6, pairs, q6_pairs = r8._matmul, r8._matmul_q6_group, r16._matmul_pairs, r16._matmul_q6_pairs
    monkeypatch.setattr(r8, "_matmul", lambda *a: (ran.append("eight"), eight(*a)))
    monkeypatch.setattr(r8, "_matmul_q6_group", lambda *a: (ran.append("eight"), eight_q6(*a)))
    monkeypatch.setattr(r16, "_matmul_pairs", lambda *a: (ran.append("pairs"), pairs(*a)))
    monkeypatch.setattr(r16, "_matmul_q6_pairs", lambda *a: (ran.append("pairs"), q6_pairs(*a)))
    p = km.prepare(weight(t, 32, 512, seed=5))
    few = r16.FEW_TOKENS_ON_EIGHT_ROWS if t != GGMLType.Q6_K else r16.FEW_Q6_TOKENS_ON_EIGHT_ROWS
    for n_tok in range(1, 6):
        x = acts(n_tok, 512)
        out = np.empty((n_tok, 32), np.float32)
        km.matmul(x, p, out)
        km.direct_call(x, p, out, None)()
        assert ran == ["eight" if n_tok <= few else "pairs"] * 2, n_tok
        ran.clear()
    print(f"CPU {simd.target_cpu_name()}: {t.name} passes of up to {few} tokens on the eight-row kernels")


@pytest.mark.skipif(not simd512.WIDE, reason=NO_WIDE)
@pytest.mark.parametrize("n_out", [40, 43, 48])  # five groups (one alone at the end), three more rows, six
@pytest.mark.parametrize("n_tok", [2, 13, 70])
def test_q8_0_prefill_gives_the_eight_row_kernels_bits(n_out, n_tok):
    rng = np.random.default_rng(n_out + n_tok)
    w = rng.standard_normal((n_out, 512)).astype(np.float32)
    p = qm.prepare(WeightTensor("w", GGMLType.Q8_0, (n_out, 512), gq.quantize(w, GGMLType.Q8_0).view(np.uint8)))
    xq = qm.quantize_activations(acts(n_tok, 512))
    au = qm._shifted_activations(xq._q, n_tok)
    wide, narrow = (np.full((n_tok, n_out), np.nan, np.float32) for _ in range(2))
    qm._q8_0_pairs(p.rows8, p.flat, p.rb, xq._q, au, xq._ds, wide)
    qm._q8_0_rows8(p.rows8, p.flat, p.rb, xq._q, au, xq._ds, narrow)
    assert not np.isnan(wide).any()
    assert wide.view(np.uint32).tolist() == narrow.view(np.uint32).tolist()


@pytest.mark.parametrize("n_tok", [1, 2, 9])
def test_a_plans_bound_q8_0_call_runs_the_kernel_matmul_runs(monkeypatch, n_tok):
    # the same bits either way, so only the kernel the call runs tells them apart: a plan's bound call
    # once kept the eight-row kernel while matmul ran the pairs
    ran = []
    pairs = qm._q8_0_pairs
    monkeypatch.setattr(qm, "_q8_0_pairs", lambda *a: (ran.append("pairs"), pairs(*a)))
    rng = np.random.default_rng(n_tok)
    w = rng.standard_normal((40, 512)).astype(np.float32)
    p = qm.prepare(WeightTensor("w", GGMLType.Q8_0, (40, 512), gq.quantize(w, GGMLType.Q8_0).view(np.uint8)))
    x = acts(n_tok, 512)
    out = np.empty((n_tok, 40), np.float32)
    qm.matmul(x, p, out)
    qm.direct_call(x, p, out, None)()
    assert ran == (["pairs", "pairs"] if simd512.WIDE and n_tok > 1 else [])
