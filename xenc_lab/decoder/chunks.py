"""Decoders' stage 3: pack chunks of sequences into one token stream that attends to a paged KV cache.

A chunk is a run of one sequence's tokens at absolute positions [start, start + len): it attends to its context
(the sequence's earlier tokens, whose keys and values are already in the cache, ``kv_cache``) and causally to its
own tokens. A pair with nothing shared is one chunk with no context; a pair whose prefix another pair shares is a
chunk of its own tokens over the prefix's cached pages (``prefix``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..batch import StreamBatch, rows_for
from ..pages import ATTENTION_ALIGN, pages_for


@dataclass(slots=True)
class Chunk:
    """One chunk to run: its token ids, the cache slots of its context (``len(context)`` is its start position), the
    cache slots its own keys and values are stored at (None: not stored, nothing attends to it later) and the pair
    whose logits its last token gives (-1: none, a shared prefix)."""

    tokens: np.ndarray  # (n,) int64
    context: np.ndarray  # (start,) int64 cache slots
    slots: np.ndarray | None = None  # (n,) int64 cache slots, or None
    pair: int = -1

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, dtype=np.int64)
        self.context = np.asarray(self.context, dtype=np.int64)
        assert len(self.tokens) > 0
        assert self.slots is None or len(self.slots) == len(self.tokens), (len(self.slots), len(self.tokens))


@dataclass(slots=True)
class ChunkBatch(StreamBatch):
    """C chunks laid end to end as one stream of T tokens (T a whole number of pages; tokens past ``num_tokens`` are
    filler). Key slots index the cache's S slots followed by the stream's T tokens. In the "padded" layout attention
    lays queries out as (C, Lq) and keys as (C, Lk), with a mask; in the "varlen" layout (flash attention over
    cu_seqlens, CUDA) each chunk's keys lie end to end, ``cu_seqlens_k`` apart, and the padded fields are empty."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, absolute positions in each chunk's sequence
    cu_seqlens: torch.Tensor  # (C + 1,) int32, chunk c is stream tokens cu_seqlens[c]:cu_seqlens[c + 1]
    max_seqlen: int  # Lq: the longest chunk, rounded up to a multiple of ATTENTION_ALIGN
    pad_index: torch.Tensor  # (C * Lq,) int64, the stream token at each (chunk, query slot); past a chunk: its first
    unpad_index: torch.Tensor  # (T,) int64, the (chunk, query slot) of each stream token; filler: 0
    key_index: torch.Tensor  # (C * Lk,) int64, the key at each (chunk, key slot): cache slot s -> s, stream t -> S + t;
    # "varlen": (K,), each chunk's context and own keys end to end
    key_mask: torch.Tensor  # (C, 1, Lq, Lk) bool, True where a query slot may see a key slot (context, causal own)
    cu_seqlens_k: torch.Tensor  # "varlen": (C + 1,) int32, chunk c's keys are key_index[cu_seqlens_k[c]:...[c + 1]]
    max_seqlen_k: int  # "varlen": the most keys a chunk has
    layout: str  # "padded" | "varlen"
    cache_slots: int  # S: the size of the cache this batch was packed for
    write_index: torch.Tensor  # (W,) int64, stream tokens whose keys and values the cache keeps ...
    write_slots: torch.Tensor  # (W,) int64, ... at these slots
    last_index: torch.Tensor  # (R,) int64, R >= P: the last token of each chunk that ends a pair, then filler rows
    last_chunk: torch.Tensor  # (R,) int64, the chunk of each of those rows ...
    last_slot: torch.Tensor  # (R,) int64, ... and its query slot there
    pairs: np.ndarray  # (P,) the pair each of those chunks ends
    num_tokens: int  # real tokens, without the filler

    @property
    def sequences(self) -> int:
        return self.cu_seqlens.shape[0] - 1  # C


def _aligned(n: int) -> int:
    return pages_for(n, ATTENTION_ALIGN) * ATTENTION_ALIGN


def pack_chunks(
    chunks: list[Chunk],
    page_size: int,
    pad_token_id: int = 0,
    cache_slots: int = 0,
    total_tokens: int | None = None,
    layout: str = "padded",
) -> ChunkBatch:
    """Lay ``chunks`` end to end, the stream rounded up to whole pages of ``page_size`` tokens (or to
    ``total_tokens``, a fixed shape); ``cache_slots`` is the size of the KV cache their context slots index.
    ``layout``: how attention reads them, "padded" or "varlen" (see ChunkBatch)."""
    assert layout in ("padded", "varlen"), layout
    lens = np.array([len(c.tokens) for c in chunks], dtype=np.int64)
    ctx = np.array([len(c.context) for c in chunks], dtype=np.int64)
    n_real = int(lens.sum())
    total = pages_for(n_real, page_size) * page_size
    if total_tokens is not None:
        assert total_tokens >= total, (total_tokens, total)
        total = total_tokens
    starts = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lens, out=starts[1:])
    n_chunks = len(chunks)

    input_ids = np.full(total, pad_token_id, dtype=np.int64)
    positions = np.zeros(total, dtype=np.int64)
    if n_chunks:
        input_ids[:n_real] = np.concatenate([c.tokens for c in chunks])
        within = np.arange(n_real, dtype=np.int64) - np.repeat(starts[:-1], lens)
        positions[:n_real] = within + np.repeat(ctx, lens)
    else:
        within = np.zeros(0, dtype=np.int64)

    # Each chunk's keys: the context's cache slots, then its own tokens in the stream.
    keys = [np.concatenate([chunk.context, cache_slots + starts[c] + np.arange(lens[c])])
            for c, chunk in enumerate(chunks)]
    key_lens = ctx + lens
    if layout == "varlen":
        lq = int(lens.max()) if n_chunks else 1
        empty = np.zeros(0, dtype=np.int64)
        pad_index, unpad_index, key_mask = empty, empty, np.zeros((0, 1, 1, 0), dtype=bool)
        key_index = np.concatenate(keys) if n_chunks else empty
        cu_k = np.zeros(n_chunks + 1, dtype=np.int64)
        np.cumsum(key_lens, out=cu_k[1:])
        max_k = int(key_lens.max()) if n_chunks else 0
    else:
        # Queries (C, Lq): slots past a chunk's end repeat its first token.
        lq = _aligned(int(lens.max()) if n_chunks else 1)
        slot_q = np.arange(lq, dtype=np.int64)
        pad_index = np.where(slot_q[None, :] < lens[:, None], starts[:-1, None] + slot_q[None, :], starts[:-1, None])
        unpad_index = np.zeros(total, dtype=np.int64)
        unpad_index[:n_real] = np.repeat(np.arange(n_chunks, dtype=np.int64), lens) * lq + within
        # Keys (C, Lk); padding repeats a chunk's first own key.
        lk = _aligned(int(key_lens.max()) if n_chunks else 1)
        key_index = np.empty((n_chunks, lk), dtype=np.int64)
        for c in range(n_chunks):
            key_index[c, : key_lens[c]] = keys[c]
            key_index[c, key_lens[c] :] = cache_slots + starts[c]
        key_index = key_index.reshape(-1)
        # Query slot i of chunk c sees keys j <= ctx + i (its context and its own tokens up to itself); a padding
        # query slot sees what the chunk's last token sees, so that no row is all masked.
        slot_k = np.arange(lk, dtype=np.int64)
        seen = ctx[:, None] + np.minimum(slot_q[None, :], lens[:, None] - 1)  # (C, Lq)
        key_mask = (slot_k[None, None, :] <= seen[:, :, None])[:, None]
        cu_k, max_k = np.zeros(0, dtype=np.int64), 0

    stored = [c for c in range(n_chunks) if chunks[c].slots is not None]
    write_index = np.concatenate([starts[c] + np.arange(lens[c]) for c in stored]) if stored else np.zeros(0, np.int64)
    write_slots = np.concatenate([chunks[c].slots for c in stored]).astype(np.int64) if stored else np.zeros(0, np.int64)

    scored = np.array([c for c in range(n_chunks) if chunks[c].pair >= 0], dtype=np.int64)
    filler = rows_for(len(scored)) - len(scored)  # repeats of the first scored chunk's row
    row_chunks = np.concatenate([scored, np.full(filler, scored[0] if len(scored) else 0, dtype=np.int64)])
    rows = starts[1:][row_chunks] - 1 if n_chunks else np.zeros(len(row_chunks), dtype=np.int64)
    row_slots = lens[row_chunks] - 1 if n_chunks else np.zeros(len(row_chunks), dtype=np.int64)
    return ChunkBatch(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        cu_seqlens=torch.from_numpy(starts.astype(np.int32)),
        max_seqlen=int(lq),
        pad_index=torch.from_numpy(pad_index.reshape(-1)),
        unpad_index=torch.from_numpy(unpad_index),
        key_index=torch.from_numpy(key_index),
        key_mask=torch.from_numpy(np.ascontiguousarray(key_mask)),
        cu_seqlens_k=torch.from_numpy(cu_k.astype(np.int32)),
        max_seqlen_k=max_k,
        layout=layout,
        cache_slots=int(cache_slots),
        write_index=torch.from_numpy(write_index),
        write_slots=torch.from_numpy(write_slots),
        last_index=torch.from_numpy(rows.astype(np.int64)),
        last_chunk=torch.from_numpy(row_chunks),
        last_slot=torch.from_numpy(row_slots.astype(np.int64)),
        pairs=np.array([chunks[c].pair for c in scored], dtype=np.int64),
        num_tokens=n_real,
    )
