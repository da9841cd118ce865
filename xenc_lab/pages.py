"""Stage 2: plan batches of whole pages, and the shapes they are padded to. Plain host-side integers; no tensors here.

A batch's token stream is its pairs laid end to end with no padding, rounded up to whole pages of
``page_size`` tokens; a batch holds at most ``max_pages`` pages. Pairs are taken longest first so that
the pairs sharing a batch have similar lengths: attention laid out per pair, padded to the batch's longest
pair, then wastes little.
"""
from __future__ import annotations

import numpy as np

ATTENTION_SLACK = 1.1  # padded attention slots per real token a batch may hold, where attention is laid out padded
ATTENTION_ALIGN = 8  # the per-pair attention layout's length L is a multiple of this (measured: 8 beats 1 and 16)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def plan_batches(
    lengths: np.ndarray,
    page_size: int,
    max_pages: int,
    max_pairs: int | None = None,
    slack: float | None = ATTENTION_SLACK,
) -> list[np.ndarray]:
    """Split pair indices into batches, longest pairs first.

    Each batch keeps ``pages_for(sum(lengths)) <= max_pages`` and at most ``max_pairs`` pairs. Where attention
    runs on a (pairs, longest) padded layout, a batch also keeps that layout within ``slack`` times its real
    tokens: long pairs are not batched with much shorter ones. ``slack=None`` (attention on the packed stream,
    whose work does not depend on batchmates) fills each batch up to the budget: fewer, fuller batches.
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
            or (slack is not None and (count + 1) * longest > slack * (tokens + n))
            or (max_pairs is not None and count == max_pairs)
        ):
            batches.append(order[start:k])
            start, tokens, longest = k, 0, 0
        tokens += n
        longest = max(longest, n)
    if start < len(order):
        batches.append(order[start:])
    return batches


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


# Both bucketing policies live here: ``bucket_shape`` for encoders' batches of pairs (tokens, pairs and the attention
# length quantized together) and ``bucket_tokens`` for decoders' batches of chunks (the stream length alone).
def bucket_shape(
    tokens: int,
    pairs: int,
    longest: int,
    page_size: int,
    max_pages: int,
    bucket_length: bool = True,
) -> tuple[int, int, int]:
    """Quantize a batch's (tokens, pairs, attention length) to a few shapes.

    Tokens go up to a multiple of an eighth of the budget (never past it), pairs up to a power of two, and, where
    ``bucket_length``, the attention length (which keeps a slot past the longest pair, see batch.pack) up to a power
    of two pages, then to a multiple of ATTENTION_ALIGN; else it stays the batch's own. A long run meets a handful of
    shapes, at most 8 token counts, and the filler costs at most an eighth of the per-token work.
    """
    pages = min(_round_up(pages_for(tokens, page_size), max(1, max_pages // 8)), max_pages)
    if bucket_length:
        length_pages = 1 << (pages_for(longest, page_size) - 1).bit_length()
        if length_pages * page_size <= longest:  # a pair exactly a power of two pages long: one more page
            length_pages += 1
        length = _round_up(length_pages * page_size, ATTENTION_ALIGN)
    else:
        length = _round_up(longest + 1, ATTENTION_ALIGN)
    return pages * page_size, 1 << (pairs - 1).bit_length(), length


def bucket_tokens(tokens: int, page_size: int, max_pages: int) -> int:
    """The stream length of a decoder's batch of ``tokens`` real tokens under bucketed shapes: whole pages up to a
    16th of the budget, then a multiple of a 64th of the budget: at most about 80 lengths. A decoder's batches are
    often small (a shared prefix, a rerank's last documents): ``bucket_shape``'s eighths would pad them to several
    times their size."""
    pages = pages_for(tokens, page_size)
    step = 1 if pages <= max_pages // 16 else max(1, max_pages // 64)
    return min(_round_up(pages, step), max_pages) * page_size
