"""evaluate and significance against ir-measures and scipy called directly on the same data."""
from __future__ import annotations

import ir_measures
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from xenc_lab.ir.experiments import significance
from xenc_lab.ir.metrics import evaluate

MEASURES = [ir_measures.nDCG @ 10, ir_measures.RR @ 10, ir_measures.R @ 100]


def random_run(n_queries=8, n_docs=30, seed=0, decimals=None):
    rng = np.random.default_rng(seed)
    scores = rng.random(n_queries * n_docs)
    if decimals is not None:
        scores = scores.round(decimals)  # coarse scores give ties, broken by docno as trec_eval breaks them
    return pd.DataFrame({"qid": np.repeat([f"q{q}" for q in range(n_queries)], n_docs),
                         "docno": [f"d{d}" for _ in range(n_queries) for d in range(n_docs)], "score": scores})


def random_qrels(n_queries=8, n_docs=40, seed=1):
    rng = np.random.default_rng(seed)
    rows = [(f"q{q}", f"d{d}", int(rng.integers(0, 3))) for q in range(n_queries) for d in range(0, n_docs, 2)]
    return pd.DataFrame(rows, columns=["qid", "docno", "relevance"])


def ir_frames(run, qrels):
    return (run.rename(columns={"qid": "query_id", "docno": "doc_id"})[["query_id", "doc_id", "score"]],
            qrels.rename(columns={"qid": "query_id", "docno": "doc_id"}))


def test_aggregate_equals_calc_aggregate():
    run, qrels = random_run(), random_qrels()
    got = evaluate(run, qrels, MEASURES)
    want = ir_measures.calc_aggregate(MEASURES, *ir_frames(run, qrels)[::-1])
    assert list(got.index) == ["nDCG@10", "RR@10", "R@100"]
    for m in MEASURES:
        assert got[str(m)] == pytest.approx(want[m], abs=1e-12)
    assert evaluate(run, qrels).index.tolist() == ["nDCG@10", "RR@10", "R@100"]  # the defaults


def test_trec_files_give_what_ir_measures_reads_from_them(tmp_path):
    run, qrels = random_run(decimals=1), random_qrels()
    run_path, qrels_path = tmp_path / "run.trec", tmp_path / "qrels.txt"
    with open(run_path, "w") as f:
        for qid, group in run.groupby("qid"):
            ranked = enumerate(zip(group["docno"], group["score"]), 1)
            f.writelines(f"{qid} Q0 {docno} {rank} {score} tag\n" for rank, (docno, score) in ranked)
    with open(qrels_path, "w") as f:
        for qid, docno, rel in qrels.itertuples(index=False):
            f.write(f"{qid} 0 {docno} {rel}\n")
    got = evaluate(run_path, qrels_path, MEASURES)
    want = ir_measures.calc_aggregate(MEASURES, list(ir_measures.read_trec_qrels(str(qrels_path))),
                                      list(ir_measures.read_trec_run(str(run_path))))
    for m in MEASURES:
        assert got[str(m)] == pytest.approx(want[m], abs=1e-12)


def test_per_query_equals_iter_calc_over_judged_queries():
    run = random_run(n_queries=10)
    qrels = random_qrels(n_queries=8)  # q8 and q9 of the run are unjudged
    got = evaluate(run, qrels, MEASURES, per_query=True)
    assert got.shape == (8, 3)
    assert list(got.columns) == ["nDCG@10", "RR@10", "R@100"]
    assert set(got.index) == {f"q{q}" for q in range(8)}
    want = {(m.query_id, str(m.measure)): m.value for m in ir_measures.iter_calc(MEASURES, *ir_frames(run, qrels)[::-1])}
    assert len(want) == got.size
    for (qid, name), value in want.items():
        assert got.loc[qid, name] == pytest.approx(value, abs=1e-12)
    assert got.mean().to_numpy() == pytest.approx(evaluate(run, qrels, MEASURES).to_numpy(), abs=1e-12)


def test_judged_queries_missing_from_the_run_score_zero_with_a_warning():
    run, qrels = random_run(n_queries=8), random_qrels(n_queries=8)
    part = run[run["qid"] >= "q3"]
    with pytest.warns(UserWarning, match=r"no documents for 3 of the 8 judged queries.*'q0'"):
        per = evaluate(part, qrels, MEASURES, per_query=True)
    assert per.shape == (8, 3) and (per.loc[["q0", "q1", "q2"]] == 0).all().all()
    with pytest.warns(UserWarning, match="no documents for 3"):
        got = evaluate(part, qrels, MEASURES)
    want = ir_measures.calc_aggregate(MEASURES, *ir_frames(part, qrels)[::-1])
    assert got.to_numpy() == pytest.approx([want[m] for m in MEASURES], abs=1e-12)


def test_tied_scores_are_broken_as_the_measure_implementation_breaks_them():
    # d1 and d2 tie; only d2 is relevant. trec_eval (nDCG, P...) puts d2 first (docno descending), MS MARCO's RR@k
    # script, which ir-measures picks for RR@10, puts d1 first (docno ascending)
    run = pd.DataFrame({"qid": "q", "docno": ["d1", "d2", "d0"], "score": [1.0, 1.0, 0.5]})
    qrels = pd.DataFrame({"qid": ["q"], "docno": ["d2"], "relevance": [1]})
    got = evaluate(run, qrels, ["P@1", "RR", "RR@10"])
    assert got.to_dict() == {"P@1": 1.0, "RR": 1.0, "RR@10": 0.5}
    want = ir_measures.calc_aggregate([ir_measures.parse_measure("RR@10")], *ir_frames(run, qrels)[::-1])
    assert got["RR@10"] == next(iter(want.values()))


def test_measure_names_in_both_syntaxes():
    run, qrels = random_run(), random_qrels()
    got = evaluate(run, qrels, ["ndcg_cut_10", "P@5", ir_measures.AP])
    assert list(got.index) == ["nDCG@10", "P@5", "AP"]
    assert got["nDCG@10"] == pytest.approx(evaluate(run, qrels, ["nDCG@10"])["nDCG@10"], abs=1e-12)


def test_bad_measure_name_is_named_with_examples():
    run, qrels = random_run(), random_qrels()
    with pytest.raises(ValueError, match=r"unknown measure 'nDCG@ten'.*'nDCG@10'"):
        evaluate(run, qrels, ["nDCG@ten"])
    with pytest.raises(ValueError, match="'bogus'"):
        evaluate(run, qrels, "bogus")
    with pytest.raises(TypeError, match="int"):
        evaluate(run, qrels, [10])


def test_no_judged_query_is_an_error_naming_both_sides():
    run, qrels = random_run(), random_qrels()
    qrels = qrels.assign(qid="x" + qrels["qid"])
    with pytest.raises(ValueError, match=r"none of the run's 8 queries.*'q0'.*'xq0'"):
        evaluate(run, qrels)


def test_identical_runs_have_delta_zero_and_p_one():
    run, qrels = random_run(), random_qrels()
    table = significance(run, run, qrels, MEASURES, trials=2000)
    assert list(table.index) == ["nDCG@10", "RR@10", "R@100"]
    assert list(table.columns) == ["mean_a", "mean_b", "delta", "+", "-", "p-value", "p-value (randomization)",
                                   "n_queries"]
    assert (table["delta"] == 0).all() and (table["+"] == 0).all() and (table["-"] == 0).all()
    assert (table["p-value"] == 1.0).all() and (table["p-value (randomization)"] == 1.0).all()
    assert (table["n_queries"] == 8).all()


def better_and_worse(n_queries=30):
    """Run b puts relevant documents first (score = relevance + small noise); run a scores at random."""
    qrels = random_qrels(n_queries=n_queries, n_docs=60)
    worse = random_run(n_queries=n_queries, n_docs=60, seed=2)
    rel = worse.merge(qrels, on=["qid", "docno"], how="left")["relevance"].fillna(0).to_numpy()
    better = worse.assign(score=rel + 0.5 * np.random.default_rng(3).random(len(worse)))
    return worse, better, qrels


def test_clearly_better_run_gets_small_p_values_and_positive_delta():
    worse, better, qrels = better_and_worse()
    table = significance(worse, better, qrels, MEASURES, trials=5000)
    print(table.to_string())
    for name in ["nDCG@10", "RR@10"]:
        assert table.loc[name, "delta"] > 0.2
        assert table.loc[name, "p-value"] < 1e-3 and table.loc[name, "p-value (randomization)"] < 1e-3
    swapped = significance(better, worse, qrels, MEASURES, trials=5000)
    assert swapped.loc["nDCG@10", "delta"] == pytest.approx(-table.loc["nDCG@10", "delta"])


def test_p_values_agree_with_scipy_on_per_query_values():
    worse, _, qrels = better_and_worse()
    rng = np.random.default_rng(4)
    noisy = worse.assign(score=worse["score"] + 0.3 * rng.random(len(worse)))  # a close run: mid-range p-values
    table = significance(worse, noisy, qrels, MEASURES, trials=3000, seed=7)
    per_a = evaluate(worse, qrels, MEASURES, per_query=True)
    per_b = evaluate(noisy, qrels, MEASURES, per_query=True).loc[per_a.index]
    for name in ["nDCG@10", "RR@10"]:
        a, b = per_a[name].to_numpy(), per_b[name].to_numpy()
        t_p = stats.ttest_rel(b, a).pvalue
        perm_p = stats.permutation_test((b, a), lambda x, y, axis: np.mean(x - y, axis=axis),
                                        permutation_type="samples", vectorized=True, n_resamples=3000,
                                        rng=7).pvalue
        assert table.loc[name, "p-value"] == pytest.approx(t_p, rel=1e-12)
        assert table.loc[name, "p-value (randomization)"] == pytest.approx(perm_p, rel=1e-12)
        assert table.loc[name, "+"] == (b > a).sum() and table.loc[name, "-"] == (b < a).sum()
        assert table.loc[name, "delta"] == pytest.approx(b.mean() - a.mean(), abs=1e-12)
    assert 0.001 < table.loc["nDCG@10", "p-value"] < 1  # not a degenerate case


def test_a_query_a_run_lacks_scores_zero_or_with_drop_the_intersection_is_tested():
    run, qrels = random_run(n_queries=8), random_qrels(n_queries=8)
    part = run[run["qid"].isin(["q0", "q1", "q2", "q3", "q4"])]
    with pytest.warns(UserWarning, match=r"no results for 3 of the 8 judged queries; they score 0"):
        table = significance(run, part, qrels, MEASURES, trials=500)
    assert (table["n_queries"] == 8).all() and (table["delta"] <= 0).all()
    with pytest.warns(UserWarning, match=r"no results for 3 of the 8 judged queries; they are left out"):
        table = significance(run, part, qrels, MEASURES, trials=500, missing="drop")
    assert (table["n_queries"] == 5).all() and (table["+"] == 0).all() and (table["-"] == 0).all()


def test_runs_with_no_shared_query_are_an_error():
    run, qrels = random_run(n_queries=8), random_qrels(n_queries=8)
    first, last = run[run["qid"] < "q4"], run[run["qid"] >= "q4"]
    with pytest.raises(ValueError, match="share no judged query"), pytest.warns(UserWarning):
        significance(first, last, qrels, MEASURES, missing="drop")
    with pytest.raises(ValueError, match="trials must be positive, got 0"):
        significance(run, run, qrels, MEASURES, trials=0)
    with pytest.raises(TypeError, match="trials must be an int, got float"):
        significance(run, run, qrels, MEASURES, trials=1e4)
