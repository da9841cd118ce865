"""``RowLayerNorm``: LayerNorm on the CPU in 16-bit dtypes through xenc_lab's row kernel."""
from __future__ import annotations

import torch
from torch import nn

from .kernels import layer_norm_cpu


class RowLayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose eager CPU forward on a bfloat16 or float16 (T, d) stream runs xenc_lab's row kernel: one
    read of each row, float32 math, one rounding to the dtype, as torch's. Its outputs equal torch's but for about 1
    element in 10^4, one rounding step away (a two-pass float32 mean and variance against Welford's). Float32 keeps
    torch's LayerNorm, whose rounding parity measures; so do torch.compile (inductor fuses the norm with its
    neighbours), other devices and shapes, and CPUs where the kernel could not be built."""

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
