"""Where CPU attention runs: xenc_lab's kernel, its tile path, or torch's SDPA; measured where it is in doubt.

Float32, and CPUs without AMX for the dtype, run the kernel. With AMX, which path is fastest depends on the head
shape, so it is measured once per kind of CPU, torch version, dtype, head shape and thread count, and the answer is
kept on disk beside the kernel build: a machine takes the same path in every run. ``XENC_LAB_CPU_ATTENTION`` forces
one. The kernel's and the tile path's result for a pair is bitwise independent of its batchmates; SDPA's in half
precision can move by a rounding step with the batch's padded length (docs/cpu-backends.md). It times whole packed
batches through ``ops``, so it stands above the CPU backend (cpu/), beside the choices made at load.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

import numpy as np
import torch

from . import settings
from .batch import pack
from .cpu import kernels, native
from .cpu.info import cpu_info
from .ops.attention import packed_attention
from .tokenize import Encodings

logger = logging.getLogger("xenc_lab")

AMX_FLAG = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}
TUNING_LENGTHS = (128, 384)  # tokens per pair at which the two paths are timed (together)

_lock = threading.Lock()
_choices: dict[str, str] = {}  # this process's answers (path names), by key


PATHS = ("kernel", "tiles", "sdpa")


def cpu_attention_path(dtype: torch.dtype, num_heads: int, head_dim: int) -> str:
    """Where CPU attention at ``dtype`` and this head shape runs: "kernel", "tiles" (the kernel's tile path) or
    "sdpa" (SDPA also runs where the kernel could not be built, whatever this says)."""
    forced = settings.get("XENC_LAB_CPU_ATTENTION")
    if forced:
        return forced
    if dtype not in AMX_FLAG or AMX_FLAG[dtype] not in cpu_info().flags or not native.available():
        return "kernel"
    paths = candidate_paths(dtype)
    key = f"{str(dtype).removeprefix('torch.')}-{num_heads}x{head_dim}-{torch.get_num_threads()}threads-{'+'.join(paths)}"
    if key not in _choices:
        with _lock:
            if key not in _choices:
                _choices[key] = _measured_choice(key, dtype, num_heads, head_dim)
    return _choices[key]


def candidate_paths(dtype: torch.dtype) -> list[str]:
    """The CPU attention paths that run here at ``dtype``."""
    if not native.available():
        return ["sdpa"]
    return ["kernel", "tiles", "sdpa"] if kernels.tiles_available(dtype) else ["kernel", "sdpa"]


def _measured_choice(key: str, dtype: torch.dtype, num_heads: int, head_dim: int) -> str:
    """The fastest path's name (seconds at TUNING_LENGTHS), from the disk record or measured now and recorded."""
    record = native.build_directory() / "attention-paths.json"
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = {}
    if known.get(key) in PATHS:
        return known[key]
    seconds: dict[str, float] = {}
    for n in TUNING_LENGTHS:  # the same math on every path: its GFLOP over each path's rate
        for path, rate in attention_rates(num_heads, head_dim, dtype, n).items():
            seconds[path] = seconds.get(path, 0.0) + 4 * num_heads * head_dim * n * n * (4096 // n) / 1e9 / rate
    path = min(seconds, key=seconds.get)
    logger.info("CPU attention at %s: %s; using %s", key, ", ".join(f"{p} {s:.4f} s" for p, s in seconds.items()), path)
    try:  # another process may write its own answer meanwhile: the last rename wins, and both are measurements
        known[key] = path
        record.parent.mkdir(parents=True, exist_ok=True)
        scratch = record.with_name(f"{record.name}.{os.getpid()}.{threading.get_ident()}")
        scratch.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(scratch, record)
    except OSError as e:
        logger.warning("could not record the CPU attention choice in %s (%s)", record, e)
    return path


def attention_rates(
    num_heads: int, head_dim: int, dtype: torch.dtype, pair_tokens: int, tokens: int = 4096, repeats: int = 10
) -> dict[str, float]:
    """GFLOP/s (4 x d x n^2 per pair of n tokens) of attention alone on 4096-token batches of packed pairs of
    ``pair_tokens`` tokens, by CPU path that runs here (``candidate_paths``): {"kernel": ..., "tiles": ...,
    "sdpa": ...}. SDPA's time includes laying the pairs out and back. The paths run in turn and each keeps its best
    time, so a busy moment of the machine does not fall on one path alone."""
    d, n = num_heads * head_dim, max(1, int(pair_tokens))
    count = max(1, tokens // n)
    enc = Encodings(np.ones(count * n, dtype=np.int64), None, np.arange(count + 1, dtype=np.int64) * n)
    batch = pack(enc, np.arange(count), page_size=16)
    qkv = torch.randn(batch.input_ids.shape[0], 3 * d, generator=torch.Generator().manual_seed(0)).to(dtype)
    paths = candidate_paths(dtype)
    best = dict.fromkeys(paths, float("inf"))
    with torch.inference_mode():
        for path in paths:
            packed_attention(qkv, batch, num_heads, path)  # warm up
        for _ in range(repeats):
            for path in paths:
                start = time.perf_counter()
                packed_attention(qkv, batch, num_heads, path)
                best[path] = min(best[path], time.perf_counter() - start)
    return {path: 4 * d * n * n * count / seconds / 1e9 for path, seconds in best.items()}
