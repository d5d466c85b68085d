"""Kernel-level benchmark of every block type's GEMV against the read bandwidth (``--bandwidth``) and GEMM
against the FMA peak (``--peak``): see :mod:`minfer.testing.kquant_bench` (the tests use it too, so it
lives in the package).

    python bench/kquant_bench.py --bandwidth --threads 1 2
"""

from minfer.testing.kquant_bench import main

if __name__ == "__main__":
    main()
