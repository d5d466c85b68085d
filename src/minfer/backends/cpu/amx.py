"""Intel AMX tiles from numba-compiled code: whether this process may use them, and the tile intrinsics.

AMX (Sapphire Rapids and later Xeons) multiplies int8 tiles of up to 16 rows x 64 bytes, ~10x the int8
rate of 512-bit ``vpdpbusd`` on one core. Three things must hold before a tile instruction runs
(``../shared/DESIGN.md``, "AMX tiles"): the CPU lists ``amx-tile`` and ``amx-int8``, the kernel grants this
process the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), and a small tile product
gives the right answer. Some VMs advertise AMX and fault on it, so the product runs once in a child
process (a fault costs that child), and its answer is kept beside numba's cache, keyed by the CPU.
:func:`usable` says all three (``MINFER_AMX=0`` says no without asking); :func:`reason` says why not.

The intrinsics are LLVM's legacy tile intrinsics, tile numbers as constants (numba's LLVM refuses inline
assembly): a kernel loads its tile configuration (``tile_config``, 64 bytes from :func:`config`) at the
start of each work item, as every thread needs it.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from minfer.backends.cpu.simd import LL_I8, element_pointer, ir_call, is_1d, target_has

_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
_I8P = ir.PointerType(LL_I8)
_VERDICT_VERSION = 1
_state: dict[str, str] = {}  # this process's verdict, once asked: "ok" or why not


def config(tiles: dict[int, tuple[int, int]]) -> np.ndarray:
    """The 64-byte tile configuration (palette 1) for ``{tile: (rows, bytes per row)}``."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for t, (rows, colsb) in tiles.items():
        cfg[16 + 2 * t : 18 + 2 * t] = np.array([colsb], np.uint16).view(np.uint8)
        cfg[48 + t] = rows
    return cfg


def _grant() -> bool:
    """Ask the kernel for the tile state (process-wide; True when granted)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def _verdict_file() -> Path:
    cache = numba.config.CACHE_DIR or str(Path(__file__).parent / "__pycache__")
    key = "-".join([str(_VERDICT_VERSION), numba.config.CPU_NAME or "host"] + sorted(
        f for f in ("amx-tile", "amx-int8", "avx512f", "avx512bw", "avx512vnni") if target_has(f)))
    return Path(cache) / f"minfer-amx-probe-{key}.txt"


def _ask_child() -> str:
    """Run :func:`_probe_here` in a child process: "ok", or why the tiles cannot be used."""
    try:
        r = subprocess.run([sys.executable, "-c", "from minfer.backends.cpu.amx import _probe_here; _probe_here()"],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the AMX probe did not finish ({e})"
    if r.returncode == 0 and r.stdout.strip().endswith("ok"):
        return "ok"
    last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or [""])[-1]
    return f"the AMX probe failed (exit {r.returncode}{': ' + last[:200] if last else ''})"


def reason() -> str:
    """"ok" where the tiles may be used, else one line saying why not (asked once per process)."""
    if "verdict" in _state:
        return _state["verdict"]
    if os.environ.get("MINFER_AMX", "1") == "0":
        verdict = "MINFER_AMX=0"
    elif not all(target_has(f) for f in ("amx-tile", "amx-int8", "avx512f", "avx512bw", "avx512vnni")):
        verdict = "the CPU has no AMX int8 tiles (or no AVX-512 VNNI beside them)"
    else:
        path = _verdict_file()
        try:
            verdict = path.read_text().strip()
        except OSError:
            verdict = _ask_child()
            try:  # kept for the next process; written whole or not at all
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(verdict + "\n")
                os.replace(tmp, path)
            except OSError:
                pass
        if verdict == "ok" and not _grant():
            verdict = "the kernel did not grant this process the AMX tile state"
    _state["verdict"] = verdict
    return verdict


def usable() -> bool:
    """Whether this process may run tile instructions (see :func:`reason`)."""
    return reason() == "ok"


# --- the intrinsics --------------------------------------------------------------------------------


def _pointer(context, builder, sig, args, k: int) -> ir.Value:
    """``args[k]`` (a 1-D array) at element ``args[k + 1]``, as an i8 pointer."""
    return builder.bitcast(element_pointer(context, builder, sig.args[k], args[k], args[k + 1], sig.args[k + 1],
                                           LL_I8), _I8P)


def _tile(v: int) -> ir.Constant:
    return ir.Constant(LL_I8, v)


@intrinsic
def tile_config(typingctx, cfg):
    """ldtilecfg from the 64 bytes of ``cfg`` (:func:`config`)."""
    if not is_1d(cfg):
        return None

    def codegen(context, builder, sig, args):
        zero = ir.Constant(ir.IntType(64), 0)
        p = builder.bitcast(element_pointer(context, builder, sig.args[0], args[0], zero, types.int64, LL_I8), _I8P)
        ir_call(builder, "llvm.x86.ldtilecfg", ir.VoidType(), [p])
        return context.get_dummy_value()

    return types.void(cfg), codegen


def _tile_memory(name: str, tile: int):
    """An intrinsic ``(arr, at, stride)`` calling LLVM's ``name`` on tile ``tile`` and the rows from element
    ``at`` of a 1-D array, ``stride`` bytes apart."""

    @intrinsic
    def move(typingctx, arr, at, stride):
        if not is_1d(arr):
            return None

        def codegen(context, builder, sig, args):
            stride64 = context.cast(builder, args[2], sig.args[2], types.int64)
            ir_call(builder, name, ir.VoidType(), [_tile(tile), _pointer(context, builder, sig, args, 0), stride64])
            return context.get_dummy_value()

        return types.void(arr, at, stride), codegen

    return move


def tile_load(tile: int):
    """``load(arr, at, stride)``: tile ``tile``'s rows from element ``at`` of a 1-D array, ``stride`` bytes apart."""
    return _tile_memory("llvm.x86.tileloadd64", tile)


def tile_store(tile: int):
    """``store(arr, at, stride)``: tile ``tile``'s rows to element ``at`` of a 1-D array, ``stride`` bytes apart."""
    return _tile_memory("llvm.x86.tilestored64", tile)


def tile_zero(tile: int):
    @intrinsic
    def zero(typingctx):
        def codegen(context, builder, sig, args):
            ir_call(builder, "llvm.x86.tilezero", ir.VoidType(), [_tile(tile)])
            return context.get_dummy_value()

        return types.void(), codegen

    return zero


def tile_dot(dst: int, a: int, b: int, a_signed: bool = True, b_signed: bool = True):
    """``dst += a . b`` on int8 tiles into int32 (tdpbssd / tdpbsud / tdpbusd / tdpbuud: A's rows are
    M x K bytes, B's are K/4 rows of N x 4 bytes, "VNNI order"); exact."""
    name = "llvm.x86.tdpb" + ("s" if a_signed else "u") + ("s" if b_signed else "u") + "d"

    @intrinsic
    def dot(typingctx):
        def codegen(context, builder, sig, args):
            ir_call(builder, name, ir.VoidType(), [_tile(dst), _tile(a), _tile(b)])
            return context.get_dummy_value()

        return types.void(), codegen

    return dot


# --- the probe -------------------------------------------------------------------------------------

_probe_load_a, _probe_load_b, _probe_store = tile_load(1), tile_load(2), tile_store(0)
_probe_zero, _probe_dot = tile_zero(0), tile_dot(0, 1, 2)


@njit
def _probe_product(cfg, a, b, c):
    tile_config(cfg)
    _probe_zero()
    _probe_load_a(a, 0, 64)
    _probe_load_b(b, 0, 64)
    _probe_dot()
    _probe_store(c, 0, 64)


def _probe_here() -> None:
    """In the probe's child: a 16x64 by 64x16 int8 tile product against numpy's; prints "ok"."""
    if not _grant():
        print("the kernel did not grant the AMX tile state")
        sys.exit(1)
    rng = np.random.default_rng(0)
    a = rng.integers(-128, 128, (16, 64), dtype=np.int8)
    b = rng.integers(-128, 128, (64, 16), dtype=np.int8)
    b_vnni = b.reshape(16, 4, 16).transpose(0, 2, 1).copy()  # row k/4: for each column, 4 consecutive k
    c = np.zeros((16, 16), np.int32)
    _probe_product(config({0: (16, 64), 1: (16, 64), 2: (16, 64)}), a.reshape(-1), b_vnni.reshape(-1), c.reshape(-1))
    if not np.array_equal(c, a.astype(np.int32) @ b.astype(np.int32)):
        print("a tile product gave a wrong answer")
        sys.exit(1)
    print("ok")
