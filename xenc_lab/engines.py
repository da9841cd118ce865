"""The engine of a model's family, built once when the model loads: an encoder's packed batches or a decoder's chunks
over its paged KV cache (``engine.py`` holds the loop both share)."""
from __future__ import annotations

from .decoder.engine import DecoderEngine
from .decoder.kv_cache import KVCache
from .engine import Budget, EncoderEngine, Engine
from .runner import ModelRunner


def engine_for(runner: ModelRunner, budget: Budget, *, share_prefix: bool = False,
               pooled_past: int | None = None) -> Engine:
    """The engine of the runner's model family: an encoder's, or a decoder's with its KV cache in the model's dtype
    (``share_prefix``: shared prefixes computed once; ``pooled_past``: the model's ``pooled_past(config)``)."""
    model = runner.model
    if not model.causal:
        return EncoderEngine(runner, budget)
    cache = KVCache(*model.cache_shape(), budget.page_size, runner.choices.dtype, runner.device)
    return DecoderEngine(runner, budget, cache, share_prefix=share_prefix, pooled_past=pooled_past)
