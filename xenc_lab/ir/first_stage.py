"""A BM25 first stage on ``bm25s``: any collection's queries and corpus (files, frames, dicts) in, a run frame out."""
from __future__ import annotations

import numbers


def bm25(queries, corpus, k: int = 100, title_sep: str | None = " "):
    """A BM25 first stage (``bm25s``, English stopwords) as a run frame (qid, docno, rank, score): each query's top
    ``k`` documents that share a term with it (score above 0). ``queries``/``corpus``: what
    ``read_queries``/``read_corpus`` take (PyTerrier's topics and document frames too)."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    import bm25s
    import pandas as pd

    from .files import read_corpus, read_queries

    texts, docs = read_queries(queries), read_corpus(corpus, title_sep=title_sep)
    docnos = list(docs)
    if not docnos or not texts:
        raise ValueError(f"bm25 needs queries and documents, got {len(texts)} queries and {len(docnos)} documents")
    index = bm25s.BM25()
    index.index(bm25s.tokenize([docs[d] or "" for d in docnos], show_progress=False), show_progress=False)
    qids = list(texts)
    found, scores = index.retrieve(bm25s.tokenize([texts[q] for q in qids], show_progress=False),
                                   k=min(k, len(docnos)), show_progress=False)
    rows = [(qid, docnos[i], float(s)) for qid, ids, ss in zip(qids, found, scores) for i, s in zip(ids, ss) if s > 0]
    run = pd.DataFrame(rows, columns=["qid", "docno", "score"])
    # Ranks in the order evaluation reads a run (score descending, ties by docno descending, as trec_eval), so that
    # the top k by rank are the top k that rerank(depth=k) rescores.
    run = run.sort_values(["score", "docno"], ascending=False, kind="stable")
    run = run.iloc[run["qid"].map({q: i for i, q in enumerate(qids)}).argsort(kind="stable")]
    run.insert(2, "rank", run.groupby("qid", sort=False).cumcount() + 1)
    return run.reset_index(drop=True)
