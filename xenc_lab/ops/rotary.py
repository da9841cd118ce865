"""Rotary positions, one module for every family that uses them: the inverse frequencies as transformers computes
them, the cos/sin tables, and rotation by halves in the two roundings the families need (``rotate``: in the model
dtype, as transformers' decoders; ``rotate_float32``: in float32, as its ModernBERT)."""
from __future__ import annotations

import importlib

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..choices import Choices
from ..cpu.kernels import rope_cpu

# These rescale the frequencies by the length of the padded batch, so no per-pair engine can match them.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
SUPPORTED_ROPE = ("default",) + tuple(t for t in ROPE_INIT_FUNCTIONS if t not in LENGTH_DEPENDENT_ROPE)


def rope_type_of(config) -> str:
    """A decoder checkpoint's rope type, refused where no packed engine can reproduce it."""
    params = config.rope_parameters or {}
    rope_type = params.get("rope_type", "default")
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise ValueError(
            f"rope_type {rope_type!r} rescales positions by the padded batch's length, which a packed engine cannot "
            f"reproduce; supported rope types: {', '.join(SUPPORTED_ROPE)}"
        )
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(f"unknown rope_type {rope_type!r}; supported rope types: {', '.join(SUPPORTED_ROPE)}")
    return rope_type


def inverse_frequencies(config, rope_type: str, rotary_class: str) -> tuple[torch.Tensor, float]:
    """(inv_freq (D / 2,) float32 on the CPU, attention_scaling) as transformers computes them: the default type by
    ``rotary_class`` (the config's model_type's rotary module), the others by transformers' rope functions."""
    if rope_type == "default":
        kind = config.model_type
        module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
        return getattr(module, rotary_class).compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


def negated_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (T, D) at absolute positions, in float32 times ``scaling``, cast to ``dtype``, the sines' first half
    negated (for ``rotate``)."""
    freqs = positions.float()[:, None] * inv_freq  # (T, D / 2)
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(T, H, D) rotated by halves, as transformers' apply_rotary_pos_emb, in x's dtype: x * cos + rotate_half(x) *
    sin, with rotate_half(x) * sin = roll(x, D / 2) * ``sin`` when ``sin`` holds the first half's sines negated
    (``negated_tables``): the same products, one op fewer."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * sin[:, None]


def rotate_float32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(n, H, dh) rotated by cos, sin: (n, dh) (sines not negated). In float32, cast back, as transformers'
    ModernBERT."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def normed_rotated(qk: torch.Tensor, norm, cos: torch.Tensor, sin: torch.Tensor, choices: Choices) -> torch.Tensor:
    """(T, G, D) heads each RMS-normalized by ``norm`` (an RMSNorm over D whose weight is (G, D), or None), then
    rotated (``rotate``): in one pass by xenc_lab's CPU kernel where the choices run row kernels and the forward is
    eager (compiled, inductor fuses torch's ops with their neighbours)."""
    if choices.row_kernels and not torch.compiler.is_compiling():
        out = rope_cpu(qk, None if norm is None else norm.weight, 0.0 if norm is None else norm.eps, cos, sin)
        if out is not None:
            return out
    if norm is not None:
        qk = norm(qk, choices)
    return rotate(qk, cos, sin)
