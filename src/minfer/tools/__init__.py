"""Tools over the engine: benchmarks against peers, the model summary of ``minfer inspect``."""
