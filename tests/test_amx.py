"""AMX tiles (``amx``, ``kquant_amx``): the probe says whether this process may use them and why not, and
Q4_K's prefill on the tiles gives the eight-row kernels' bits: whole 16-token tiles, a tail of tokens, odd
group counts, and calls of several weights. Where the probe does not pass (no AMX, a VM that faults on it,
``MINFER_AMX=0``) the kernel tests skip, saying why; the 512-bit and eight-row kernels then run."""

from __future__ import annotations

import numpy as np
import pytest
from test_kquants import acts, weight

from minfer.backends.cpu import amx, kquant_amx
from minfer.backends.cpu import kquant_matmul as km
from minfer.backends.cpu import kquant_rows8 as r8
from minfer.formats.block_types import GGMLType

WHY_NOT = amx.reason()


def test_the_probe_says_ok_or_why_not(monkeypatch):
    assert WHY_NOT == "ok" or len(WHY_NOT) > 10
    print(f"AMX tiles here: {WHY_NOT}")
    monkeypatch.setattr(amx, "_state", {})
    monkeypatch.setenv("MINFER_AMX", "0")
    assert amx.reason() == "MINFER_AMX=0"
    assert not amx.usable()


def test_a_tile_configuration_holds_each_tiles_shape():
    cfg = amx.config({0: (16, 64), 3: (8, 32)})
    assert cfg[0] == 1 and cfg.size == 64
    assert cfg[16:18].view(np.uint16)[0] == 64 and cfg[48] == 16
    assert cfg[22:24].view(np.uint16)[0] == 32 and cfg[51] == 8


def test_base_8_digits_of_every_q6_k_scale_fit_the_panels():
    sc = np.arange(-128, 128)
    rest, digits = sc.copy(), []
    for _ in range(3):  # as kquant_amx._digit_bytes computes them
        d = ((rest + 3) & 7) - 3
        digits.append(d)
        rest = (rest - d) >> 3
    assert np.array_equal(digits[0] + 8 * digits[1] + 64 * digits[2], sc)
    assert all(d.min() >= -3 and d.max() <= 4 for d in digits)
    products = np.outer(np.arange(-32, 32), np.arange(-3, 5))  # (u - 32) times a digit: a signed byte
    assert products.min() >= -128 and products.max() <= 127


@pytest.mark.skipif(WHY_NOT != "ok", reason=f"AMX tiles cannot run here: {WHY_NOT}")
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [32, 37, 70])
def test_the_tiles_give_the_eight_row_kernels_bits(t, n_tok):
    """One weight and three (groups 5, 2 and 3: a pair of one at the end of two of them) in one call."""
    x = acts(n_tok, 512)
    ws = [weight(t, n_out, 512, seed=50 + i) for i, n_out in enumerate((40, 16, 24))]
    repack, tiles = kquant_amx.REPACKED[t]
    _, narrow = r8.REPACKED[t]
    packed = [repack(np.ascontiguousarray(w.data), w.shape[0], 512) for w in ws]
    xq = km.quantize_activations_q8_k(x)
    q, d, bs = xq._q, xq._d, xq._bs
    for members in (1, 3):
        outs = {}
        for name, kernel in (("tiles", tiles), ("narrow", narrow)):
            o = [np.full((n_tok, w.shape[0]), np.nan, np.float32) for w in ws[:members]]
            args = [a for pair in zip(packed[1:members], o[1:], strict=True) for a in pair]
            kernel(packed[0], q, d, bs, o[0], *args)
            outs[name] = o
        for a, b in zip(outs["tiles"], outs["narrow"], strict=True):
            assert not np.isnan(a).any()
            assert a.view(np.uint32).tolist() == b.view(np.uint32).tolist()


@pytest.mark.skipif(WHY_NOT != "ok", reason=f"AMX tiles cannot run here: {WHY_NOT}")
def test_a_long_q4_k_pass_runs_on_the_tiles_and_a_short_one_does_not(monkeypatch):
    ran = []
    tiles = kquant_amx._matmul_tiles
    monkeypatch.setattr(kquant_amx, "_matmul_tiles", lambda *a: (ran.append(a[6].shape[0]), tiles(*a)))
    w = km.prepare(weight(GGMLType.Q4_K, 32, 512, seed=3))
    for n_tok in (kquant_amx.AMX_TOKENS - 1, kquant_amx.AMX_TOKENS):
        km.matmul(acts(n_tok, 512), w, np.empty((n_tok, 32), np.float32))
    assert ran == [kquant_amx.AMX_TOKENS]
