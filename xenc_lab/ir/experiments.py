"""``experiment``: several named systems evaluated on the same queries in one table, in the shape of PyTerrier's
``pt.Experiment`` (a ``name`` column, one column per measure, and against a baseline ``{m} +``, ``{m} -``,
``{m} p-value``, ``{m} p-value corrected`` and ``{m} reject``)."""
from __future__ import annotations

import numbers
import warnings

import numpy as np

from .files import read_qrels, read_queries
from .metrics import DEFAULT_MEASURES, _ir_measures, _per_query, _to_ir, drop_identical_ids, parse_measures
from .paired import check_correction, check_test, corrected, paired_pvalue
from .systems import DEFAULT_DEPTH, named_systems, run_systems

MISSING_RULES = ("zero", "drop")


def check_missing(missing) -> str:
    if missing not in MISSING_RULES:
        raise ValueError(f"missing must be 'zero' (a judged query a run lacks scores 0, as ir-measures and "
                         f"trec_eval -c) or 'drop' (left out of that run's mean, trec_eval's default), got {missing!r}")
    return missing


def _baseline_name(baseline, names: list[str]):
    if baseline is None:
        return None
    if isinstance(baseline, numbers.Integral) and not isinstance(baseline, bool):
        if not -len(names) <= baseline < len(names):
            raise ValueError(f"baseline={baseline} is out of range for {len(names)} systems")
        return names[baseline]
    if isinstance(baseline, str) and baseline in names:
        return baseline
    raise ValueError(f"baseline must be a system's name ({names}) or its index, got {baseline!r}")


def experiment(systems, queries, qrels, measures=DEFAULT_MEASURES, *, baseline=None, correction="holm",
               test="t", perquery=False, names=None, corpus=None, first_stage=None, depth: int | None = DEFAULT_DEPTH,
               cache=None, ignore_identical_ids: bool = True, missing: str = "zero", alpha: float = 0.05,
               trials: int = 10000, seed: int = 0, round: int | None = None, show_progress_bar: bool = True,
               **rerank_kwargs):
    """Evaluates ``systems`` on ``qrels`` with ir-measures and returns pt.Experiment's table: one row per system, a
    ``name`` column, one column per measure (the mean over queries, ``ir_measures.calc_aggregate``), ``mrt`` (mean
    milliseconds per query) where a system is a reranker, and with ``baseline`` (a name or an index), per measure,
    ``{m} +`` / ``{m} -`` (queries the system improves / degrades against the baseline), ``{m} p-value`` (paired
    ``test``: ``"t"`` for scipy's ``ttest_rel``, ``"randomization"``, ``"wilcoxon"`` or a function), and with
    ``correction`` (a statsmodels ``multipletests`` method, over the non-baseline systems of each measure)
    ``{m} reject`` (at ``alpha``) and ``{m} p-value corrected``, in pt.Experiment's order; all NaN on the
    baseline's row.

    ``systems``: a mapping name -> system or a list (``names``): a run (TREC file or DataFrame with qid, docno,
    score; PyTerrier's results frames), or a reranker (a ``Scorer``, anything with ``predict``, a model directory)
    that reranks ``first_stage`` (a run or a run system's name) to ``depth`` with ``rerank`` (``queries``,
    ``corpus``, ``cache``, ``rerank_kwargs`` go there). ``queries``: what ``read_queries`` takes (PyTerrier topics:
    qid, query) or None; when given, only its queries are evaluated. Evaluated are the judged queries;
    ``missing="zero"`` (default, ir-measures' and ``trec_eval -c``'s rule): a judged query a run lacks scores 0 and
    every row has the same queries; ``"drop"`` (trec_eval's default): it is left out of that run's mean and the
    tests pair the queries both runs hold. ``ignore_identical_ids`` (BEIR's default, True): results whose docno
    equals the qid are dropped first. ``perquery=True`` returns pt.Experiment's long frame (name, qid, measure,
    value) instead, ``"both"`` (table, per-query frame)."""
    import pandas as pd

    measures = list(measures) if isinstance(measures, (list, tuple)) else [measures]
    want_mrt = "mrt" in measures
    measures = parse_measures([m for m in measures if m != "mrt"] or list(DEFAULT_MEASURES))
    test, correction, missing = check_test(test), check_correction(correction), check_missing(missing)
    if perquery not in (True, False, "both"):
        raise ValueError(f"perquery must be True, False or 'both', got {perquery!r}")
    if not (isinstance(alpha, float) and 0 < alpha < 1):
        raise ValueError(f"alpha must be a float between 0 and 1, got {alpha!r}")
    systems = named_systems(systems, names)
    base = _baseline_name(baseline, list(systems))
    texts = None if queries is None else read_queries(queries)
    qrels_ir = _to_ir(read_qrels(qrels))
    if texts is not None:
        qrels_ir = qrels_ir[qrels_ir["query_id"].isin(set(texts))]
    judged = set(qrels_ir["query_id"])
    if not judged:
        raise ValueError("no judged query to evaluate: the qrels are empty" +
                         ("" if texts is None else " or share no qid with the queries"))

    runs = run_systems(systems, queries=texts, corpus=corpus, first_stage=first_stage, depth=depth, cache=cache,
                       show_progress_bar=show_progress_bar, **rerank_kwargs)
    ir = _ir_measures()
    rows, per_query, notes = [], {}, {"queries": len(judged), "missing": {}, "identical_ids_dropped": {}}
    for name, sys_run in runs.items():
        run_ir = _to_ir(sys_run.run)
        run_ir = run_ir[run_ir["query_id"].isin(judged)]
        if ignore_identical_ids:
            before = len(run_ir)
            run_ir = drop_identical_ids(run_ir, f"system {name!r}")
            notes["identical_ids_dropped"][name] = before - len(run_ir)
        held = set(run_ir["query_id"])
        if not held:
            raise ValueError(f"system {name!r} has no results for any of the {len(judged)} judged queries (qids e.g. "
                             f"{sorted(judged)[:5]}; its own e.g. {sorted(set(_to_ir(sys_run.run)['query_id']))[:5]})")
        notes["missing"][name] = len(judged - held)
        if judged - held:
            rule = "score 0" if missing == "zero" else "are left out of its mean"
            warnings.warn(f"system {name!r} has no results for {len(judged - held)} of the {len(judged)} judged "
                          f"queries; they {rule} (missing={missing!r})", stacklevel=2)
        q = qrels_ir if missing == "zero" else qrels_ir[qrels_ir["query_id"].isin(held)]
        agg = ir.calc_aggregate(measures, q, run_ir)
        per = _per_query(measures, run_ir, q).reindex(sorted(set(q["query_id"]))).fillna(0.0)
        per_query[name] = per
        rows.append({"name": name, **{str(m): float(agg[m]) for m in measures}, "mrt": sys_run.mrt})
    table = pd.DataFrame(rows)
    if not (want_mrt or any(r.seconds is not None for r in runs.values())):
        table = table.drop(columns="mrt")
    if base is not None:
        table = _compare(table, per_query, base, [str(m) for m in measures], test, correction, alpha, trials, seed)
    if round is not None:
        table[[str(m) for m in measures]] = table[[str(m) for m in measures]].round(round)
    table.attrs.update(notes, baseline=base, missing_rule=missing, test=test if isinstance(test, str) else "custom",
                       correction=correction)
    if perquery is False:
        return table
    long = pd.concat([per.rename_axis("qid").reset_index().melt(id_vars="qid", var_name="measure", value_name="value")
                      .assign(name=name) for name, per in per_query.items()], ignore_index=True)
    long = long[["name", "qid", "measure", "value"]]
    return long if perquery is True else (table, long)


def _compare(table, per_query, base, measures, test, correction, alpha, trials, seed):
    """pt.Experiment's comparison columns against ``base``, per measure."""
    import pandas as pd

    names = list(table["name"])
    others = [n for n in names if n != base]
    out = table.copy()
    for m in measures:
        plus, minus, p = {}, {}, {}
        for name in others:
            pair = pd.concat([per_query[name][m].rename("s"), per_query[base][m].rename("b")], axis=1,
                             join="inner").dropna()
            s, b = pair["s"].to_numpy(), pair["b"].to_numpy()
            plus[name], minus[name] = int((s > b).sum()), int((s < b).sum())
            p[name] = paired_pvalue(s, b, test, trials, seed)
        out[f"{m} +"] = [plus.get(n, np.nan) for n in names]
        out[f"{m} -"] = [minus.get(n, np.nan) for n in names]
        out[f"{m} p-value"] = [p.get(n, np.nan) for n in names]
        if correction is not None:
            reject, adjusted = corrected([p[n] for n in others], correction, alpha)
            rej, adj = dict(zip(others, reject)), dict(zip(others, adjusted))
            out[f"{m} reject"] = pd.array([bool(rej[n]) if n in rej else pd.NA for n in names], dtype="boolean")
            out[f"{m} p-value corrected"] = [adj.get(n, np.nan) for n in names]
    return out


def format_table(table, fmt: str = "markdown", digits: int = 4) -> str:
    """An ``experiment`` table as text: ``"markdown"`` or ``"latex"`` (tabulate's booktabs), or ``"csv"``. Measures
    are shown to ``digits`` decimals, p-values to 3 significant digits, counts as integers, NaN as empty."""
    import pandas as pd

    if fmt not in ("markdown", "latex", "csv"):
        raise ValueError(f"fmt must be 'markdown', 'latex' or 'csv', got {fmt!r}")
    if not isinstance(table, pd.DataFrame) or "name" not in table.columns:
        raise TypeError(f"expected an experiment() table (a DataFrame with a 'name' column), got "
                        f"{type(table).__name__}")
    if fmt == "csv":
        return table.to_csv(index=False)
    try:
        from tabulate import tabulate
    except ImportError:  # pragma: no cover - tabulate comes with the 'ir' extra
        raise ImportError("rendering a table needs tabulate: pip install 'xenc-lab[ir]'") from None

    def cell(column, value):
        if value is None or value is pd.NA or (isinstance(value, float) and np.isnan(value)):
            return ""
        if column == "name" or isinstance(value, (bool, np.bool_)):
            return str(value)
        if column.endswith((" +", " -")):
            return str(int(value))
        if column.endswith(("p-value", "p-value corrected")):
            return f"{value:.3g}"
        if column == "mrt":
            return f"{value:.1f}"
        return f"{value:.{digits}f}"

    cells = [[cell(c, v) for c, v in zip(table.columns, row)] for row in table.itertuples(index=False)]
    return tabulate(cells, headers=list(table.columns), tablefmt="github" if fmt == "markdown" else "latex_booktabs",
                    disable_numparse=True)
