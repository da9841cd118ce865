"""Gemma rerankers, packed (``GemmaForCausalLM`` as BAAI/bge-reranker-v2-gemma): the decoders' layers with Gemma's
differences, read by sentence-transformers' LogitScore (the "Yes" logit alone, or yes/no).

What differs from Qwen/Llama, as transformers' Gemma computes it: the embeddings times sqrt(hidden_size) (a float32
scalar rounded to the model dtype, multiplied in it), RMSNorm times (1 + weight) in float32 before the cast back, a
GELU-tanh gated MLP (``hidden_act``), multi-query or grouped-query attention, no biases, tied embeddings.
"""
from __future__ import annotations

import torch

from ..choices import Choices
from ..ops.rms_norm import rms_norm_scaled_float32
from .decoder import DecoderFlags, DecoderForCausalLM, RMSNorm


class GemmaRMSNorm(RMSNorm):
    """x over its root mean square times (1 + weight), in float32, then cast to x's dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        self.scale: torch.Tensor | None = None

    def after_load(self) -> None:
        self.scale = 1.0 + self.weight.float()  # float32 whatever the model dtype, as transformers

    def forward(self, x: torch.Tensor, choices: Choices) -> torch.Tensor:
        return rms_norm_scaled_float32(x, self.scale, self.eps, choices)


class GemmaForCausalLM(DecoderForCausalLM):
    @classmethod
    def flags(cls, config) -> DecoderFlags:
        if config.model_type != "gemma":
            raise ValueError(f"GemmaForCausalLM needs a gemma config, got model_type {config.model_type!r}")
        if getattr(config, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention=True is not a causal reranker; the packed engine runs "
                             "Gemma with causal attention only")
        return DecoderFlags("GemmaRotaryEmbedding", qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                            norm=GemmaRMSNorm, embed_scale=True)
