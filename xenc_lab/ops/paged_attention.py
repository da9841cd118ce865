"""Causal attention of packed chunks over a paged KV cache: each chunk's queries see its context's cached keys and
values and its own up to themselves. The load's ``Choices.attention`` decides, with the batch's layout
(``decoder.chunks.ChunkBatch.layout``, "varlen" where attention runs on the packed stream): "kernel", each chunk's
keys listed end to end, read in place by xenc_lab's CPU kernel (``cpu.kernels.paged_attention_cpu``); "varlen" (CUDA
in half precision), gathered for torch's flash attention over cu_seqlens, whose causal mask aligns a chunk's
queries with the last of its keys; "sdpa", keys gathered for SDPA on the padded (chunks, slots) layout with a mask
(every device and dtype). Grouped-query heads are each path's own."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cpu.kernels import paged_attention_cpu
from ..decoder.chunks import ChunkBatch

try:  # torch >= 2.9: flash attention over cu_seqlens, CUDA only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover
    varlen_attn = None


def _kernel_runs(batch: ChunkBatch, attention: str) -> bool:
    """Whether the batch runs on xenc_lab's kernel ("kernel": the CPU) rather than flash attention or SDPA."""
    assert attention != "sdpa" or batch.layout == "padded", (attention, batch.layout)
    return attention == "kernel" and batch.layout == "varlen"


def _store(k, v, batch: ChunkBatch, cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the batch's keys and values that the cache keeps; returns the cache's (S, KVH, D) keys and values of
    ``layer`` (empty without a cache)."""
    if cache is None:
        return k.new_empty((0, *k.shape[1:])), v.new_empty((0, *v.shape[1:]))
    k_cache, v_cache = cache.k[layer], cache.v[layer]
    k_cache.index_copy_(0, batch.write_slots, k.index_select(0, batch.write_index))
    v_cache.index_copy_(0, batch.write_slots, v.index_select(0, batch.write_index))
    return k_cache, v_cache


def _kernel(q, k, v, batch: ChunkBatch, cache, layer: int, scale: float, cu_q: torch.Tensor) -> torch.Tensor:
    """xenc_lab's CPU kernel: the chunks' queries (``cu_q`` over q's rows) over their keys, read in place from the
    cache and the stream by ``batch.key_index``."""
    k_cache, v_cache = _store(k, v, batch, cache, layer)
    out = paged_attention_cpu(q.flatten(1), k.flatten(1), v.flatten(1), k_cache.flatten(1), v_cache.flatten(1),
                              batch.key_index, cu_q, batch.cu_seqlens_k, q.shape[1], scale)
    if out is None:  # pragma: no cover - choices.resolve picks the kernel only where it is loaded
        raise RuntimeError("xenc_lab's CPU attention kernel is not loaded")
    return out


def _keys_values(k, v, batch: ChunkBatch, cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the batch's keys and values that the cache keeps, then gather every chunk's (C * Lk, KVH, D) keys and
    values: its context's from the cache, its own from the stream."""
    if cache is None:
        return k.index_select(0, batch.key_index), v.index_select(0, batch.key_index)
    k_cache, v_cache = _store(k, v, batch, cache, layer)
    # Each key slot from the cache or from the stream, gathered without copying the whole cache.
    from_cache = (batch.key_index < batch.cache_slots)[:, None, None]
    in_cache = batch.key_index.clamp(max=max(batch.cache_slots - 1, 0))
    in_stream = (batch.key_index - batch.cache_slots).clamp(min=0)
    keys = torch.where(from_cache, k_cache.index_select(0, in_cache), k.index_select(0, in_stream))
    values = torch.where(from_cache, v_cache.index_select(0, in_cache), v.index_select(0, in_stream))
    return keys, values


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ChunkBatch, cache, layer: int, scale: float,
    attention: str = "sdpa",
) -> torch.Tensor:
    """(T, H * D) attention output of the stream's tokens. ``q`` (T, H, D), ``k`` and ``v`` (T, KVH, D), after
    rotary; ``cache`` a ``decoder.kv_cache.KVCache`` (or None: no chunk has context and none is stored); ``attention``
    the load's ``Choices.attention``. The keys and values of ``batch.write_index`` are stored in the cache's ``layer``
    first."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    if _kernel_runs(batch, attention):
        return _kernel(q, k, v, batch, cache, layer, scale, batch.cu_seqlens)
    keys, values = _keys_values(k, v, batch, cache, layer)
    if batch.layout == "varlen":
        n = batch.num_tokens  # flash attention writes the chunks' rows; the filler tail stays zero
        out = _causal_varlen(q[:n], keys, values, batch.cu_seqlens, batch, batch.max_seqlen, scale)
        return F.pad(out.reshape(n, heads * dim), (0, 0, 0, q.shape[0] - n))
    chunks, _, lq, lk = batch.key_mask.shape
    qp = q.index_select(0, batch.pad_index).view(chunks, lq, heads, dim).transpose(1, 2)
    kp = keys.view(chunks, lk, kv_heads, dim).transpose(1, 2)
    vp = values.view(chunks, lk, kv_heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=batch.key_mask, scale=scale,
                                         enable_gqa=heads != kv_heads)
    return out.transpose(1, 2).reshape(chunks * lq, heads * dim).index_select(0, batch.unpad_index)


def last_token_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ChunkBatch, cache, layer: int, scale: float,
    attention: str = "sdpa",
) -> torch.Tensor:
    """(R, H * D) attention output of the rows ``batch.last_index`` only (the last layer: nothing past it reads the
    other tokens' outputs); ``q``, ``k`` and ``v`` are the whole stream's, the keys and values stored in the cache as
    ``chunk_attention`` stores them."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    if batch.layout == "varlen":
        # One query per chunk, its last token, over all of the chunk's keys.
        chunks = batch.cu_seqlens.shape[0] - 1
        ends = batch.cu_seqlens[1:].long() - 1
        one_each = torch.arange(chunks + 1, dtype=torch.int32, device=q.device)
        if _kernel_runs(batch, attention):
            out = _kernel(q.index_select(0, ends), k, v, batch, cache, layer, scale, one_each)
        else:
            keys, values = _keys_values(k, v, batch, cache, layer)
            out = _causal_varlen(q.index_select(0, ends), keys, values, one_each, batch, 1, scale)
        return out.reshape(chunks, heads * dim).index_select(0, batch.last_chunk)
    keys, values = _keys_values(k, v, batch, cache, layer)
    q = q.index_select(0, batch.last_index)
    chunks, _, lq, lk = batch.key_mask.shape
    kp = keys.view(chunks, lk, kv_heads, dim).index_select(0, batch.last_chunk).transpose(1, 2)
    vp = values.view(chunks, lk, kv_heads, dim).index_select(0, batch.last_chunk).transpose(1, 2)
    mask = batch.key_mask.view(chunks, lq, lk)[batch.last_chunk, batch.last_slot][:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None], kp, vp, attn_mask=mask, scale=scale,
                                         enable_gqa=heads != kv_heads)
    return out.reshape(q.shape[0], heads * dim)


def _causal_varlen(q, keys, values, cu_q, batch: ChunkBatch, max_q: int, scale: float) -> torch.Tensor:
    """Flash attention of the chunks' queries (``cu_q``) over their keys (``batch.cu_seqlens_k``), causal with the
    queries aligned to the last keys (query i of a chunk of n sees its first ``len(keys) - n + i + 1`` keys)."""
    return varlen_attn(q, keys, values, cu_q, batch.cu_seqlens_k, max_q, batch.max_seqlen_k, scale=scale,
                        window_size=(-1, 0), enable_gqa=q.shape[1] != keys.shape[1])
