"""DistilBERT, packed. Learned (or stored sinusoidal) positions, no token types, post-norm blocks,
and a pre_classifier + ReLU head. Attribute names mirror the checkpoint."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation, get_activation

from ..batch import PackedBatch
from ..choices import Choices
from ..ops.attention import packed_attention
from ..ops.first_token import first_token_self_attention
from ..ops.linear import fuse_linears, int8_mlp, linear_plus_norm
from .base import EncoderModel

EPS = 1e-12  # DistilBERT's LayerNorms do not read the config


class Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.dim)
        self.LayerNorm = nn.LayerNorm(config.dim, eps=EPS)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        return self.LayerNorm(self.word_embeddings(batch.input_ids) + self.position_embeddings(batch.positions))


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.n_heads
        self.q_lin, self.k_lin, self.v_lin = (nn.Linear(config.dim, config.dim) for _ in range(3))
        self.out_lin = nn.Linear(config.dim, config.dim)

    def fuse(self) -> None:
        self.qkv = fuse_linears(self.q_lin, self.k_lin, self.v_lin)
        del self.q_lin, self.k_lin, self.v_lin

    def forward(
        self, x: torch.Tensor, batch: PackedBatch, choices: Choices, residual: torch.Tensor, norm: nn.Module,
        first_only: bool = False
    ) -> torch.Tensor:
        """norm(residual + attention) (at first tokens only with ``first_only``, where ``residual`` holds their
        rows)."""
        if first_only:
            attended = first_token_self_attention(self.qkv, x, batch, self.n_heads, choices)
        else:
            attended = packed_attention(self.qkv(x), batch, self.n_heads, choices.attention)
        return linear_plus_norm(self.out_lin, attended, residual, norm)


class FFN(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.lin1 = nn.Linear(config.dim, config.hidden_dim)
        self.lin2 = nn.Linear(config.hidden_dim, config.dim)
        self.activation = get_activation(config.activation)

    def forward(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """norm(x + the FFN of x)."""
        if type(self.activation) is GELUActivation:
            both = int8_mlp(self.lin1, self.lin2, x, "gelu", x, norm)
            if both is not None:
                return both
        return linear_plus_norm(self.lin2, self.activation(self.lin1(x)), x, norm)


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = MultiHeadSelfAttention(config)
        self.sa_layer_norm = nn.LayerNorm(config.dim, eps=EPS)
        self.ffn = FFN(config)
        self.output_layer_norm = nn.LayerNorm(config.dim, eps=EPS)

    def per_pair_linears(self) -> list[nn.Module]:
        """The linears that see one row per pair under ``first_only``: all but the attention's projection."""
        return [self.attention.out_lin, self.ffn.lin1, self.ffn.lin2]

    def forward(self, x: torch.Tensor, batch: PackedBatch, choices: Choices, first_only: bool = False) -> torch.Tensor:
        """(T, d) -> (T, d), or (B, d) at each pair's first token with ``first_only``."""
        residual = x[batch.first_index] if first_only else x
        x = self.attention(x, batch, choices, residual, self.sa_layer_norm, first_only)
        return self.ffn(x, self.output_layer_norm)


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))


class DistilBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = Embeddings(config)
        self.transformer = Transformer(config)

    def forward(self, batch: PackedBatch, choices: Choices, first_only: bool = False) -> torch.Tensor:
        x = self.embeddings(batch)
        *layers, last = self.transformer.layer
        for layer in layers:
            x = layer(x, batch, choices)
        return last(x, batch, choices, first_only)


class DistilBertForSequenceClassification(EncoderModel):
    def __init__(self, config):
        super().__init__()
        self.distilbert = DistilBertModel(config)
        self.pre_classifier = nn.Linear(config.dim, config.dim)
        self.classifier = nn.Linear(config.dim, config.num_labels)

    def after_load(self) -> None:
        for layer in self.distilbert.transformer.layer:
            layer.attention.fuse()

    def head_shape(self) -> tuple[int, int]:
        attention = self.distilbert.transformer.layer[0].attention
        return attention.n_heads, attention.qkv.out_features // 3 // attention.n_heads

    def per_pair_linears(self) -> list[nn.Module]:
        return self.distilbert.transformer.layer[-1].per_pair_linears() + [self.pre_classifier, self.classifier]

    def forward(self, batch: PackedBatch, choices: Choices) -> torch.Tensor:
        first = self.distilbert(batch, choices, first_only=True)
        return self.classifier(F.relu(self.pre_classifier(first)))
