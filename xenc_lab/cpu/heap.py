"""glibc's heap thresholds, raised once per process so that a batch's freed activations stay for the next batch."""
from __future__ import annotations

import ctypes
import functools
import platform

import torch

# glibc's DEFAULT_MMAP_THRESHOLD_MAX: the highest its dynamic mmap threshold goes (32 MiB on 64-bit systems).
_GLIBC_THRESHOLD_CEILING = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)


@functools.cache
def keep_freed_batches() -> bool:
    """Raise glibc's heap thresholds to their ceiling, once per process; True where it ran (Linux with glibc).

    glibc serves an allocation above its mmap threshold from fresh pages, and each freed mmap'd chunk larger than
    the threshold raises it to that chunk's size, up to 32 MiB; the heap then keeps up to twice that free. Without
    this, each batch's activations were handed back to the kernel and taken again, zero-filled, by the next batch
    (page faults that cost 5-25% of bf16 throughput, docs/cpu-backends.md). Freeing one block just under 32 MiB
    does what a run of large batches would. Nothing is frozen: the thresholds stay dynamic, and another allocator
    sees one allocation and no more."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    torch.empty(_GLIBC_THRESHOLD_CEILING - (64 << 10), dtype=torch.uint8)  # mapped and unmapped, never touched
    return True
