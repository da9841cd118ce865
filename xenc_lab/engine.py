"""The pipeline driven end to end: windows of pairs are tokenized (stage 1), planned into batches (2), packed (3)
and run (4); the logits gather in the caller's order. Memory is bounded by the window and the token budget."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from tqdm.auto import tqdm

from .batch import pack
from .runner import ModelRunner
from .tokenize import Encodings

WINDOW = 1024  # pairs tokenized and scheduled together: memory is bounded by this, not by the input


def tokenized_windows(
    tokenize: Callable[..., Encodings], text_1: list[str], text_2: list[str], max_length: int | None = None
) -> Iterator[tuple[int, Encodings]]:
    """Yield (start, Encodings) per window of pairs; the next window is tokenized in a background thread while the
    caller runs the model on this one (the tokenizer releases the GIL)."""
    starts = range(0, len(text_1), WINDOW)
    window = lambda start: (text_1[start : start + WINDOW], text_2[start : start + WINDOW], max_length)
    if len(starts) <= 1:
        yield from ((start, tokenize(*window(start))) for start in starts)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="xenc-tokenize") as pool:
        pending = pool.submit(tokenize, *window(starts[0]))
        for i, start in enumerate(starts):
            enc = pending.result()
            if i + 1 < len(starts):
                pending = pool.submit(tokenize, *window(starts[i + 1]))
            yield start, enc


def run_pairs(
    tokenize: Callable[..., Encodings],
    runner: ModelRunner,
    text_1: list[str],
    text_2: list[str],
    *,
    num_labels: int,
    page_size: int,
    max_pages: int,
    pad_token_id: int,
    batch_size: int | None = None,
    max_length: int | None = None,
    show_progress_bar: bool = False,
) -> tuple[torch.Tensor, np.ndarray | None]:
    """(rows, num_labels) float32 logits on the CPU, in the caller's order, and the pair each row scores (None: row i
    is pair i; a tokenizer that makes windows of long documents makes several rows of a pair).

    The logits gather on the model's device and come back in one copy at the end: on CUDA the host packs the next
    batch while the GPU runs this one (a copy back per batch would wait for each)."""
    n = len(text_1)
    parts, owners = [], []
    with tqdm(total=n, desc="Scoring pairs", unit="pair", disable=not show_progress_bar) as bar:
        for start, enc in tokenized_windows(tokenize, text_1, text_2, max_length):
            out = torch.empty(len(enc), num_labels, dtype=torch.float32, device=runner.device)
            last = enc.last_rows()  # a pair is done when its last window is
            for rows, part in run_order(enc):
                for pairs in runner.plan(part.lengths, page_size, max_pages, batch_size):
                    shape = runner.batch_shape(part.lengths[pairs], page_size, max_pages)
                    batch = pack(part, pairs, page_size, pad_token_id, shape)
                    pairs = pairs if rows is None else rows[pairs]
                    index = torch.from_numpy(pairs).to(runner.device, non_blocking=True)
                    out[index] = runner(batch).float()  # queued before a CUDA graph's next replay reuses it
                    bar.update(int(last[pairs].sum()))
            parts.append(out)
            owners.append(None if enc.owner is None else enc.owner + start)
    return gathered(parts, owners, num_labels)


def run_order(enc: Encodings) -> list[tuple[np.ndarray | None, Encodings]]:
    """The rows of a window of pairs as they run, (rows, their Encodings): all at once (rows None), or with windows of
    long documents the pairs' first windows, batched as the truncated pairs alone are (their scores are then the
    same bit for bit: a pair's score may depend on its batch's size by a rounding), then the further windows."""
    if enc.owner is None:
        return [(None, enc)]
    first = enc.first_rows()
    return [(rows, enc.take(rows)) for rows in (np.flatnonzero(first), np.flatnonzero(~first)) if len(rows)]


def gathered(parts: list[torch.Tensor], owners: list, num_labels: int) -> tuple[torch.Tensor, np.ndarray | None]:
    """The windows of pairs' logits as one CPU tensor, and their rows' pairs (None where every row is its pair)."""
    logits = torch.cat(parts).cpu() if parts else torch.empty(0, num_labels)
    if all(owner is None for owner in owners):
        return logits, None
    assert all(owner is not None for owner in owners), "a call's windows of pairs are all windowed or none"
    return logits, np.concatenate(owners)
