"""Stage 4: run the packed model on one batch. torch.compile is applied here, and only here."""
from __future__ import annotations

import time

import torch
from torch import nn

from .batch import PackedBatch


def _graphs_compiled() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class ModelRunner:
    """Runs the model on packed batches, compiled or not.

    Compiled on the CPU, the forward is traced once with symbolic sizes (batches are whole pages; the GEMMs
    and attention are opaque ops, and inductor fuses what lies between them), so any batch reuses the one
    graph and nothing is padded. On CUDA, "reduce-overhead" records a CUDA graph per shape, which must be
    static: there the caller pads batches to page-quantized bucket shapes (``pages.bucket_shape``), and a
    long run compiles a handful of graphs rather than one per batch."""

    MAX_GRAPHS = 64  # compiled graphs kept before torch.compile would fall back to eager

    def __init__(self, model: nn.Module, device: torch.device, compile: bool = False):
        self.model = model
        self.device = device
        self.compiled = compile
        self.static_shapes = compile and device.type == "cuda"
        self.compile_options = self._compile_options() if compile else {}
        self._forward = torch.compile(model, dynamic=not self.static_shapes, options=self.compile_options) if compile else model
        self.shapes: set[tuple[int, int, int]] = set()  # (T, B, L) of every batch run so far
        self.graphs = 0  # graphs compiled for this model
        self.compile_seconds = 0.0  # time of the calls that compiled one

    def _compile_options(self) -> dict:
        """Inductor's options: on CUDA those of mode "reduce-overhead" (CUDA graphs; torch.compile takes a mode or
        options, not both). Everywhere, inductor keeps the roundings to bf16/fp16 that eager code does
        (emulate_precision_casts): by default it drops a round trip through a 16-bit type inside a fused kernel,
        and compile=True would change the numbers."""
        import torch._inductor
        from torch._inductor import config as inductor_config

        options = dict(torch._inductor.list_mode_options("reduce-overhead")) if self.static_shapes else {}
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
