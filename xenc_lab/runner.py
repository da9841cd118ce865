"""Stage 4: run the packed model on one batch. torch.compile is applied here, and only here."""
from __future__ import annotations

import torch
from torch import nn

from .batch import PackedBatch


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, compile: bool = False):
        self.model = model
        self.device = device
        self.compiled = compile
        # Batches come in whole pages, so a long run meets few distinct shapes: compile them statically.
        self._forward = torch.compile(model, dynamic=False) if compile else model
        self.shapes_seen: set[tuple[int, int, int]] = set()

    @torch.inference_mode()
    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        """(B, num_labels) logits for the batch's pairs, in the batch's order."""
        self.shapes_seen.add((batch.input_ids.shape[0], batch.seq_lens.shape[0], batch.max_seqlen))
        return self._forward(batch.to(self.device))
