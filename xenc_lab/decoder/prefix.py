"""Shared prefixes of an input block's pairs, found on token ids: a prefix tree whose inner nodes are token runs that
two or more pairs begin with, computed once into the KV cache, and whose leaves are each pair's own tokens.

Ids, not strings: tokenization can merge across the boundary of a query and a document (a query's last punctuation
with the newline after it), so the shared part is whatever the pairs' ids have in common, found by sorting them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..tokenize import Encodings


@dataclass(slots=True)
class Node:
    """Tokens ``start:stop`` of pair ``seq``'s ids. A leaf ends pair ``pair``; an inner node (``pair`` -1) is a prefix
    of every pair below it. ``parent`` is the node just above (-1: none), ``level`` the number of nodes above."""

    start: int
    stop: int
    parent: int
    pair: int
    seq: int
    level: int

    @property
    def length(self) -> int:
        return self.stop - self.start


def no_sharing(enc: Encodings) -> list[Node]:
    """Every pair one leaf, from its first token."""
    return [Node(0, int(n), -1, i, i, 0) for i, n in enumerate(enc.lengths)]


def prefix_tree(enc: Encodings, min_shared: int) -> list[Node]:
    """The block's pairs as a prefix tree, parents before children. A run of tokens becomes a shared node when at
    least two pairs begin with it and it is at least ``min_shared`` tokens long (shorter ones cost more passes and
    page ends than they save); every pair keeps at least its last token for its own leaf, whose logits score it."""
    n = len(enc)
    seqs = [enc.ids[enc.offsets[i] : enc.offsets[i + 1]] for i in range(n)]
    order = sorted(range(n), key=lambda i: seqs[i].tolist())
    lengths = np.array([len(seqs[i]) for i in order], dtype=np.int64)
    nodes: list[Node] = []

    def common(a: np.ndarray, b: np.ndarray, start: int) -> int:
        # The first position from ``start`` where a and b differ (or the shorter one's end).
        m = min(len(a), len(b))
        diff = np.flatnonzero(a[start:m] != b[start:m])
        return start + int(diff[0]) if len(diff) else m

    # An explicit stack of (lo, hi, depth, parent, level, node_start): sorted ranges whose pairs share ids up to depth.
    stack = [(0, n, 0, -1, 0, 0)]
    while stack:
        lo, hi, depth, parent, level, node_start = stack.pop()
        if hi - lo == 1:
            i = order[lo]
            nodes.append(Node(node_start, len(seqs[i]), parent, i, i, level))
            continue
        # The common prefix of a sorted range is that of its first and last members; each pair keeps a token.
        shared = min(common(seqs[order[lo]], seqs[order[hi - 1]], depth), int(lengths[lo:hi].min()) - 1)
        if shared - node_start >= min_shared:
            nodes.append(Node(node_start, shared, parent, -1, order[lo], level))
            parent, level, node_start = len(nodes) - 1, level + 1, shared
        # Split the range by the token at ``shared``. In a group, the pairs that end with that token sort first
        # (a prefix sorts before what extends it): they are leaves; the rest share that token too and go on.
        keys = [int(seqs[order[k]][shared]) for k in range(lo, hi)]
        bounds = [lo] + [lo + k for k in range(1, hi - lo) if keys[k] != keys[k - 1]] + [hi]
        for a, b in reversed(list(itertools.pairwise(bounds))):
            ends = a
            while ends < b and lengths[ends] == shared + 1:
                ends += 1
            if ends < b:
                stack.append((ends, b, shared + 1, parent, level, node_start))
            for k in range(ends - 1, a - 1, -1):
                stack.append((k, k + 1, shared, parent, level, node_start))
    return nodes


def split_long(nodes: list[Node], limit: int) -> list[Node]:
    """``nodes`` with every node longer than ``limit`` tokens cut into a chain of nodes of at most ``limit`` (all but
    the last cached, as shared nodes are): a pair longer than the token budget runs in chunks, each over the cached
    ones before it. Parents stay before children."""
    if all(node.length <= limit for node in nodes):
        return nodes
    out: list[Node] = []
    last_piece: dict[int, int] = {}  # old index -> new index of its last piece
    for i, node in enumerate(nodes):
        parent = -1 if node.parent < 0 else last_piece[node.parent]
        level = 0 if parent < 0 else out[parent].level + 1
        start = node.start
        while node.stop - start > limit:
            out.append(Node(start, start + limit, parent, -1, node.seq, level))
            parent, level, start = len(out) - 1, level + 1, start + limit
        out.append(Node(start, node.stop, parent, node.pair, node.seq, level))
        last_piece[i] = len(out) - 1
    return out
