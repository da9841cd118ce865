"""Moving a packed (T, ...) stream to a per-pair (B, L, ...) layout and back, and per-pair means on the stream."""
from __future__ import annotations

import torch

from ..batch import PackedBatch


def to_padded(x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """(T, ...) -> (B, L, ...): pair b's tokens at [b, :len_b]; the slots past a pair hold junk."""
    return x[batch.pad_index].view(batch.seq_lens.shape[0], batch.max_seqlen, *x.shape[1:])


def from_padded(y: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """(B, L, ...) -> (T, ...), the inverse of to_padded on real tokens (filler tokens get slot 0's value)."""
    return y.reshape(-1, *y.shape[2:])[batch.unpad_index]


def mean_per_pair(x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Each pair's mean over its tokens, (T, d) -> (B, d), on the packed stream: summed in float32 and rounded once to
    x's dtype, as torch's sum over the padded (B, L, d) layout (transformers' mean pooling) is; only the order of the
    float32 additions differs. Rows past the pairs (shape filler) hold zeros."""
    B = batch.seq_lens.shape[0]
    tokens = torch.arange(x.shape[0], device=x.device, dtype=batch.cu_seqlens.dtype)
    pair = torch.searchsorted(batch.cu_seqlens[1:], tokens, right=True)  # tokens past the pairs: row B at most
    sums = x.new_zeros(B + 1, x.shape[1], dtype=torch.float32).index_add_(0, pair, x.float())
    return sums[:B].to(x.dtype) / batch.seq_lens[:, None]
