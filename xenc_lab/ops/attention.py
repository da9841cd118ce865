"""Attention within each pair of a packed stream, over all of a pair's tokens or for its first token alone.

``path`` is the choice made at load (``choices.Choices.attention``): "kernel" or "tiles" (xenc_lab's CPU kernel
or its tile path, on the packed stream in place), "varlen" (torch's flash attention over cu_seqlens, CUDA), or
"sdpa" (the pairs laid out as padded sequences, fused SDPA with a key mask).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from ..batch import PackedBatch
from ..cpu.kernels import packed_attention_cpu
from .layout import from_padded, to_padded

PATHS = ("kernel", "tiles", "sdpa", "varlen")

try:  # torch >= 2.9: flash attention over cu_seqlens, CUDA only
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover
    _varlen_attn = None

# torch's varlen_attn took no scale at first (then always 1 / sqrt(head dim)) and no window; later versions take both.
_VARLEN_ARGS = set(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else set()
_VARLEN_TAKES_SCALE = "scale" in _VARLEN_ARGS
_VARLEN_TAKES_WINDOW = "window_size" in _VARLEN_ARGS

_FLASH_CAPABLE: dict[int, bool] = {}  # CUDA device index -> whether torch's flash attention runs there


def flash_capable(device: torch.device) -> bool:
    """Whether torch's flash attention (which ``varlen_attn`` calls) runs on this CUDA device: compute capability
    8.0 (Ampere) or newer. Read once per device, at load."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _FLASH_CAPABLE:
        _FLASH_CAPABLE[index] = torch.cuda.get_device_capability(index) >= (8, 0)
    return _FLASH_CAPABLE[index]


def varlen_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's flash varlen kernel runs attention here: half precision on a CUDA GPU with flash attention,
    head dims it takes (multiples of 8 up to 256)."""
    if _varlen_attn is None or device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    return head_dim % 8 == 0 and head_dim <= 256 and flash_capable(device)


def varlen_takes(head_dim: int, scale: float | None = None, sliding_window: int | None = None) -> bool:
    """Whether this torch's varlen_attn can take a layer's scale and sliding window (constants of the torch version)."""
    if sliding_window is not None and not _VARLEN_TAKES_WINDOW:
        return False
    return scale is None or _VARLEN_TAKES_SCALE or scale == head_dim**-0.5


def _varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float | None,
            sliding_window: int | None = None) -> torch.Tensor:
    """Flash attention over cu_seqlens. ``sliding_window``: key j is visible from query i when |i - j| <=
    sliding_window // 2, as flash attention's (left, right) window."""
    kwargs = {}
    if scale is not None and _VARLEN_TAKES_SCALE:
        kwargs["scale"] = scale  # else the default scale (``varlen_takes`` checked)
    if sliding_window is not None:
        kwargs["window_size"] = (sliding_window // 2, sliding_window // 2)
    return _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def _cu_with_filler(cu: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens with the stream's filler tail as one more sequence, so that cu_seqlens covers every row. Where
    the tail is longer than max_seqlen (a bucket-shaped batch), flash attention leaves its rows past max_seqlen
    unwritten: they belong to no pair, and every later op is row-wise, so no pair reads them."""
    return torch.cat([cu, cu.new_full((1,), total)])


def window_mask(batch: PackedBatch, sliding_window: int, first_only: bool = False) -> torch.Tensor:
    """(B, 1, L, L) bool, or (B, 1, 1, L) for first tokens only: key j is visible from query i when
    |i - j| <= sliding_window // 2 and j is a real token."""
    slots = torch.arange(batch.max_seqlen, device=batch.key_mask.device)
    queries = slots[:1] if first_only else slots
    near = (queries[:, None] - slots[None, :]).abs() <= sliding_window // 2
    return batch.key_mask & near


def packed_attention(
    qkv: torch.Tensor,
    batch: PackedBatch,
    num_heads: int,
    path: str,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention within each pair, (T, 3 * d) -> (T, d), on ``path``. Never crosses a pair
    boundary. ``sliding_window``: keys farther than sliding_window // 2 from the query are masked (sliding-window
    layers)."""
    T, d = qkv.shape[0], qkv.shape[-1] // 3
    dh = d // num_heads
    if path in ("kernel", "tiles"):
        q, k, v = qkv.split(d, dim=-1)  # strided views: the kernel reads them in place
        out = packed_attention_cpu(q, k, v, batch.cu_seqlens, batch.cu_seqlens, num_heads, scale, sliding_window,
                                   path == "tiles")
        if out is not None:
            return out
    if path == "varlen" and varlen_takes(dh, scale, sliding_window):
        q, k, v = qkv.view(T, 3, num_heads, dh).unbind(1)  # (T, H, dh) each
        cu = _cu_with_filler(batch.cu_seqlens, T)
        out = _varlen(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, scale, sliding_window)
        return out.reshape(T, d)
    B, L = batch.seq_lens.shape[0], batch.max_seqlen
    q, k, v = to_padded(qkv, batch).view(B, L, 3, num_heads, dh).permute(2, 0, 3, 1, 4)  # (B, H, L, dh)
    mask = batch.key_mask if sliding_window is None else window_mask(batch, sliding_window)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (B, H, L, dh)
    return from_padded(out.transpose(1, 2).reshape(B, L, d), batch)


def first_token_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    batch: PackedBatch,
    num_heads: int,
    path: str,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of each pair's first token over the pair, on ``path``: q (B, d), kv (T, 2 * d) -> (B, d)."""
    B, d = q.shape
    T, dh = kv.shape[0], d // num_heads
    # One query per pair: the tile path's GEMMs would run 32 query rows for it, so "tiles" means the kernel here.
    if path in ("kernel", "tiles"):
        k, v = kv.split(d, dim=-1)
        out = packed_attention_cpu(q, k, v, batch.cu_first, batch.cu_seqlens, num_heads, scale, sliding_window)
        if out is not None:
            return out
    # Flash attention aligns a shorter query sequence with the end of its keys (a window would then sit around
    # the pair's last token, not its first): windowed layers take the padded path below.
    if path == "varlen" and sliding_window is None and varlen_takes(dh, scale):
        cu_q, cu_k = _cu_with_filler(batch.cu_first, B), _cu_with_filler(batch.cu_seqlens, T)
        k, v = kv.view(T, 2, num_heads, dh).unbind(1)
        out = _varlen(q.view(B, num_heads, dh), k, v, cu_q, cu_k, 1, batch.max_seqlen, scale)
        return out.reshape(B, d)
    L = batch.max_seqlen
    k, v = to_padded(kv, batch).view(B, L, 2, num_heads, dh).permute(2, 0, 3, 1, 4)  # (B, H, L, dh)
    mask = batch.key_mask if sliding_window is None else window_mask(batch, sliding_window, first_only=True)
    out = F.scaled_dot_product_attention(q.view(B, num_heads, 1, dh), k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, d)
