"""Fusing runs: reciprocal rank fusion, and the interpolation of a first stage's and a reranker's normalised scores
with its weight chosen on a dev split. Each returns a run frame (qid, docno, rank, score), so a fused run is one more
system for ``experiment``."""
from __future__ import annotations

import numbers
from collections.abc import Mapping

import numpy as np

from .files import read_run
from .metrics import evaluate, parse_measures

NORMS = ("min-max", "z-score")


def _ordered(run):
    """A run with each query's 1-based position in trec_eval's order (score descending, ties by docno descending)."""
    frame = read_run(run).sort_values(["qid", "score", "docno"], ascending=[True, False, False], kind="stable")
    return frame.assign(pos=frame.groupby("qid", sort=False).cumcount() + 1)


def _as_run(frame):
    """qid, docno and a fused score as a run frame, ranked by score (ties by docno descending, as trec_eval)."""
    frame = frame.sort_values(["qid", "score", "docno"], ascending=[True, False, False], kind="stable")
    frame = frame.assign(rank=frame.groupby("qid", sort=False).cumcount() + 1)
    return frame[["qid", "docno", "rank", "score"]].reset_index(drop=True)


def _runs_of(runs) -> list:
    items = list(runs.values()) if isinstance(runs, Mapping) else list(runs) if isinstance(runs, (list, tuple)) else []
    if len(items) < 2:
        raise ValueError(f"expected two or more runs (a list or a mapping name -> run), got {runs!r:.80}")
    return items


def rrf(runs, k: int = 60, weights=None):
    """Reciprocal rank fusion (Cormack et al., 2009): a document's score is the sum over the runs that hold it of
    ``weight / (k + rank)``, ranks from 1 in trec_eval's order of each run's scores. ``runs``: a list or a mapping
    of runs (paths or frames); ``weights``: one per run (default 1)."""
    import pandas as pd

    if isinstance(k, bool) or not isinstance(k, numbers.Real) or k < 0:
        raise ValueError(f"k must be a non-negative number, got {k!r}")
    items = _runs_of(runs)
    weights = [1.0] * len(items) if weights is None else list(weights)
    if len(weights) != len(items):
        raise ValueError(f"weights has {len(weights)} entries for {len(items)} runs")
    parts = [o.assign(score=w / (k + o["pos"])) for o, w in ((_ordered(r), w) for r, w in zip(items, weights))]
    fused = pd.concat(parts).groupby(["qid", "docno"], as_index=False, sort=False)["score"].sum()
    return _as_run(fused)


def normalized(run, norm: str = "min-max"):
    """A run's scores normalised per query: ``"min-max"`` to [0, 1], ``"z-score"`` to mean 0 and standard deviation 1
    (population: ddof=0). A query whose scores are all equal gets 0 throughout."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {list(NORMS)}, got {norm!r}")
    frame = read_run(run)
    by = frame.groupby("qid", sort=False)["score"]
    if norm == "min-max":
        low, span = by.transform("min"), by.transform("max") - by.transform("min")
    else:
        low, span = by.transform("mean"), by.transform(lambda s: s.std(ddof=0))
    score = (frame["score"] - low) / span.where(span > 0, np.inf)  # equal scores: 0
    return frame.assign(score=score.to_numpy())


def interpolate(first_stage, reranked, weight: float, norm: str = "min-max"):
    """``weight * first + (1 - weight) * reranked`` of the two runs' scores normalised per query (``norm``: "min-max"
    or "z-score"), over the documents either holds; a document one run lacks takes that run's lowest normalised score
    of the query. ``weight`` = 0 ranks as the reranker, 1 as the first stage."""
    import pandas as pd

    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not 0 <= weight <= 1:
        raise ValueError(f"weight must be a number in [0, 1], got {weight!r}")
    a = normalized(first_stage, norm).set_index(["qid", "docno"])["score"]
    b = normalized(reranked, norm).set_index(["qid", "docno"])["score"]
    both = pd.concat({"a": a, "b": b}, axis=1)
    for column in ("a", "b"):
        lowest = both.groupby(level="qid")[column].transform("min")
        both[column] = both[column].fillna(lowest)
    fused = (weight * both["a"] + (1 - weight) * both["b"]).rename("score").reset_index()
    return _as_run(fused)


def tune_interpolation(first_stage, reranked, qrels, measure="nDCG@10", weights=None, norm: str = "min-max"):
    """The interpolation weight that scores best on ``qrels`` (a dev split's judgements: only its queries count) under
    ``measure``, searched over the grid ``weights`` (default 0, 0.1, ..., 1; the first of equal scores wins).
    Returns (best weight, a Series weight -> the measure)."""
    import pandas as pd

    (m,) = parse_measures(measure) if not isinstance(measure, (list, tuple)) else parse_measures(list(measure)[:1])
    grid = np.round(np.linspace(0, 1, 11), 10) if weights is None else np.asarray(list(weights), dtype="float64")
    if grid.ndim != 1 or not len(grid) or ((grid < 0) | (grid > 1)).any():
        raise ValueError(f"weights must be a non-empty sequence of numbers in [0, 1], got {weights!r}")
    first, second = read_run(first_stage), read_run(reranked)
    values = pd.Series({float(w): float(evaluate(interpolate(first, second, float(w), norm), qrels, [m]).iloc[0])
                        for w in grid}, name=str(m))
    values.index.name = "weight"
    return float(values.idxmax()), values
