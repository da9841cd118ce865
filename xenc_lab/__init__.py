"""xenc_lab: cross-encoder scores as exact as sentence-transformers', from a packed engine of our own."""
from .config import ScorerConfig
from .scorer import Scorer

__all__ = ["Scorer", "ScorerConfig"]
__version__ = "0.1.0"
