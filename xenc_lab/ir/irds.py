"""Test collections by name: a local BEIR folder, or an ir_datasets id (``"beir/scifact/test"``) whose files are on
this machine already. Nothing is downloaded: an ir_datasets collection without a local copy is refused, saying
where ir_datasets looks for it."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass


@dataclass
class Collection:
    """A test collection's parts, in the forms ``rerank``, ``bm25`` and ``experiment`` take: ``queries`` (qid -> text),
    ``corpus`` (docno -> text, or {"title", "text"}; or a file path), ``qrels`` (a path or a frame qid, docno,
    relevance)."""

    name: str
    queries: object
    corpus: object
    qrels: object


def load_collection(name: str | os.PathLike, split: str = "test") -> Collection:
    """The collection ``name``: a BEIR folder (corpus.jsonl, queries.jsonl, qrels/``split``.tsv; files are streamed
    as read) or an ir_datasets id, read from ir_datasets' local copy (``IR_DATASETS_HOME``, by default
    ~/.ir_datasets) with ``pip install ir_datasets``. No download is ever started."""
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"name must be a BEIR folder or an ir_datasets id (str), got {type(name).__name__}")
    if os.path.isdir(name):
        return _beir_folder(os.fspath(name), split)
    try:
        import ir_datasets
    except ImportError:
        raise ImportError(f"{name!r} is not a local folder; loading a collection by its ir_datasets id needs "
                          "ir_datasets: pip install 'xenc-lab[pyterrier]' (or ir_datasets)") from None
    try:
        dataset = ir_datasets.load(str(name))
    except KeyError:
        raise ValueError(f"{name!r} is neither a local folder nor an ir_datasets id (e.g. 'beir/scifact/test', "
                         "'msmarco-passage/dev/small')") from None
    missing = [part for part in ("docs", "queries", "qrels") if not getattr(dataset, f"has_{part}")()]
    if missing:
        raise ValueError(f"ir_datasets' {name!r} has no {' and no '.join(missing)}: pick a split with all three "
                         f"(e.g. 'beir/scifact/test' rather than 'beir/scifact')")
    import pandas as pd

    with _no_downloads(str(name)):
        queries = {q.query_id: q.default_text() for q in dataset.queries_iter()}
        corpus = {d.doc_id: _doc(d) for d in dataset.docs_iter()}
        qrels = pd.DataFrame([(q.query_id, q.doc_id, int(q.relevance)) for q in dataset.qrels_iter()],
                             columns=["qid", "docno", "relevance"])
    return Collection(str(name), queries, corpus, qrels)


def _doc(doc):
    text = getattr(doc, "text", None)
    text = doc.default_text() if text is None else text
    title = getattr(doc, "title", None)
    return {"title": title, "text": text} if title else text


def _beir_folder(folder: str, split: str) -> Collection:
    paths = {"queries": os.path.join(folder, "queries.jsonl"), "corpus": os.path.join(folder, "corpus.jsonl"),
             "qrels": os.path.join(folder, "qrels", f"{split}.tsv")}
    absent = [p for p in paths.values() if not os.path.isfile(p)]
    if absent:
        raise FileNotFoundError(f"{folder} is not a BEIR folder with split {split!r}: missing {absent}")
    return Collection(folder, paths["queries"], paths["corpus"], paths["qrels"])


class NotLocal(FileNotFoundError):
    """An ir_datasets file this machine does not hold; xenc_lab does not download it."""


@contextlib.contextmanager
def _no_downloads(name: str):
    """ir_datasets with every remote source refused: a file it would fetch raises ``NotLocal`` instead."""
    from ir_datasets import util
    from ir_datasets.util import download

    def refuse(self):
        url = getattr(self, "url", None) or getattr(self, "bucket", None) or type(self).__name__
        raise NotLocal(f"ir_datasets' {name!r} is not on this machine (it would download {url}); xenc_lab does not "
                       f"download collections: fetch it once with `ir_datasets export {name} docs` where a network "
                       f"is at hand, or point IR_DATASETS_HOME at a copy (now {util.home_path()})")

    remote = [c for c in vars(download).values()
              if isinstance(c, type) and issubclass(c, download.BaseDownload) and c is not download.LocalDownload
              and "stream" in vars(c)]
    saved = {c: c.stream for c in remote}
    try:
        for c in remote:
            c.stream = refuse
        yield
    except RuntimeError as err:  # ir_datasets' "All download sources failed" around our refusals
        refused = [e for _, e in (err.args[1] if len(err.args) > 1 else []) if isinstance(e, NotLocal)]
        if refused:
            raise refused[0] from None
        raise
    finally:
        for c, stream in saved.items():
            c.stream = stream
