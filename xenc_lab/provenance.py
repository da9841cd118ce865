"""Where a report's numbers come from: the machine, the date, the commit, the library versions and the one command
that regenerates the report whole. Every file in reports/ opens with this line."""
from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The CPU flags that decide which kernels run (docs/cpu-backends.md): a report names each, present or absent.
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
PACKAGES = ("torch", "transformers", "sentence-transformers")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def commit() -> str:
    """The checkout's commit, ``+changes`` where tracked files outside reports/ and notebooks/ differ from it (the
    code that ran is not the commit's); "unknown" outside a git checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!reports",
                                ":!notebooks"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return sha + (" +changes" if dirty else "")


def cpu_line() -> str:
    """CPU model (family and model numbers), logical CPUs, torch threads, and each of FLAGS as present or absent."""
    import os

    import torch

    from .cpu.info import cpu_info

    info = cpu_info()
    flags = info.flags
    have = [f for f in FLAGS if f in flags]
    lacks = [f for f in FLAGS if f not in flags]
    return (f"{info.model}{f' ({info.family})' if info.family else ''}, {os.cpu_count()} CPUs, "
            f"{torch.get_num_threads()} torch threads; flags: {', '.join(have) or 'none of ' + ', '.join(FLAGS)}"
            + (f" (absent: {', '.join(lacks)})" if have and lacks else ""))


def provenance(command: str, machine: str | None = None) -> str:
    """The report's header paragraph (markdown): ``machine`` (default: this CPU, ``cpu_line``), date (UTC), commit,
    Python and library versions, and ``command``, the one that regenerates the report (or its section) whole."""
    machine = machine or cpu_line()
    versions = ", ".join([f"Python {platform.python_version()}"] + [f"{p} {_version(p)}" for p in PACKAGES])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"Machine: {machine}.  \nWritten {when} at commit {commit()}; {versions}.  \n"
            f"Regenerate with `{command}`.")
