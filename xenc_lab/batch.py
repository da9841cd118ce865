"""Stage 3: pack one planned batch into the flat tensors the model runs on. One host->device copy.

``StreamBatch`` is what every packed batch shares (an encoder's ``PackedBatch`` here, a decoder's
``decoder.chunks.ChunkBatch``): a token stream of whole pages, at least ``MIN_ROWS`` rows for the last GEMMs, its
(T, sequences, L) shape, one copy to the device. Their shapes are bucketed in ``pages`` (``bucket_shape``,
``bucket_tokens``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from .pages import ATTENTION_ALIGN, pages_for
from .tokenize import Encodings

# A batch gives the last GEMMs (the last layer past attention, the head) at least this many rows (filler past the
# pairs): MKL rounds GEMMs of fewer than about 12 rows differently from the large ones (measured), which would make
# a pair's score depend on its batchmates and on its row.
MIN_ROWS = 16


def rows_for(pairs: int) -> int:
    """The rows a batch of ``pairs`` scored pairs runs its last GEMMs on."""
    return max(MIN_ROWS, pairs)


class StreamBatch:
    """What every packed batch has: ``input_ids`` (T,), ``max_seqlen`` (L), ``pairs`` (P,) and its sequences."""

    __slots__ = ()

    @property
    def sequences(self) -> int:
        raise NotImplementedError

    def shape(self) -> tuple[int, int, int]:
        """(T, sequences, L), the shape the runner records."""
        return self.input_ids.shape[0], self.sequences, self.max_seqlen

    def to(self, device: torch.device):
        """The batch with its tensors on ``device`` (copies queued without waiting)."""
        moved = {}
        for field in fields(self):
            value = getattr(self, field.name)
            moved[field.name] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        return type(self)(**moved)


@dataclass(slots=True)
class PackedBatch(StreamBatch):
    """P pairs laid end to end as one token stream of T tokens (T a whole number of pages), as B >= P
    sequences: past the pairs come filler sequences (up to MIN_ROWS, or a compiled shape).

    Tokens past the last pair (the filler of the last page) belong to no pair. For attention, which runs
    per pair, ``pad_index`` lays the stream out as (B, L) and ``unpad_index`` takes it back.
    """

    input_ids: torch.Tensor  # (T,) int64
    token_type_ids: torch.Tensor | None  # (T,) int64
    positions: torch.Tensor  # (T,) int64, 0-based within each pair
    cu_seqlens: torch.Tensor  # (P + 1,) int32, pair b is tokens cu_seqlens[b]:cu_seqlens[b + 1]; with a fixed
    # shape (B + 1,): the filler sequences are empty there, so its length depends on the shape alone
    cu_first: torch.Tensor  # like cu_seqlens, for one query per pair (its first token): min(b, P)
    seq_lens: torch.Tensor  # (B,) int64
    max_seqlen: int  # L: longest pair + 1, rounded up to a multiple of ATTENTION_ALIGN
    pad_index: torch.Tensor  # (B * L,) int64, the stream token at each (pair, slot); slots past a pair repeat its first token
    unpad_index: torch.Tensor  # (T,) int64, the (pair, slot) of each stream token; filler tokens point at slot 0
    key_mask: torch.Tensor  # (B, 1, 1, L) bool, True where the slot holds one of the pair's tokens
    first_index: torch.Tensor  # (B,) int64, the stream index of each pair's first token ([CLS] / <s>)
    pairs: np.ndarray  # (P,) which input pair each sequence is; sequences past P are shape filler
    num_tokens: int  # real tokens, without the filler

    @property
    def sequences(self) -> int:
        return self.seq_lens.shape[0]  # B


def pack(
    enc: Encodings,
    pairs: np.ndarray,
    page_size: int,
    pad_token_id: int = 0,
    shape: tuple[int, int, int] | None = None,
) -> PackedBatch:
    """Lay the pairs end to end. ``shape`` = (T, B, L) pads the batch to a fixed shape (for compiled
    forwards): filler tokens, and filler sequences that each see only the stream's first token. There are
    filler sequences up to MIN_ROWS in any case."""
    lens = enc.lengths[pairs]
    n_real = int(lens.sum())
    total = pages_for(n_real, page_size) * page_size
    # At least one key slot past the longest pair: every pair then takes SDPA's masked path, whose result
    # does not depend on L, so a pair's score does not depend on its batchmates.
    seq_len = pages_for(int(lens.max()) + 1, ATTENTION_ALIGN) * ATTENTION_ALIGN
    if shape is not None:
        assert shape[0] >= total and shape[1] >= len(pairs) and shape[2] >= seq_len, (shape, total, len(pairs), seq_len)
        total, seq_len = shape[0], shape[2]
    starts = np.zeros(len(pairs) + 1, dtype=np.int64)
    np.cumsum(lens, out=starts[1:])

    # Gather each pair's ids from the flat encodings in one vectorised step.
    src_starts = enc.offsets[pairs]
    within = np.arange(n_real, dtype=np.int64) - np.repeat(starts[:-1], lens)
    src = np.repeat(src_starts, lens) + within
    input_ids = np.full(total, pad_token_id, dtype=np.int64)
    input_ids[:n_real] = enc.ids[src]
    positions = np.zeros(total, dtype=np.int64)
    positions[:n_real] = within
    token_type_ids = None
    if enc.type_ids is not None:
        token_type_ids = np.zeros(total, dtype=np.int64)
        token_type_ids[:n_real] = enc.type_ids[src]

    seq_lens, first = lens, starts[:-1]
    n_seq = rows_for(len(pairs) if shape is None else shape[1])
    if n_seq > len(pairs):
        extra = n_seq - len(pairs)
        seq_lens = np.concatenate([lens, np.ones(extra, dtype=np.int64)])
        first = np.concatenate([first, np.zeros(extra, dtype=np.int64)])
    slot = np.arange(seq_len, dtype=np.int64)
    valid = slot[None, :] < seq_lens[:, None]  # (B, L)
    pad_index = np.where(valid, first[:, None] + slot[None, :], first[:, None])
    cu_seqlens = starts
    if shape is not None:
        cu_seqlens = np.concatenate([starts, np.full(n_seq - len(pairs), n_real, dtype=np.int64)])
    cu_first = np.minimum(np.arange(len(cu_seqlens), dtype=np.int64), len(pairs))
    seq_of_token = np.repeat(np.arange(len(pairs), dtype=np.int64), lens)
    unpad_index = np.zeros(total, dtype=np.int64)
    unpad_index[:n_real] = seq_of_token * seq_len + within

    return PackedBatch(
        input_ids=torch.from_numpy(input_ids),
        token_type_ids=None if token_type_ids is None else torch.from_numpy(token_type_ids),
        positions=torch.from_numpy(positions),
        cu_seqlens=torch.from_numpy(cu_seqlens.astype(np.int32)),
        cu_first=torch.from_numpy(cu_first.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int64)),
        max_seqlen=int(seq_len),
        pad_index=torch.from_numpy(pad_index.reshape(-1)),
        unpad_index=torch.from_numpy(unpad_index),
        key_mask=torch.from_numpy(valid[:, None, None, :].copy()),
        first_index=torch.from_numpy(first.astype(np.int64)),
        pairs=pairs,
        num_tokens=n_real,
    )
