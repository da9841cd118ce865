"""experiment() against an independent computation on held-out synthetic runs and qrels: ir-measures called
directly, scipy's paired tests, statsmodels' multipletests and Holm's step-down procedure written out by hand."""
from __future__ import annotations

import ir_measures
import numpy as np
import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from xenc_lab import experiment, format_table, rerank

MEASURES = [ir_measures.nDCG @ 10, ir_measures.AP, ir_measures.RR @ 10]
NAMES = ["nDCG@10", "AP", "RR@10"]


def synthetic_run(seed, n_queries=25, n_docs=40, skip=()):
    """A run whose quality grows with ``seed`` a little: relevant documents (even docnos) get a boost."""
    rng = np.random.default_rng(seed)
    rows = []
    for q in range(n_queries):
        if f"q{q}" in skip:
            continue
        for d in range(n_docs):
            rows.append((f"q{q}", f"d{d}", rng.random() + (0.06 * seed if d % 2 == 0 else 0.0)))
    return pd.DataFrame(rows, columns=["qid", "docno", "score"])


def synthetic_qrels(seed=99, n_queries=25, n_docs=40):
    rng = np.random.default_rng(seed)
    rows = [(f"q{q}", f"d{d}", int(rng.integers(1, 3)) if d % 2 == 0 else 0)
            for q in range(n_queries) for d in rng.choice(n_docs, 12, replace=False)]
    return pd.DataFrame(rows, columns=["qid", "docno", "relevance"])


def ir(frame):
    return frame.rename(columns={"qid": "query_id", "docno": "doc_id"})


def per_query(run, qrels):
    values = {}
    for m in ir_measures.iter_calc(MEASURES, ir(qrels), ir(run)):
        values.setdefault(str(m.measure), {})[m.query_id] = m.value
    return pd.DataFrame(values)


def holm(p):
    """Holm's step-down adjustment, written out: sort ascending, multiply the i-th smallest by (n - i), keep the running
    maximum, cap at 1."""
    order = np.argsort(p)
    adjusted, running = np.empty(len(p)), 0.0
    for i, j in enumerate(order):
        running = max(running, min(1.0, (len(p) - i) * p[j]))
        adjusted[j] = running
    return adjusted


@pytest.fixture(scope="module")
def held_out():
    runs = {"base": synthetic_run(0), "better": synthetic_run(6), "much better": synthetic_run(15),
            "other": synthetic_run(1)}
    return runs, synthetic_qrels()


def test_means_tests_counts_and_holm_equal_an_independent_computation(held_out):
    runs, qrels = held_out
    table = experiment(runs, None, qrels, NAMES, baseline="base")
    assert list(table["name"]) == list(runs)
    cols = ["name", *NAMES]
    for m in NAMES:
        cols += [f"{m} +", f"{m} -", f"{m} p-value", f"{m} reject", f"{m} p-value corrected"]
    assert list(table.columns) == cols
    table = table.set_index("name")
    base_pq = per_query(runs["base"], qrels)
    for name, run in runs.items():
        agg = ir_measures.calc_aggregate(MEASURES, ir(qrels), ir(run))
        for m in MEASURES:
            assert table.loc[name, str(m)] == pytest.approx(agg[m], abs=1e-12)
    others = ["better", "much better", "other"]
    for m in NAMES:
        p = []
        for name in others:
            pq = per_query(runs[name], qrels).reindex(base_pq.index)
            diff = pq[m] - base_pq[m]
            assert table.loc[name, f"{m} +"] == (diff > 0).sum() and table.loc[name, f"{m} -"] == (diff < 0).sum()
            p.append(stats.ttest_rel(pq[m], base_pq[m]).pvalue)
            assert table.loc[name, f"{m} p-value"] == pytest.approx(p[-1], rel=1e-12)
        reject, adjusted = multipletests(p, alpha=0.05, method="holm")[:2]
        np.testing.assert_allclose(table.loc[others, f"{m} p-value corrected"].to_numpy(float), holm(np.array(p)),
                                   rtol=1e-12)
        np.testing.assert_allclose(table.loc[others, f"{m} p-value corrected"].to_numpy(float), adjusted, rtol=1e-12)
        assert list(table.loc[others, f"{m} reject"]) == list(reject)
        base_row = table.loc["base", [f"{m} +", f"{m} -", f"{m} p-value", f"{m} p-value corrected"]]
        assert base_row.isna().all() and pd.isna(table.loc["base", f"{m} reject"])
    # the data are not all of one kind: some improvement is significant, the near-copy is not
    assert table.loc["much better", "nDCG@10 reject"] and not table.loc["other", "nDCG@10 reject"]


def test_the_table_is_pt_experiments_on_the_same_runs(held_out):
    pt = pytest.importorskip("pyterrier")
    runs, qrels = held_out
    topics = pd.DataFrame({"qid": sorted(set(qrels["qid"])), "query": "unused"})
    theirs = pt.Experiment([pt.Transformer.from_df(r.assign(query="unused")) for r in runs.values()], topics,
                           qrels.rename(columns={"relevance": "label"}), [MEASURES[0], MEASURES[1]],
                           names=list(runs), baseline=0, correction="holm")
    ours = experiment(runs, topics, qrels, NAMES[:2], baseline="base")
    assert sorted(ours.columns) == sorted(theirs.columns)
    theirs = theirs.set_index("name").loc[list(runs)]
    for column in ours.columns[1:]:
        got, want = ours[column].to_numpy(), theirs[column].to_numpy()
        if column.endswith("reject"):  # pt.Experiment writes False on the baseline's row, experiment NA
            assert list(got[1:]) == list(want[1:]) and pd.isna(got[0])
        else:
            np.testing.assert_allclose(got.astype(float), want.astype(float), rtol=1e-10, err_msg=column)
    partial = synthetic_run(6, skip={"q0", "q1", "q2"})  # pt.Experiment scores a query a run lacks 0, as missing="zero"
    theirs = pt.Experiment([pt.Transformer.from_df(r.assign(query="unused")) for r in (runs["base"], partial)], topics,
                           qrels.rename(columns={"relevance": "label"}), [MEASURES[1]], names=["base", "partial"],
                           baseline=0)
    with pytest.warns(UserWarning, match="they score 0"):
        ours = experiment({"base": runs["base"], "partial": partial}, topics, qrels, ["AP"], baseline="base",
                          correction=None)
    for column in ["AP", "AP +", "AP -", "AP p-value"]:
        np.testing.assert_allclose(ours[column].to_numpy(float), theirs[column].to_numpy(float), rtol=1e-10)


def test_randomization_test_bonferroni_and_baseline_by_index(held_out):
    runs, qrels = held_out
    table = experiment(runs, None, qrels, ["nDCG@10"], baseline=0, test="randomization", correction="bonferroni",
                       trials=2000, seed=3).set_index("name")
    base_pq = per_query(runs["base"], qrels)["nDCG@10"].sort_index()  # experiment pairs queries by sorted qid
    p = []
    for name in ["better", "much better", "other"]:
        pq = per_query(runs[name], qrels)["nDCG@10"].reindex(base_pq.index)
        want = stats.permutation_test((pq.to_numpy(), base_pq.to_numpy()), lambda x, y, axis: np.mean(x - y, axis=axis),
                                      permutation_type="samples", vectorized=True, n_resamples=2000, rng=3).pvalue
        p.append(want)
        assert table.loc[name, "nDCG@10 p-value"] == pytest.approx(want)
    np.testing.assert_allclose(table.loc[["better", "much better", "other"], "nDCG@10 p-value corrected"]
                               .to_numpy(float), np.minimum(1, 3 * np.array(p)))


def test_without_baseline_or_correction_the_table_has_only_what_was_asked(held_out):
    runs, qrels = held_out
    assert list(experiment(runs, None, qrels, ["nDCG@10", "AP"]).columns) == ["name", "nDCG@10", "AP"]
    table = experiment(runs, None, qrels, ["AP"], baseline="base", correction=None)
    assert list(table.columns) == ["name", "AP", "AP +", "AP -", "AP p-value"]


def test_identical_systems_tie_on_every_query_with_p_one(held_out):
    runs, qrels = held_out
    table = experiment({"a": runs["base"], "b": runs["base"].copy()}, None, qrels, ["AP"], baseline="a")
    row = table.set_index("name").loc["b"]
    assert row["AP +"] == 0 and row["AP -"] == 0 and row["AP p-value"] == 1.0 and not row["AP reject"]


def test_missing_queries_score_zero_by_default_or_are_dropped_as_trec_eval_does(held_out):
    runs, qrels = held_out
    partial = synthetic_run(6, skip={"q0", "q1", "q2"})
    with pytest.warns(UserWarning, match="no results for 3 of the 25 judged queries; they score 0"):
        zero = experiment({"base": runs["base"], "partial": partial}, None, qrels, ["AP"], baseline="base")
    assert zero.set_index("name").loc["partial", "AP"] == pytest.approx(
        ir_measures.calc_aggregate([ir_measures.AP], ir(qrels), ir(partial))[ir_measures.AP])
    held = qrels[~qrels["qid"].isin(["q0", "q1", "q2"])]
    with pytest.warns(UserWarning, match="are left out of its mean"):
        drop = experiment({"base": runs["base"], "partial": partial}, None, qrels, ["AP"], baseline="base",
                          missing="drop", perquery="both")
    table, long = drop
    want = ir_measures.calc_aggregate([ir_measures.AP], ir(held), ir(partial))[ir_measures.AP]
    assert table.set_index("name").loc["partial", "AP"] == pytest.approx(want)
    assert table.set_index("name").loc["base", "AP"] == pytest.approx(
        ir_measures.calc_aggregate([ir_measures.AP], ir(qrels), ir(runs["base"]))[ir_measures.AP])
    base_pq, part_pq = per_query(runs["base"], held)["AP"], per_query(partial, held)["AP"]
    assert table.set_index("name").loc["partial", "AP p-value"] == pytest.approx(
        stats.ttest_rel(part_pq, base_pq.reindex(part_pq.index)).pvalue)
    assert set(long[long["name"] == "partial"]["qid"]) == set(held["qid"])


def test_identical_ids_are_dropped_as_beir_does_unless_asked_not_to():
    qrels = pd.DataFrame({"qid": ["1", "2"], "docno": ["10", "20"], "label": [1, 1]})  # PyTerrier's label
    run = pd.DataFrame({"qid": ["1", "1", "2", "2"], "docno": ["1", "10", "2", "20"], "score": [9.0, 1.0, 9.0, 1.0]})
    with pytest.warns(UserWarning, match="dropped 2 results whose docno equals the qid"):
        dropped = experiment({"r": run}, None, qrels, ["RR@10"])
    kept = experiment({"r": run}, None, qrels, ["RR@10"], ignore_identical_ids=False)
    assert dropped.loc[0, "RR@10"] == 1.0 and kept.loc[0, "RR@10"] == 0.5


def test_pyterrier_topics_restrict_the_queries_and_perquery_is_the_long_frame(held_out):
    runs, qrels = held_out
    topics = pd.DataFrame({"qid": [f"q{i}" for i in range(10)], "query": ["some words"] * 10})
    long = experiment({"base": runs["base"]}, topics, qrels.rename(columns={"relevance": "label"}), ["AP"],
                      perquery=True)
    assert list(long.columns) == ["name", "qid", "measure", "value"] and len(long) == 10
    sub = qrels[qrels["qid"].isin(topics["qid"])]
    want = per_query(runs["base"], sub)["AP"]
    np.testing.assert_allclose(long.set_index("qid")["value"].reindex(want.index), want)


def test_a_scorer_system_reranks_the_first_stage_and_is_timed(scorer, held_out):
    _, qrels = held_out
    first = synthetic_run(0, n_queries=6, n_docs=10)
    queries = {f"q{q}": f"query number {q}" for q in range(6)}
    corpus = {f"d{d}": f"document {d} about things" for d in range(10)}
    table = experiment({"first": first, "tiny": scorer}, queries, qrels, ["nDCG@10"], baseline="first",
                       corpus=corpus, first_stage="first", depth=5, show_progress_bar=False)
    direct = rerank(scorer, queries, corpus, first, depth=5, show_progress_bar=False)
    qrels6 = qrels[qrels["qid"].isin(queries)]
    want = ir_measures.calc_aggregate([ir_measures.nDCG @ 10], ir(qrels6), ir(direct))[ir_measures.nDCG @ 10]
    row = table.set_index("name").loc["tiny"]
    assert row["nDCG@10"] == pytest.approx(want) and row["mrt"] > 0
    assert np.isnan(table.set_index("name").loc["first", "mrt"])
    assert list(table.columns[:3]) == ["name", "nDCG@10", "mrt"]


def test_format_table_renders_markdown_latex_and_csv(held_out):
    runs, qrels = held_out
    table = experiment(runs, None, qrels, ["AP"], baseline="base")
    md = format_table(table).splitlines()
    assert md[0].startswith("| name") and "AP p-value corrected" in md[0] and len(md) == 2 + len(runs)
    assert f"{table.loc[1, 'AP']:.4f}" in md[3] and "| base " in md[2]
    latex = format_table(table, "latex")
    assert "\\toprule" in latex and "\\bottomrule" in latex and "much better" in latex
    assert format_table(table, "csv").splitlines()[0].startswith("name,AP,AP +,AP -,AP p-value")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"baseline": "nope"}, ValueError, "baseline must be a system's name"),
    ({"baseline": 7}, ValueError, "out of range"),
    ({"baseline": "base", "correction": "magic"}, ValueError, "statsmodels multipletests method"),
    ({"baseline": "base", "test": "z"}, ValueError, "test must be one of"),
    ({"missing": "skip"}, ValueError, "missing must be 'zero'"),
    ({"perquery": "yes"}, ValueError, "perquery must be"),
    ({"measures": ["nDCG@ten"]}, ValueError, "unknown measure"),
])
def test_bad_arguments_are_refused(held_out, kwargs, error, match):
    runs, qrels = held_out
    kwargs = {"measures": ["AP"], **kwargs}
    with pytest.raises(error, match=match):
        experiment(runs, None, qrels, **kwargs)


def test_bad_systems_are_refused(held_out, scorer, tmp_path):
    runs, qrels = held_out
    with pytest.raises(TypeError, match="expected a run .* or a reranker"):
        experiment({"x": 42}, None, qrels)
    with pytest.raises(FileNotFoundError, match="neither a run file nor a model directory"):
        experiment({"x": str(tmp_path / "nothing.trec")}, None, qrels)
    with pytest.raises(ValueError, match="pass first_stage="):
        experiment({"base": runs["base"], "ce": scorer}, None, qrels)
    with pytest.raises(ValueError, match="has no results for any of the"):
        experiment({"x": runs["base"].assign(qid="zz" + runs["base"]["qid"])}, None, qrels)
    with pytest.raises(ValueError, match="systems is empty"):
        experiment({}, None, qrels)


def test_evaluate_command_prints_the_experiment_table(held_out, tmp_path, capsys):
    from xenc_lab.cli import main
    from xenc_lab.ir import write_run

    runs, qrels = held_out
    paths = []
    for name in ("base", "much better"):
        paths.append(str(tmp_path / f"{name.replace(' ', '_')}.trec"))
        write_run(runs[name], paths[-1])
    with open(tmp_path / "qrels.txt", "w") as f:
        f.writelines(f"{r.qid} 0 {r.docno} {r.relevance}\n" for r in qrels.itertuples())
    argv = ["evaluate", *paths, "--qrels", str(tmp_path / "qrels.txt"), "--baseline", "base.trec", "--measures",
            "nDCG@10", "AP", "--format", "csv"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    got = pd.read_csv(__import__("io").StringIO(out)).set_index("name")
    want = experiment(runs, None, qrels, ["nDCG@10", "AP"], baseline="base").set_index("name")
    assert got.loc["much_better.trec", "nDCG@10"] == pytest.approx(want.loc["much better", "nDCG@10"])
    assert got.loc["much_better.trec", "AP p-value"] == pytest.approx(want.loc["much better", "AP p-value"])
    assert "25 judged queries" in err and "holm correction" in err
    assert main(argv[:-2] + ["--format", "markdown"]) == 0
    assert capsys.readouterr().out.startswith("| name")
    with pytest.raises(SystemExit):
        main(argv[:-2] + ["--baseline", "nope"])
    assert "baseline must be a system's name" in capsys.readouterr().err
