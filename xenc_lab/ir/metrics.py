"""Scoring a run against judgements with ir-measures, and paired significance tests between two runs.

Runs and qrels are anything ``read_run``/``read_qrels`` take (a path or a DataFrame); measures are ir-measures
objects or their names (``"nDCG@10"``, or trec_eval's ``"ndcg_cut_10"``). The numbers are ir-measures' own, so they
match what its command line gives on the same files."""
from __future__ import annotations

import warnings

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


def drop_identical_ids(run_ir, what: str = "a run"):
    """BEIR's ``ignore_identical_ids``: the run without results whose document id equals the query id, with a
    warning giving how many there were."""
    same = run_ir["query_id"].to_numpy() == run_ir["doc_id"].to_numpy()
    if same.any():
        warnings.warn(f"{what}: dropped {int(same.sum())} results whose docno equals the qid (BEIR's "
                      "ignore_identical_ids; pass ignore_identical_ids=False to keep them)", stacklevel=3)
        return run_ir[~same]
    return run_ir


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


def evaluate(run, qrels, measures=DEFAULT_MEASURES, per_query: bool = False, ignore_identical_ids: bool = True):
    """The run's scores under ``measures``: a Series measure name -> mean over queries (``ir_measures.calc_aggregate``),
    or with ``per_query`` a DataFrame indexed by qid with one column per measure name (``ir_measures.iter_calc``).

    As ir-measures does, every judged query counts: one the run has no documents for scores 0 (trec_eval's ``-c``);
    a warning says how many there are. ir-measures picks an implementation per measure, and they differ on tied
    scores: nDCG, R, P, AP go through trec_eval (ties by docno descending), RR@k through MS MARCO's script (ties by
    docno ascending). ``ignore_identical_ids`` (True, as BEIR's evaluation): a result whose docno equals its qid is
    dropped first, with a warning (ArguAna, Quora: a query is also a document); False keeps it, as trec_eval does."""
    import pandas as pd

    measures = parse_measures(measures)
    run_ir, qrels_ir = _to_ir(read_run(run)), _to_ir(read_qrels(qrels))
    if ignore_identical_ids:
        run_ir = drop_identical_ids(run_ir, "the run")
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


def significance(run_a, run_b, qrels, measures=DEFAULT_MEASURES, trials: int = 10000, seed: int = 0, *,
                 missing: str = "zero", ignore_identical_ids: bool = True):
    """Paired tests of run b against run a, ``experiment``'s for two runs: a DataFrame indexed by measure name with
    mean_a, mean_b, delta (mean_b - mean_a), ``+`` / ``-`` (queries b improves / degrades), ``p-value`` (paired
    t-test, ``scipy.stats.ttest_rel``), ``p-value (randomization)`` (two-sided paired randomization test,
    ``scipy.stats.permutation_test`` on the mean difference, ``trials`` resamples, ``seed``) and n_queries (the
    queries paired). ``missing`` and ``ignore_identical_ids`` as in ``experiment``: by default a judged query a run
    lacks scores 0; ``missing="drop"`` pairs the queries both hold. Where every per-query difference is zero the
    p-values are 1.0 (scipy's t-test would give nan); with fewer than 2 queries nan. (The p-values were formerly
    named t_p and perm_p.)"""
    import pandas as pd

    from .experiments import experiment
    from .paired import paired_pvalue

    if isinstance(trials, bool) or not isinstance(trials, int):
        raise TypeError(f"trials must be an int, got {type(trials).__name__}")
    if trials < 1:
        raise ValueError(f"trials must be positive, got {trials}")
    table, long = experiment({"a": run_a, "b": run_b}, None, qrels, measures, baseline="a", correction=None,
                             perquery="both", missing=missing, ignore_identical_ids=ignore_identical_ids)
    per = long.pivot_table(index=["measure", "qid"], columns="name", values="value")
    rows = {}
    for name in [c for c in table.columns if c != "name" and " " not in c]:
        pair = per.loc[name].dropna()
        a, b = pair["a"].to_numpy(), pair["b"].to_numpy()
        if not len(a):
            raise ValueError(f"the two runs share no judged query (missing={missing!r})")
        mean_a, mean_b = table.loc[0, name], table.loc[1, name]
        rows[name] = {"mean_a": mean_a, "mean_b": mean_b, "delta": mean_b - mean_a,
                      "+": int((b > a).sum()), "-": int((b < a).sum()), "p-value": table.loc[1, f"{name} p-value"],
                      "p-value (randomization)": paired_pvalue(b, a, "randomization", trials, seed),
                      "n_queries": len(a)}
    return pd.DataFrame.from_dict(rows, orient="index").astype({"+": "int64", "-": "int64", "n_queries": "int64"})
