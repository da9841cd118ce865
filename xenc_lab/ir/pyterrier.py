"""A Scorer as a PyTerrier reranking transformer (``bm25 % 100 >> scorer.as_pyterrier()``), when PyTerrier is
installed (``pip install 'xenc-lab[pyterrier]'``)."""
from __future__ import annotations


def _pyterrier():
    try:
        import pyterrier
    except ImportError:
        raise ImportError("Scorer.as_pyterrier() needs PyTerrier: pip install 'xenc-lab[pyterrier]' (python-terrier); "
                          "xenc_lab.experiment() compares systems without it") from None
    return pyterrier


def as_pyterrier(scorer, text_field: str = "text", query_field: str = "query", *, batch_size: int | None = None,
                 show_progress_bar: bool = False, **predict_kwargs):
    """A ``pt.Transformer`` that scores each row's (``query_field``, ``text_field``) with ``scorer`` and returns the
    frame with ``score`` replaced and ``rank`` recomputed per query (PyTerrier's ``add_ranks``: 0-based, by score), as
    PyTerrier's rerankers do. ``predict_kwargs`` (``prompt``, ``max_length``, ``long_documents``...) go to
    ``predict``; one-label models only."""
    pt = _pyterrier()
    if getattr(scorer, "num_labels", 1) != 1:
        raise ValueError(f"a PyTerrier reranker needs a one-label model; this one has {scorer.num_labels} labels")
    for name in ("convert_to_numpy", "convert_to_tensor", "apply_softmax"):
        if name in predict_kwargs:
            raise TypeError(f"as_pyterrier() sets {name} itself; leave it out")

    class XencLabReranker(pt.Transformer):
        """Reranks a PyTerrier results frame (qid, query, docno, text) with a xenc_lab Scorer."""

        def __init__(self):
            super().__init__()
            self.scorer = scorer

        def __repr__(self):
            return f"XencLabReranker({scorer.config.model if hasattr(scorer, 'config') else scorer!r})"

        def transform(self, inp):
            missing = [c for c in ("qid", "docno", query_field, text_field) if c not in inp.columns]
            if missing:
                raise ValueError(f"the reranker needs a results frame with columns qid, docno, {query_field!r} and "
                                 f"{text_field!r} (pt.text.get_text adds the text); missing {missing}, it has "
                                 f"{list(inp.columns)}")
            out = inp.copy()
            if len(out):
                pairs = list(zip(out[query_field].astype(str), out[text_field].astype(str)))
                scores = scorer.predict(pairs, batch_size=batch_size, show_progress_bar=show_progress_bar,
                                        **predict_kwargs)
                out["score"] = scores.astype("float64")
            else:
                out["score"] = []
            return pt.model.add_ranks(out)

    return XencLabReranker()
