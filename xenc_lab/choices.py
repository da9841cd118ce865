"""The engine's choices for one loaded model, made once at load from the device, the dtype, the model's head shape,
the CPU's features and the ``XENC_LAB_*`` overrides (``settings``): one frozen record that the runner hands to the
model with every batch. Nothing is chosen again while scoring."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import settings
from .cpu import gemm, kernels, native
from .attention_paths import cpu_attention_path
from .ops.attention import varlen_runs


@dataclass(frozen=True, slots=True)
class Choices:
    device: str  # "cpu" or "cuda"
    dtype: torch.dtype
    attention: str  # "kernel" | "tiles" (CPU, on the packed stream) | "varlen" (CUDA flash) | "sdpa" (padded pairs)
    first_token_kv: str  # "folded" (CPU float32) | "projected": the last layer's keys and values for the first token
    bf16_gemm: str | None  # CPU bfloat16: "native" | "fp32" | "fp16" (gemm.bf16_gemm); None elsewhere
    f32_gelu_gemm: str | None  # CPU float32: "fused" | "onednn" (gemm.f32_gelu_gemm); None elsewhere
    batch_shapes: str  # "bucketed" (CPU) | "graphs" (CUDA, compiled) | "exact": how batches are shaped
    compile: bool
    dynamic: bool  # compile=True traces symbolic sizes (one graph for any batch, or one compilation for all buckets)
    quantization: str | None = None  # "int8": linear layers int8 (cpu/int8.py: its route), the rest at dtype

    @property
    def attends_packed(self) -> bool:
        """Whether attention runs on the packed stream itself (else on pairs laid out padded, for SDPA)."""
        return self.attention != "sdpa"

    @property
    def row_kernels(self) -> bool:
        """Whether eager forwards may run xenc_lab's CPU row kernels (decoders' RMSNorm and rotary positions)."""
        return self.device == "cpu"


def resolve(
    device: torch.device, dtype: torch.dtype, head_shape: tuple[int, int] | None, compile: bool, causal: bool = False,
    quantization: str | None = None,
) -> Choices:
    """The choices for a model of this ``head_shape`` ((heads, head dim); None where the family's attention is its
    own) at ``dtype`` on ``device``. On the CPU this builds the native kernels (once per kind of CPU) and, on CPUs
    with AMX, may time the attention paths (once per kind of CPU, kept on disk). A ``causal`` model (a decoder)
    writes its KV cache in place from inside the forward, which CUDA graphs cannot replay: compiled on CUDA, it
    runs without them."""
    cpu = device.type == "cpu"
    attention = "sdpa"
    if causal:  # a decoder's chunk attention: flash varlen or xenc_lab's kernel where it runs, else padded SDPA
        if head_shape is not None and not cpu and varlen_runs(device, dtype, head_shape[1]):
            attention = "varlen"
        elif (head_shape is not None and cpu and native.available() and head_shape[1] <= kernels.MAX_HEAD_DIM
              and settings.get("XENC_LAB_CPU_ATTENTION") != "sdpa"):
            attention = "kernel"
    elif head_shape is not None and cpu and native.available():
        attention = cpu_attention_path(dtype, *head_shape)
        if attention == "tiles" and not kernels.tiles_available(dtype):
            attention = "kernel"
    elif head_shape is not None and not cpu and varlen_runs(device, dtype, head_shape[1]):
        attention = "varlen"
    graphs = compile and not cpu and not causal
    if graphs:
        batch_shapes = "graphs"
    elif cpu:
        batch_shapes = settings.get("XENC_LAB_CPU_BATCH_SHAPES") or "bucketed"
    else:
        batch_shapes = "exact"
    # The folded first-token keys and values multiply by the float weights, which int8 layers do not keep.
    folded = cpu and dtype == torch.float32 and quantization is None and (settings.get("XENC_LAB_FIRST_TOKEN_KV") or "folded") == "folded"
    return Choices(
        device=device.type,
        dtype=dtype,
        attention=attention,
        first_token_kv="folded" if folded else "projected",
        bf16_gemm=gemm.bf16_gemm() if cpu and dtype == torch.bfloat16 else None,
        f32_gelu_gemm=gemm.f32_gelu_gemm() if cpu and dtype == torch.float32 else None,
        batch_shapes=batch_shapes,
        compile=compile,
        dynamic=not graphs or settings.get("XENC_LAB_CUDA_COMPILE") != "static",
        quantization=quantization,
    )
