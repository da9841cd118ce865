"""Stage 4: run the packed model on one batch. torch.compile is applied here, and only here."""
from __future__ import annotations

import ctypes
import functools
import platform
import time

import numpy as np
import torch
from torch import nn

from .batch import PackedBatch
from .config import env_choice
from .layers import flash_capable
from .pages import ATTENTION_SLACK, bucket_shape, plan_batches

CUDA_COMPILES = ("dynamic", "static")
CPU_BATCH_SHAPES = ("bucketed", "exact")


def _graphs_compiled() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# glibc's DEFAULT_MMAP_THRESHOLD_MAX: the highest its dynamic mmap threshold goes (32 MiB on 64-bit systems).
_GLIBC_THRESHOLD_CEILING = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)


@functools.cache
def keep_freed_batches() -> bool:
    """Raise glibc's heap thresholds to their ceiling, once per process, so that a batch's freed activations stay
    in the heap for the next batch; True where it ran (Linux with glibc).

    glibc serves an allocation above its mmap threshold (128 KiB at first) from fresh pages, and each freed
    mmap'd chunk larger than the threshold raises it to that chunk's size, up to 32 MiB; the heap keeps up to
    twice the threshold free at its top before it hands memory back (the trim threshold). A batch's activations
    (MiniLM-L6 at 4,096 tokens in bfloat16: 3-13 MB each, about 30 MB live at once; twice that in float32) were
    freed at its end, handed back, and taken again, zero-filled, by the next batch: 60,000-140,000 page faults
    per 256 long pairs in a process of its own, bfloat16 5-15% slower on long pairs and 10-25% on short ones
    (measured). Freeing one block just under 32 MiB does what a run of larger batches would do: both thresholds
    reach glibc's ceiling (the heap then keeps up to 64 MiB free), and steady-state runs take no page faults.
    Nothing is frozen: glibc's thresholds stay dynamic (``mallopt`` would fix them), and a process whose
    thresholds are already there, or another allocator (jemalloc, tcmalloc), sees one allocation and no more."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    torch.empty(_GLIBC_THRESHOLD_CEILING - (64 << 10), dtype=torch.uint8)  # mapped and unmapped, never touched
    return True


class ModelRunner:
    """Runs the model on packed batches, compiled or not.

    Batch shapes (``batch_shapes``, the (T, B, L) that ``batch_shape`` gives a batch):
    - ``"bucketed"``, the CPU's: tokens up to a multiple of an eighth of the budget, sequences up to a power of two,
      the attention length the batch's own. oneDNN keeps what it builds for each GEMM shape it meets (its primitive
      cache and ideep's, up to 1,024 entries each; about 0.5 MB per linear layer and row count at MiniLM's shapes,
      measured), so with a shape per batch memory grew with the input: a fresh process scoring mixed pairs in
      bfloat16 on MiniLM-L6 took 637 MB over what it held before scoring for 20,000 pairs, 139 MB bucketed (111 MB
      for 2,000). The filler is 1-2.5% more tokens on the benchmark's workloads; alternating in one process, bucketed
      runs scored within 1-3% of exact ones' pairs/s, about the machine's noise. ``XENC_LAB_CPU_BATCH_SHAPES=exact``
      runs each batch at its own shape instead.
    - ``"graphs"``, compile=True on CUDA: "reduce-overhead" records a CUDA graph per shape, which must be static,
      so the attention length is bucketed too, and tokens to an eighth of the budget: a long run records a
      handful of CUDA graphs rather than one per batch.
    - ``"exact"``, eager on CUDA: each batch its own shape (whole pages).

    Compiled on the CPU, the forward is traced once with symbolic sizes (the GEMMs and attention are opaque ops,
    and inductor fuses what lies between them), so any batch reuses the one graph. Inductor compiles the CUDA
    forward once with symbolic sizes too, and each new bucket shape costs a graph recording, not a compilation;
    ``XENC_LAB_CUDA_COMPILE=static`` compiles one graph per bucket shape instead (benchmarks compare them)."""

    MAX_GRAPHS = 64  # compiled graphs kept before torch.compile would fall back to eager

    def __init__(self, model: nn.Module, device: torch.device, compile: bool = False):
        self.model = model
        self.device = device
        self.compiled = compile
        self.cuda_graphs = compile and device.type == "cuda"
        if self.cuda_graphs:
            self.batch_shapes = "graphs"
        elif device.type == "cpu":
            self.batch_shapes = env_choice("XENC_LAB_CPU_BATCH_SHAPES", CPU_BATCH_SHAPES) or "bucketed"
        else:
            self.batch_shapes = "exact"
        # Symbolic sizes: on the CPU one graph serves every batch; on CUDA one compilation serves every bucket.
        self.dynamic = not self.cuda_graphs or env_choice("XENC_LAB_CUDA_COMPILE", CUDA_COMPILES) != "static"
        self.compile_options = self._compile_options() if compile else {}
        self._forward = torch.compile(model, dynamic=self.dynamic, options=self.compile_options) if compile else model
        self.shapes: set[tuple[int, int, int]] = set()  # (T, B, L) of every batch run so far
        if device.type == "cpu":
            keep_freed_batches()
        else:
            flash_capable(device)  # read now, not while a forward is traced
        self.graphs = 0  # graphs compiled for this model
        self.compile_seconds = 0.0  # time of the calls that compiled one

    @functools.cached_property
    def pads_pairs(self) -> bool:
        """Whether the model lays a batch out as (pairs, longest pair) padded sequences anywhere (SDPA, DeBERTa's
        relative positions), on this device at its dtype: each module that may says so
        (``pads_pairs``); a model whose modules say nothing is taken to. Read at the first plan, when the CPU's
        attention path (``tuning``) is known."""
        dtype = next(self.model.parameters()).dtype
        answers = [m.pads_pairs(self.device, dtype) for m in self.model.modules() if hasattr(m, "pads_pairs")]
        return not answers or any(answers)

    def plan(self, lengths: np.ndarray, page_size: int, max_pages: int, max_pairs: int | None = None) -> list[np.ndarray]:
        """``pages.plan_batches`` for this model: batches bounded by ``ATTENTION_SLACK`` where it pads pairs, else
        filled to the budget. On MiniLM-L6 (attention on the packed stream), 256 mixed pairs ran in 10 batches
        instead of 18, with 2.7% filler tokens instead of 11% at bucket shapes."""
        slack = ATTENTION_SLACK if self.pads_pairs else None
        return plan_batches(lengths, page_size, max_pages, max_pairs, slack)

    def batch_shape(self, lengths: np.ndarray, page_size: int, max_pages: int) -> tuple[int, int, int] | None:
        """The (T, B, L) to pad a batch of pairs of these token ``lengths`` to, or None: its own shape."""
        if self.batch_shapes == "exact":
            return None
        return bucket_shape(int(lengths.sum()), len(lengths), int(lengths.max()), page_size, max_pages,
                            bucket_length=self.batch_shapes == "graphs")

    def _compile_options(self) -> dict:
        """Inductor's options: on CUDA those of mode "reduce-overhead" (CUDA graphs; torch.compile takes a mode or
        options, not both). Everywhere, inductor keeps the roundings to bf16/fp16 that eager code does
        (emulate_precision_casts): by default it drops a round trip through a 16-bit type inside a fused kernel,
        and compile=True would change the numbers."""
        import torch._inductor
        from torch._inductor import config as inductor_config

        options = dict(torch._inductor.list_mode_options("reduce-overhead")) if self.cuda_graphs else {}
        if hasattr(inductor_config, "emulate_precision_casts"):
            options["emulate_precision_casts"] = True
        return options

    @torch.inference_mode()
    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        """(P, num_labels) logits for the batch's pairs, in the batch's order (shape filler dropped)."""
        self.shapes.add((batch.input_ids.shape[0], batch.seq_lens.shape[0], batch.max_seqlen))
        batch = batch.to(self.device)
        if not self.compiled:
            return self.model(batch)[: len(batch.pairs)]
        before, start = _graphs_compiled(), time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=self.MAX_GRAPHS):
            logits = self._forward(batch)
        if (after := _graphs_compiled()) > before:
            self.graphs += after - before
            self.compile_seconds += time.perf_counter() - start
        return logits[: len(batch.pairs)]
