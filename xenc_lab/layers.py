"""Ops shared by the packed models: moving the stream to a per-pair layout and back, and attention.

Attention runs within each pair, over all of the pair's tokens (``packed_attention``) or for the pair's
first token alone (``first_token_attention``): a classifier reads only the first token, so the last
layer needs no other query, and skipping them is exact. Its keys and values can be folded into that query
(``folded_first_token_attention``), and then the last layer projects none.
"""
from __future__ import annotations

import inspect
import itertools
import platform
import weakref
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .batch import PackedBatch
from .config import env_choice
from .cpuinfo import cpu_info
from .kernels import (
    f32_gemm_available,
    folded_pool_cpu,
    gemm_blocks,
    half_blocks,
    half_gemm_available,
    layer_norm_cpu,
    linear_f32_cpu,
    linear_half_cpu,
    linear_widened_cpu,
    packed_attention_cpu,
    widened_gemm_available,
)
from .kernels import load as load_kernels
from .tuning import PATHS, cpu_attention_path


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


def _linear_rows(linear: nn.Module, start: int, stop: int, x: torch.Tensor, per_pair: bool = False) -> torch.Tensor:
    """Output features start:stop of ``linear`` on x. ``per_pair``: x holds one row per pair, which in float32 take
    torch's F.linear even where the layer is prepacked (see ``prepack_linears``)."""
    if isinstance(linear, PrepackedLinear) and not (per_pair and x.dtype == torch.float32):
        return linear.forward_rows(x, start, stop)
    bias = None if linear.bias is None else linear.bias[start:stop]
    return F.linear(x, linear.weight[start:stop], bias)


def split_first(qkv: nn.Module, x: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused (q, k, v) projection for a layer whose output is read at first tokens only:
    q of each pair's first token (B, d), and k, v of every token (T, 2d)."""
    d = qkv.out_features // 3
    return _linear_rows(qkv, 0, d, x[batch.first_index], per_pair=True), _linear_rows(qkv, d, 3 * d, x)


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
    8.0 (Ampere) or newer. Read once per device; the runner reads it at load, before any forward is traced."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _FLASH_CAPABLE:
        _FLASH_CAPABLE[index] = torch.cuda.get_device_capability(index) >= (8, 0)
    return _FLASH_CAPABLE[index]


def _use_varlen(x: torch.Tensor, window: int | None, scale: float | None, head_dim: int) -> bool:
    """Whether attention on ``x`` runs in torch's flash varlen kernel: half precision on a CUDA GPU that has flash
    attention, head dims it takes (multiples of 8 up to 256), and a scale and window this torch can pass to it."""
    return x.is_cuda and _varlen_runs(x.device, x.dtype, window, scale, head_dim)


def _varlen_runs(device: torch.device, dtype: torch.dtype, window: int | None, scale: float | None, head_dim: int) -> bool:
    if _varlen_attn is None or device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if head_dim % 8 or head_dim > 256 or not flash_capable(device):
        return False
    if window is not None and not _VARLEN_TAKES_WINDOW:
        return False
    return scale is None or _VARLEN_TAKES_SCALE or scale == head_dim**-0.5


def attends_packed(
    device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int, scale: float | None = None,
    window: int | None = None,
) -> bool:
    """Whether ``packed_attention`` and ``first_token_attention`` run on the packed stream itself at this device,
    dtype and head shape: xenc_lab's kernel or its tile path on the CPU, flash varlen on CUDA. Where not, they lay
    the batch out as (pairs, longest pair) padded sequences for SDPA, whose work then grows with the longest pair
    times the pair count (``pages.plan_batches`` bounds that with ``ATTENTION_SLACK``)."""
    if device.type == "cpu":
        return cpu_attention_path(dtype, num_heads, head_dim) != "sdpa" and load_kernels()
    # One query per pair with a window takes the padded path on CUDA (see first_token_attention).
    return window is None and _varlen_runs(device, dtype, None, scale, head_dim)


def _varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float | None, window: int | None = None) -> torch.Tensor:
    """Flash attention over cu_seqlens. ``window``: key j is visible from query i when |i - j| <= window // 2, as
    flash attention's (left, right) window (``_use_varlen`` checked that this torch takes one)."""
    kwargs = {}
    if scale is not None and _VARLEN_TAKES_SCALE:
        kwargs["scale"] = scale  # else the default scale (``_use_varlen`` checked)
    if window is not None:
        kwargs["window_size"] = (window // 2, window // 2)
    return _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def _cu_with_filler(cu: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens with the stream's filler tail as one more sequence, so that cu_seqlens covers every row. Where
    the tail is longer than max_seqlen (a bucket-shaped batch), flash attention leaves its rows past max_seqlen
    unwritten: they belong to no pair, and every later op is row-wise, so no pair reads them."""
    return torch.cat([cu, cu.new_full((1,), total)])


def window_mask(batch: PackedBatch, window: int, first_only: bool = False) -> torch.Tensor:
    """(B, 1, L, L) bool, or (B, 1, 1, L) for first tokens only: key j is visible from query i when
    |i - j| <= window // 2 and j is a real token."""
    slots = torch.arange(batch.max_seqlen, device=batch.key_mask.device)
    queries = slots[:1] if first_only else slots
    near = (queries[:, None] - slots[None, :]).abs() <= window // 2
    return batch.key_mask & near


def packed_attention(
    qkv: torch.Tensor,
    batch: PackedBatch,
    num_heads: int,
    scale: float | None = None,
    window: int | None = None,
    cpu_path: str | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention within each pair: (T, 3 * d) -> (T, d). Never crosses a pair boundary.

    ``window``: keys farther than window // 2 from the query are masked (sliding-window layers).
    On the CPU, attention runs on the packed stream itself in xenc_lab's kernel (``kernels``), or its tile
    path, or SDPA, as ``tuning`` chooses (the kernel but on CPUs with AMX); on CUDA in half precision, in the
    flash varlen kernel. Elsewhere, or where the kernel could not be built, the stream is laid out per pair and
    fused SDPA runs with a key mask. ``cpu_path`` ("kernel", "tiles" or "sdpa") overrides the CPU's choice
    (benchmarks compare them).
    """
    T, d = qkv.shape[0], qkv.shape[-1] // 3
    dh = d // num_heads
    if cpu_path is not None and cpu_path not in PATHS:
        raise ValueError(f"cpu_path must be None or one of {', '.join(PATHS)}, got {cpu_path!r}")
    path = "" if qkv.device.type != "cpu" else cpu_path or cpu_attention_path(qkv.dtype, num_heads, dh)
    if path in ("kernel", "tiles"):
        q, k, v = qkv.split(d, dim=-1)  # strided views: the kernel reads them in place
        out = packed_attention_cpu(q, k, v, batch.cu_seqlens, batch.cu_seqlens, num_heads, scale, window, path == "tiles")
        if out is not None:
            return out
    if _use_varlen(qkv, window, scale, dh):
        q, k, v = qkv.view(T, 3, num_heads, dh).unbind(1)  # (T, H, dh) each
        cu = _cu_with_filler(batch.cu_seqlens, T)
        out = _varlen(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, scale, window)
        return out.reshape(T, d)
    B, L = batch.seq_lens.shape[0], batch.max_seqlen
    q, k, v = to_padded(qkv, batch).view(B, L, 3, num_heads, dh).permute(2, 0, 3, 1, 4)  # (B, H, L, dh)
    mask = batch.key_mask if window is None else window_mask(batch, window)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (B, H, L, dh)
    return from_padded(out.transpose(1, 2).reshape(B, L, d), batch)


def first_token_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    batch: PackedBatch,
    num_heads: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of each pair's first token over the pair: q (B, d), kv (T, 2 * d) -> (B, d)."""
    B, d = q.shape
    T, dh = kv.shape[0], d // num_heads
    # One query per pair: the tile path's GEMMs would run 32 query rows for it, so its choice means the kernel here.
    path = cpu_attention_path(q.dtype, num_heads, dh) if q.device.type == "cpu" else ""
    if path in ("kernel", "tiles"):
        k, v = kv.split(d, dim=-1)
        out = packed_attention_cpu(q, k, v, batch.cu_first, batch.cu_seqlens, num_heads, scale, window)
        if out is not None:
            return out
    # Flash attention aligns a shorter query sequence with the end of its keys (a window would then sit around
    # the pair's last token, not its first): windowed layers take the padded path below.
    if window is None and _use_varlen(q, None, scale, dh):
        cu_q, cu_k = _cu_with_filler(batch.cu_first, B), _cu_with_filler(batch.cu_seqlens, T)
        k, v = kv.view(T, 2, num_heads, dh).unbind(1)
        out = _varlen(q.view(B, num_heads, dh), k, v, cu_q, cu_k, 1, batch.max_seqlen, scale)
        return out.reshape(B, d)
    L = batch.max_seqlen
    k, v = to_padded(kv, batch).view(B, L, 2, num_heads, dh).permute(2, 0, 3, 1, 4)  # (B, H, L, dh)
    mask = batch.key_mask if window is None else window_mask(batch, window, first_only=True)
    out = F.scaled_dot_product_attention(q.view(B, num_heads, 1, dh), k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, d)


FIRST_TOKEN_KV = ("folded", "projected")


def first_token_kv() -> str:
    """How the last layer's attention, read at first tokens only, gets its keys and values on the CPU in float32:

    - ``"projected"``: k and v of every token by the layer's projection (2 d^2 multiply-adds per token), then
      attention of the first token over them (``split_first``, ``first_token_attention``).
    - ``"folded"``: the projections folded into the one query instead (``folded_first_token_attention``):
      2 H d multiply-adds per token (H heads), the projections' work once per pair. On MiniLM-L6 that is 3% of
      the model's multiply-adds.

    The default is ``"folded"``; ``XENC_LAB_FIRST_TOKEN_KV`` forces either (benchmarks compare them). Other
    devices and dtypes take ``"projected"``."""
    return env_choice("XENC_LAB_FIRST_TOKEN_KV", FIRST_TOKEN_KV) or "folded"


def first_token_self_attention(qkv: nn.Module, x: torch.Tensor, batch: PackedBatch, num_heads: int) -> torch.Tensor:
    """Self-attention of each pair's first token over the pair, (T, d) -> (B, d), for a layer whose fused
    (q, k, v) projection is ``qkv`` and whose output is read at first tokens only."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and first_token_kv() == "folded":
        d = qkv.out_features // 3
        q = _linear_rows(qkv, 0, d, x[batch.first_index], per_pair=True)
        kv_bias = None if qkv.bias is None else qkv.bias[d:]
        return folded_first_token_attention(x, q, batch.cu_seqlens, qkv.weight[d:], kv_bias, num_heads)
    return first_token_attention(*split_first(qkv, x, batch), batch, num_heads)


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


BF16_GEMMS = ("native", "fp32", "fp16")


def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (torch asks for AVX-512 or bf16 units; AVX2-only CPUs have
    neither)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_fp16() -> bool:
    """Whether oneDNN multiplies float16 on this CPU (torch asks for AVX512-FP16 or AMX-FP16)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def bf16_gemm() -> str:
    """How bfloat16 linear layers multiply on this CPU (``PrepackedLinear``):

    - ``"native"``: oneDNN's bf16 GEMM (AMX; AMD cores, whose bf16 dot product does the work of two fp32 FMAs).
    - ``"fp32"``: float32 FMAs on the bf16 values. The products of bf16 numbers are exact in fp32, and a bf16 GEMM
      sums them in fp32 and rounds once to bf16: the same arithmetic, but for the order of the sums. On Intel cores
      without AMX the bf16 dot product (AVX512-BF16) issues once per cycle against two fp32 FMAs (oneDNN's bf16
      GEMMs measured 150-170 GFLOP/s against 250-300 for fp32 on a 2-core Xeon).
    - ``"fp16"``: xenc_lab's float16 GEMM (``kernels.linear_half_cpu``), on Intel CPUs without AMX that have
      AVX512-FP16: an fp16 FMA does twice an fp32 FMA's multiply-adds at the same rate. bf16 values are exact in
      fp16 once scaled by powers of two; the sums run in fp16 over 64 consecutive products and in fp32 across
      them. Each fp16 step rounds to 11 bits, a little below the 8 the bf16 result keeps: on MiniLM-L6 the logits'
      error against fp32 stayed within 0.9-1.2x that of sentence-transformers' own bf16 (the fp32 route: 0.8-1.1x),
      and the model ran 1.45x faster than on the fp32 route (measured).

    Where oneDNN has no bf16 GEMM (``onednn_bf16``: AVX2-only CPUs) the default is ``"fp32"``: on an AVX2-only AMD
    EPYC (Zen 1), MiniLM-L6 in bf16 scored 33.0 short pairs/s this way through torch's ops, 34.3 in xenc_lab's GEMM
    (``kernels.linear_widened_cpu``), against 5.7 with torch's own bf16 matmul (sentence-transformers' bf16: 4.1)
    and 35.9 in float32; its logits' error against fp32 was 1.00-1.03x sentence-transformers' own bf16 error
    (measured).

    The default is the fastest of these here; ``XENC_LAB_BF16_GEMM`` forces one (``fp16`` falls back to ``fp32``
    where it cannot run, and ``native`` where oneDNN has no bf16 GEMM)."""
    forced = env_choice("XENC_LAB_BF16_GEMM", BF16_GEMMS)
    if forced:
        return forced
    if not onednn_bf16():
        return "fp32"
    cpu = cpu_info()
    if platform.machine() not in ("x86_64", "AMD64") or cpu.vendor != "GenuineIntel" or "amx_bf16" in cpu.flags:
        return "native"
    return "fp16" if half_gemm_available() else "fp32"


F32_GELU_GEMMS = ("fused", "onednn")


def f32_gelu_gemm() -> str:
    """How float32 linear layers followed by the exact GELU multiply on this CPU (``PrepackedLinear``):

    - ``"onednn"``: oneDNN's GEMM on the prepacked weight, with its GELU post-op.
    - ``"fused"``: xenc_lab's fp32 GEMM (``kernels.linear_f32_cpu``): ATen's fp32 brgemm ukernel (oneDNN's) on blocks
      of 96 rows by 64 columns, the bias and GELU (torch's erf approximation) applied to each output tile while it
      is in L1, on a float32 copy of the weight in its own blocked layout, made at the layer's first GELU call. On an
      AVX2-only AMD EPYC (Zen 1) MiniLM's intermediate GEMM ran at 61-62 GFLOP/s this way inside the model, against
      58 for oneDNN's with its post-op, and the model scored 1.016-1.028x the pairs/s (same process, alternating);
      the output equals the product followed by GELU within float32 rounding, as oneDNN's does.

    The default is ``"fused"`` on x86 CPUs without AVX-512, where it was measured, if it runs here, and ``"onednn"``
    elsewhere; ``XENC_LAB_F32_GELU_GEMM`` forces one (``fused`` falls back to ``onednn`` where it cannot run)."""
    forced = env_choice("XENC_LAB_F32_GELU_GEMM", F32_GELU_GEMMS)
    if forced == "onednn" or not f32_gemm_available():
        return "onednn"
    if forced:
        return forced
    return "onednn" if "avx512f" in cpu_info().flags else "fused"


class PrepackedLinear(nn.Module):
    """A Linear whose weight is packed once, at load, for the CPU GEMM that runs it (float32 and bfloat16, and
    float16 where oneDNN has no float16 GEMM).

    A float32 layer, and a bfloat16 one where ``gemm`` is ``"native"``, runs oneDNN's GEMM on its weight reordered
    once into oneDNN's blocked layout. torch's CPU GEMMs take the weight as it is on every call: MKL in float32
    (which on this project's AMD CPUs ran at under half of oneDNN's rate, measured), oneDNN with a reorder per call
    in bfloat16. Prepacked oneDNN GEMMs skip both costs. In bfloat16 the products are the same to the bit; in
    float32 they round differently from MKL's (by float32 rounding, about 1e-7 relative), and like MKL's, a row's
    result does not depend on the other rows once there are 12 or more (measured).

    The other bfloat16 GEMMs (``bf16_gemm``) are xenc_lab's own, with the bias, GELU or residual and the rounding
    to bfloat16 applied to each output tile while it is in cache:
    - ``"fp16"``: float16 FMAs (``kernels.linear_half_cpu``) on a float16 copy of the weight, scaled;
    - ``"fp32"``: float32 FMAs on a float32 copy of the weight, each block of input rows widened in cache
      (``kernels.linear_widened_cpu``; 1.06-1.25x the rate of the same GEMM through torch's ops at MiniLM's
      shapes on AVX-512), or, where that kernel does not run or ``fused=False`` asks (benchmarks compare them),
      torch's ops around oneDNN's float32 GEMM (a pass over memory for each widening and rounding).
    Each falls back to the next where it does not run here. ``weight`` and ``bias`` stay as they were.

    A float16 layer takes the ``"fp32"`` route: the products of fp16 numbers are exact in fp32 too. It is prepacked
    only where oneDNN has no float16 GEMM (``onednn_fp16``; torch's float16 matmul runs through conversions there,
    measured at a fifth of float32's speed on an AVX2-only CPU); elsewhere it stays torch's.

    A float32 layer called with the GELU runs xenc_lab's fp32 GEMM instead where ``f32_gelu_gemm()`` says so (the
    GELU applied to each output tile in cache), on a blocked float32 copy of the weight made at its first GELU call.

    Under torch.compile the GEMM is one opaque op, ``xenc_lab::prepacked_linear`` (inductor cannot lower
    oneDNN's packed float32 weights itself): the compiled graph keeps these GEMMs and fuses what lies
    between them."""

    _keys = itertools.count()

    def __init__(self, linear: nn.Linear, gemm: str | None = None, fused: bool | None = None):
        super().__init__()
        if gemm is not None and gemm not in BF16_GEMMS:
            raise ValueError(f"gemm must be None or one of {', '.join(BF16_GEMMS)}, got {gemm!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        if linear.weight.dtype == torch.float32:
            gemm = "native"
        elif linear.weight.dtype == torch.float16:
            gemm = "fp32"
        elif gemm is None:
            gemm = bf16_gemm()
        if gemm == "fp16" and not (half_gemm_available() and bool(linear.weight.isfinite().all())):
            gemm = "fp32"
        if gemm == "native" and linear.weight.dtype == torch.bfloat16 and not onednn_bf16():
            gemm = "fp32"
        self.gemm = gemm
        # xenc_lab's GEMMs: the fp16 one, or the fp32 one where it runs here unless ``fused=False`` asks for torch's
        # ops around oneDNN's fp32 GEMM (benchmarks compare them).
        self.fused = gemm == "fp16" or (gemm == "fp32" and (fused is None or fused) and widened_gemm_available())
        weight, self._bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        self._exponent = 0
        if gemm == "fp16":  # xenc_lab's fp16 GEMM: its own blocked, scaled fp16 copy of the weight
            self.packed, self._exponent, self._bias = half_blocks(weight, self._bias)
        elif self.fused:  # xenc_lab's fp32 GEMM: its own blocked fp32 copy of the weight
            self.packed, self._bias = gemm_blocks(weight, self._bias)
        else:
            if gemm == "fp32":
                weight, self._bias = weight.float(), None if self._bias is None else self._bias.float()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.gelu_gemm = f32_gelu_gemm() if linear.weight.dtype == torch.float32 else None
        self._gelu_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows: dict[tuple[int, int], PrepackedLinear] = {}
        self.key = next(self._keys)  # how the compiled op finds this layer
        _PREPACKED[self.key] = self

    @staticmethod
    def supported(dtype: torch.dtype, device: torch.device) -> bool:
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        # bf16 without oneDNN's bf16 GEMM, and fp16 wherever prepacked: the fp32 route
        return dtype in (torch.float32, torch.bfloat16) or (dtype == torch.float16 and not onednn_fp16())

    def rows(self, start: int, stop: int) -> PrepackedLinear:
        """Output features start:stop, prepacked on first use."""
        if (start, stop) == (0, self.out_features):
            return self
        if (start, stop) not in self._rows:
            part = nn.Linear(self.in_features, stop - start, bias=self.bias is not None)
            part.weight = nn.Parameter(self.weight[start:stop], requires_grad=False)
            if self.bias is not None:
                part.bias = nn.Parameter(self.bias[start:stop], requires_grad=False)
            self._rows[start, stop] = PrepackedLinear(part, self.gemm, self.fused)
        return self._rows[start, stop]

    def _rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """x as (M, in_features) rows with contiguous columns, as xenc_lab's GEMMs take them."""
        rows = x.reshape(-1, self.in_features)
        return rows if rows.stride(-1) == 1 else rows.contiguous()

    def _gemm(self, x: torch.Tensor, activation: str, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None and activation != "none":
            raise ValueError(f"a residual is added to the plain product only, not after {activation!r}")
        if activation == "gelu" and self.gelu_gemm == "fused":  # xenc_lab's fp32 GEMM, GELU in cache
            if self._gelu_blocks is None:  # only the layers that GELU follows need this copy
                self._gelu_blocks = gemm_blocks(self.weight, self._bias)
            y = linear_f32_cpu(self._rows_of(x), *self._gelu_blocks, self.out_features, "gelu")
            return y.view(*x.shape[:-1], self.out_features)
        if self.fused:  # xenc_lab's GEMMs
            rows = self._rows_of(x)
            if residual is not None:
                residual = residual.reshape(-1, self.out_features)
                if residual.stride(-1) != 1:
                    residual = residual.contiguous()
            if self.gemm == "fp16":
                y = linear_half_cpu(rows, self.packed, self._exponent, self._bias, self.out_features, activation, residual)
            else:
                y = linear_widened_cpu(rows, self.packed, self._bias, self.out_features, activation, residual)
            return y.view(*x.shape[:-1], self.out_features)
        dtype = x.dtype
        if self.gemm == "fp32":
            x, residual = x.float(), None if residual is None else residual.float()
        if residual is not None:
            y = torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), self.packed, self._bias, "add")
        else:
            algorithm = "none" if activation == "gelu" else ""
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self._bias, activation, [], algorithm)
        return y.to(dtype)

    def forward_rows(
        self, x: torch.Tensor, start: int, stop: int, activation: str = "none", residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Output features start:stop of the layer on x (plus ``residual``, if given)."""
        if torch.compiler.is_compiling():
            if self.gemm == "fp32" and not self.fused:  # widen and round outside the opaque op: inductor fuses them with neighbours
                residual = None if residual is None else residual.float()
                return _prepacked_linear(x.float(), self.key, start, stop, activation, residual).to(x.dtype)
            return _prepacked_linear(x, self.key, start, stop, activation, residual)
        return self.rows(start, stop)._gemm(x, activation, residual)

    def forward(self, x: torch.Tensor, activation: str = "none", residual: torch.Tensor | None = None) -> torch.Tensor:
        """``activation="gelu"`` applies exact (erf) GELU inside the GEMM, and ``residual`` is added there (a
        oneDNN post-op, while the output tile is in cache): each is one pass over the output less. In float32 the
        sum equals the GEMM followed by ``+ residual`` to the bit; in bfloat16 it is rounded once, not twice."""
        return self.forward_rows(x, 0, self.out_features, activation, residual)


_PREPACKED: weakref.WeakValueDictionary[int, PrepackedLinear] = weakref.WeakValueDictionary()


@torch.library.custom_op("xenc_lab::prepacked_linear", mutates_args=())
def _prepacked_linear(
    x: torch.Tensor, key: int, start: int, stop: int, activation: str, residual: torch.Tensor | None
) -> torch.Tensor:
    return _PREPACKED[key].rows(start, stop)._gemm(x, activation, residual)


@_prepacked_linear.register_fake
def _(x: torch.Tensor, key: int, start: int, stop: int, activation: str, residual: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], stop - start))


def linear_plus(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """linear(x) + residual, the add inside the GEMM where the layer is prepacked."""
    if isinstance(linear, PrepackedLinear):
        return linear(x, residual=residual)
    return linear(x) + residual


def prepack_linears(model: nn.Module, keep: Iterable[nn.Module] = ()) -> int:
    """Replace every nn.Linear of a CPU model by a PrepackedLinear where its dtype is ``supported``, but those in
    ``keep``; returns how many.

    The loader keeps a float32 model's per-pair linears torch's (the model's ``per_pair_linears()``: the layers that
    see one row per pair, as the last layer past its attention and the classification head do), and the first
    tokens' query rows take torch's F.linear too (``_linear_rows``). oneDNN's packed float32 GEMM sums each output
    over K in one running sum, torch's (MKL's, the oracle's) in blocks: at MiniLM's shapes oneDNN's products were
    1.3x (K = 384) to 1.9x (K = 1536) further from float64, mean relative error, and a per-pair row carries its
    error to the score undiluted. With these rows torch's, MiniLM-L6's logits came 1.46e-6 from float64 on average
    over 1,024 pairs of 28 tokens (max 6.1e-6), against 1.67e-6 all prepacked (max 8.7e-6), and 1.29e-6 against
    1.59e-6 over 1,024 of 95 tokens; sentence-transformers' own: 1.16e-6 and 1.11e-6. These GEMMs have one row per
    pair, under 1% of the time: the pairs/s moved by no more than the noise (0.995x and 1.007x)."""
    kept = {id(module) for module in keep}
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in kept:
                continue
            if type(child) is nn.Linear and PrepackedLinear.supported(child.weight.dtype, child.weight.device):
                setattr(parent, name, PrepackedLinear(child))
                count += 1
    return count


class RowLayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose eager CPU forward on a bfloat16 or float16 (T, d) stream runs xenc_lab's row kernel
    (``kernels``): one read of each row, float32 math, one rounding to the dtype, as torch's, at 1.6-1.7x its
    speed on 384-wide rows (torch's widens, normalizes and rounds in separate passes). Its outputs equal torch's
    in all but about 1 in 10^4 elements, those one rounding step away: its float32 mean and variance round
    otherwise than torch's (a two-pass sum against Welford's). In float32 that rounding is what parity with
    sentence-transformers measures (it doubled the deltas of the tiny test models), so float32 keeps torch's
    LayerNorm. So do torch.compile (inductor fuses the norm with its neighbours), other devices and shapes, and
    CPUs where the kernel could not be built."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type == "cpu"
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.dim() == 2
            and x.stride(-1) == 1
            and len(self.normalized_shape) == 1
            and (self.weight is None or self.weight.dtype == x.dtype)
            and not torch.compiler.is_compiling()
        ):
            out = layer_norm_cpu(x, self.weight, self.bias, self.eps)
            if out is not None:
                return out
        return super().forward(x)


def row_layer_norms(model: nn.Module) -> int:
    """Turn every nn.LayerNorm of a CPU model into a RowLayerNorm (same parameters, same state dict); returns how
    many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.LayerNorm and module.weight is not None and module.weight.device.type == "cpu":
            module.__class__ = RowLayerNorm
            count += 1
    return count
