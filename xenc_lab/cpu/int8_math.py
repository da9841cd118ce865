"""The int8 arithmetic in torch's ops: weights quantized per output channel, activations per row with a zero
point, inputs rotated by Hadamard blocks, the kernel's packed layout, and the torch route's product
(``torch_linear_int8``), which the kernel is checked against (cpu/int8.py)."""
from __future__ import annotations

import torch

INT8_COLS = 64  # columns of W^T per packed block (kInt8Cols in the C++ source)
ROTATION = 128  # input features per Hadamard block (kRotation in the C++ source)


def hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """(M, K) float32 rows, K a multiple of ROTATION, each block of ROTATION columns times the Sylvester Hadamard
    matrix of that order (entries +-1): the butterflies of strides 1, 2, ..., 64 in that order, each (a, b) ->
    (a + b, a - b), as the kernel computes them (bit for bit)."""
    y = x.reshape(-1, ROTATION)
    stride = 1
    while stride < ROTATION:
        pairs = y.view(-1, ROTATION // (2 * stride), 2, stride)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, ROTATION)
        stride *= 2
    return y.view(x.shape)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float weight -> (N, K) int8 and (N,) float32 scales: symmetric, one scale per output channel, the
    largest magnitude of each row mapped to 127 (a row of zeros gets scale 0)."""
    w = weight.detach().float()
    largest = w.abs().amax(dim=1)
    scale = largest / 127
    q = torch.where(scale[:, None] > 0, w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0.0)
    return q.round().clamp_(-127, 127).to(torch.int8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(M, K) activations -> (M, K) uint8 codes u, (M, 1) float32 scales s and zero points z, per row (token), as the
    kernel does: x ~ s (u - z) over the row's range [min(x, 0), max(x, 0)] in 255 steps (zero exact),
    u = round(x * (1 / s)) + z."""
    xf = x.float()
    low, high = xf.amin(dim=1, keepdim=True).clamp_(max=0), xf.amax(dim=1, keepdim=True).clamp_(min=0)
    s = ((high - low) / 255).clamp_(min=1e-30)
    z = (-low / s).round_()
    return (xf * s.reciprocal()).round_().add_(z).clamp_(0, 255).to(torch.uint8), s, z


def int8_blocks(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """A quantized (N, K) weight in ``linear_int8``'s layout: int8 blocks (ceil(N / 64), ceil(K / 4), 64, 4) of W^T
    (4 consecutive k of a column side by side, VNNI's layout), the int32 column sums sum_k W[n, k] for the
    zero points of x, the float32 scales and bias; each zero-padded to ceil(N / 64) * 64 columns."""
    n, k = q.shape
    width, k4 = -(-n // INT8_COLS) * INT8_COLS, -(-k // 4) * 4
    padded = torch.zeros(width, k4, dtype=torch.int8)
    padded[:n, :k] = q
    blocks = padded.view(width // INT8_COLS, INT8_COLS, k4 // 4, 4).permute(0, 2, 1, 3).contiguous()
    correction = padded.sum(dim=1, dtype=torch.int32)
    scales, biases = torch.zeros(width), torch.zeros(width)
    scales[:n] = scale
    if bias is not None:
        biases[:n] = bias.detach().float()
    return blocks, correction, scales, biases


def gated_order(n: int) -> torch.Tensor:
    """The row order of a gated layer's fused (2n, K) gate/up weight as ``activation="silu_mul"`` takes it: each
    block of INT8_COLS rows holds INT8_COLS / 2 gate rows, then the up rows of the same features."""
    half = INT8_COLS // 2
    if n % half:
        raise ValueError(f"a gated int8 layer needs a multiple of {half} features, got {n}")
    gate = torch.arange(n).view(-1, half)
    return torch.cat([gate, gate + n], dim=1).reshape(-1)


def silu_mul(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a gated layer's (M, 2n) product in ``gated_order``: (M, n)."""
    blocks = y.view(y.shape[0], -1, 2, INT8_COLS // 2)
    return (torch.nn.functional.silu(blocks[:, :, 0]) * blocks[:, :, 1]).reshape(y.shape[0], -1)


# Columns of k per float32 product in int_products: |(u - z) w| <= 255 * 127, and 512 such terms sum below 2^24, so
# every partial sum is an integer that float32 holds exactly, whatever order the GEMM adds in.
EXACT_K = 512


def int_products(u: torch.Tensor, z: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """sum_k (u[m, k] - z[m]) weight_t[k, n] for codes u (M, K) uint8, zero points z (M values) and an int8 weight_t
    (K, N), exact, as int32: float32 GEMMs over blocks of EXACT_K columns of k (float64 where float32 matmuls may
    run at lower precision, ``torch.set_float32_matmul_precision``). ``torch._int_mm`` is not exact on CPUs without
    AVX512-VNNI or AMX: oneDNN's ``vpmaddubsw`` saturates its 16-bit pair sums there."""
    dtype = torch.float32 if torch.get_float32_matmul_precision() == "highest" else torch.float64
    centered, w = u.to(dtype) - z.to(dtype).reshape(-1, 1), weight_t.to(dtype)
    sums = torch.zeros(u.shape[0], w.shape[1], dtype=torch.int32)
    for k0 in range(0, u.shape[1], EXACT_K):
        sums += (centered[:, k0:k0 + EXACT_K] @ w[k0:k0 + EXACT_K]).to(torch.int32)
    return sums


def torch_linear_int8(x: torch.Tensor, weight_t: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                       activation: str, residual: torch.Tensor | None, rotation: int = 0) -> torch.Tensor:
    """The torch route: x (M, K) rotated (where ``rotation``) and quantized per row, the (K, N) int8 weight_t
    multiplied exactly (``int_products``)."""
    u, x_scale, z = quantize_rows(hadamard_rows(x.float()) if rotation else x)
    y = int_products(u, z, weight_t).float().mul_(x_scale).mul_(scale)
    if bias is not None:
        y.add_(bias)
    if activation == "gelu":
        y = torch.nn.functional.gelu(y)
    elif activation == "silu_mul":
        y = silu_mul(y)
    elif residual is not None:
        y.add_(residual.float())
    return y.to(x.dtype)
