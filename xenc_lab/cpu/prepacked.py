"""``PrepackedLinear``: a CPU linear layer whose weight is packed once, at load, for the GEMM route that runs it."""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from .gemm import BF16_GEMMS, bf16_gemm, f32_gelu_gemm, onednn_bf16, onednn_fp16
from .kernels import (
    f32_gemm_available,
    gemm_blocks,
    half_blocks,
    half_gemm_available,
    linear_f32_cpu,
    linear_half_cpu,
    linear_widened_cpu,
    widened_gemm_available,
)


def rows_of(t: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """t (or None) as (M, width) rows with contiguous columns, as xenc_lab's GEMMs take inputs and residuals."""
    if t is None:
        return None
    rows = t.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class PrepackedLinear(nn.Module):
    """A Linear whose weight is packed once, at load, for the CPU GEMM that runs it (float32 and bfloat16, and
    float16 where oneDNN has no float16 GEMM). ``weight`` and ``bias`` stay as they were.

    - float32, and bfloat16 where ``gemm`` is ``"native"``: oneDNN's GEMM on the weight reordered once into its
      blocked layout (torch's CPU GEMMs take the weight as it is on every call). Called with the GELU, a float32
      layer runs xenc_lab's fp32 GEMM instead where ``gelu_gemm`` is ``"fused"`` (``gemm.f32_gelu_gemm``).
    - bfloat16 ``"fp16"``: xenc_lab's float16 GEMM on a scaled float16 copy of the weight.
    - bfloat16 ``"fp32"``, and float16: float32 FMAs on a float32 copy, each block of input rows widened in cache
      (xenc_lab's GEMM), or torch's ops around oneDNN's float32 GEMM where that does not run or ``fused=False``.
    Each falls back to the next where it does not run here; xenc_lab's GEMMs apply the bias, GELU or residual and
    the rounding to each output tile in cache.

    Under torch.compile the GEMM is one opaque op, ``xenc_lab::prepacked_linear`` (inductor cannot lower oneDNN's
    packed float32 weights itself): the compiled graph keeps these GEMMs and fuses what lies between them."""

    _keys = itertools.count()

    def __init__(
        self, linear: nn.Linear, gemm: str | None = None, fused: bool | None = None, gelu_gemm: str | None = None
    ):
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
        if linear.weight.dtype == torch.float32:
            self.gelu_gemm = gelu_gemm or f32_gelu_gemm()
            if self.gelu_gemm == "fused" and not f32_gemm_available():
                self.gelu_gemm = "onednn"
        else:
            self.gelu_gemm = None
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
            self._rows[start, stop] = PrepackedLinear(part, self.gemm, self.fused, self.gelu_gemm)
        return self._rows[start, stop]

    def _rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """x as (M, in_features) rows with contiguous columns, as xenc_lab's GEMMs take them."""
        return rows_of(x, self.in_features)

    def _gemm(self, x: torch.Tensor, activation: str, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None and activation != "none":
            raise ValueError(f"a residual is added to the plain product only, not after {activation!r}")
        if activation == "gelu" and self.gelu_gemm == "fused":  # xenc_lab's fp32 GEMM, GELU in cache
            if self._gelu_blocks is None:  # only the layers that GELU follows need this copy
                self._gelu_blocks = gemm_blocks(self.weight, self._bias)
            y = linear_f32_cpu(self._rows_of(x), *self._gelu_blocks, self.out_features, "gelu")
            return y.view(*x.shape[:-1], self.out_features)
        if self.fused:  # xenc_lab's GEMMs
            rows, residual = self._rows_of(x), rows_of(residual, self.out_features)
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
    return x.new_empty((*x.shape[:-1], (stop - start) // (2 if activation == "silu_mul" else 1)))


def prepack_linears(model: nn.Module, choices, keep: Iterable[nn.Module] = ()) -> int:
    """Replace every nn.Linear of a CPU model by a PrepackedLinear on the GEMM routes of ``choices`` (a
    ``choices.Choices``) where its dtype is ``supported``, but those in ``keep``; returns how many.

    The loader keeps a float32 model's per-pair linears torch's (the layers that see one row per pair): oneDNN's
    packed float32 GEMM sums each output over K in one running sum, torch's (MKL's, the oracle's) in blocks, and a
    per-pair row carries its rounding to the score undiluted (docs/cpu-backends.md)."""
    kept = {id(module) for module in keep}
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in kept:
                continue
            if type(child) is nn.Linear and PrepackedLinear.supported(child.weight.dtype, child.weight.device):
                setattr(parent, name, PrepackedLinear(child, choices.bf16_gemm, gelu_gemm=choices.f32_gelu_gemm))
                count += 1
    return count
