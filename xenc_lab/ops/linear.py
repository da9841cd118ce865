"""Linear layers as the models use them: fused projections, output rows, and a GEMM with its residual or GELU
inside where the CPU backend prepacked the layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu.int8 import Int8Linear, int8_mlp_available, int8_norm_available
from ..cpu.norm import RowLayerNorm
from ..cpu.prepacked import PrepackedLinear


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


def linear_rows(linear: nn.Module, start: int, stop: int, x: torch.Tensor, per_pair: bool = False) -> torch.Tensor:
    """Output features start:stop of ``linear`` on x. ``per_pair``: x holds one row per pair, which in float32 take
    torch's F.linear even where the layer is prepacked (see ``cpu.prepacked.prepack_linears``), but an int8 layer's."""
    if isinstance(linear, PrepackedLinear) and (linear.gemm == "int8" or not (per_pair and x.dtype == torch.float32)):
        return linear.forward_rows(x, start, stop)
    bias = None if linear.bias is None else linear.bias[start:stop]
    return F.linear(x, linear.weight[start:stop], bias)


def linear_plus(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """linear(x) + residual, the add inside the GEMM where the layer is prepacked."""
    if isinstance(linear, PrepackedLinear):
        return linear(x, residual=residual)
    return linear(x) + residual


def linear_gelu(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU of linear(x): inside the GEMM where the layer is prepacked, else in place."""
    if isinstance(linear, PrepackedLinear):
        return linear(x, activation="gelu")
    return torch.ops.aten.gelu_(linear(x))


def int8_mlp(first: nn.Module, second: nn.Module, x: torch.Tensor, activation: str, residual: torch.Tensor,
             norm: nn.Module | None = None) -> torch.Tensor | None:
    """second(``activation`` of first(x)) + residual, then ``norm`` where given, in one kernel call, a block of rows
    at a time, where both are int8 layers on the kernel route (``cpu.int8.Int8Linear.then``): the intermediate never
    leaves the cache, nor does the sum on its way to a norm the kernel can end in (``kernel_norm``). None elsewhere,
    under torch.compile, and where the two-layer call failed its check (``cpu.int8.int8_mlp_available``): the layers
    then run one at a time."""
    if (isinstance(first, Int8Linear) and isinstance(second, Int8Linear) and first.route == second.route == "kernel"
            and not torch.compiler.is_compiling() and int8_mlp_available()):
        if kernel_norm(norm, x):
            return first.then(second, x, activation, residual, norm)
        y = first.then(second, x, activation, residual)
        return y if norm is None else norm(y)
    return None


def linear_plus_norm(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """norm(linear(x) + residual): inside the int8 kernel's call where ``linear`` runs on it and it can end in
    ``norm`` (``kernel_norm``), each block of rows normed while in cache; else norm(linear_plus(...))."""
    if (isinstance(linear, Int8Linear) and linear.route == "kernel" and not torch.compiler.is_compiling()
            and kernel_norm(norm, x)):
        return linear._gemm(x, "none", residual, norm)
    return norm(linear_plus(linear, x, residual))


def kernel_norm(norm: nn.Module | None, x: torch.Tensor) -> bool:
    """Whether the int8 kernel's calls can end in ``norm`` on x: a row-kernel LayerNorm (``cpu.norm.RowLayerNorm``,
    which runs the layer_norm op in 16-bit dtypes) with a weight and bias of x's dtype, x in bfloat16 or float16,
    and the call's check passed (``cpu.int8.int8_norm_available``). Float32 keeps torch's LayerNorm."""
    return (type(norm) is RowLayerNorm and x.dtype in (torch.bfloat16, torch.float16)
            and len(norm.normalized_shape) == 1 and norm.weight is not None and norm.bias is not None
            and norm.weight.dtype == norm.bias.dtype == x.dtype and int8_norm_available())
