"""ModernBERT, packed: rotary positions with a theta per layer kind, global and sliding-window attention,
a GeGLU MLP, pre-norm layers, and a CLS or mean-pooled classification head.

Everything runs on the (T, d) stream, mean pooling too; attention runs within each pair, over all of its
tokens on global layers and ``|i - j| <= local_attention // 2`` on sliding ones, as transformers' SDPA path.
Attribute names mirror the checkpoints; LayerNorms carry a bias only when ``norm_bias``.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..batch import PackedBatch
from ..choices import Choices
from ..ops.attention import first_token_attention, packed_attention, varlen_takes
from ..ops.first_token import split_first
from ..ops.layout import mean_per_pair
from ..ops.linear import linear_plus
from ..ops.rotary import rotate_float32
from .base import EncoderModel

KINDS = ("full_attention", "sliding_attention")
# These rescale the frequencies by the length of the padded batch, so no per-pair engine can match them.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _norm(config) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


def _rope_type(config, kind: str) -> str:
    params = (config.rope_parameters or {}).get(kind)
    if params is None:
        raise ValueError(f"config.rope_parameters has no entry for {kind!r} layers: {config.rope_parameters!r}")
    rope_type = params.get("rope_type", "default")
    if rope_type in _LENGTH_DEPENDENT_ROPE or (rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS):
        raise ValueError(f"rope_type {rope_type!r} ({kind} layers) is not supported by the packed engine")
    return rope_type


class Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _norm(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(ids))


class Attention(nn.Module):
    def __init__(self, config, kind: str):
        super().__init__()
        d = config.hidden_size
        if d % config.num_attention_heads:
            raise ValueError(f"hidden_size {d} is not a multiple of num_attention_heads {config.num_attention_heads}")
        self.num_heads, self.head_dim, self.kind = config.num_attention_heads, d // config.num_attention_heads, kind
        self.sliding_window = config.local_attention if kind == "sliding_attention" else None
        self.Wqkv = nn.Linear(d, 3 * d, bias=config.attention_bias)
        self.Wo = nn.Linear(d, d, bias=config.attention_bias)

    def pads_pairs(self, choices: Choices) -> bool:
        """Flash attention on CUDA runs one query per pair without a window only (``first_token_attention``)."""
        if choices.attention == "varlen":
            return self.sliding_window is not None or not varlen_takes(self.head_dim, self.head_dim**-0.5)
        return not choices.attends_packed

    def forward(
        self, x: torch.Tensor, batch: PackedBatch, choices: Choices, rope: dict, residual: torch.Tensor,
        first_only: bool = False,
    ) -> torch.Tensor:
        """residual + attention: (T, d) -> (T, d), or (B, d) for each pair's first token alone with ``first_only``
        (``residual`` then holds the first tokens' rows)."""
        cos, sin = rope[self.kind]
        T, H, scale = x.shape[0], self.num_heads, self.head_dim**-0.5
        if first_only:
            q, kv = split_first(self.Wqkv, x, batch)
            first = batch.first_index
            q = rotate_float32(q.view(q.shape[0], H, -1), cos[first], sin[first]).view(q.shape)
            k, v = kv.view(T, 2, H, -1).unbind(1)
            kv = torch.stack((rotate_float32(k, cos, sin), v), dim=1).view(kv.shape)
            out = first_token_attention(q, kv, batch, H, choices.attention, scale=scale,
                                        sliding_window=self.sliding_window)
        else:
            q, k, v = self.Wqkv(x).view(T, 3, H, -1).unbind(1)  # (T, H, dh) each
            qkv = torch.stack((rotate_float32(q, cos, sin), rotate_float32(k, cos, sin), v), dim=1).view(T, -1)
            out = packed_attention(qkv, batch, H, choices.attention, scale=scale, sliding_window=self.sliding_window)
        return linear_plus(self.Wo, out, residual)


class MLP(nn.Module):
    """GeGLU: Wi -> (input, gate) -> act(input) * gate -> Wo."""

    def __init__(self, config):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.act = ACT2FN[config.hidden_activation]
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + the MLP of x."""
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return linear_plus(self.Wo, self.act(inp) * gate, residual)


class Layer(nn.Module):
    def __init__(self, config, index: int):
        super().__init__()
        self.attn_norm = nn.Identity() if index == 0 else _norm(config)
        self.attn = Attention(config, config.layer_types[index])
        self.mlp_norm = _norm(config)
        self.mlp = MLP(config)

    def per_pair_linears(self) -> list[nn.Module]:
        """The linears that see one row per pair under ``first_only``: all but the attention's projection."""
        return [self.attn.Wo, self.mlp.Wi, self.mlp.Wo]

    def forward(
        self, x: torch.Tensor, batch: PackedBatch, choices: Choices, rope: dict, first_only: bool = False
    ) -> torch.Tensor:
        residual = x[batch.first_index] if first_only else x
        x = self.attn(self.attn_norm(x), batch, choices, rope, residual, first_only)
        return self.mlp(self.mlp_norm(x), x)


class ModernBertModel(nn.Module):
    """Embeddings + layers over a packed stream: (T,) ids -> (T, d) hidden states before final_norm, or
    (B, d) at each pair's first token with ``first_only``."""

    def __init__(self, config):
        super().__init__()
        kinds = list(config.layer_types)
        if len(kinds) != config.num_hidden_layers or not set(kinds) <= set(KINDS):
            raise ValueError(f"layer_types must be {config.num_hidden_layers} of {KINDS}, got {kinds}")
        self.config = config
        self.rope_types = {kind: _rope_type(config, kind) for kind in sorted(set(kinds))}
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = _norm(config)

    def after_load(self) -> None:
        """Rotary inverse frequencies per layer kind, computed on the CPU in float32 as transformers does."""
        self.rope_scaling = {}
        for kind, rope_type in self.rope_types.items():
            if rope_type == "default":
                theta = self.config.rope_parameters[kind]["rope_theta"]
                dim = self.config.hidden_size // self.config.num_attention_heads
                inv_freq, scaling = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, None, layer_type=kind)
            self.register_buffer(f"{kind}_inv_freq", inv_freq.to(self.final_norm.weight.device), persistent=False)
            self.rope_scaling[kind] = scaling

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """{kind: (cos, sin)}, each (T, dh) in the model's dtype."""
        out = {}
        for kind, scaling in self.rope_scaling.items():
            freqs = positions.float()[:, None] * getattr(self, f"{kind}_inv_freq")  # (T, dh / 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            out[kind] = ((emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype))
        return out

    def forward(self, batch: PackedBatch, choices: Choices, first_only: bool = False) -> torch.Tensor:
        x = self.embeddings(batch.input_ids)  # (T, d)
        rope = self.rope(batch.positions, x.dtype)
        *layers, last = self.layers
        for layer in layers:
            x = layer(x, batch, choices, rope)
        return last(x, batch, choices, rope, first_only)


class PredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.act = ACT2FN[config.classifier_activation]
        self.norm = _norm(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertForSequenceClassification(EncoderModel):
    @classmethod
    def position_limit(cls, config) -> None:
        return None  # rotary positions only

    def __init__(self, config):
        super().__init__()
        if config.classifier_pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling must be 'cls' or 'mean', got {config.classifier_pooling!r}")
        self.pooling = config.classifier_pooling
        self.model = ModernBertModel(config)
        self.head = PredictionHead(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)  # always biased, as transformers

    def after_load(self) -> None:
        self.model.after_load()

    def head_shape(self) -> tuple[int, int]:
        attention = self.model.layers[0].attn
        return attention.num_heads, attention.head_dim

    def pads_pairs(self, choices: Choices) -> bool:
        return any(layer.attn.pads_pairs(choices) for layer in self.model.layers)

    def per_pair_linears(self) -> list[nn.Module]:
        """The head's linears, and with CLS pooling the last layer's (mean pooling reads every token)."""
        last = self.model.layers[-1].per_pair_linears() if self.pooling == "cls" else []
        return last + [self.head.dense, self.classifier]

    def forward(self, batch: PackedBatch, choices: Choices) -> torch.Tensor:
        if self.pooling == "cls":
            pooled = self.model.final_norm(self.model(batch, choices, first_only=True))  # (B, d)
        else:
            # As transformers: (hidden * mask).sum(1) / mask.sum(1), over the pair's real tokens.
            pooled = mean_per_pair(self.model.final_norm(self.model(batch, choices)), batch)
        return self.classifier(self.head(pooled))
