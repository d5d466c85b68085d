"""llama.cpp's logits for every position of one sequence of a GGUF file (run in an interpreter that has
``llama_cpp``, e.g. ``/tmp/lcpenv/bin/python``); used by ``make_family_fixtures.py`` for its cross-check::

    python scripts/llamacpp_logits.py MODEL.gguf '[0, 5, 9]' N_CTX OUT.npy
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> int:
    import llama_cpp

    path, ids, n_ctx, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                          n_threads=1, verbose=True, flash_attn=False, type_k=0, type_v=0)  # f32 KV cache
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    np.save(out, logits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
