"""The decoders' engine: blocks of input pairs are tokenized (``engine.Engine``'s loop), their shared prefixes found
on token ids (``prefix``) and computed once into the paged KV cache, level by level, then every pair's own tokens
run as chunks over the cached pages, packed under the token budget; the last token of each pair gives its logits,
in the caller's order.

The cache holds only shared prefixes (nothing attends to a pair's own tokens after its chunk ran), and at most about
``CACHE_BATCHES`` batches' worth at a time: a block's prefix tree runs in groups of whole subtrees that fit.
"""
from __future__ import annotations

import numpy as np
import torch

from ..engine import Budget, CallOptions, Engine, run_order
from ..pages import pages_for
from ..runner import ModelRunner
from ..tokenize import Encodings
from .chunks import Chunk, pack_chunks
from .kv_cache import KVCache
from .prefix import Node, no_sharing, prefix_tree, split_long

CACHE_BATCHES = 4  # shared-prefix tokens cached at once, in token budgets


def _groups(nodes: list[Node], budget: int, page_size: int) -> list[list[int]]:
    """Node indices in groups of whole subtrees (a root and what lies below it) whose shared nodes take at most
    ``budget`` cache slots together (a single larger subtree is a group of its own). Nodes are parents first."""
    root_of = np.empty(len(nodes), dtype=np.int64)
    for i, node in enumerate(nodes):
        root_of[i] = i if node.parent < 0 else root_of[node.parent]
    cost: dict[int, int] = {}
    for i, node in enumerate(nodes):
        if node.pair < 0:
            cost[int(root_of[i])] = cost.get(int(root_of[i]), 0) + pages_for(node.length, page_size) * page_size
    members: dict[int, list[int]] = {}
    for i in range(len(nodes)):
        members.setdefault(int(root_of[i]), []).append(i)
    groups, current, used = [], [], 0
    for root, idx in members.items():
        c = cost.get(root, 0)
        if current and used + c > budget:
            groups.append(current)
            current, used = [], 0
        current.extend(idx)
        used += c
    if current:
        groups.append(current)
    return groups


def trim_trailing(enc: Encodings, token: int) -> Encodings:
    """``enc`` without each pair's trailing ``token``s (a pair of nothing else keeps its first token)."""
    ends = enc.offsets[1:].copy()
    for i in np.flatnonzero(enc.ids[ends - 1] == token):
        while ends[i] - 1 > enc.offsets[i] and enc.ids[ends[i] - 1] == token:
            ends[i] -= 1
    if (ends == enc.offsets[1:]).all():
        return enc
    keep = np.concatenate([np.arange(a, b) for a, b in zip(enc.offsets[:-1], ends)])
    offsets = np.zeros_like(enc.offsets)
    np.cumsum(ends - enc.offsets[:-1], out=offsets[1:])
    return Encodings(enc.ids[keep], None, offsets, enc.owner)


class DecoderEngine(Engine):
    """Each block's pairs as chunks over the paged KV cache ``cache``: shared prefixes (``share_prefix``) computed once
    into it, then every pair's own tokens. ``pooled_past``: a token id that a pair's logits are read before
    (transformers' sequence classifiers read the last token that is not the pad id): trailing runs of it are dropped,
    which under causal attention changes nothing before them."""

    def __init__(self, runner: ModelRunner, budget: Budget, cache: KVCache, *, share_prefix: bool = True,
                 pooled_past: int | None = None):
        super().__init__(runner, budget)
        self.cache = cache
        self.share_prefix = share_prefix
        self.pooled_past = pooled_past

    def prepared(self, enc: Encodings) -> Encodings:
        return enc if self.pooled_past is None else trim_trailing(enc, self.pooled_past)

    def release(self) -> None:
        self.cache.allocator.reset()  # an interrupted run leaves no page held: the next call starts from an empty cache

    def run_block(self, enc: Encodings, options: CallOptions, bar) -> torch.Tensor:
        """(rows, num_labels) logits of one block of pairs on the model's device, its rows in the order
        ``engine.run_order`` runs them."""
        runner, b, counts = self.runner, self.budget, self.counts
        out = torch.empty(len(enc), b.num_labels, dtype=torch.float32, device=runner.device)
        last = enc.last_rows()  # a pair is done when its last window is
        for rows, part in run_order(enc):
            nodes = prefix_tree(part, min_shared=b.page_size) if self.share_prefix else no_sharing(part)
            nodes = split_long(nodes, b.max_pages * b.page_size)
            counts.total += int(part.lengths.sum())
            counts.computed += sum(node.length for node in nodes)
            scored = out if rows is None else torch.empty(len(part), b.num_labels, dtype=torch.float32,
                                                            device=runner.device)
            for group in _groups(nodes, CACHE_BATCHES * b.max_pages * b.page_size, b.page_size):
                leaves = self._run_group(part, nodes, group, scored, options.batch_size)
                bar.update(int(last[leaves if rows is None else rows[leaves]].sum()))
            if rows is not None:
                out[torch.from_numpy(rows).to(runner.device)] = scored
        return out

    def _run_group(self, enc: Encodings, nodes: list[Node], group: list[int], out: torch.Tensor,
                   batch_size: int | None) -> np.ndarray:
        """Run one group of subtrees: shared nodes level by level into the cache, then the leaves; returns the rows it
        scored."""
        cache, page_size = self.cache, self.budget.page_size
        ids = lambda node: enc.ids[enc.offsets[node.seq] + node.start : enc.offsets[node.seq] + node.stop]
        shared = [i for i in group if nodes[i].pair < 0]
        leaves = [i for i in group if nodes[i].pair >= 0]
        # Each shared node's pages, and each node's context: its ancestors' slots (its page table's, end to end).
        pages: dict[int, list[int]] = {}
        context: dict[int, np.ndarray] = {}
        table: dict[int, list[int]] = {}  # the pages of a node's ancestors
        cache.reserve(sum(pages_for(nodes[i].length, page_size) for i in shared))
        for i in group:
            parent = nodes[i].parent
            context[i] = np.zeros(0, dtype=np.int64) if parent < 0 else np.concatenate(
                [context[parent], cache.slots_of(pages[parent], nodes[parent].length)])
            table[i] = [] if parent < 0 else table[parent] + pages[parent]
            if nodes[i].pair < 0:
                pages[i] = cache.allocator.allocate(pages_for(nodes[i].length, page_size))
        for i in leaves:  # every pair's page table holds its ancestors' pages until it has run
            if table[i]:
                cache.allocator.share(table[i])
        for level in sorted({nodes[i].level for i in shared}):
            chunks = [Chunk(ids(nodes[i]), context[i], cache.slots_of(pages[i], nodes[i].length))
                      for i in shared if nodes[i].level == level]
            self._run_chunks(chunks, batch_size, None)
        chunks = [Chunk(ids(nodes[i]), context[i], None, nodes[i].pair) for i in leaves]
        self._run_chunks(chunks, batch_size, out)
        for i in leaves:
            if table[i]:
                cache.allocator.release(table[i])
        for i in shared:
            cache.allocator.release(pages[i])
        return np.array([nodes[i].pair for i in leaves], dtype=np.int64)


    def _run_chunks(self, chunks: list[Chunk], batch_size: int | None, out: torch.Tensor | None) -> None:
        """Run ``chunks`` in batches under the token budget; logits of the chunks that end pairs go to ``out``."""
        if not chunks:
            return
        runner, cache, b = self.runner, self.cache, self.budget
        page_size, max_pages = b.page_size, b.max_pages
        lengths = np.array([len(c.tokens) for c in chunks], dtype=np.int64)
        cached = cache if cache.slots else None
        for batch_chunks in runner.plan(lengths, page_size, max_pages, batch_size):
            batch = pack_chunks([chunks[c] for c in batch_chunks], page_size, b.pad_token_id,
                                cache_slots=cache.slots if cached is not None else 0,
                                total_tokens=runner.chunk_tokens(int(lengths[batch_chunks].sum()), page_size,
                                                                 max_pages),
                                layout="varlen" if runner.choices.attends_packed else "padded")
            logits = runner(batch, cached)
            if out is not None:
                rows = torch.from_numpy(batch.pairs).to(runner.device, non_blocking=True)
                out[rows] = logits.float()
