"""Reranking experiments: read a first-stage run, rerank it, evaluate it, compare systems in one table, fuse runs,
compare rankings. Needs pandas and ir-measures (``pip install 'xenc-lab[ir]'``), imported when a tool is first used."""
import importlib

_HOMES = {
    "experiment": "experiments", "format_table": "experiments",
    "rerank": "reranking", "rerank_variants": "variants", "bm25": "first_stage", "load_collection": "irds",
    "evaluate": "metrics", "significance": "experiments",
    "rrf": "fusion", "interpolate": "fusion", "tune_interpolation": "fusion",
    "compare_rankings": "compare", "summarize_comparison": "compare", "score_frame": "frames",
    "read_run": "files", "read_qrels": "files", "read_queries": "files", "read_corpus": "files", "write_run": "files",
}
__all__ = list(_HOMES)


def __getattr__(name):
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'xenc_lab.ir' has no attribute {name!r}")
