"""Random weights of a real model's shapes, written as a GGUF: see :mod:`minfer.testing.synthetic_model`
(the tests use it too, so it lives in the package).

    python bench/synthetic_model.py --shape smollm2-1.7b --type q4_k_m -o /tmp/synth/smollm2-1.7b-q4_k_m.gguf
"""

import sys

from minfer.testing.synthetic_model import main

if __name__ == "__main__":
    sys.exit(main())
