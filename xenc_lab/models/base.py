"""The two contracts of a packed model family, encoder and decoder: what a new family fills in, in one place.

A family is an ``nn.Module`` whose parameter paths mirror its checkpoint's, built from the checkpoint's config on
the meta device, then loaded with its safetensors weights (``loader``). What every family declares:

1. ``before_load(names)`` adapts to the checkpoint's tensor names, ``after_load()`` derives what the checkpoint does
   not store (fused projections, rotary tables), once;
2. ``head_shape()`` tells ``choices.resolve`` the attention's (heads, head dim), or None where the family's
   attention is its own (it then never runs ``ops.attention``);
3. ``pads_pairs(choices)`` tells the runner whether some layer lays a batch out as (sequences, longest) padded
   sequences under those choices: the planner then bounds the padding (``pages.plan_batches``);
4. ``per_pair_linears()`` names the linear layers that see one row per pair (the last layer past its attention when
   only first tokens are read, the head): on the CPU in float32 they stay torch's (``cpu.prepacked``);
5. read from the config before any weight is loaded (class methods): ``position_limit(config)``, the longest pair
   the model can embed, and ``num_labels_of(config)``, the scores per pair.

``EncoderModel``: ``forward(batch, choices)`` maps a ``batch.PackedBatch`` to (B, num_labels) logits, B >= the batch's
pairs (``engine.EncoderEngine`` runs it).

``DecoderModel``: causal attention over a paged KV cache. ``forward(batch, choices, cache)`` maps a
``decoder.chunks.ChunkBatch`` to the logits of the chunks that end pairs (``decoder.engine.DecoderEngine`` runs it);
``cache_shape()`` sizes its ``decoder.kv_cache.KVCache``; how a score is read: ``scores_by_logits`` (a causal LM
read by sentence-transformers' LogitScore, whose token ids ``set_score_tokens`` takes after loading) or a classifier
head over the last token that is not ``pooled_past(config)``.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..choices import Choices


class PackedModel(nn.Module):
    """What encoders and decoders share; a family derives from ``EncoderModel`` or ``DecoderModel``."""

    causal: ClassVar[bool] = False  # a decoder: causal attention over chunks and a paged KV cache

    @classmethod
    def position_limit(cls, config) -> int | None:
        """The longest pair the model can embed: its position table; None where positions are only relative."""
        return config.max_position_embeddings

    @classmethod
    def num_labels_of(cls, config) -> int:
        return int(config.num_labels)

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


class EncoderModel(PackedModel):
    """Bidirectional attention within each pair: ``forward(batch: PackedBatch, choices)`` -> (B, num_labels)."""

    def forward(self, batch, choices: Choices) -> torch.Tensor:
        raise NotImplementedError


class DecoderModel(PackedModel):
    """Causal attention over chunks and a paged KV cache: ``forward(batch: ChunkBatch, choices, cache)`` -> (R,
    num_labels) at each chunk that ends a pair (then filler rows)."""

    causal: ClassVar[bool] = True
    scores_by_logits: ClassVar[bool] = False  # a causal LM scored by LogitScore, else a classifier head

    @classmethod
    def num_labels_of(cls, config) -> int:
        # A causal LM scores through its true/false token logits (sentence-transformers' LogitScore): one label.
        return 1 if cls.scores_by_logits else int(config.num_labels)

    @classmethod
    def pooled_past(cls, config) -> int | None:
        """The token id a pair's logits are read before (transformers' sequence classifiers read the last token that
        is not the pad id), or None: the pair's last token."""
        return None if cls.scores_by_logits else config.pad_token_id

    def cache_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the keys and values the KV cache keeps."""
        raise NotImplementedError

    def set_score_tokens(self, true_id: int, false_id: int | None) -> None:
        """The vocabulary ids whose logits make the score (``scores_by_logits`` families only)."""
        raise TypeError(f"{type(self).__name__} scores through its classifier head, not token logits")

    def forward(self, batch, choices: Choices, cache=None) -> torch.Tensor:
        raise NotImplementedError
