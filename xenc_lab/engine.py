"""The pipeline driven end to end, one engine per loaded model: blocks of input pairs are tokenized (stage 1),
planned into batches (2), packed (3) and run (4); the logits gather in the caller's order. Memory is bounded by the
input block and the token budget.

``Engine`` owns the input-block loop that every family shares; ``EncoderEngine`` runs a block's pairs as packed
batches, ``decoder.engine.DecoderEngine`` as chunks over a paged KV cache. ``engines.engine_for`` builds the model
family's engine once, at load.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from .batch import pack
from .runner import ModelRunner
from .tokenize import Encodings

INPUT_BLOCK = 1024  # pairs tokenized and scheduled together: memory is bounded by this, not by the input


@dataclass(frozen=True, slots=True)
class Budget:
    """What every batch of a loaded model is packed under (the Scorer's config, fixed at load)."""

    num_labels: int
    page_size: int
    max_pages: int  # pages per batch: the token budget
    pad_token_id: int


@dataclass(frozen=True, slots=True)
class CallOptions:
    """One scoring call's options, as the Scorer hands them down."""

    batch_size: int | None = None  # pairs per batch at most (the token budget bounds them anyway)
    max_length: int | None = None  # tokens per pair (None: the tokenizer's)
    show_progress_bar: bool = False


@dataclass
class TokenCounts:
    """Tokens of the pairs scored (``total``) and tokens the model ran (``computed``): their ratio is the gain that
    sharing prefixes can give at best (decoders; an encoder's counts stay 0)."""

    total: int = 0
    computed: int = 0

    @property
    def saved(self) -> float:
        return 1 - self.computed / self.total if self.total else 0.0


def input_blocks(
    tokenize: Callable[..., Encodings], text_1: list[str], text_2: list[str], max_length: int | None = None
) -> Iterator[tuple[int, Encodings]]:
    """Yield (start, Encodings) per block of INPUT_BLOCK pairs; the next block is tokenized in a background thread
    while the caller runs the model on this one (the tokenizer releases the GIL)."""
    starts = range(0, len(text_1), INPUT_BLOCK)
    block = lambda start: (text_1[start : start + INPUT_BLOCK], text_2[start : start + INPUT_BLOCK], max_length)
    if len(starts) <= 1:
        yield from ((start, tokenize(*block(start))) for start in starts)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="xenc-tokenize") as pool:
        pending = pool.submit(tokenize, *block(starts[0]))
        for i, start in enumerate(starts):
            enc = pending.result()
            if i + 1 < len(starts):
                pending = pool.submit(tokenize, *block(starts[i + 1]))
            yield start, enc


def run_order(enc: Encodings) -> list[tuple[np.ndarray | None, Encodings]]:
    """The rows of a block of pairs as they run, (rows, their Encodings): all at once (rows None), or with windows of
    long documents the pairs' first windows, batched as the truncated pairs alone are (their scores are then the
    same bit for bit: a pair's score may depend on its batch's size by a rounding), then the further windows."""
    if enc.owner is None:
        return [(None, enc)]
    first = enc.first_rows()
    return [(rows, enc.take(rows)) for rows in (np.flatnonzero(first), np.flatnonzero(~first)) if len(rows)]


def gathered(parts: list[torch.Tensor], owners: list, num_labels: int) -> tuple[torch.Tensor, np.ndarray | None]:
    """The blocks of pairs' logits as one CPU tensor, and their rows' pairs (None where every row is its pair)."""
    logits = torch.cat(parts).cpu() if parts else torch.empty(0, num_labels)
    if all(owner is None for owner in owners):
        return logits, None
    assert all(owner is not None for owner in owners), "a call's blocks of pairs are all windowed or none"
    return logits, np.concatenate(owners)


class Engine:
    """Runs a model's pairs: the input-block loop every family shares; ``run_block`` is the family's."""

    def __init__(self, runner: ModelRunner, budget: Budget):
        self.runner = runner
        self.budget = budget
        self.counts = TokenCounts()  # tokens scored and computed since the last ``new_call``

    def new_call(self) -> None:
        """Start a scoring call's counts (a call may run several blocks of the input through ``run``)."""
        self.counts = TokenCounts()

    def run(self, tokenize: Callable[..., Encodings], text_1: list[str], text_2: list[str],
            options: CallOptions) -> tuple[torch.Tensor, np.ndarray | None]:
        """(rows, num_labels) float32 logits on the CPU, in the caller's order, and the pair each row scores (None:
        row i is pair i; a tokenizer that makes windows of long documents makes several rows of a pair).

        The logits gather on the model's device and come back in one copy at the end: on CUDA the host packs the next
        batch while the GPU runs this one (a copy back per batch would wait for each)."""
        parts, owners = [], []
        with tqdm(total=len(text_1), desc="Scoring pairs", unit="pair", disable=not options.show_progress_bar) as bar:
            try:
                for start, enc in input_blocks(tokenize, text_1, text_2, options.max_length):
                    enc = self.prepared(enc)
                    parts.append(self.run_block(enc, options, bar))
                    owners.append(None if enc.owner is None else enc.owner + start)
            finally:
                self.release()
        return gathered(parts, owners, self.budget.num_labels)

    def prepared(self, enc: Encodings) -> Encodings:
        """A block's encodings as the family runs them; as they are by default."""
        return enc

    def release(self) -> None:
        """After a call, finished or interrupted: let go of what it held; nothing by default."""

    def run_block(self, enc: Encodings, options: CallOptions, bar: tqdm) -> torch.Tensor:
        """(rows, num_labels) logits of one block of pairs on the model's device, in the block's order."""
        raise NotImplementedError


class EncoderEngine(Engine):
    """Each block's pairs packed into batches (``batch.pack``) and run whole."""

    def run_block(self, enc: Encodings, options: CallOptions, bar: tqdm) -> torch.Tensor:
        runner, b = self.runner, self.budget
        out = torch.empty(len(enc), b.num_labels, dtype=torch.float32, device=runner.device)
        last = enc.last_rows()  # a pair is done when its last window is
        for rows, part in run_order(enc):
            for pairs in runner.plan(part.lengths, b.page_size, b.max_pages, options.batch_size):
                shape = runner.batch_shape(part.lengths[pairs], b.page_size, b.max_pages)
                batch = pack(part, pairs, b.page_size, b.pad_token_id, shape)
                pairs = pairs if rows is None else rows[pairs]
                index = torch.from_numpy(pairs).to(runner.device, non_blocking=True)
                out[index] = runner(batch).float()  # queued before a CUDA graph's next replay reuses it
                bar.update(int(last[pairs].sum()))
        return out
