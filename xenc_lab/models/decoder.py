"""Decoder LLM rerankers, packed: Qwen3, Qwen2 and Llama (and, by the same classes, Gemma: ``gemma``), read at the
last token of each pair.

One implementation; the families differ by flags (``DecoderFlags``, from the config's model_type): Qwen3 normalizes
q and k per head before rotary, Qwen2 always biases q/k/v and never o_proj, Llama biases all four projections with
``attention_bias`` and the MLP with ``mlp_bias``. Grouped-query or multi-head attention runs per chunk over the paged
KV cache (``ops.paged_attention.chunk_attention``), on the path the load's ``Choices`` name. Two heads:
transformers' bias-free ``score`` Linear (seq-cls) and sentence-transformers' LogitScore (CausalLM: the "yes" logit
less the "no" logit, two rows of the output embedding, or the "yes" logit alone).

Numerics follow transformers': RMSNorm in float32 cast back before the weight, rotary tables in float32 cast to the
model dtype, residual adds and the logit difference in the model dtype. Attribute names mirror the checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ..choices import Choices
from ..ops.linear import fuse_linears, linear_plus
from ..ops.paged_attention import chunk_attention, last_token_attention
from ..ops.rms_norm import rms_norm
from ..ops.rotary import inverse_frequencies, negated_tables, normed_rotated, rope_type_of
from .base import DecoderModel


class RMSNorm(nn.Module):
    """As transformers' Llama: normalized in float32, cast back to the input dtype, then times the weight
    (``ops.rms_norm``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def after_load(self) -> None:
        """Derive what the norm multiplies by from the loaded weight; nothing here."""

    def forward(self, x: torch.Tensor, choices: Choices) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, choices)


@dataclass(frozen=True, slots=True)
class DecoderFlags:
    """What one decoder family's layers differ by."""

    rotary: str  # transformers' rotary class of the config's model_type: the default rope frequencies' source
    qk_norm: bool = False  # RMSNorm of each query and key head before rotary (Qwen3)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm: type[RMSNorm] = RMSNorm  # the RMSNorm of the layers and the final norm
    embed_scale: bool = False  # the embeddings times sqrt(hidden_size), in the model dtype (Gemma)


# model_type -> its flags, from the config
FLAGS = {
    "qwen3": lambda c: DecoderFlags("Qwen3RotaryEmbedding", qk_norm=True, qkv_bias=c.attention_bias,
                                    o_bias=c.attention_bias),
    "qwen2": lambda c: DecoderFlags("Qwen2RotaryEmbedding", qkv_bias=True),
    "llama": lambda c: DecoderFlags("LlamaRotaryEmbedding", qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                                    mlp_bias=c.mlp_bias),
}


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_full_attention(config) -> None:
    """Refuse sliding-window layers whose window a sequence within max_position_embeddings could exceed."""
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported by the packed engine (only full attention)")
    if "sliding_attention" not in kinds:
        return
    window, limit = getattr(config, "sliding_window", None), config.max_position_embeddings
    # transformers: key j is seen from query i when i - window < j <= i, so a window binds once i >= window.
    if window is None or window < limit:
        raise ValueError(
            f"sliding-window attention (sliding_window={window}, on layers "
            f"{[i for i, kind in enumerate(kinds) if kind == 'sliding_attention']}) is not supported by the packed "
            f"engine, which runs full causal attention; a window >= max_position_embeddings ({limit}) never binds"
        )


def plus(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x). In float32 the add runs inside the GEMM where the layer is prepacked (the same sum to
    the bit, one pass less), and so it does in an int8 layer (rounded once: int8 keeps no parity to round for);
    otherwise, in 16 bits, the product and then the sum are rounded, as transformers rounds them."""
    if x.dtype == torch.float32 or getattr(linear, "gemm", None) == "int8":
        return linear_plus(linear, x, residual)
    return linear(x) + residual


class Attention(nn.Module):
    def __init__(self, config, flags: DecoderFlags, layer: int):
        super().__init__()
        d, self.layer = config.hidden_size, layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        self.head_dim = D = head_dim_of(config)
        self.q_proj = nn.Linear(d, self.num_heads * D, bias=flags.qkv_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * D, bias=flags.qkv_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * D, bias=flags.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * D, d, bias=flags.o_bias)
        self.qk_norm = flags.qk_norm
        if flags.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(D, config.rms_norm_eps), RMSNorm(D, config.rms_norm_eps)

    def fuse(self) -> None:
        """One GEMM for q, k and v; one norm for q's and k's heads (each head its norm's weight)."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj
        if self.qk_norm:
            weight = torch.cat([self.q_norm.weight.expand(self.num_heads, -1),
                                self.k_norm.weight.expand(self.num_kv_heads, -1)])
            self.qk_norm_heads = RMSNorm(self.head_dim, self.q_norm.eps)
            self.qk_norm_heads.weight = nn.Parameter(weight, requires_grad=False)
            del self.q_norm, self.k_norm

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch, cache, residual: torch.Tensor,
                choices: Choices, last: bool = False) -> torch.Tensor:
        """(T, d) -> (T, d): ``residual`` plus the attention's output projection (``plus``); ``last``: (R, d), the
        rows ``batch.last_index`` only (every token's keys and values are still made, and stored where the cache keeps
        them), ``residual`` being those rows'."""
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        qk, v = qkv[:, : (H + KVH) * D].view(T, H + KVH, D), qkv[:, (H + KVH) * D :].view(T, KVH, D)
        qk = normed_rotated(qk, self.qk_norm_heads if self.qk_norm else None, *rope, choices)  # heads normed, rotated
        q, k = qk[:, :H], qk[:, H:]
        attention = last_token_attention if last else chunk_attention
        return plus(self.o_proj, attention(q, k, v, batch, cache, self.layer, D**-0.5, choices.attention), residual)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up run as one GEMM once fused."""

    def __init__(self, config, flags: DecoderFlags):
        super().__init__()
        d, n = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, n, bias=flags.mlp_bias)
        self.up_proj = nn.Linear(d, n, bias=flags.mlp_bias)
        self.down_proj = nn.Linear(n, d, bias=flags.mlp_bias)
        self.act = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act in ("silu", "swish")

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def silu_gated(self) -> nn.Module | None:
        """The fused gate/up layer where SiLU follows it: int8 quantizes it gated (``cpu.int8.quantize_linears``)."""
        return self.gate_up if self.silu and isinstance(self.gate_up, nn.Linear) else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + down(act(gate(x)) * up(x)) (``plus``); a gated layer computes act(gate) * up itself."""
        if getattr(self.gate_up, "gated", False):
            return plus(self.down_proj, self.gate_up(x, "silu_mul"), residual)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return plus(self.down_proj, self.act(gate).mul_(up), residual)


class Layer(nn.Module):
    def __init__(self, config, flags: DecoderFlags, index: int):
        super().__init__()
        self.input_layernorm = flags.norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, flags, index)
        self.post_attention_layernorm = flags.norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, flags)

    def forward(self, x: torch.Tensor, rope, batch, cache, choices: Choices, last: bool = False) -> torch.Tensor:
        """(T, d) -> (T, d); ``last``: (R, d) at ``batch.last_index``, the only rows the head reads."""
        x = self.self_attn(self.input_layernorm(x, choices), rope, batch, cache, x[batch.last_index] if last else x,
                           choices, last)
        return self.mlp(self.post_attention_layernorm(x, choices), x)


class DecoderStack(nn.Module):
    """Embeddings + pre-norm layers over a chunk stream: (T,) ids -> (R, d) final-normed hidden states at
    ``batch.last_index`` (the tokens that end pairs, then filler rows)."""

    def __init__(self, config, flags: DecoderFlags):
        super().__init__()
        self.flags = flags
        self.rope_type = rope_type_of(config)
        check_full_attention(config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config, flags, i) for i in range(config.num_hidden_layers))
        self.norm = flags.norm(config.hidden_size, config.rms_norm_eps)

    def after_load(self) -> None:
        """Fused projections, derived norm weights, the embedding scale in the model dtype, and the rotary inverse
        frequencies as transformers computes them (float32, CPU)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.after_load()
        weight = self.embed_tokens.weight
        # as transformers: sqrt(hidden) a float32 scalar rounded to the model dtype, multiplied in it
        self.embed_scale = (torch.tensor(self.config.hidden_size**0.5).to(device=weight.device, dtype=weight.dtype)
                            if self.flags.embed_scale else None)
        inv_freq, self.attention_scaling = inverse_frequencies(self.config, self.rope_type, self.flags.rotary)
        D = head_dim_of(self.config)
        if tuple(inv_freq.shape) != (D // 2,):
            raise ValueError(
                f"rope {self.config.rope_parameters} gives {tuple(inv_freq.shape)} frequencies for head_dim {D}; "
                f"partial rotary embeddings are not supported"
            )
        self.register_buffer("inv_freq", inv_freq.float().to(self.norm.weight.device), persistent=False)

    def forward(self, batch, cache, choices: Choices) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # (T, d)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = negated_tables(batch.positions, self.inv_freq, self.attention_scaling, x.dtype)  # cos, sin (T, D)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, batch, cache, choices, last=i == len(self.layers) - 1)
        return self.norm(x, choices)  # (R, d)


class OutputEmbedding(nn.Module):
    """``lm_head.weight`` of an untied checkpoint, held (not an nn.Linear: the full vocabulary is never projected,
    nor prepacked); the LogitScore head takes its rows."""

    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))


class DecoderReranker(DecoderModel):
    """What both heads share: the decoder stack (``self.model``), its own attention, no padded layouts. A family's
    flags come from ``flags(config)``: by model_type from ``FLAGS`` here; a family of its own overrides it."""

    model: DecoderStack

    @classmethod
    def flags(cls, config) -> DecoderFlags:
        kind = config.model_type
        if kind not in FLAGS:
            raise ValueError(f"model_type {kind!r} is not a decoder family of the packed engine; supported: "
                             f"{', '.join(sorted(FLAGS))}")
        return FLAGS[kind](config)

    def __init__(self, config):
        super().__init__()
        self.model = DecoderStack(config, self.flags(config))

    def after_load(self) -> None:
        self.model.after_load()

    def head_shape(self) -> tuple[int, int]:
        """(heads, head dim): where flash varlen attention (CUDA, half precision) or xenc_lab's kernel (CPU) runs,
        chunk_attention takes it."""
        attn = self.model.layers[0].self_attn
        return attn.num_heads, attn.head_dim

    def cache_shape(self) -> tuple[int, int, int]:
        attn = self.model.layers[0].self_attn
        return len(self.model.layers), attn.num_kv_heads, attn.head_dim

    def pads_pairs(self, choices) -> bool:
        # chunk_attention's SDPA lays chunks out as (chunks, longest chunk): the planner bounds the padding
        return not choices.attends_packed


class DecoderForCausalLM(DecoderReranker):
    """Qwen3/Qwen2/LlamaForCausalLM as sentence-transformers' LogitScore reads it: (R, 1) = logit[true] -
    logit[false] at each pair's last token, each logit and the difference in the model dtype (or logit[true] alone).
    Call ``set_score_tokens`` once after loading."""

    scores_by_logits: ClassVar[bool] = True

    def __init__(self, config):
        super().__init__(config)
        self.tied = bool(config.tie_word_embeddings)
        # transformers saves no lm_head.weight when tied: the head reads embed_tokens (see before_load).
        if not self.tied:
            self.lm_head = OutputEmbedding(config)
        self.score_tokens: tuple[int, int | None] | None = None
        self.score_rows: torch.Tensor | None = None

    def before_load(self, names: set[str]) -> None:
        """A tied checkpoint that stores lm_head.weight anyway is read as transformers reads it: the stored matrix is
        the head's (transformers keeps it where it differs from the embedding)."""
        if self.tied and "lm_head.weight" in names:
            self.tied = False
            self.lm_head = OutputEmbedding(self.model.config)

    def per_pair_linears(self) -> list[nn.Module]:
        return []  # the head is F.linear on two rows of the output embedding: torch's in every dtype

    def set_score_tokens(self, true_id: int, false_id: int | None) -> None:
        """Keep the output embedding's rows of ``true_id`` (and ``false_id``) as the head's (2 or 1, d) weight. An
        untied model's full lm_head is freed then, so later calls may only repeat the same ids."""
        ids = (true_id,) if false_id is None else (true_id, false_id)
        vocab = self.model.config.vocab_size
        for name, value in zip(("true_id", "false_id"), ids):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int token id, got {type(value).__name__}")
            if not 0 <= value < vocab:
                raise ValueError(f"{name} {value} is not a token id of this model (vocab_size {vocab})")
        if (true_id, false_id) == self.score_tokens:
            return
        if not self.tied and not hasattr(self, "lm_head"):
            raise RuntimeError(f"score tokens are already {self.score_tokens}; the untied lm_head was freed then")
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        self.score_rows = weight[list(ids)].detach().clone()  # (2 or 1, d), model dtype and device
        self.score_tokens = (true_id, false_id)
        if not self.tied:
            del self.lm_head

    def forward(self, batch, choices: Choices, cache=None) -> torch.Tensor:
        if self.score_rows is None:
            raise RuntimeError("call set_score_tokens(true_id, false_id) after loading, before scoring")
        logits = F.linear(self.model(batch, cache, choices), self.score_rows)  # (R, 2 or 1), model dtype
        if logits.shape[1] == 1:
            return logits
        return logits[:, :1] - logits[:, 1:]


class DecoderForSequenceClassification(DecoderReranker):
    """Qwen3/Qwen2/LlamaForSequenceClassification: the bias-free ``score`` Linear at each pair's last token,
    (R, num_labels)."""

    def __init__(self, config):
        super().__init__(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

    def per_pair_linears(self) -> list[nn.Module]:
        return [self.score]

    def forward(self, batch, choices: Choices, cache=None) -> torch.Tensor:
        return self.score(self.model(batch, cache, choices))
