"""Peers in one command (``tox -e peers``, or ``python -m xenc_lab.bench.peers``): OpenVINO, ONNX Runtime,
sentence-transformers, llama.cpp and xenc_lab on the same held-out pairs, each engine in its own process and, where its
pins conflict with the project's, its own environment. Nothing here imports a peer: the engines run in
scripts/peers/worker.py, and this package writes their pairs, runs them and reports (docs/benchmarking.md)."""
from .stats import ORACLE, EngineResult, PeerRow, fidelity, parse_result, rows, table

__all__ = ["ORACLE", "EngineResult", "PeerRow", "fidelity", "parse_result", "rows", "table"]
