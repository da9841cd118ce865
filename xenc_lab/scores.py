"""Stage 5: logits -> scores, as CrossEncoder.predict does it.

Logits are upcast to fp32, the activation applied, a single label squeezed, and softmax taken over
labels when asked. The default activation is resolved in sentence-transformers' order.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from .st_format import CrossEncoderSave

logger = logging.getLogger(__name__)


def import_from_string(dotted_path: str):
    module_path, _, name = dotted_path.rpartition(".")
    if not module_path:
        raise ValueError(f"activation {dotted_path!r} is not a dotted import path")
    return getattr(importlib.import_module(module_path), name)


def _from_path(dotted_path: str, trust_remote_code: bool) -> Callable | None:
    if trust_remote_code or dotted_path.startswith("torch."):
        return import_from_string(dotted_path)()
    logger.warning(
        "Activation function path %r is not trusted, using the default activation instead. "
        "Pass trust_remote_code=True to allow it.",
        dotted_path,
    )
    return None


def default_activation(
    config: PretrainedConfig, save: CrossEncoderSave, trust_remote_code: bool = False, num_labels: int | None = None
) -> Callable:
    """A CrossEncoder save's ``activation_fn``, then config.json's ``sentence_transformers`` and legacy keys,
    else Sigmoid for one label and Identity for more (``num_labels``: the model's, where not the config's: a causal
    LM's yes/no score is one)."""
    candidates = [save.activation_fn]
    st_section = getattr(config, "sentence_transformers", None)
    if isinstance(st_section, dict) and "activation_fn" in st_section:
        candidates.append(st_section["activation_fn"])
    else:
        candidates.append(getattr(config, "sbert_ce_default_activation_function", None))
    for dotted in candidates:
        if dotted is not None and (fn := _from_path(dotted, trust_remote_code)) is not None:
            return fn
    num_labels = config.num_labels if num_labels is None else num_labels
    return nn.Sigmoid() if num_labels == 1 else nn.Identity()


def to_scores(logits: torch.Tensor, activation: Callable, apply_softmax: bool) -> torch.Tensor:
    """(N, num_labels) logits -> (N,) scores for one label, else (N, num_labels). The activation sees all N rows
    at once (CrossEncoder applies it a batch at a time: the same for any activation that works row by row)."""
    scores = activation(logits.float())
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"activation_fn must map the logits tensor to a torch.Tensor, got {type(scores).__name__}")
    if logits.shape[-1] == 1 and scores.ndim > 1:  # a one-label model's column, whatever the activation returns
        scores = scores.squeeze(-1)
    if apply_softmax and scores.ndim > 1:
        scores = torch.softmax(scores, dim=1)
    return scores
