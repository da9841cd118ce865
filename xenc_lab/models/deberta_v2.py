"""DeBERTa-v2 and v3, packed: disentangled attention over relative position buckets.

Attention scores are q.k plus content->position (c2p: q against the relative position embeddings) and
position->content (p2c: k against them), indexed by each (query, key) slot distance; both terms are
computed per token on the packed stream, then gathered into one additive (B, H, L, L) bias.
Everything else runs on the (T, d) stream. Attribute names mirror the checkpoints.

Attention is HF's own matmul/softmax in the padded layout rather than SDPA: op for op, it reproduces
transformers' float32 logits to the bit on unpadded pairs (SDPA's fused kernel drifts by ~1e-5).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..batch import PackedBatch
from ..choices import Choices
from ..ops.first_token import split_first
from ..ops.layout import from_padded, to_padded
from ..ops.linear import fuse_linears
from .base import EncoderModel
from .bert import Layer


def pos_att_type(config) -> set[str]:
    """config.pos_att_type as a set: a list, a "p2c|c2p" string or None."""
    kinds = config.pos_att_type or []
    if isinstance(kinds, str):
        kinds = kinds.lower().split("|")
    return {k.strip() for k in kinds}


def attention(q, k, v, batch: PackedBatch, scale: float, bias) -> torch.Tensor:
    """softmax(q.k / scale + bias) v within each pair, HF's op order: queries (B, H, Lq, dh) over keys and
    values (B, H, L, dh) -> (B, H, Lq, dh)."""
    scores = q @ (k.transpose(-1, -2) / scale)  # (B, H, Lq, L)
    if bias is not None:
        scores = scores + bias
    probs = scores.masked_fill(~batch.key_mask, torch.finfo(scores.dtype).min).softmax(-1)
    return probs @ v


def log_bucket(rel: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    """transformers' make_log_bucket_position, op for op: its float32 rounding decides the buckets."""
    sign, mid = torch.sign(rel), bucket_size // 2
    abs_pos = torch.where((rel < mid) & (rel > -mid), torch.tensor(mid - 1).type_as(rel), torch.abs(rel))
    log_pos = torch.ceil(torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, rel.type_as(log_pos), log_pos * sign)


class Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        size = getattr(config, "embedding_size", config.hidden_size)
        self.word_embeddings = nn.Embedding(config.vocab_size, size)
        if getattr(config, "position_biased_input", True):
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, size)
        if config.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size)
        if size != config.hidden_size:
            self.embed_proj = nn.Linear(size, config.hidden_size, bias=False)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        # HF then multiplies by the attention mask: 1 on every real token, so nothing to do here.
        x = self.word_embeddings(batch.input_ids)  # (T, e)
        if hasattr(self, "position_embeddings"):
            x = x + self.position_embeddings(batch.positions)
        if hasattr(self, "token_type_embeddings"):
            types = batch.token_type_ids if batch.token_type_ids is not None else torch.zeros_like(batch.input_ids)
            x = x + self.token_type_embeddings(types)
        if hasattr(self, "embed_proj"):
            x = self.embed_proj(x)
        return self.LayerNorm(x)


class DisentangledSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, self.num_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = getattr(config, "attention_head_size", d // self.num_heads)
        hd = self.num_heads * self.head_dim
        self.query_proj, self.key_proj, self.value_proj = nn.Linear(d, hd), nn.Linear(d, hd), nn.Linear(d, hd)
        kinds = pos_att_type(config)
        # As HF: the scale counts the position terms even when relative attention is off.
        self.scale = math.sqrt(self.head_dim * (1 + len(kinds & {"c2p", "p2c"})))
        self.pos_att = kinds if getattr(config, "relative_attention", False) else set()
        self.share_att_key = getattr(config, "share_att_key", False)
        if not self.share_att_key and "c2p" in self.pos_att:
            self.pos_key_proj = nn.Linear(d, hd)
        if not self.share_att_key and "p2c" in self.pos_att:
            self.pos_query_proj = nn.Linear(d, hd)

    def fuse(self) -> None:
        """One (3hd, d) projection instead of three (query/key_proj stay when they also project positions)."""
        self.qkv = fuse_linears(self.query_proj, self.key_proj, self.value_proj)
        del self.value_proj
        self.scale = float(torch.tensor(self.scale).to(self.qkv.weight.dtype))  # as HF: the scale in the model dtype
        if not self.share_att_key:
            del self.query_proj, self.key_proj

    def _per_head(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return proj(x).view(x.shape[0], self.num_heads, self.head_dim).transpose(0, 1)  # (H, n, dh)

    def forward(
        self, x: torch.Tensor, batch: PackedBatch, choices: Choices, rel_emb, rel_idx, first_only: bool = False
    ) -> torch.Tensor:
        """(T, d) -> (T, hd), or (B, hd) for each pair's first token alone with ``first_only``. Its attention is its
        own, on the padded layout: ``choices`` changes nothing here."""
        B, L, H = batch.seq_lens.shape[0], batch.max_seqlen, self.num_heads
        if first_only:
            q_rows, kv = split_first(self.qkv, x, batch)  # (B, hd), (T, 2hd)
            hd = q_rows.shape[-1]
            k, v = to_padded(kv, batch).view(B, L, 2, H, -1).permute(2, 0, 3, 1, 4)  # (B, H, L, dh)
            q = q_rows.view(B, H, 1, -1)
            k_rows, q_index, rel_idx = kv[:, :hd], torch.arange(B, device=x.device).view(B, 1, 1, 1), rel_idx[:1]
        else:
            qkv = self.qkv(x)  # (T, 3hd)
            hd = qkv.shape[-1] // 3
            q, k, v = to_padded(qkv, batch).view(B, L, 3, H, -1).permute(2, 0, 3, 1, 4)  # (B, H, L, dh)
            q_rows, k_rows, q_index = qkv[:, :hd], qkv[:, hd : 2 * hd], batch.pad_index.view(B, 1, L, 1)
        heads = torch.arange(H, device=x.device).view(1, H, 1, 1)
        bias = None
        if "c2p" in self.pos_att:  # bias[b, h, i, j] = q_i . pos_k[bucket(i - j)]
            pos_k = self._per_head(self.key_proj if self.share_att_key else self.pos_key_proj, rel_emb)  # (H, 2S, dh)
            q_heads = q_rows.view(q_rows.shape[0], H, -1).transpose(0, 1)  # (H, n, dh)
            c2p = torch.bmm(q_heads, pos_k.transpose(1, 2)).transpose(0, 1)  # (n, H, 2S)
            bias = c2p[q_index, heads, rel_idx] / self.scale  # (B, H, Lq, L)
        if "p2c" in self.pos_att:  # bias[b, h, i, j] = k_j . pos_q[-bucket(j - i)] = k_j . pos_q[bucket(i - j)]
            pos_q = self._per_head(self.query_proj if self.share_att_key else self.pos_query_proj, rel_emb)
            k_heads = k_rows.view(k_rows.shape[0], H, -1).transpose(0, 1)  # (H, T, dh)
            p2c = torch.bmm(k_heads, pos_q.transpose(1, 2)).transpose(0, 1)  # (T, H, 2S)
            p2c = p2c[batch.pad_index.view(B, 1, 1, L), heads, rel_idx] / self.scale
            bias = p2c if bias is None else bias + p2c
        out = attention(q, k, v, batch, self.scale, bias)  # (B, H, Lq, dh)
        if first_only:
            return out.reshape(B, hd)
        return from_padded(out.transpose(1, 2).reshape(B, L, hd), batch)


class ConvLayer(nn.Module):
    """DeBERTa-v2's convolution beside the first layer, over each pair's embeddings (zero past its end)."""

    def __init__(self, config):
        super().__init__()
        k, d = getattr(config, "conv_kernel_size", 3), config.hidden_size
        self.conv = nn.Conv1d(d, d, k, padding=(k - 1) // 2, groups=getattr(config, "conv_groups", 1))
        self.LayerNorm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.act = ACT2FN[getattr(config, "conv_act", "tanh")]

    def forward(self, emb: torch.Tensor, residual: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        x = to_padded(emb, batch) * batch.key_mask.view(batch.seq_lens.shape[0], -1, 1)  # (B, L, d)
        out = self.conv(x.permute(0, 2, 1).contiguous()).permute(0, 2, 1).contiguous()
        return self.LayerNorm(residual + self.act(from_padded(out, batch)))


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(Layer(config, DisentangledSelfAttention) for _ in range(config.num_hidden_layers))
        self.relative_attention = getattr(config, "relative_attention", False)
        if self.relative_attention:
            self.max_relative_positions = getattr(config, "max_relative_positions", -1)
            if self.max_relative_positions < 1:
                self.max_relative_positions = config.max_position_embeddings
            self.position_buckets = getattr(config, "position_buckets", -1)
            self.span = self.position_buckets if self.position_buckets > 0 else self.max_relative_positions
            self.rel_embeddings = nn.Embedding(2 * self.span, config.hidden_size)
        if "layer_norm" in [x.strip() for x in getattr(config, "norm_rel_ebd", "none").lower().split("|")]:
            self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if getattr(config, "conv_kernel_size", 0) > 0:
            self.conv = ConvLayer(config)

    def relative_index(self, L: int, device: torch.device) -> torch.Tensor:
        """(L, L) [query slot i, key slot j] -> row of the 2S relative embeddings, clamp(bucket(i - j) + S).

        Buckets are odd in i - j, so HF's p2c index clamp(S - bucket(j - i)) is this same table."""
        dist = torch.arange(-(L - 1), L, device=device)  # (2L - 1,) every slot difference q - k
        if self.position_buckets > 0 and self.max_relative_positions > 0:
            dist = log_bucket(dist, self.position_buckets, self.max_relative_positions)
        slots = torch.arange(L, device=device)
        rel = dist.long()[slots[:, None] - slots[None, :] + L - 1]  # (L, L) bucket of i - j
        return (rel + self.span).clamp(0, 2 * self.span - 1)

    @property
    def prunes_last_layer(self) -> bool:
        """Whether ``first_only`` runs the last layer at first tokens only: unless the convolution, beside the first
        layer, still needs its output."""
        return not (len(self.layer) == 1 and hasattr(self, "conv"))

    def forward(self, x: torch.Tensor, batch: PackedBatch, choices: Choices, first_only: bool = False) -> torch.Tensor:
        """(T, d) -> (T, d), or with ``first_only`` (B, d) at each pair's first token."""
        rel = (None, None)
        if self.relative_attention:
            emb = self.rel_embeddings.weight  # (2S, d)
            if hasattr(self, "LayerNorm"):
                emb = self.LayerNorm(emb)
            rel = (emb, self.relative_index(batch.max_seqlen, x.device))
        embeddings, last = x, len(self.layer) - 1
        prune = first_only and self.prunes_last_layer
        for i, layer in enumerate(self.layer):
            x = layer(x, batch, choices, *rel, first_only=prune and i == last)
            if i == 0 and hasattr(self, "conv"):
                x = self.conv(embeddings, x, batch)
        return x[batch.first_index] if first_only and not prune else x


class DebertaV2Model(nn.Module):
    """Embeddings + encoder over a packed stream: (T,) ids -> (T, d) hidden states, or (B, d) at first
    tokens with ``first_only``."""

    def __init__(self, config):
        super().__init__()
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)

    def forward(self, batch: PackedBatch, choices: Choices, first_only: bool = False) -> torch.Tensor:
        return self.encoder(self.embeddings(batch), batch, choices, first_only)


class ContextPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        size = getattr(config, "pooler_hidden_size", config.hidden_size)
        self.dense = nn.Linear(size, size)
        self.act = ACT2FN[config.pooler_hidden_act]

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(first))


class DebertaV2ForSequenceClassification(EncoderModel):
    @classmethod
    def position_limit(cls, config) -> int | None:
        """v3 checkpoints embed no absolute positions (relative ones only): no limit."""
        return config.max_position_embeddings if getattr(config, "position_biased_input", True) else None

    def __init__(self, config):
        super().__init__()
        self.deberta = DebertaV2Model(config)
        self.pooler = ContextPooler(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def after_load(self) -> None:
        for layer in self.deberta.encoder.layer:
            layer.attention.self.fuse()

    def head_shape(self) -> None:
        return None  # its attention is its own: relative-position biases on the padded layout

    def pads_pairs(self, choices: Choices) -> bool:
        return True

    def per_pair_linears(self) -> list[nn.Module]:
        encoder = self.deberta.encoder
        last = encoder.layer[-1].per_pair_linears() if encoder.prunes_last_layer else []
        return last + [self.pooler.dense, self.classifier]

    def forward(self, batch: PackedBatch, choices: Choices) -> torch.Tensor:
        return self.classifier(self.pooler(self.deberta(batch, choices, first_only=True)))
