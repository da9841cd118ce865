"""The CPU backend: CPU facts, the native kernels' build and self-checks, GEMM routes, attention-path tuning and heap
settings. Models never import it directly: ``choices.resolve`` and the loader apply it."""
