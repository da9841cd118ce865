"""What the CPU is, read from /proc/cpuinfo (never assumed): choices of kernels and GEMM paths depend on it."""
from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import NamedTuple


class CpuInfo(NamedTuple):
    vendor: str  # vendor_id: "GenuineIntel", "AuthenticAMD", ...; "" where unknown
    model: str  # model name, else what the platform module says
    flags: frozenset[str]  # e.g. "avx512_bf16", "amx_bf16"
    family: str = ""  # "cpu family" and "model" numbers, e.g. "family 26, model 2" (AMD Zen 5); "" where unknown


@functools.cache
def cpu_info() -> CpuInfo:
    """The first CPU's vendor, model name, flags, and family and model numbers."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    fields: dict[str, str] = {}
    for line in lines:
        if not line.strip():
            break  # the end of the first CPU's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine()
    family = f"family {fields['cpu family']}, model {fields['model']}" if "cpu family" in fields and "model" in fields else ""
    return CpuInfo(fields.get("vendor_id", ""), model, frozenset(fields.get("flags", "").split()), family)
