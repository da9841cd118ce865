"""The BERT family, packed: BERT/MiniLM, RoBERTa, XLM-RoBERTa and ELECTRA.

They share one encoder; the differences are flags: RoBERTa-style positions count from
``padding_idx + 1`` and skip pad tokens, ELECTRA projects small embeddings up to the hidden size,
and each family has its own classification head. Attribute names mirror the checkpoints.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN, GELUActivation

from ..batch import PackedBatch
from ..choices import Choices
from ..ops.attention import packed_attention
from ..ops.first_token import first_token_self_attention
from ..ops.linear import fuse_linears, int8_mlp, linear_gelu, linear_plus_norm
from .base import EncoderModel


class Embeddings(nn.Module):
    def __init__(self, config, size: int, roberta_positions: bool):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size)
        self.LayerNorm = nn.LayerNorm(size, eps=config.layer_norm_eps)
        self.padding_idx = config.pad_token_id if roberta_positions else None

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        ids, positions = batch.input_ids, batch.positions
        if self.padding_idx is not None:
            # As RoBERTa: position = padding_idx + (count of non-pad tokens so far in the pair), pad tokens at padding_idx.
            real = (ids != self.padding_idx).long()
            seen = torch.cumsum(real, 0)
            before_pair = (seen - real)[torch.arange(ids.shape[0], device=ids.device) - positions]
            positions = (seen - before_pair) * real + self.padding_idx
        types = batch.token_type_ids if batch.token_type_ids is not None else torch.zeros_like(ids)
        x = self.word_embeddings(ids) + self.token_type_embeddings(types)
        x = x + self.position_embeddings(positions)
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def fuse(self) -> None:
        self.qkv = fuse_linears(self.query, self.key, self.value)
        del self.query, self.key, self.value

    def forward(self, x: torch.Tensor, batch: PackedBatch, choices: Choices, first_only: bool = False) -> torch.Tensor:
        if first_only:
            return first_token_self_attention(self.qkv, x, batch, self.num_heads, choices)
        return packed_attention(self.qkv(x), batch, self.num_heads, choices.attention)


class DenseNorm(nn.Module):
    """dense -> (+ residual) -> LayerNorm: BERT's SelfOutput and Output."""

    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return linear_plus_norm(self.dense, x, residual, self.LayerNorm)


class Attention(nn.Module):
    def __init__(self, config, self_attention: type[nn.Module] = SelfAttention):
        super().__init__()
        self.self = self_attention(config)
        self.output = DenseNorm(config.hidden_size, config.hidden_size, config.layer_norm_eps)


class Intermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.act) is GELUActivation:  # exact erf GELU: fused into the GEMM, or in place
            return linear_gelu(self.dense, x)
        return self.act(self.dense(x))


class Layer(nn.Module):
    """A post-norm encoder layer; DeBERTa reuses it with its own self-attention (extra args go to it).

    With ``first_only`` it returns each pair's first token alone, (B, d): the queries, the output
    projection and the feed-forward of every other token are skipped."""

    def __init__(self, config, self_attention: type[nn.Module] = SelfAttention):
        super().__init__()
        self.attention = Attention(config, self_attention)
        self.intermediate = Intermediate(config)
        self.output = DenseNorm(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def per_pair_linears(self) -> list[nn.Module]:
        """The linears that see one row per pair under ``first_only``: all but the attention's projection."""
        return [self.attention.output.dense, self.intermediate.dense, self.output.dense]

    def forward(self, x: torch.Tensor, batch: PackedBatch, choices: Choices, *extra, first_only: bool = False) -> torch.Tensor:
        attended = self.attention.self(x, batch, choices, *extra, first_only=first_only)
        x = self.attention.output(attended, x[batch.first_index] if first_only else x)
        if type(self.intermediate.act) is GELUActivation:
            both = int8_mlp(self.intermediate.dense, self.output.dense, x, "gelu", x, self.output.LayerNorm)
            if both is not None:
                return both
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))


class Pooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)


class BertModel(nn.Module):
    """Embeddings + encoder over a packed stream: (T,) ids -> (T, d) hidden states, or with
    ``first_only`` the last layer's output at each pair's first token, (B, d)."""

    def __init__(self, config, *, roberta_positions: bool = False, pooler: bool = False):
        super().__init__()
        size = getattr(config, "embedding_size", config.hidden_size)
        self.embeddings = Embeddings(config, size, roberta_positions)
        self.projects_embeddings = size != config.hidden_size  # ELECTRA
        if self.projects_embeddings:
            self.embeddings_project = nn.Linear(size, config.hidden_size)
        self.encoder = Encoder(config)
        self.has_pooler = pooler
        if pooler:
            self.pooler = Pooler(config)

    def after_load(self) -> None:
        for layer in self.encoder.layer:
            layer.attention.self.fuse()

    def head_shape(self) -> tuple[int, int]:
        attention = self.encoder.layer[0].attention.self
        return attention.num_heads, attention.qkv.out_features // 3 // attention.num_heads

    def per_pair_linears(self) -> list[nn.Module]:
        """The linears that see one row per pair under ``first_only``: the last layer's, and the pooler's."""
        pooler = [self.pooler.dense] if self.has_pooler else []
        return self.encoder.layer[-1].per_pair_linears() + pooler

    def forward(self, batch: PackedBatch, choices: Choices, first_only: bool = False) -> torch.Tensor:
        x = self.embeddings(batch)
        if self.projects_embeddings:
            x = self.embeddings_project(x)
        *layers, last = self.encoder.layer
        for layer in layers:
            x = layer(x, batch, choices)
        return last(x, batch, choices, first_only=first_only)


class ClassificationHead(nn.Module):
    """RoBERTa / XLM-R (tanh) and ELECTRA (GELU): first token -> dense -> act -> out_proj."""

    def __init__(self, config, act):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)
        self.act = act

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.act(self.dense(first)))


class BertFamily(EncoderModel):
    """What the BERT family's classifiers share: an encoder (``self.encoder_model``) read at first tokens."""

    encoder_model: BertModel

    def after_load(self) -> None:
        self.encoder_model.after_load()

    def head_shape(self) -> tuple[int, int]:
        return self.encoder_model.head_shape()


class BertForSequenceClassification(BertFamily):
    def __init__(self, config):
        super().__init__()
        self.bert = BertModel(config, pooler=True)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    @property
    def encoder_model(self) -> BertModel:
        return self.bert

    def per_pair_linears(self) -> list[nn.Module]:
        return self.bert.per_pair_linears() + [self.classifier]

    def forward(self, batch: PackedBatch, choices: Choices) -> torch.Tensor:
        first = self.bert(batch, choices, first_only=True)
        return self.classifier(torch.tanh(self.bert.pooler.dense(first)))


class RobertaForSequenceClassification(BertFamily):
    """Also XLM-RoBERTa, whose checkpoints use the same names."""

    @classmethod
    def position_limit(cls, config) -> int:
        """The position table less RoBERTa's offset of padding_idx + 1."""
        return config.max_position_embeddings - config.pad_token_id - 1

    def __init__(self, config):
        super().__init__()
        self.roberta = BertModel(config, roberta_positions=True)
        self.classifier = ClassificationHead(config, torch.tanh)

    @property
    def encoder_model(self) -> BertModel:
        return self.roberta

    def per_pair_linears(self) -> list[nn.Module]:
        return self.roberta.per_pair_linears() + [self.classifier.dense, self.classifier.out_proj]

    def forward(self, batch: PackedBatch, choices: Choices) -> torch.Tensor:
        return self.classifier(self.roberta(batch, choices, first_only=True))


class ElectraForSequenceClassification(BertFamily):
    def __init__(self, config):
        super().__init__()
        self.electra = BertModel(config)
        self.classifier = ClassificationHead(config, ACT2FN["gelu"])

    @property
    def encoder_model(self) -> BertModel:
        return self.electra

    def per_pair_linears(self) -> list[nn.Module]:
        return self.electra.per_pair_linears() + [self.classifier.dense, self.classifier.out_proj]

    def forward(self, batch: PackedBatch, choices: Choices) -> torch.Tensor:
        return self.classifier(self.electra(batch, choices, first_only=True))
