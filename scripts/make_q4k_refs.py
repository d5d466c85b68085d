"""Write ``tests/data/q4_k_ref.npz``: llama.cpp's own Q4_K quantization of a set of float32 rows.

The ``gguf`` package has no Q4_K quantizer, so ``minfer.formats.quantize`` ports llama.cpp's
``quantize_row_q4_K_ref`` and the tests hold it to these bytes. They come from the C function itself, called
through ctypes in the ``libggml-base`` that ``llama-cpp-python`` ships (run with the system python, where
``llama-cpp-python`` is installed)::

    python3 scripts/make_q4k_refs.py [--out tests/data/q4_k_ref.npz]

Rows: Gaussian weights at a typical scale, heavy-tailed ones, all-positive and all-negative rows (the min
clamps to 0), zeros, a constant, sparse rows, tiny and huge magnitudes; 256 or 512 values each. The input
rows are stored next to the bytes, so the test needs no random generator to agree with this one.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import os
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]


def cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20240817)
    return {
        "gaussian": rng.standard_normal((24, 512)).astype(np.float32) * 0.02,
        "heavy_tailed": rng.standard_t(2, (16, 512)).astype(np.float32),
        "positive": (np.abs(rng.standard_normal((4, 256))) + 1).astype(np.float32),
        "negative": (-np.abs(rng.standard_normal((4, 256)))).astype(np.float32),
        "zeros": np.zeros((1, 256), np.float32),
        "constant": np.full((1, 256), 0.3, np.float32),
        "sparse": (rng.standard_normal((4, 256)) * (rng.random((4, 256)) < 0.05)).astype(np.float32),
        "tiny": (rng.standard_normal((2, 256)) * 1e-6).astype(np.float32),
        "huge": (rng.standard_normal((2, 256)) * 1e4).astype(np.float32),
    }


def main() -> None:
    import llama_cpp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "data" / "q4_k_ref.npz")
    args = ap.parse_args()
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.quantize_row_q4_K_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.quantize_row_q4_K_ref.restype = None
    arrays: dict[str, np.ndarray] = {}
    for name, x in cases().items():
        x = np.ascontiguousarray(x)
        out = np.zeros((x.shape[0], x.shape[1] // 256 * 144), np.uint8)
        for r in range(x.shape[0]):
            lib.quantize_row_q4_K_ref(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
        arrays[f"{name}.x"] = x
        arrays[f"{name}.q4_k"] = out
    version = importlib.metadata.version("llama-cpp-python")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, source=np.array(f"llama-cpp-python {version}: quantize_row_q4_K_ref"), **arrays)
    print(f"{args.out}: {len(arrays) // 2} cases from llama-cpp-python {version}")


if __name__ == "__main__":
    main()
