"""How much two rankings of the same queries differ: rank correlation, top-k overlap and rank shifts, per query.

Rank positions (1 = first) come from each run's scores, ordered as trec_eval orders them: score descending, ties
broken by docno descending. A run's own ``rank`` column is not used, so a file whose ranks disagree with its scores is
compared as it would be evaluated."""
from __future__ import annotations

import warnings

import numpy as np

from .files import read_run


def _positions(run):
    """(qid, docno, pos) with pos the 1-based position in trec_eval's order."""
    frame = read_run(run).sort_values(["qid", "score", "docno"], ascending=[True, False, False], kind="stable")
    return frame.assign(pos=frame.groupby("qid", sort=False).cumcount() + 1)[["qid", "docno", "pos"]]


def _tau(a, b) -> float:
    """Kendall's tau-b; exactly 1 for the same order (scipy's arithmetic leaves 1 - 2e-16)."""
    if len(a) < 2:
        return np.nan
    from scipy import stats

    return 1.0 if np.array_equal(np.argsort(a), np.argsort(b)) else float(stats.kendalltau(a, b).statistic)


def compare_rankings(run_a, run_b, k: int = 10):
    """Per-query differences of run b from run a (paths or DataFrames) over the queries both hold: a DataFrame
    indexed by qid (sorted) with columns

    - ``shared``: number of candidates in both lists;
    - ``kendall_tau``: Kendall's tau-b between the two runs' positions of the shared candidates (NaN below 2);
    - ``overlap@k``: |top k of a ∩ top k of b| / min(k, len a, len b), so 1 when the shorter top-k list lies inside
      the other, 0 when they share nothing;
    - ``identical@k``: both top-k lists hold the same documents in the same order (formerly ``same_top_k``);
    - ``mean_shift@k``, ``max_shift@k``: |position in b - position in a| over a's top k, a document absent from b
      counting as placed just past b's list (position len b + 1).

    Queries only one run holds are left out with a warning giving the counts."""
    import pandas as pd

    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"k must be positive, got {k}")
    k = int(k)
    a, b = _positions(run_a), _positions(run_b)
    qa, qb = set(a["qid"]), set(b["qid"])
    both = qa & qb
    if not both:
        raise ValueError(f"the two runs share no query: run a has e.g. {sorted(qa)[:5]}, run b has e.g. "
                         f"{sorted(qb)[:5]}")
    if len(both) < len(qa | qb):
        warnings.warn(f"comparing the {len(both)} queries both runs hold; {len(qa - both)} only in run a, "
                      f"{len(qb - both)} only in run b are left out", stacklevel=2)
    merged = a[a["qid"].isin(both)].merge(b[b["qid"].isin(both)], on=["qid", "docno"], how="outer",
                                          suffixes=("_a", "_b"))
    rows = {}
    for qid, group in merged.groupby("qid", sort=True):
        pa, pb = group["pos_a"].to_numpy("float64"), group["pos_b"].to_numpy("float64")
        in_a, in_b = ~np.isnan(pa), ~np.isnan(pb)
        shared = in_a & in_b
        top_a, top_b = pa <= k, pb <= k  # NaN (absent) compares False
        pb_or_past = np.where(in_b, pb, in_b.sum() + 1)
        shifts = np.abs(pb_or_past[top_a] - pa[top_a])
        rows[qid] = {
            "shared": int(shared.sum()),
            "kendall_tau": _tau(pa[shared], pb[shared]),
            f"overlap@{k}": (top_a & top_b).sum() / min(k, in_a.sum(), in_b.sum()),
            f"identical@{k}": bool(top_a.sum() == top_b.sum() and np.array_equal(pa[top_a], pb[top_a])),
            f"mean_shift@{k}": shifts.mean(),
            f"max_shift@{k}": shifts.max(),
        }
    frame = pd.DataFrame.from_dict(rows, orient="index")
    frame.index.name = "qid"
    return frame.astype({"shared": "int64", "kendall_tau": "float64", f"overlap@{k}": "float64",
                         f"identical@{k}": "bool", f"mean_shift@{k}": "float64", f"max_shift@{k}": "float64"})


def summarize_comparison(frame):
    """One line for a ``compare_rankings`` frame, as a Series: queries, mean_kendall_tau (over queries where tau is
    defined), mean_overlap@k, share_identical@k, mean_shift@k (the mean of the per-query means) and max_shift@k (the
    largest over all queries)."""
    import pandas as pd

    k = next((c.removeprefix("overlap@") for c in getattr(frame, "columns", []) if str(c).startswith("overlap@")),
             None)
    n = k if k is not None else "<k>"
    needed = ["shared", "kendall_tau", f"overlap@{n}", f"identical@{n}", f"mean_shift@{n}", f"max_shift@{n}"]
    if not isinstance(frame, pd.DataFrame) or k is None or any(c not in frame.columns for c in needed):
        got = list(frame.columns) if isinstance(frame, pd.DataFrame) else type(frame).__name__
        raise ValueError(f"expected a compare_rankings frame with columns {needed}, got {got}")
    return pd.Series({
        "queries": float(len(frame)),
        "mean_kendall_tau": frame["kendall_tau"].mean(),
        f"mean_overlap@{k}": frame[f"overlap@{k}"].mean(),
        f"share_identical@{k}": frame[f"identical@{k}"].mean(),
        f"mean_shift@{k}": frame[f"mean_shift@{k}"].mean(),
        f"max_shift@{k}": frame[f"max_shift@{k}"].max(),
    }, dtype="float64")
