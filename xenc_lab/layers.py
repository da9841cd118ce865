"""Ops shared by the packed models: per-pair attention over a packed token stream."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import PackedBatch


def packed_attention(qkv: torch.Tensor, batch: PackedBatch, num_heads: int, scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention within each pair: (T, 3 * d) -> (T, d). Never crosses a pair boundary."""
    d = qkv.shape[-1] // 3
    B, L = batch.seq_lens.shape[0], batch.max_seqlen
    q, k, v = qkv[batch.pad_index].view(B, L, 3, num_heads, d // num_heads).permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.key_mask, scale=scale)  # (B, H, L, dh)
    return out.transpose(1, 2).reshape(B * L, d)[batch.unpad_index]
