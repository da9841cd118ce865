"""Decoder LLM rerankers, packed: Qwen3, Qwen2 and Llama, read at the last token of each pair.

One implementation; the families differ by flags (``Family``): Qwen3 normalizes q and k per head before rotary,
Qwen2 always biases q/k/v and never o_proj, Llama biases all four projections with ``attention_bias`` and the MLP
with ``mlp_bias``. Grouped-query or multi-head attention runs per chunk over the paged KV cache
(``ops.paged_attention.chunk_attention``). Two heads: transformers' bias-free ``score`` Linear (seq-cls) and
sentence-transformers' LogitScore (CausalLM: the "yes" logit less the "no" logit, two rows of the output embedding).

Numerics follow transformers': RMSNorm in float32 cast back before the weight, rotary tables in float32 cast to the
model dtype, residual adds and the logit difference in the model dtype. Attribute names mirror the checkpoints.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..cpu.kernels import rms_norm_cpu, rope_cpu
from ..ops.linear import fuse_linears, linear_plus
from ..ops.paged_attention import chunk_attention, last_token_attention
from .base import PackedModel

# These rescale the frequencies by the length of the padded batch, so no per-pair engine can match them.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
SUPPORTED_ROPE = ("default",) + tuple(t for t in ROPE_INIT_FUNCTIONS if t not in _LENGTH_DEPENDENT_ROPE)
# model_type -> the transformers class whose default rotary frequencies the family uses
_ROTARY = {"qwen3": "Qwen3RotaryEmbedding", "qwen2": "Qwen2RotaryEmbedding", "llama": "LlamaRotaryEmbedding"}


@dataclass(frozen=True, slots=True)
class Family:
    qk_norm: bool  # RMSNorm of each query and key head before rotary (Qwen3)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @staticmethod
    def of(config) -> Family:
        kind = config.model_type
        if kind == "qwen3":
            return Family(qk_norm=True, qkv_bias=config.attention_bias, o_bias=config.attention_bias, mlp_bias=False)
        if kind == "qwen2":
            return Family(qk_norm=False, qkv_bias=True, o_bias=False, mlp_bias=False)
        if kind == "llama":
            bias = config.attention_bias
            return Family(qk_norm=False, qkv_bias=bias, o_bias=bias, mlp_bias=config.mlp_bias)
        raise ValueError(
            f"model_type {kind!r} is not a decoder family of the packed engine; supported: {', '.join(sorted(_ROTARY))}"
        )


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_type_of(config) -> str:
    """The checkpoint's rope type, refused where no packed engine can reproduce it."""
    params = config.rope_parameters or {}
    rope_type = params.get("rope_type", "default")
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(
            f"rope_type {rope_type!r} rescales positions by the padded batch's length, which a packed engine cannot "
            f"reproduce; supported rope types: {', '.join(SUPPORTED_ROPE)}"
        )
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(f"unknown rope_type {rope_type!r}; supported rope types: {', '.join(SUPPORTED_ROPE)}")
    return rope_type


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


class RMSNorm(nn.Module):
    """As transformers: normalized in float32, cast back to the input dtype, then times the weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _row_kernels(x) and x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype:
            out = rms_norm_cpu(x, self.weight, self.eps)  # one pass over each row
            if out is not None:
                return out
        # torch's fused RMS norm, in float32: the same values as transformers' x * rsqrt(mean(x^2) + eps) (checked
        # in the tests); the weight multiplies after the cast, as there.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if x.dtype == torch.float32:
            return normed.mul_(self.weight)
        return self.weight * normed.to(x.dtype)


def _row_kernels(x: torch.Tensor) -> bool:
    """Whether xenc_lab's row kernels (``cpu.kernels.rms_norm_cpu``, ``rope_cpu``) may run on x: eager, on the CPU
    (compiled, inductor fuses torch's ops with their neighbours)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(T, H, D) rotated by halves, as transformers' apply_rotary_pos_emb, in x's dtype: x * cos + rotate_half(x) *
    sin, with rotate_half(x) * sin = roll(x, D / 2) * ``sin`` when ``sin`` holds the first half's sines negated
    (``DecoderModel.rope``): the same products, one op fewer."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * sin[:, None]


def plus(linear: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x): in float32 the add inside the GEMM where the layer is prepacked (the same sum to the
    bit, one pass less); in 16 bits rounded twice, product then sum, as transformers rounds them."""
    if x.dtype == torch.float32:
        return linear_plus(linear, x, residual)
    return linear(x) + residual


class Attention(nn.Module):
    def __init__(self, config, family: Family, layer: int):
        super().__init__()
        d, self.layer = config.hidden_size, layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        self.head_dim = D = head_dim_of(config)
        self.q_proj = nn.Linear(d, self.num_heads * D, bias=family.qkv_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * D, bias=family.qkv_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * D, bias=family.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * D, d, bias=family.o_bias)
        self.qk_norm = family.qk_norm
        if family.qk_norm:
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

    def normed_rotated(self, qk: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q's heads and k's together, (T, H + KVH, D): each head normalized (Qwen3), then rotated; one pass on the
        CPU (``cpu.kernels.rope_cpu``)."""
        if _row_kernels(qk):
            weight = self.qk_norm_heads.weight if self.qk_norm else None
            out = rope_cpu(qk, weight, self.qk_norm_heads.eps if self.qk_norm else 0.0, *rope)
            if out is not None:
                return out
        if self.qk_norm:
            qk = self.qk_norm_heads(qk)
        return rotate(qk, *rope)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch, cache, residual: torch.Tensor,
                last: bool = False) -> torch.Tensor:
        """(T, d) -> (T, d): ``residual`` plus the attention's output projection (``plus``); ``last``: (R, d), the
        rows ``batch.last_index`` only (every token's keys and values are still made, and stored where the cache keeps
        them), ``residual`` being those rows'."""
        T, H, KVH, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        qk, v = qkv[:, : (H + KVH) * D].view(T, H + KVH, D), qkv[:, (H + KVH) * D :].view(T, KVH, D)
        qk = self.normed_rotated(qk, rope)
        q, k = qk[:, :H], qk[:, H:]
        attention = last_token_attention if last else chunk_attention
        return plus(self.o_proj, attention(q, k, v, batch, cache, self.layer, D**-0.5), residual)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up run as one GEMM once fused."""

    def __init__(self, config, family: Family):
        super().__init__()
        d, n = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, n, bias=family.mlp_bias)
        self.up_proj = nn.Linear(d, n, bias=family.mlp_bias)
        self.down_proj = nn.Linear(n, d, bias=family.mlp_bias)
        self.act = ACT2FN[config.hidden_act]

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + down(act(gate(x)) * up(x)) (``plus``)."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return plus(self.down_proj, self.act(gate).mul_(up), residual)


class Layer(nn.Module):
    def __init__(self, config, family: Family, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, family, index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, family)

    def forward(self, x: torch.Tensor, rope, batch, cache, last: bool = False) -> torch.Tensor:
        """(T, d) -> (T, d); ``last``: (R, d) at ``batch.last_index``, the only rows the head reads."""
        x = self.self_attn(self.input_layernorm(x), rope, batch, cache, x[batch.last_index] if last else x, last)
        return self.mlp(self.post_attention_layernorm(x), x)


class DecoderModel(nn.Module):
    """Embeddings + pre-norm layers over a chunk stream: (T,) ids -> (R, d) final-normed hidden states at
    ``batch.last_index`` (the tokens that end pairs, then filler rows)."""

    def __init__(self, config):
        super().__init__()
        family = Family.of(config)
        self.rope_type = rope_type_of(config)
        check_full_attention(config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config, family, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def after_load(self) -> None:
        """Fused projections, and the rotary inverse frequencies as transformers computes them (float32, CPU)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if self.rope_type == "default":
            kind = self.config.model_type
            module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
            init = getattr(module, _ROTARY[kind]).compute_default_rope_parameters
        else:
            init = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init(self.config)
        D = head_dim_of(self.config)
        if tuple(inv_freq.shape) != (D // 2,):
            raise ValueError(
                f"rope {self.config.rope_parameters} gives {tuple(inv_freq.shape)} frequencies for head_dim {D}; "
                f"partial rotary embeddings are not supported"
            )
        self.register_buffer("inv_freq", inv_freq.float().to(self.norm.weight.device), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: (T, D) at absolute positions, in float32 times attention_scaling, cast to ``dtype`` (the sines'
        first half negated)."""
        freqs = positions.float()[:, None] * self.inv_freq  # (T, D / 2)
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        # The sines with the first half negated, for ``rotate``.
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def forward(self, batch, cache) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # (T, d)
        rope = self.rope(batch.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, batch, cache, last=i == len(self.layers) - 1)
        return self.norm(x)  # (R, d)


class OutputEmbedding(nn.Module):
    """``lm_head.weight`` of an untied checkpoint, held (not an nn.Linear: the full vocabulary is never projected,
    nor prepacked); the LogitScore head takes its rows."""

    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))


class DecoderFamily(PackedModel):
    """What both heads share: the decoder (``self.model``), its own attention, no padded layouts."""

    causal = True
    model: DecoderModel

    def after_load(self) -> None:
        self.model.after_load()

    def head_shape(self) -> tuple[int, int]:
        """(heads, head dim): where flash varlen attention (CUDA, half precision) or xenc_lab's kernel (CPU) runs,
        chunk_attention takes it."""
        attn = self.model.layers[0].self_attn
        return attn.num_heads, attn.head_dim

    def pads_pairs(self, choices) -> bool:
        # chunk_attention's SDPA lays chunks out as (chunks, longest chunk): the planner bounds the padding
        return not choices.attends_packed


class DecoderForCausalLM(DecoderFamily):
    """Qwen3/Qwen2/LlamaForCausalLM as sentence-transformers' LogitScore reads it: (R, 1) = logit[true] -
    logit[false] at each pair's last token, each logit and the difference in the model dtype. Call
    ``set_score_tokens`` once after loading."""

    def __init__(self, config):
        super().__init__()
        self.model = DecoderModel(config)
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

    def forward(self, batch, choices, cache=None) -> torch.Tensor:
        if self.score_rows is None:
            raise RuntimeError("call set_score_tokens(true_id, false_id) after loading, before scoring")
        logits = F.linear(self.model(batch, cache), self.score_rows)  # (R, 2 or 1), model dtype
        if logits.shape[1] == 1:
            return logits
        return logits[:, :1] - logits[:, 1:]


class DecoderForSequenceClassification(DecoderFamily):
    """Qwen3/Qwen2/LlamaForSequenceClassification: the bias-free ``score`` Linear at each pair's last token,
    (R, num_labels)."""

    def __init__(self, config):
        super().__init__()
        self.model = DecoderModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

    def per_pair_linears(self) -> list[nn.Module]:
        return [self.score]

    def forward(self, batch, choices, cache=None) -> torch.Tensor:
        return self.score(self.model(batch, cache))
