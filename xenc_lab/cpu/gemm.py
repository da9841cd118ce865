"""GEMM routes on the CPU: which GEMM multiplies bfloat16 and float32-with-GELU linear layers here.

Each default is the fastest route measured on the CPUs this project has run on; docs/cpu-backends.md has the
measurements. ``XENC_LAB_BF16_GEMM`` and ``XENC_LAB_F32_GELU_GEMM`` force one.
"""
from __future__ import annotations

import platform

import torch

from .. import settings
from .info import cpu_info
from .kernels import f32_gemm_available, half_gemm_available

BF16_GEMMS = ("native", "fp32", "fp16")
F32_GELU_GEMMS = ("fused", "onednn")


def onednn_bf16() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (torch asks for AVX-512 or bf16 units; AVX2-only CPUs have
    neither)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_fp16() -> bool:
    """Whether oneDNN multiplies float16 on this CPU (torch asks for AVX512-FP16 or AMX-FP16)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def bf16_gemm() -> str:
    """How bfloat16 linear layers multiply on this CPU (``prepacked.PrepackedLinear``):

    - ``"native"``: oneDNN's bf16 GEMM (AMX; AMD cores, whose bf16 dot product does the work of two fp32 FMAs).
    - ``"fp32"``: float32 FMAs on the bf16 values: bf16 products are exact in fp32, and a bf16 GEMM sums them in
      fp32 and rounds once, so the arithmetic is a bf16 GEMM's but for the order of the sums. The default where
      oneDNN has no bf16 GEMM (AVX2-only CPUs), and on Intel cores without AMX or AVX512-FP16.
    - ``"fp16"``: xenc_lab's float16 GEMM (``kernels.linear_half_cpu``) on Intel cores without AMX that have
      AVX512-FP16: bf16 values are exact in fp16 once scaled by powers of two; sums run in fp16 over 64 products
      and in fp32 across them.

    A forced ``fp16`` or ``native`` that cannot run here gives ``fp32``."""
    forced = settings.get("XENC_LAB_BF16_GEMM")
    if forced == "fp16" and not half_gemm_available() or forced == "native" and not onednn_bf16():
        return "fp32"
    if forced:
        return forced
    if not onednn_bf16():
        return "fp32"
    cpu = cpu_info()
    if platform.machine() not in ("x86_64", "AMD64") or cpu.vendor != "GenuineIntel" or "amx_bf16" in cpu.flags:
        return "native"
    return "fp16" if half_gemm_available() else "fp32"


def f32_gelu_gemm() -> str:
    """How float32 linear layers followed by the exact GELU multiply on this CPU (``prepacked.PrepackedLinear``):
    ``"onednn"``, oneDNN's GEMM on the prepacked weight with its GELU post-op; ``"fused"``, xenc_lab's fp32 GEMM
    (``kernels.linear_f32_cpu``), GELU applied to each output tile in cache. ``fused`` is the default on x86 CPUs
    without AVX-512, where it was measured faster, if it runs here; ``fused`` falls back to ``onednn``."""
    forced = settings.get("XENC_LAB_F32_GELU_GEMM")
    if forced == "onednn" or not f32_gemm_available():
        return "onednn"
    if forced:
        return forced
    return "onednn" if "avx512f" in cpu_info().flags else "fused"
