"""xenc_lab: cross-encoder scores as exact as sentence-transformers', from a packed engine of our own."""
from .config import ScorerConfig
from .scorer import Scorer

_EXPERIMENTS = ["experiment", "format_table", "rerank", "rerank_variants", "evaluate", "significance", "bm25",
                "load_collection", "rrf", "interpolate", "tune_interpolation", "compare_rankings", "summarize_comparison",
                "read_run", "read_qrels", "read_queries", "read_corpus", "write_run"]
__all__ = ["Scorer", "ScorerConfig", *_EXPERIMENTS]
__version__ = "0.1.0"


def __getattr__(name):
    # The experiment tools import pandas and ir-measures: only when first used.
    if name in _EXPERIMENTS:
        from . import ir

        return getattr(ir, name)
    raise AttributeError(f"module 'xenc_lab' has no attribute {name!r}")
