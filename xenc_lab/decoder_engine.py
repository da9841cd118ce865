"""The decoders' pipeline: windows of pairs are tokenized, their shared prefixes found on token ids (``prefix``) and
computed once into the paged KV cache, level by level, then every pair's own tokens run as chunks over the cached
pages, packed under the token budget; the last token of each pair gives its logits, in the caller's order.

The cache holds only shared prefixes (nothing attends to a pair's own tokens after its chunk ran), and at most about
``CACHE_BATCHES`` batches' worth at a time: a window's prefix tree runs in groups of whole subtrees that fit.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from .chunks import Chunk, pack_chunks
from .engine import gathered, run_order, tokenized_windows
from .kv_cache import KVCache
from .pages import pages_for
from .prefix import Node, no_sharing, prefix_tree, split_long
from .runner import ModelRunner
from .tokenize import Encodings

CACHE_BATCHES = 4  # shared-prefix tokens cached at once, in token budgets


@dataclass
class TokenCounts:
    """Tokens of the pairs scored (``total``) and tokens the model ran (``computed``): their ratio is the gain that
    sharing prefixes can give at best."""

    total: int = 0
    computed: int = 0

    @property
    def saved(self) -> float:
        return 1 - self.computed / self.total if self.total else 0.0


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


def run_decoder_pairs(
    tokenize: Callable[..., Encodings],
    runner: ModelRunner,
    cache: KVCache,
    text_1: list[str],
    text_2: list[str],
    *,
    num_labels: int,
    page_size: int,
    max_pages: int,
    pad_token_id: int,
    share_prefix: bool = True,
    batch_size: int | None = None,
    max_length: int | None = None,
    show_progress_bar: bool = False,
    counts: TokenCounts | None = None,
    pooled_past: int | None = None,
) -> tuple[torch.Tensor, np.ndarray | None]:
    """(rows, num_labels) float32 logits on the CPU, in the caller's order, and the pair each row scores (None: row i
    is pair i), as ``engine.run_pairs`` returns them. ``counts`` (if given) adds up the tokens scored and computed.
    ``pooled_past``: a token id that a pair's logits are read before (transformers' sequence classifiers read the last
    token that is not the pad id): trailing runs of it are dropped, which under causal attention changes nothing
    before them."""
    n = len(text_1)
    parts, owners = [], []
    counts = counts if counts is not None else TokenCounts()
    with tqdm(total=n, desc="Scoring pairs", unit="pair", disable=not show_progress_bar) as bar:
        try:
            for start, enc in tokenized_windows(tokenize, text_1, text_2, max_length):
                if pooled_past is not None:
                    enc = trim_trailing(enc, pooled_past)
                parts.append(_run_window(enc, runner, cache, bar, counts, num_labels, page_size, max_pages,
                                         pad_token_id, share_prefix, batch_size))
                owners.append(None if enc.owner is None else enc.owner + start)
        finally:  # an interrupted run leaves no page held: the next call starts from an empty cache
            cache.allocator.reset()
    return gathered(parts, owners, num_labels)


def _run_window(enc, runner, cache, bar, counts, num_labels, page_size, max_pages, pad_token_id, share_prefix,
                batch_size) -> torch.Tensor:
    """(rows, num_labels) logits of one window of pairs on the model's device, its rows in the order
    ``engine.run_order`` runs them."""
    out = torch.empty(len(enc), num_labels, dtype=torch.float32, device=runner.device)
    last = enc.last_rows()  # a pair is done when its last window is
    for rows, part in run_order(enc):
        nodes = prefix_tree(part, min_shared=page_size) if share_prefix else no_sharing(part)
        nodes = split_long(nodes, max_pages * page_size)
        counts.total += int(part.lengths.sum())
        counts.computed += sum(node.length for node in nodes)
        scored = out if rows is None else torch.empty(len(part), num_labels, dtype=torch.float32,
                                                        device=runner.device)
        for group in _groups(nodes, CACHE_BATCHES * max_pages * page_size, page_size):
            leaves = _run_group(part, nodes, group, runner, cache, scored, page_size, max_pages, pad_token_id,
                                batch_size)
            bar.update(int(last[leaves if rows is None else rows[leaves]].sum()))
        if rows is not None:
            out[torch.from_numpy(rows).to(runner.device)] = scored
    return out


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


def _run_group(enc, nodes, group, runner, cache, out, page_size, max_pages, pad_token_id, batch_size) -> np.ndarray:
    """Run one group of subtrees: shared nodes level by level into the cache, then the leaves; returns the rows it
    scored."""
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
        _run_chunks(chunks, runner, cache, page_size, max_pages, pad_token_id, batch_size, None)
    chunks = [Chunk(ids(nodes[i]), context[i], None, nodes[i].pair) for i in leaves]
    _run_chunks(chunks, runner, cache, page_size, max_pages, pad_token_id, batch_size, out)
    for i in leaves:
        if table[i]:
            cache.allocator.release(table[i])
    for i in shared:
        cache.allocator.release(pages[i])
    return np.array([nodes[i].pair for i in leaves], dtype=np.int64)


def _bucketed_tokens(tokens: int, runner: ModelRunner, page_size: int, max_pages: int) -> int | None:
    """The stream length of a batch of ``tokens`` real tokens: on the CPU (bucketed shapes, which bound the GEMM
    shapes oneDNN keeps) whole pages up to a 16th of the budget, then a multiple of a 64th of the budget: at most
    about 80 lengths. A decoder's batches are often small (a shared prefix, a rerank's last documents): the
    encoders' eighths would pad them to several times their size."""
    if runner.batch_shapes != "bucketed":
        return None
    pages = -(-tokens // page_size)
    step = 1 if pages <= max_pages // 16 else max(1, max_pages // 64)
    return min(-(-pages // step) * step, max_pages) * page_size


def _run_chunks(chunks, runner, cache, page_size, max_pages, pad_token_id, batch_size, out) -> None:
    """Run ``chunks`` in batches under the token budget; logits of the chunks that end pairs go to ``out``."""
    if not chunks:
        return
    lengths = np.array([len(c.tokens) for c in chunks], dtype=np.int64)
    cached = cache if cache.slots else None
    for batch_chunks in runner.plan(lengths, page_size, max_pages, batch_size):
        batch = pack_chunks([chunks[c] for c in batch_chunks], page_size, pad_token_id,
                            cache_slots=cache.slots if cached is not None else 0,
                            total_tokens=_bucketed_tokens(int(lengths[batch_chunks].sum()), runner, page_size,
                                                          max_pages),
                            layout="varlen" if runner.choices.attends_packed else "padded")
        logits = runner(batch, cached)
        if out is not None:
            rows = torch.from_numpy(batch.pairs).to(runner.device, non_blocking=True)
            out[rows] = logits.float()
