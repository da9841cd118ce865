"""Stage 2: plan batches of whole pages. Plain host-side integers; no tensors here.

A batch's token stream is its pairs laid end to end with no padding, rounded up to whole pages of
``page_size`` tokens; a batch holds at most ``max_pages`` pages. Pairs are taken longest first so that
the pairs sharing a batch have similar lengths: attention, which runs per pair, then wastes little.
"""
from __future__ import annotations

import numpy as np


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def plan_batches(
    lengths: np.ndarray,
    page_size: int,
    max_pages: int,
    max_pairs: int | None = None,
) -> list[np.ndarray]:
    """Split pair indices into batches, longest pairs first.

    Each batch keeps ``pages_for(sum(lengths)) <= max_pages`` and ``len(batch) * max(lengths) <=
    2 * max_pages * page_size`` (the padded per-pair attention scratch), and at most ``max_pairs`` pairs.
    """
    budget = max_pages * page_size
    assert len(lengths) == 0 or int(lengths.max()) <= budget, (int(lengths.max()), budget)
    order = np.argsort(-lengths, kind="stable")  # ties keep input order: plans are deterministic
    batches, start, tokens, longest = [], 0, 0, 0
    for k, i in enumerate(order.tolist()):
        n = int(lengths[i])
        count = k - start
        if count and (
            pages_for(tokens + n, page_size) > max_pages
            or (count + 1) * longest > 2 * budget
            or (max_pairs is not None and count == max_pairs)
        ):
            batches.append(order[start:k])
            start, tokens, longest = k, 0, 0
        tokens += n
        longest = max(longest, n)
    if start < len(order):
        batches.append(order[start:])
    return batches
