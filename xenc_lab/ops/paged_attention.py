"""Causal attention of packed chunks over a paged KV cache: each chunk's queries see its context's cached keys and
values and its own up to themselves. A composition of torch ops (gathers, then SDPA on the (chunks, slots) layout),
correct on every device; grouped-query heads are SDPA's own (``enable_gqa``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..chunks import ChunkBatch


def _keys_values(k, v, batch: ChunkBatch, cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the batch's keys and values that the cache keeps, then gather every chunk's (C * Lk, KVH, D) keys and
    values: its context's from the cache, its own from the stream."""
    if cache is None:
        return k.index_select(0, batch.key_index), v.index_select(0, batch.key_index)
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    k_cache.index_copy_(0, batch.write_slots, k.index_select(0, batch.write_index))
    v_cache.index_copy_(0, batch.write_slots, v.index_select(0, batch.write_index))
    # Each key slot from the cache or from the stream, gathered without copying the whole cache.
    from_cache = (batch.key_index < batch.cache_slots)[:, None, None]
    in_cache = batch.key_index.clamp(max=max(batch.cache_slots - 1, 0))
    in_stream = (batch.key_index - batch.cache_slots).clamp(min=0)
    keys = torch.where(from_cache, k_cache.index_select(0, in_cache), k.index_select(0, in_stream))
    values = torch.where(from_cache, v_cache.index_select(0, in_cache), v.index_select(0, in_stream))
    return keys, values


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ChunkBatch, cache, layer: int, scale: float
) -> torch.Tensor:
    """(T, H * D) attention output of the stream's tokens. ``q`` (T, H, D), ``k`` and ``v`` (T, KVH, D), after
    rotary; ``cache`` a ``kv_cache.KVCache`` (or None: no chunk has context and none is stored). The keys and values
    of ``batch.write_index`` are stored in the cache's ``layer`` first."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    chunks, _, lq, lk = batch.key_mask.shape
    keys, values = _keys_values(k, v, batch, cache, layer)
    qp = q.index_select(0, batch.pad_index).view(chunks, lq, heads, dim).transpose(1, 2)
    kp = keys.view(chunks, lk, kv_heads, dim).transpose(1, 2)
    vp = values.view(chunks, lk, kv_heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=batch.key_mask, scale=scale,
                                         enable_gqa=heads != kv_heads)
    return out.transpose(1, 2).reshape(chunks * lq, heads * dim).index_select(0, batch.unpad_index)


def last_token_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ChunkBatch, cache, layer: int, scale: float
) -> torch.Tensor:
    """(R, H * D) attention output of the rows ``batch.last_index`` only (the last layer: nothing past it reads the
    other tokens' outputs); ``q`` (R, H, D) is theirs, ``k`` and ``v`` (T, KVH, D) the whole stream's, stored in the
    cache as ``chunk_attention`` stores them."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    chunks, _, lq, lk = batch.key_mask.shape
    keys, values = _keys_values(k, v, batch, cache, layer)
    kp = keys.view(chunks, lk, kv_heads, dim).index_select(0, batch.last_chunk).transpose(1, 2)
    vp = values.view(chunks, lk, kv_heads, dim).index_select(0, batch.last_chunk).transpose(1, 2)
    mask = batch.key_mask.view(chunks, lq, lk)[batch.last_chunk, batch.last_slot][:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None], kp, vp, attn_mask=mask, scale=scale,
                                         enable_gqa=heads != kv_heads)
    return out.reshape(q.shape[0], heads * dim)
