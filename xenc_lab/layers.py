"""Ops shared by the packed models: moving the stream to a per-pair layout and back, and attention."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .batch import PackedBatch


def to_padded(x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """(T, ...) -> (B, L, ...): pair b's tokens at [b, :len_b]; the slots past a pair hold junk."""
    return x[batch.pad_index].view(batch.seq_lens.shape[0], batch.max_seqlen, *x.shape[1:])


def from_padded(y: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """(B, L, ...) -> (T, ...), the inverse of to_padded on real tokens (filler tokens get slot 0's value)."""
    return y.reshape(-1, *y.shape[2:])[batch.unpad_index]


try:  # torch >= 2.9: flash attention over cu_seqlens, CUDA only
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover
    _varlen_attn = None


def _packed_varlen(qkv: torch.Tensor, batch: PackedBatch, num_heads: int, scale: float | None) -> torch.Tensor:
    T, d = qkv.shape[0], qkv.shape[-1] // 3
    q, k, v = qkv.view(T, 3, num_heads, d // num_heads).unbind(1)  # (T, H, dh) each
    # The page filler past the last pair is one more sequence of its own, so every row is defined.
    cu = torch.cat([batch.cu_seqlens, batch.cu_seqlens.new_full((1,), T)])
    out = _varlen_attn(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, scale=scale)
    return out.reshape(T, d)


def window_mask(batch: PackedBatch, window: int) -> torch.Tensor:
    """(B, 1, L, L) bool: key j is visible from query i when |i - j| <= window // 2 and j is a real token."""
    slots = torch.arange(batch.max_seqlen, device=batch.key_mask.device)
    near = (slots[:, None] - slots[None, :]).abs() <= window // 2
    return batch.key_mask & near


def packed_attention(
    qkv: torch.Tensor,
    batch: PackedBatch,
    num_heads: int,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention within each pair: (T, 3 * d) -> (T, d). Never crosses a pair boundary.

    ``mask`` replaces the key mask: a bool mask or an additive float bias broadcastable to (B, H, L, L).
    On CUDA in half precision, plain attention runs on the packed stream itself (flash varlen kernel);
    elsewhere the stream is laid out per pair and fused SDPA runs with a key mask.
    """
    d = qkv.shape[-1] // 3
    if mask is None and qkv.is_cuda and qkv.dtype in (torch.float16, torch.bfloat16) and _varlen_attn is not None:
        return _packed_varlen(qkv, batch, num_heads, scale)
    B, L = batch.seq_lens.shape[0], batch.max_seqlen
    q, k, v = to_padded(qkv, batch).view(B, L, 3, num_heads, d // num_heads).permute(2, 0, 3, 1, 4)
    attn_mask = batch.key_mask if mask is None else mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)  # (B, H, L, dh)
    return from_padded(out.transpose(1, 2).reshape(B, L, d), batch)


def fuse_linears(*parts: nn.Linear) -> nn.Linear:
    """One Linear computing all of ``parts`` side by side: one GEMM, one pass over the activations."""
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None)
    fused = fused.to(device=first.weight.device, dtype=first.weight.dtype).requires_grad_(False)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused
