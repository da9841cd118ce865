"""Scoring a run against judgements with ir-measures, and paired significance tests between two runs.

Runs and qrels are anything ``read_run``/``read_qrels`` take (a path or a DataFrame); measures are ir-measures
objects or their names (``"nDCG@10"``, or trec_eval's ``"ndcg_cut_10"``). The numbers are ir-measures' own, so they
match what its command line gives on the same files."""
from __future__ import annotations

import warnings

import numpy as np

from .files import read_qrels, read_run

DEFAULT_MEASURES = ("nDCG@10", "RR@10", "R@100")


def _ir_measures():
    try:
        import ir_measures
    except ImportError:  # pragma: no cover - ir-measures comes with the 'ir' extra
        raise ImportError("xenc_lab's metrics need ir-measures: pip install 'xenc-lab[ir]'") from None
    return ir_measures


def parse_measures(measures) -> list:
    """ir-measures objects for ``measures`` (one or a sequence of objects or names), duplicates dropped in order."""
    ir_measures = _ir_measures()
    if isinstance(measures, (str, ir_measures.Measure)):
        measures = [measures]
    if not isinstance(measures, (list, tuple)) or not measures:
        raise TypeError(f"measures must be a non-empty list or tuple of ir-measures measures or their names, got "
                        f"{measures!r}")
    parsed = []
    for m in measures:
        if isinstance(m, ir_measures.Measure):
            parsed.append(m)
        elif isinstance(m, str):
            parsed.extend(_parse_name(m))
        else:
            raise TypeError(f"a measure must be an ir-measures measure or its name (str), got {type(m).__name__}")
    return list(dict.fromkeys(parsed))


def _parse_name(name: str) -> list:
    """ir-measures' syntax first (``nDCG@10``), then trec_eval's (``ndcg_cut_10``, which may name several)."""
    ir_measures = _ir_measures()
    try:
        return [ir_measures.parse_measure(name)]
    except (ValueError, NameError, TypeError):
        pass
    try:
        return list(ir_measures.parse_trec_measure(name))
    except (ValueError, NameError, TypeError):
        raise ValueError(f"unknown measure {name!r}: expected an ir-measures name such as 'nDCG@10', 'RR@10', "
                         f"'R@100', 'P@5', 'AP' or a trec_eval name such as 'ndcg_cut_10', 'recip_rank', "
                         f"'map'") from None


def _to_ir(frame):
    """A read_run or read_qrels frame in ir-measures' columns: (query_id, doc_id, score) or (..., relevance)."""
    value = "score" if "score" in frame.columns else "relevance"
    return frame[["qid", "docno", value]].set_axis(["query_id", "doc_id", value], axis=1)


def _judged_queries(run_ir, qrels_ir, what: str = "the run") -> set:
    """The run's judged queries; none is an error (every measure would be meaningless, most often a qid mismatch)."""
    run_q, qrels_q = set(run_ir["query_id"]), set(qrels_ir["query_id"])
    if not run_q & qrels_q:
        raise ValueError(f"none of {what}'s {len(run_q)} queries have judgements in the qrels ({len(qrels_q)} "
                         f"queries); run qids e.g. {sorted(run_q)[:5]}, qrels qids e.g. {sorted(qrels_q)[:5]}")
    return run_q & qrels_q


def _per_query(measures, run_ir, qrels_ir):
    """ir_measures.iter_calc as a DataFrame indexed by qid, one column per measure name, in the measures' order."""
    import pandas as pd

    rows = [(m.query_id, str(m.measure), float(m.value))
            for m in _ir_measures().iter_calc(measures, qrels_ir, run_ir)]
    frame = pd.DataFrame(rows, columns=["qid", "measure", "value"])
    table = frame.pivot(index="qid", columns="measure", values="value").reindex(columns=[str(m) for m in measures])
    table.columns.name = None
    return table


def evaluate(run, qrels, measures=DEFAULT_MEASURES, per_query: bool = False):
    """The run's scores under ``measures``: a Series measure name -> mean over queries (``ir_measures.calc_aggregate``),
    or with ``per_query`` a DataFrame indexed by qid with one column per measure name (``ir_measures.iter_calc``).

    As ir-measures does, every judged query counts: one the run has no documents for scores 0 (trec_eval's ``-c``);
    a warning says how many there are. ir-measures picks an implementation per measure, and they differ on tied
    scores: nDCG, R, P, AP go through trec_eval (ties by docno descending), RR@k through MS MARCO's script (ties by
    docno ascending)."""
    import pandas as pd

    measures = parse_measures(measures)
    run_ir, qrels_ir = _to_ir(read_run(run)), _to_ir(read_qrels(qrels))
    judged = _judged_queries(run_ir, qrels_ir)
    missing = sorted(set(qrels_ir["query_id"]) - judged)
    if missing:
        warnings.warn(f"the run has no documents for {len(missing)} of the {len(missing) + len(judged)} judged "
                      f"queries (e.g. {missing[:5]}); they score 0", stacklevel=2)
    if per_query:
        return _per_query(measures, run_ir, qrels_ir)
    agg = _ir_measures().calc_aggregate(measures, qrels_ir, run_ir)
    return pd.Series([float(agg[m]) for m in measures], index=[str(m) for m in measures], name="value",
                     dtype="float64")


def significance(run_a, run_b, qrels, measures=DEFAULT_MEASURES, trials: int = 10000, seed: int = 0):
    """Paired tests of run b against run a over the judged queries both runs hold: a DataFrame indexed by measure
    name with mean_a, mean_b, delta (mean_b - mean_a), t_p (``scipy.stats.ttest_rel``), perm_p (two-sided paired
    randomization test, ``scipy.stats.permutation_test`` on the mean difference, ``trials`` resamples, ``seed``) and
    n_queries. Where every per-query difference is zero the t-test is undefined (scipy's nan); t_p is 1.0 there.
    With fewer than 2 shared queries both p-values are nan. Runs that hold different judged queries are tested on
    those both hold, with a warning giving the counts."""
    import pandas as pd

    if isinstance(trials, bool) or not isinstance(trials, int):
        raise TypeError(f"trials must be an int, got {type(trials).__name__}")
    if trials < 1:
        raise ValueError(f"trials must be positive, got {trials}")
    measures = parse_measures(measures)
    a_ir, b_ir, qrels_ir = _to_ir(read_run(run_a)), _to_ir(read_run(run_b)), _to_ir(read_qrels(qrels))
    judged_a, judged_b = _judged_queries(a_ir, qrels_ir, "run a"), _judged_queries(b_ir, qrels_ir, "run b")
    shared = judged_a & judged_b
    if not shared:
        raise ValueError(f"the two runs share no judged query: run a has e.g. {sorted(judged_a)[:5]}, run b has "
                         f"e.g. {sorted(judged_b)[:5]}")
    if judged_a != judged_b:
        warnings.warn(f"the runs hold different judged queries (run a {len(judged_a)}, run b {len(judged_b)}); "
                      f"testing the {len(shared)} both hold", stacklevel=2)
    qrels_ir = qrels_ir[qrels_ir["query_id"].isin(shared)]
    per_a = _per_query(measures, a_ir[a_ir["query_id"].isin(shared)], qrels_ir)
    per_b = _per_query(measures, b_ir[b_ir["query_id"].isin(shared)], qrels_ir).reindex(per_a.index)
    rows = {}
    for name in per_a.columns:
        pair = pd.DataFrame({"a": per_a[name], "b": per_b[name]}).dropna()
        a, b = pair["a"].to_numpy(), pair["b"].to_numpy()
        rows[name] = {"mean_a": a.mean(), "mean_b": b.mean(), "delta": b.mean() - a.mean(),
                      **_paired_p(a, b, trials, seed), "n_queries": len(a)}
    return pd.DataFrame.from_dict(rows, orient="index").astype({"n_queries": "int64"})


def _paired_p(a: np.ndarray, b: np.ndarray, trials: int, seed: int) -> dict[str, float]:
    """t-test and randomization-test p-values for per-query pairs (a, b)."""
    from scipy import stats

    if len(a) < 2:
        return {"t_p": float("nan"), "perm_p": float("nan")}
    # Zero differences everywhere: no evidence of a difference (scipy's t-test would give nan with a warning).
    t_p = 1.0 if np.all(a == b) else float(stats.ttest_rel(b, a).pvalue)
    perm = stats.permutation_test((b, a), _mean_difference, permutation_type="samples", vectorized=True,
                                  n_resamples=trials, alternative="two-sided", rng=seed)
    return {"t_p": t_p, "perm_p": float(perm.pvalue)}


def _mean_difference(x, y, axis):
    return np.mean(x - y, axis=axis)
