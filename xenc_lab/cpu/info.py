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


# Flags of the units that multiply 16-bit floats natively; without one, a 16-bit matrix product on the CPU runs
# through conversions to float32.
HALF_UNITS = {"bfloat16": ("amx_bf16", "avx512_bf16"), "float16": ("amx_fp16", "avx512_fp16")}


def native_half_units(dtype: str) -> bool | None:
    """Whether this CPU multiplies ``dtype`` ("bfloat16" or "float16") natively (AMX or AVX-512 units): True or
    False read from its flags, None where they cannot be read (not x86, or no /proc/cpuinfo)."""
    flags = cpu_info().flags
    if not flags or platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return None
    return any(flag in flags for flag in HALF_UNITS[dtype])
