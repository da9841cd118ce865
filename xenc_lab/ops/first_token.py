"""A last layer read at first tokens only: a classifier reads only each pair's first token, so the last layer needs
no other query, and skipping them is exact. Its keys and values can be folded into that query, and then the layer
projects none (``Choices.first_token_kv``)."""
from __future__ import annotations

import torch
from torch import nn

from ..batch import PackedBatch
from ..cpu.kernels import folded_pool_cpu
from .attention import first_token_attention
from .linear import linear_rows


def split_first(qkv: nn.Module, x: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused (q, k, v) projection for a layer whose output is read at first tokens only:
    q of each pair's first token (B, d), and k, v of every token (T, 2d)."""
    d = qkv.out_features // 3
    return linear_rows(qkv, 0, d, x[batch.first_index], per_pair=True), linear_rows(qkv, d, 3 * d, x)


def first_token_self_attention(
    qkv: nn.Module, x: torch.Tensor, batch: PackedBatch, num_heads: int, choices
) -> torch.Tensor:
    """Self-attention of each pair's first token over the pair, (T, d) -> (B, d), for a layer whose fused
    (q, k, v) projection is ``qkv`` and whose output is read at first tokens only. ``choices``: a
    ``choices.Choices``; its ``first_token_kv`` says whether keys and values are folded or projected."""
    if choices.first_token_kv == "folded":
        d = qkv.out_features // 3
        q = linear_rows(qkv, 0, d, x[batch.first_index], per_pair=True)
        kv_bias = None if qkv.bias is None else qkv.bias[d:]
        return folded_first_token_attention(x, q, batch.cu_seqlens, qkv.weight[d:], kv_bias, num_heads)
    return first_token_attention(*split_first(qkv, x, batch), batch, num_heads, choices.attention)


@torch.library.custom_op("xenc_lab::folded_first_token_attention", mutates_args=())
def folded_first_token_attention(
    x: torch.Tensor,
    q: torch.Tensor,
    cu_seqlens: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_bias: torch.Tensor | None,
    num_heads: int,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(dh)) v per pair and head for the first token's query q (B, d), with k and v the
    projections ``kv_weight`` (2 d, d) and ``kv_bias`` (2 d,) of the pair's rows of x (T, d), never computed:

        q . (W_k x_j + b_k) = (W_k^T q) . x_j + q . b_k   (the last term is the same for every key: softmax drops it)
        sum_j p_j (W_v x_j + b_v) = W_v (sum_j p_j x_j) + b_v   (the p_j sum to 1)

    per head, so each pair costs two (n, d) x (d, H) products instead of projecting its n rows (exact in real
    arithmetic; in floating point it rounds otherwise, within float32 rounding). Pair b is rows
    cu_seqlens[b]:[b + 1] of x; rows of q past the pairs (filler) come back as b_v. Returns (B, d)."""
    B, d = q.shape
    dh = d // num_heads
    w_k, w_v = kv_weight.view(2, num_heads, dh, d).unbind(0)  # (H, dh, d) each
    # W_k^T q per head, with the softmax scale: (H, B, d).
    folded = torch.bmm(q.view(B, num_heads, dh).transpose(0, 1), w_k).mul_(dh**-0.5)
    pooled = folded_pool_cpu(x, folded, cu_seqlens) if x.device.type == "cpu" else None  # sum_j p_j x_j: (B, H, d)
    if pooled is None:  # the same, pair by pair here
        pooled = q.new_zeros(B, num_heads, d)
        bounds = cu_seqlens.tolist()
        for b in range(len(bounds) - 1):
            if bounds[b + 1] > bounds[b]:
                rows = x[bounds[b] : bounds[b + 1]]
                weights = torch.softmax(torch.mm(rows, folded[:, b].t()), dim=0)  # (n, H)
                torch.mm(weights.t(), rows, out=pooled[b])
    pooled = pooled.transpose(0, 1)  # (H, B, d)
    bias = None if kv_bias is None else kv_bias[d:].view(num_heads, 1, dh)
    out = torch.bmm(pooled, w_v.transpose(1, 2)) if bias is None else torch.baddbmm(bias, pooled, w_v.transpose(1, 2))
    return out.transpose(0, 1).reshape(B, d)  # (H, B, dh) -> (B, d)


@folded_first_token_attention.register_fake
def _(x, q, cu_seqlens, kv_weight, kv_bias, num_heads):
    return q.new_empty(q.shape)
