"""What the tests, the benchmarks and the scripts share, importable from one place (no ``sys.path``
edits): a real server process on loopback (:mod:`.server_process`), the GGUF writer of the fixture and
synthetic-model scripts (:mod:`.gguf_writing`), random weights of real shapes
(:mod:`.synthetic_model`, run as ``bench/synthetic_model.py``), the kernel benchmark
(:mod:`.kquant_bench`, run as ``bench/kquant_bench.py``) and llama.cpp's quantizer driver that a peer's
interpreter runs (``llamacpp_quantize.py``).

The engine never imports this package (an import-linter contract); some of it needs the test extras.
"""
