"""A request's ``truncation_side`` applied to a tokenizer for one call: the Scorer's pair tokenizers (and
sentence-transformers, and vLLM's ``tokenizer(text, text_pair, truncation=True)``) cut from the side their Hugging Face
tokenizer's ``truncation_side`` names, the longer text first, special tokens kept. Only the thread that owns the
tokenizer sets it (the batcher's worker; the token counter's thread), and puts it back after."""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def truncating_from(owner, side: str | None):
    """``owner.tokenizer`` (a Scorer's pair tokenizer) cutting from ``side`` ("left" or "right"; None: its own)."""
    if side is None:
        yield
        return
    hf = owner.tokenizer.tokenizer
    before, hf.truncation_side = hf.truncation_side, side
    try:
        yield
    finally:
        hf.truncation_side = before
