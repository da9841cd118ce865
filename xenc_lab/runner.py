"""Stage 4: run the packed model on one batch. torch.compile is applied here, and only here."""
from __future__ import annotations

import time

import torch
from torch import nn

from .batch import PackedBatch


class ModelRunner:
    """Runs the model on packed batches; with ``compile``, on batches padded to page-quantized shapes
    (``pages.bucket_shape``), so a long run compiles a handful of graphs rather than one per batch."""

    MAX_SHAPES = 64  # compiled graphs kept before torch.compile would fall back to eager

    def __init__(self, model: nn.Module, device: torch.device, compile: bool = False):
        self.model = model
        self.device = device
        self.compiled = compile
        # On CUDA, "reduce-overhead" records a CUDA graph per page-quantized shape.
        mode = "reduce-overhead" if device.type == "cuda" else None
        self._forward = torch.compile(model, dynamic=False, mode=mode) if compile else model
        self.shapes: dict[tuple[int, int, int], float] = {}  # (T, B, L) -> seconds of its first call

    @torch.inference_mode()
    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        """(P, num_labels) logits for the batch's pairs, in the batch's order (shape filler dropped)."""
        shape = (batch.input_ids.shape[0], batch.seq_lens.shape[0], batch.max_seqlen)
        first = shape not in self.shapes
        start = time.perf_counter()
        batch = batch.to(self.device)
        if self.compiled:
            with torch._dynamo.config.patch(recompile_limit=self.MAX_SHAPES):
                logits = self._forward(batch)
        else:
            logits = self._forward(batch)
        if first:
            self.shapes[shape] = time.perf_counter() - start
        return logits[: len(batch.pairs)]

    @property
    def compile_seconds(self) -> float:
        """Time spent in first calls of each shape: compilation, when compiled."""
        return sum(self.shapes.values())
