"""The native kernels' ops as Python calls, and the self-checks that decide, once per process, which of them run here.

Each ``*available()`` checks its op on a small problem against torch's result before any model uses it: a build
for another CPU, or a oneDNN that expects another layout, then falls back to torch's ops instead of computing wrong.
"""
from __future__ import annotations

import logging
import math

import torch

from .native import available, once, reason

logger = logging.getLogger("xenc_lab")

_TILE_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256  # the attention kernels' (kMaxHeadDim in the C++ source)


@torch.compiler.assume_constant_result  # checked eagerly, a constant to torch.compile
def tiles_available(dtype: torch.dtype) -> bool:
    """Whether the kernel's tile path runs here at ``dtype`` (bfloat16 or float16).

    The tile path computes Q K^T and P V as oneDNN batch-reduce GEMMs through ATen (``at::native::cpublas::brgemm``),
    on AMX tiles where the CPU has them for the dtype. It needs an AVX-512 build, a torch whose oneDNN takes the
    dtype on this CPU, and the B layout oneDNN expects for it here to be the VNNI pairs the path packs: that is
    checked, not assumed, by a small problem computed both ways and compared with the kernel, once per process and
    dtype (oneDNN's float16 GEMMs, for one, expect another layout on CPUs without AMX-FP16)."""
    if dtype not in _TILE_DTYPES or not available() or not torch.ops.xenc_lab.tiles_built():
        return False
    return once(("tiles", dtype), lambda: _tiles_check(dtype))


def _tiles_check(dtype: torch.dtype) -> bool:
    """The tile path against the kernel on three sequences (a lone query, a partial key tile, two query blocks)."""
    cu = torch.tensor([0, 1, 46, 116], dtype=torch.int32)
    qkv = torch.randn(116, 3 * 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    q, k, v = qkv.split(64, dim=1)
    expected = torch.ops.xenc_lab.packed_attention(q, k, v, cu, cu, 2, 0.3, -1).float()
    return _agrees(  # within the rounding of P and of the output, with room
        f"tile attention in {dtype}", lambda: torch.ops.xenc_lab.packed_attention_tiles(q, k, v, cu, cu, 2, 0.3, -1),
        expected, 8 * torch.finfo(dtype).eps, "oneDNN expects another layout; using the kernel")


def _agrees(what: str, run, expected: torch.Tensor, tolerance: float, otherwise: str) -> bool:
    """Whether ``run()`` runs here and comes within ``tolerance`` of ``expected`` (relative to 1 + |expected|; a
    NaN fails); a self-check's answer, logged where it is no."""
    try:
        out = run().float()
    except RuntimeError as e:
        logger.info("xenc_lab's %s does not run here (%s)", what, reason(e))
        return False
    error = ((out - expected).abs() / (1 + expected.abs())).max().item()
    if not error <= tolerance:
        logger.info("xenc_lab's %s is off by %.3g here (%s)", what, error, otherwise)
        return False
    return True


def packed_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_heads: int,
    scale: float | None,
    window: int | None = None,
    tiles: bool = False,
) -> torch.Tensor | None:
    """softmax(q k^T * scale) v per sequence and head, on a packed token stream; None without the kernel.

    q is (Tq, H * dh), k and v (Tk, H * dh), float32, bfloat16 or float16 (head_dim <= 256), rows possibly strided
    (column slices of one fused qkv tensor are read in place). Sequence b's keys and values are rows
    cu_seqlens_k[b]:[b + 1]; its queries are rows cu_seqlens_q[b]:[b + 1] of q and are the FIRST tokens of the
    sequence: cu_seqlens_q == cu_seqlens_k for self-attention, arange(B + 1) for the first token only. With
    ``window``, key j is visible from query i iff |i - j| <= window // 2. ``scale`` None means head_dim ** -0.5.
    Returns (Tq, H * dh) contiguous, q's dtype; rows of q outside every sequence come back as zeros.
    Everything but the inputs and the output is computed in float32.

    ``tiles``: in bfloat16 and float16, compute the two products with the tile path (``tiles_available``), where
    it runs here (else the kernel computes as usual). There the softmax numerators are rounded to the input type
    before they weight the values, as in torch's flash attention; the sums that divide them stay float32.
    """
    if not available():
        return None
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 or None, got {window}")
    if scale is None:
        scale = (q.shape[-1] // num_heads) ** -0.5
    op = torch.ops.xenc_lab.packed_attention
    if tiles and tiles_available(q.dtype):
        op = torch.ops.xenc_lab.packed_attention_tiles
    return op(q, k, v, cu_seqlens_q, cu_seqlens_k, num_heads, float(scale), -1 if window is None else int(window))


def paged_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_index: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_heads: int,
    scale: float,
) -> torch.Tensor | None:
    """Causal attention of chunks over a paged KV cache, on a packed stream; None without the kernel.

    Chunk b's queries are rows cu_seqlens_q[b]:[b + 1] of q, (Tq, H * dh); its keys and values are listed by
    key_index[cu_seqlens_k[b]:[b + 1]], each a row s of k_cache and v_cache, (S, KVH * dh), where s < S, else row
    s - S of k and v, (Tk, KVH * dh). The queries are the chunk's last tokens: query i of n sees its first
    ``keys - n + i + 1`` keys. Query head h reads key head h // (H / KVH) (grouped-query attention). Rows may be
    strided (columns contiguous); float32, bfloat16 or float16; exact softmax in float32, as ``packed_attention_cpu``.
    Returns (Tq, H * dh), q's dtype, rows outside every chunk zero."""
    if not available():
        return None
    return torch.ops.xenc_lab.paged_attention(q, k, v, k_cache, v_cache, key_index, cu_seqlens_q, cu_seqlens_k,
                                              num_heads, float(scale))


def folded_pool_cpu(x: torch.Tensor, folded: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor | None:
    """Per pair b (rows cu_seqlens[b]:[b + 1] of x, (T, d)) and head h, sum_j softmax_j(x_j . folded[h, b]) x_j as
    (B, H, d), zeros for empty pairs and pairs past cu_seqlens (``ops.first_token.folded_first_token_attention``); None
    without the kernel. The pairs are shared among the threads, each pair's ops single-threaded."""
    if not available():
        return None
    return torch.ops.xenc_lab.folded_pool(x, folded, cu_seqlens)


def layer_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor | None:
    """LayerNorm over the last dimension of a 2-D CPU tensor (float32, bfloat16, float16; columns contiguous),
    computed in float32 and rounded once to x's dtype, as torch's; None without the kernel. ``weight`` and
    ``bias`` are contiguous, of x's dtype, or None."""
    if not available():
        return None
    return torch.ops.xenc_lab.layer_norm(x, weight, bias, float(eps))


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """transformers' RMSNorm of each row of a 2-D CPU tensor (float32, bfloat16, float16; columns contiguous), in
    one pass: ``weight`` times the row over its root mean square (float32, rounded to x's dtype before the weight
    multiplies it); None without the kernel. ``weight`` is contiguous, of x's dtype."""
    if not available():
        return None
    return torch.ops.xenc_lab.rms_norm(x, weight, float(eps))


def rope_cpu(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor | None:
    """Rotary positions on every head of a (T, G, D) CPU tensor whose heads lie end to end in each (possibly
    strided) row: ``x * cos + roll(x, D / 2) * sin`` per head, with ``cos`` and ``sin`` (T, D) of x's dtype (the
    sines of the first half negated, ``ops.rotary.rotate``), each product rounded to the dtype before the sum;
    each head first RMS-normalized with its row of ``weight`` (G, D) if given (``rms_norm_cpu``). (T, G, D)
    contiguous, or None without the kernel."""
    if not available():
        return None
    return torch.ops.xenc_lab.rope(x, weight, float(eps), cos, sin)


GEMM_COLS = 64  # columns of W^T per packed block of ``linear_widened`` and ``linear_f32`` (kGemmCols in the C++ source)


def gemm_blocks(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's (N, K) weight and (N,) bias (or None) in ``linear_widened``'s and ``linear_f32``'s layout: float32 blocks
    (ceil(N / 64), K, 64) of W^T and a (ceil(N / 64) * 64,) bias, zero-padded past N."""
    n, k = weight.shape
    width = -(-n // GEMM_COLS) * GEMM_COLS
    wt = torch.zeros(k, width, dtype=torch.float32)
    wt[:, :n] = weight.detach().t().float()
    padded = torch.zeros(width, dtype=torch.float32)
    if bias is not None:
        padded[:n] = bias.detach().float()
    return wt.view(k, width // GEMM_COLS, GEMM_COLS).permute(1, 0, 2).contiguous(), padded


def _gemm_f32_built() -> bool:
    """Whether the fp32 GEMMs (``linear_f32``, ``linear_widened``) are in this build: AVX2 and FMA or AVX-512, and a
    torch with ATen's fp32 brgemm."""
    return available() and torch.ops.xenc_lab.gemm_f32_built()


def _gemm_check_problem() -> tuple[torch.Tensor, ...]:
    """x (100, 72), W (80, 72), bias and residual: a partial block of rows (96) and of columns (64) for the
    self-checks."""
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*shape, generator=g) for shape in ((100, 72), (80, 72), (80,), (100, 80)))


@torch.compiler.assume_constant_result  # checked eagerly, a constant to torch.compile
def widened_gemm_available() -> bool:
    """Whether ``linear_widened`` runs here: a build for a CPU with AVX2 and FMA (or AVX-512) and a torch with ATen's
    fp32 brgemm, checked once per process in bfloat16 and float16 on a small problem (a partial block of rows and of
    columns, GELU and residual) against torch's own ops."""
    if not _gemm_f32_built():
        return False
    return once("widened gemm", _widened_gemm_check)


def _widened_gemm_check() -> bool:
    x, weight, bias, residual = _gemm_check_problem()
    for dtype in (torch.bfloat16, torch.float16):
        x16, w16, r16 = x.to(dtype), weight.to(dtype), residual.to(dtype)
        blocks, padded = gemm_blocks(w16, bias)
        product = x16.float() @ w16.float().t() + bias
        for activation, want in {"gelu": torch.nn.functional.gelu(product), "none": product + r16.float()}.items():
            add = r16 if activation == "none" else None
            if not _agrees(  # one rounding to dtype, with room
                f"{dtype} GEMM ({activation})",
                lambda: torch.ops.xenc_lab.linear_widened(x16, blocks, padded, 80, activation, add),  # noqa: B023
                want, 2 * torch.finfo(dtype).eps, "using oneDNN's",
            ):
                return False
    return True


@torch.compiler.assume_constant_result  # checked eagerly, a constant to torch.compile
def f32_gemm_available() -> bool:
    """Whether ``linear_f32`` runs here: a build for a CPU with AVX2 and FMA (or AVX-512) and a torch with ATen's fp32
    brgemm, checked once per process on a small problem (a partial block of rows and of columns, GELU and residual)
    against the exact result."""
    if not _gemm_f32_built():
        return False
    return once("f32 gemm", _f32_gemm_check)


def _f32_gemm_check() -> bool:
    x, weight, bias, residual = _gemm_check_problem()
    blocks, padded = gemm_blocks(weight, bias)
    product = x.double() @ weight.double().t() + bias.double()
    expected = {"gelu": torch.nn.functional.gelu(product), "none": product + residual.double()}
    return all(  # fp32 rounding of 72-term sums, about 1e-6 here; a wrong layout is off by units
        _agrees(f"fp32 GEMM ({activation})", lambda a=activation: torch.ops.xenc_lab.linear_f32(
            x, blocks, padded, 80, a, residual if a == "none" else None).double(), want, 1e-5, "using oneDNN's")
        for activation, want in expected.items()
    )


def linear_f32_cpu(
    x: torch.Tensor,
    blocks: torch.Tensor,
    bias: torch.Tensor,
    out_features: int,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + bias, then exact GELU (``activation="gelu"``, torch's erf approximation) or ``+ residual``, in
    float32: x is (M, K) float32 with contiguous columns, ``blocks``/``bias`` from ``gemm_blocks``. ATen's fp32
    brgemm (oneDNN) on blocks of 96 rows by 64 columns, the bias and GELU or residual applied to each output tile in
    cache. Callers check ``f32_gemm_available()`` first."""
    return torch.ops.xenc_lab.linear_f32(x, blocks, bias, out_features, activation, residual)


def linear_widened_cpu(
    x: torch.Tensor,
    blocks: torch.Tensor,
    bias: torch.Tensor,
    out_features: int,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + bias, then exact GELU (``activation="gelu"``) or ``+ residual``, rounded once to x's dtype: x is
    (M, K) bfloat16 or float16 with contiguous columns, ``blocks``/``bias`` from ``gemm_blocks``. Products and sums
    in float32 (a bf16 or fp16 GEMM's arithmetic: products of either are exact in float32); x widened a block at a
    time in cache, bias, GELU, residual and rounding applied to each output tile in cache. Callers check
    ``widened_gemm_available()`` first."""
    return torch.ops.xenc_lab.linear_widened(x, blocks, bias, out_features, activation, residual)


HALF_GEMM_COLS = 128  # columns of W^T per packed block of ``linear_half`` (kHalfCols in the C++ source)
HALF_GEMM_CHUNK = 64  # consecutive k summed in float16 before the float32 sum (kHalfChunk)
HALF_GEMM_ROW_MAX = 7  # each row of x is scaled so that its largest element is below 2^7 (kHalfRowMax)


def half_blocks(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, int, torch.Tensor]:
    """A linear layer's (N, K) weight and (N,) bias (or None) in ``linear_half``'s layout: float16 blocks
    (ceil(N / 128), K, 128) of W^T scaled by 2^t so that its largest element lies in [1, 2), t, and a float32
    (ceil(N / 128) * 128,) bias; zero-padded past N. A bfloat16 weight is exact in these blocks but for elements
    below 2^-14 of the largest, which fall to float16's subnormals (at most 2^-25 of the largest off)."""
    n, k = weight.shape
    largest = weight.detach().abs().max().item() if weight.numel() else 0.0
    if not math.isfinite(largest):
        raise ValueError(f"the float16 GEMM needs a finite weight, got one whose largest magnitude is {largest}")
    exponent = 1 - math.frexp(largest)[1] if largest > 0 else 0  # largest * 2^exponent in [1, 2)
    width = -(-n // HALF_GEMM_COLS) * HALF_GEMM_COLS
    wt = torch.zeros(k, width, dtype=torch.float32)
    wt[:, :n] = torch.ldexp(weight.detach().t().float(), torch.tensor(float(exponent)))
    padded = torch.zeros(width, dtype=torch.float32)
    if bias is not None:
        padded[:n] = bias.detach().float()
    blocks = wt.half().view(k, width // HALF_GEMM_COLS, HALF_GEMM_COLS).permute(1, 0, 2).contiguous()
    return blocks, exponent, padded


def paired_bf16() -> bool:
    """Whether the kernel's bf16 attention runs on the bf16 pair dot product here (the AMD build, see
    ``_compiler_flags``): scores from bf16 pairs of query and key columns, and weighted sums of the values with the
    softmax numerators rounded to bf16 (their sum is the fp32 one), as torch's flash attention computes bf16 on the
    CPU. Elsewhere both products are fp32 FMAs on widened values and only the output is rounded."""
    return available() and bool(torch.ops.xenc_lab.paired_bf16_built())


@torch.compiler.assume_constant_result  # checked eagerly, a constant to torch.compile
def half_gemm_available() -> bool:
    """Whether ``linear_half`` runs here: a build for a CPU with AVX512-FP16, checked once per process on a small
    problem (a partial block of rows and of columns, more than one chunk of k, GELU and residual) against the
    exact result."""
    if not available() or not torch.ops.xenc_lab.half_gemm_built():
        return False
    return once("half gemm", _half_gemm_check)


def _half_gemm_check() -> bool:
    g = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=g) for shape in ((100, 136), (150, 136), (150,)))
    residual = torch.randn(100, 150, generator=g).bfloat16()
    x, weight = x.bfloat16(), weight.bfloat16()
    blocks, exponent, padded = half_blocks(weight, bias)
    product = x.double() @ weight.double().t() + bias.double()
    # float16 sums err in proportion to the terms' magnitudes, not to the result's: measured against sum |x| |w|
    scale = 1 + x.double().abs() @ weight.double().abs().t() + residual.double().abs()
    expected = {"gelu": torch.nn.functional.gelu(product), "none": product + residual.double()}
    return all(  # about 1e-3 here; a wrong layout or scale is off by tenths
        _agrees(f"fp16 GEMM ({activation})", lambda a=activation: torch.ops.xenc_lab.linear_half(
            x, blocks, exponent, padded, 150, a, residual if a == "none" else None).double() / scale,
            want / scale, torch.finfo(torch.bfloat16).eps, "using the fp32 GEMM")
        for activation, want in expected.items()
    )


def linear_half_cpu(
    x: torch.Tensor,
    blocks: torch.Tensor,
    weight_exponent: int,
    bias: torch.Tensor,
    out_features: int,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + bias, then exact GELU (``activation="gelu"``) or ``+ residual``, rounded once to bfloat16, with
    the products and sums in float16 over chunks of 64 consecutive k and the chunks summed in float32: x is (M, K)
    bfloat16 with contiguous columns, each row scaled by a power of two of its own (undone in float32);
    ``blocks``, ``weight_exponent`` and ``bias`` from ``half_blocks``. Callers check ``half_gemm_available()``."""
    return torch.ops.xenc_lab.linear_half(x, blocks, weight_exponent, bias, out_features, activation, residual)
