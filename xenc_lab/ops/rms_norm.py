"""RMSNorm as transformers' decoders compute it, on xenc_lab's CPU row kernel where the choices allow."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..choices import Choices
from ..cpu.kernels import rms_norm_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, choices: Choices) -> torch.Tensor:
    """x over its root mean square (float32), cast back to x's dtype, then times ``weight``, as transformers' Llama
    RMSNorm; one pass per row on the CPU kernel (eager, 2-D rows, weight of x's dtype)."""
    if (choices.row_kernels and not torch.compiler.is_compiling() and x.dim() == 2 and x.stride(-1) == 1
            and weight.dtype == x.dtype):
        out = rms_norm_cpu(x, weight, eps)
        if out is not None:
            return out
    # torch's fused RMS norm, in float32: the same values as transformers' x * rsqrt(mean(x^2) + eps) (checked in the
    # tests); the weight multiplies after the cast, as there.
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if x.dtype == torch.float32:
        return normed.mul_(weight)
    return weight * normed.to(x.dtype)


def rms_norm_scaled_float32(x: torch.Tensor, scale: torch.Tensor, eps: float, choices: Choices) -> torch.Tensor:
    """x over its root mean square times the float32 ``scale``, in float32, then cast to x's dtype (Gemma's order:
    the scale multiplies before the cast). In float32 that is ``rms_norm``'s."""
    if x.dtype == torch.float32:
        return rms_norm(x, scale, eps, choices)
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * scale).to(x.dtype)
