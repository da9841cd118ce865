"""Every ``XENC_LAB_*`` environment variable, in one table: name, default, allowed values, meaning.

They override choices xenc_lab makes from the machine. They are read when a Scorer loads (``choices.resolve``) or
when the native kernels are built, never while scoring. docs/cpu-backends.md says what each choice does.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    default: str  # what an unset variable means, in words or as a value
    choices: tuple[str, ...] | None  # the values it takes (any case); None: free text
    meaning: str


SETTINGS = {
    s.name: s
    for s in (
        Setting("XENC_LAB_CACHE", "~/.cache/xenc_lab", None,
                "where the default model and the native kernel builds are kept"),
        Setting("XENC_LAB_NO_KERNELS", "0", ("0", "1"),
                "1: do not build or load the native CPU kernels; torch's ops run instead"),
        Setting("XENC_LAB_KERNEL_CFLAGS", "", None,
                "compiler flags appended to the native build's (later ones win), e.g. to build another CPU's paths"),
        Setting("XENC_LAB_CPU_ATTENTION", "measured on AMX CPUs, else kernel", ("kernel", "tiles", "sdpa"),
                "where CPU attention runs: xenc_lab's kernel, its tile path, or torch's SDPA (decoders: the kernel "
                "but for sdpa)"),
        Setting("XENC_LAB_BF16_GEMM", "the fastest route here", ("native", "fp32", "fp16"),
                "how bfloat16 linear layers multiply on the CPU: oneDNN's bf16 GEMM, fp32 FMAs, or xenc_lab's fp16 GEMM"),
        Setting("XENC_LAB_F32_GELU_GEMM", "fused on x86 without AVX-512, else onednn", ("fused", "onednn"),
                "how float32 linear layers followed by GELU multiply on the CPU: xenc_lab's GEMM or oneDNN's"),
        Setting("XENC_LAB_FIRST_TOKEN_KV", "folded", ("folded", "projected"),
                "the last layer's keys and values for the first token on the CPU in float32: folded into its query, "
                "or projected"),
        Setting("XENC_LAB_CPU_BATCH_SHAPES", "bucketed", ("bucketed", "exact"),
                "CPU batches padded to a few bucket shapes (bounded oneDNN caches), or each at its own shape"),
        Setting("XENC_LAB_CUDA_COMPILE", "dynamic", ("dynamic", "static"),
                "compile=True on CUDA: one compilation with symbolic sizes, or one per bucket shape"),
        Setting("XENC_LAB_PARITY_DEVICE", "cpu", None,
                "the parity suite only: the device xenc_lab runs on against the oracle on the CPU"),
        Setting("XENC_LAB_API_KEY", "", None,
                "xenc-lab serve only: the key every route but /health requires where --api-key is not given"),
    )
}


def get(name: str) -> str | None:
    """The value the variable ``name`` forces, lower-cased where it takes choices; None where it is unset or empty.
    A value outside its choices is a ValueError naming them."""
    setting = SETTINGS[name]
    value = os.environ.get(name, "").strip()
    if setting.choices is None or not value:
        return value or None
    value = value.lower()
    if value not in setting.choices:
        raise ValueError(f"{name} must be one of {', '.join(setting.choices)}, got {value!r}")
    return value


def check_all() -> None:
    """Every variable that is set holds one of its choices (a ValueError naming them otherwise): a Scorer checks this
    before it reads any weights."""
    for name in SETTINGS:
        get(name)


def cache_root() -> Path:
    """``XENC_LAB_CACHE``, else ~/.cache/xenc_lab: where the default model and the kernel builds are kept."""
    return Path(get("XENC_LAB_CACHE") or Path.home() / ".cache" / "xenc_lab")
