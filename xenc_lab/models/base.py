"""The contract of a packed model family: what a new family fills in, in one place.

A family is an ``nn.Module`` whose parameter paths mirror its checkpoint's, built from the checkpoint's config on
the meta device, then loaded with its safetensors weights (``loader``). After that:

1. ``after_load()`` derives what the checkpoint does not store (fused projections, rotary tables), once;
2. ``head_shape()`` tells ``choices.resolve`` the attention's (heads, head dim), or None where the family's
   attention is its own (it then never runs ``ops.attention``);
3. ``pads_pairs(choices)`` tells the runner whether some layer lays a batch out as (pairs, longest pair) padded
   sequences under those choices: the planner then bounds the padding (``pages.plan_batches``);
4. ``per_pair_linears()`` names the linear layers that see one row per pair (the last layer past its attention when
   only first tokens are read, the head): on the CPU in float32 they stay torch's (``cpu.prepacked``);
5. ``forward(batch, choices)`` maps a ``PackedBatch`` to (B, num_labels) logits, B >= the batch's pairs.

A decoder (``causal = True``) instead maps a ``chunks.ChunkBatch`` and the KV cache, ``forward(batch, choices,
cache)``, to the logits of the chunks that end pairs (``decoder_engine``); its ``head_shape`` decides only whether
flash varlen attention runs its chunks on CUDA.
"""
from __future__ import annotations

import torch
from torch import nn

from ..batch import PackedBatch
from ..choices import Choices


class PackedModel(nn.Module):
    causal = False  # a decoder: causal attention over chunks and a paged KV cache (``chunks``), else an encoder

    def before_load(self, names: set[str]) -> None:
        """Adapt to the checkpoint's tensor ``names`` (on the meta device) before its weights load; nothing by
        default."""

    def after_load(self) -> None:
        """Derive what the checkpoint does not store, on the weights' device; nothing by default."""

    def head_shape(self) -> tuple[int, int] | None:
        raise NotImplementedError

    def pads_pairs(self, choices: Choices) -> bool:
        """By default: where attention does not run on the packed stream."""
        return not choices.attends_packed

    def per_pair_linears(self) -> list[nn.Module]:
        raise NotImplementedError

    def forward(self, batch: PackedBatch, choices: Choices) -> torch.Tensor:
        raise NotImplementedError
