"""A reranker trained offline: the MiniLM-L6 cross-encoder fine-tuned with sentence-transformers'
``CrossEncoderTrainer`` on the training split of the standard library's documentation collection
(``xenc_lab.ir.pydocs``), with BM25 hard negatives, and evaluated on the other split.

The split is by document: a query's relevant document decides its side (a seeded hash of its docno), so the
evaluation queries, and the documents relevant to them, are never seen in training; negatives come from a BM25
index of the training documents only. ``trained_reranker`` builds the model once and keeps it under the cache
folder, named by a hash of everything that decides it: the training examples' exact text, the settings below,
the base weights and the library versions.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TrainingSettings:
    """What decides the trained model besides its data (all go into the cache key)."""

    eval_fraction: float = 0.4  # share of the collection's queries held out for evaluation
    split_seed: int = 0  # seeds the hash that puts a query on one side of the split
    negatives: int = 3  # BM25 hard negatives per group
    negative_pool: int = 20  # drawn from the top of BM25's ranking of the training documents, positive left out
    groups_per_query: int = 1  # distinct groups (positive + negatives) per training query
    max_length: int = 64  # tokens of a pair in training (a docstring's first sentences)
    epochs: int = 4  # passes over a round's groups (one pass of 40 steps did not beat BM25; four do)
    rounds: int = 1  # each round trains on the last one's weights with new negatives (round 1: the base, a fresh head)
    batch_size: int = 8  # groups per step
    learning_rate: float = 1e-4
    head_std: float = 0.02  # the classification head starts afresh (the base's wide demo head would saturate the loss)
    warmup_ratio: float = 0.1  # share of the steps over which the learning rate rises
    seed: int = 12
    base_seed: int = 1234  # the seed of the base cross-encoder's (untrained) head

    def __post_init__(self):
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.negatives < 1 or self.negative_pool < self.negatives:
            raise ValueError(f"need 1 <= negatives <= negative_pool, got {self.negatives} and {self.negative_pool}")


def is_eval_doc(docno: str, settings: TrainingSettings) -> bool:
    """Which side of the split a relevant document (and so its query) is on: a seeded hash, stable across Pythons."""
    digest = hashlib.sha256(f"{settings.split_seed}:{docno}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < settings.eval_fraction


def pydocs_split(folder: str | os.PathLike, settings: TrainingSettings = TrainingSettings()) -> dict[str, str]:
    """Writes the standard-library documentation collection as a BEIR folder with both splits: corpus.jsonl,
    queries.jsonl (every query), qrels/train.tsv and qrels/test.tsv (the held-out queries). Returns their paths
    (keys corpus, queries, train, test)."""
    from .ir.pydocs import python_docs_collection

    paths = python_docs_collection(folder)
    lines = Path(paths["qrels"]).read_text(encoding="utf-8").splitlines()
    header, rows = lines[0], [line.split("\t") for line in lines[1:]]
    out = {"corpus": paths["corpus"], "queries": paths["queries"]}
    for split, held_out in (("train", False), ("test", True)):
        out[split] = os.path.join(folder, "qrels", f"{split}.tsv")
        kept = ["\t".join(r) for r in rows if is_eval_doc(r[1], settings) == held_out]
        Path(out[split]).write_text("\n".join([header, *kept]) + "\n", encoding="utf-8")
    return out


def training_examples(settings: TrainingSettings = TrainingSettings(), round: int = 0) -> list[dict[str, str]]:
    """The training groups, in a seeded order: one row per group with ``query``, ``docs`` (the relevant document,
    then the negatives; texts as rerank() builds them: module title, a space, docstring) and ``labels`` (1, then
    0s), the listwise losses' input. Negatives are drawn
    (seeded by ``seed + round``) from BM25's top ``negative_pool`` over the training documents, the query's own
    document left out."""
    import bm25s

    from .ir.files import read_corpus, read_qrels, read_queries

    with tempfile.TemporaryDirectory() as tmp:
        paths = pydocs_split(tmp, settings)
        queries, corpus = read_queries(paths["queries"]), read_corpus(paths["corpus"])
        qrels = read_qrels(paths["train"])
    relevant = dict(zip(qrels["qid"], qrels["docno"]))
    train_docs = sorted(relevant.values())
    index = bm25s.BM25()
    index.index(bm25s.tokenize([corpus[d] for d in train_docs], show_progress=False), show_progress=False)
    qids = sorted(relevant)
    found, _ = index.retrieve(bm25s.tokenize([queries[q] for q in qids], show_progress=False),
                              k=min(settings.negative_pool + 1, len(train_docs)), show_progress=False)
    rng = random.Random(settings.seed + round)
    rows = []
    for qid, hits in zip(qids, found):
        pool = [train_docs[i] for i in hits if train_docs[i] != relevant[qid]][: settings.negative_pool]
        for _ in range(settings.groups_per_query):
            negatives = rng.sample(pool, settings.negatives)
            rows.append({"query": queries[qid], "docs": [corpus[d] for d in (relevant[qid], *negatives)],
                         "labels": [1] + [0] * len(negatives)})
    rng.shuffle(rows)
    return rows


def cache_key(examples: list[dict[str, str]], settings: TrainingSettings, base: Path) -> str:
    """A hash of everything that decides the trained weights: examples, settings, base weights, library versions."""
    import sentence_transformers
    import torch
    import transformers

    h = hashlib.sha256()
    # ``rounds`` does not decide a round's weights: its examples (seeded per round) and its base weights do.
    decisive = {k: v for k, v in asdict(settings).items() if k != "rounds"}
    h.update(json.dumps([examples, decisive], sort_keys=True).encode())
    h.update(hashlib.sha256((Path(base) / "model.safetensors").read_bytes()).digest())
    h.update(f"{torch.__version__} {transformers.__version__} {sentence_transformers.__version__}".encode())
    return h.hexdigest()


def train(examples: list[dict[str, str]], base: Path, out: Path, settings: TrainingSettings,
          show_progress_bar: bool = True, round: int = 0) -> Path:
    """Fine-tunes the cross-encoder at ``base`` on ``examples`` with a listwise loss over each group
    (sentence-transformers' ``LambdaLoss``: the positive above its hard negatives, weighted by nDCG) and saves the
    transformers model and its tokenizer (``max_length`` tokens) as safetensors into ``out``. Round 0 starts the
    classification head afresh; later rounds continue the base's."""
    from datasets import Dataset
    from sentence_transformers.cross_encoder import (CrossEncoder, CrossEncoderTrainer,
                                                     CrossEncoderTrainingArguments, losses)

    import torch

    model = CrossEncoder(str(base), device="cpu", max_length=settings.max_length)
    if round == 0:
        torch.manual_seed(settings.seed)
        torch.nn.init.normal_(model.model.classifier.weight, std=settings.head_std)
        torch.nn.init.zeros_(model.model.classifier.bias)
    loss = losses.LambdaLoss(model)
    with tempfile.TemporaryDirectory() as scratch:
        args = CrossEncoderTrainingArguments(
            output_dir=scratch, num_train_epochs=settings.epochs, per_device_train_batch_size=settings.batch_size,
            learning_rate=settings.learning_rate, warmup_steps=settings.warmup_ratio, seed=settings.seed + round,
            data_seed=settings.seed + round, save_strategy="no", report_to="none", use_cpu=True, logging_steps=10,
            disable_tqdm=not show_progress_bar, dataloader_num_workers=0)
        trainer = CrossEncoderTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples), loss=loss)
        trainer.train()
    hf = model.model.eval()
    hf.save_pretrained(out, safe_serialization=True)
    tokenizer = model.tokenizer
    tokenizer.model_max_length = settings.max_length
    tokenizer.save_pretrained(out)
    return out


def train_reranker(base: Path, root: str | os.PathLike, settings: TrainingSettings = TrainingSettings(),
                   show_progress_bar: bool = True) -> Path:
    """Build under ``root`` (once: 160 steps of 32 pairs of 64 tokens a round) and return the folder of the reranker
    fine-tuned from the cross-encoder folder ``base`` (``zoo.trained_reranker`` passes MiniLM-L6's), that of its last
    round."""
    root, model = Path(root), Path(base)
    for round in range(settings.rounds):
        examples = training_examples(settings, round)
        target = root / f"minilm-l6-pydocs-reranker-{cache_key(examples, settings, model)[:16]}"
        if not (target / "model.safetensors").is_file():
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=".train-"))
            try:
                train(examples, model, tmp, settings, show_progress_bar, round)
                os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        model = target
    return model


def heldout_runs(model, folder: str | os.PathLike, depth: int = 20, settings: TrainingSettings = TrainingSettings(),
                 show_progress_bar: bool = False):
    """The held-out experiment: the collection written to ``folder`` (``pydocs_split``), BM25's top 100 for each
    evaluation query, and that run with each query's top ``depth`` reranked by ``model`` (a Scorer or a path).
    Returns (paths, bm25 run, reranked run); evaluate both against ``paths["test"]``."""
    from .ir.files import read_qrels
    from .ir.first_stage import bm25
    from .ir.reranking import rerank
    from .scorer import Scorer

    paths = pydocs_split(folder, settings)
    held_out = set(read_qrels(paths["test"])["qid"])
    run = bm25(paths["queries"], paths["corpus"], k=100)
    run = run[run["qid"].isin(held_out)].reset_index(drop=True)
    scorer = model if hasattr(model, "predict") else Scorer(model)
    reranked = rerank(scorer, paths["queries"], paths["corpus"], run, depth=depth, show_progress_bar=show_progress_bar)
    return paths, run, reranked
