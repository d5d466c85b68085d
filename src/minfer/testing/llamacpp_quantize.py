"""Quantize a GGUF file with llama.cpp's own quantizer (``llama_model_quantize``), in an interpreter that has
``llama_cpp`` (e.g. ``/tmp/lcpenv/bin/python``)::

    python src/minfer/testing/llamacpp_quantize.py IN.gguf OUT.gguf FTYPE [THREADS]  # LLAMA_FTYPE_MOSTLY_* suffix
"""

from __future__ import annotations

import ctypes
import sys


def main() -> int:
    import llama_cpp

    src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
