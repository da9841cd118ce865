"""compare_rankings on cases worked by hand, and its order against trec_eval's (score desc, ties by docno desc)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from xenc_lab.ir.compare import compare_rankings, summarize_comparison
from xenc_lab.ir.metrics import evaluate


def random_run(n_queries=6, n_docs=25, seed=0):
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"qid": np.repeat([f"q{q}" for q in range(n_queries)], n_docs),
                         "docno": [f"d{d:02d}" for _ in range(n_queries) for d in range(n_docs)],
                         "score": rng.random(n_queries * n_docs)})


def one_query(docnos, scores, qid="q"):
    return pd.DataFrame({"qid": qid, "docno": docnos, "score": scores})


def test_a_run_against_itself_is_identical():
    run = random_run()
    frame = compare_rankings(run, run, k=10)
    assert list(frame.columns) == ["shared", "kendall_tau", "overlap@10", "identical@10", "mean_shift@10",
                                   "max_shift@10"]
    assert list(frame.index) == [f"q{q}" for q in range(6)]
    assert (frame["shared"] == 25).all() and np.allclose(frame["kendall_tau"], 1.0, rtol=0, atol=1e-12)
    assert (frame["overlap@10"] == 1).all() and frame["identical@10"].all()
    assert (frame["mean_shift@10"] == 0).all() and (frame["max_shift@10"] == 0).all()
    summary = summarize_comparison(frame)
    assert summary.to_dict() == pytest.approx({"queries": 6.0, "mean_kendall_tau": 1.0, "mean_overlap@10": 1.0,
                                               "share_identical@10": 1.0, "mean_shift@10": 0.0, "max_shift@10": 0.0},
                                              abs=1e-12)


def test_a_reversed_ranking_has_tau_minus_one():
    run = random_run()
    frame = compare_rankings(run, run.assign(score=-run["score"]), k=5)
    assert np.allclose(frame["kendall_tau"], -1.0, rtol=0, atol=1e-12)
    assert (frame["overlap@5"] == 0).all() and not frame["identical@5"].any()
    # a's positions 1..5 land on 25..21 in b: shifts 24, 22, 20, 18, 16
    assert (frame["mean_shift@5"] == 20).all() and (frame["max_shift@5"] == 24).all()


def test_swapping_the_top_two_of_four():
    a = one_query(["d1", "d2", "d3", "d4"], [4.0, 3.0, 2.0, 1.0])
    b = one_query(["d1", "d2", "d3", "d4"], [3.0, 4.0, 2.0, 1.0])
    row = compare_rankings(a, b, k=2).loc["q"]
    assert row["kendall_tau"] == pytest.approx(4 / 6)  # 6 pairs, 1 discordant: (5 - 1) / 6
    assert row["overlap@2"] == 1 and not row["identical@2"]
    assert row["mean_shift@2"] == 1 and row["max_shift@2"] == 1
    assert compare_rankings(a, b, k=1).loc["q", "overlap@1"] == 0
    assert compare_rankings(a, b, k=3).loc["q", "mean_shift@3"] == pytest.approx(2 / 3)


def test_disjoint_candidates_count_as_placed_past_the_other_list():
    a = one_query(["a1", "a2", "a3"], [3.0, 2.0, 1.0])
    b = one_query(["b1", "b2"], [2.0, 1.0])
    row = compare_rankings(a, b, k=10).loc["q"]
    assert row["shared"] == 0 and np.isnan(row["kendall_tau"])
    assert row["overlap@10"] == 0 and not row["identical@10"]
    # a's positions 1, 2, 3 against position 3 (just past b's two): shifts 2, 1, 0
    assert row["mean_shift@10"] == 1 and row["max_shift@10"] == 2


def test_overlap_divides_by_the_shorter_list():
    a = one_query([f"d{i}" for i in range(10)], np.arange(10.0)[::-1])
    b = one_query(["d7", "d8", "d9"], [3.0, 2.0, 1.0])
    row = compare_rankings(a, b, k=5).loc["q"]
    assert row["shared"] == 3 and row["kendall_tau"] == pytest.approx(1.0)
    assert row["overlap@5"] == 0  # b's three are outside a's top 5
    row = compare_rankings(a, b, k=10).loc["q"]
    assert row["overlap@10"] == 1 and not row["identical@10"]  # b's whole list lies in a's top 10


def test_equal_scores_are_ordered_by_docno_descending_as_trec_eval_does():
    # the rank column claims d1 first; by trec_eval's rule d2 (docno descending) comes first
    tied = pd.DataFrame({"qid": "q", "docno": ["d1", "d2", "d0"], "rank": [1, 2, 3], "score": [1.0, 1.0, 0.5]})
    d2_first = one_query(["d2", "d1", "d0"], [3.0, 2.0, 1.0])
    d1_first = one_query(["d1", "d2", "d0"], [3.0, 2.0, 1.0])
    assert compare_rankings(tied, d2_first, k=2).loc["q", "identical@2"]
    assert compare_rankings(tied, d1_first, k=2).loc["q", "kendall_tau"] == pytest.approx(1 / 3)
    qrels = pd.DataFrame({"qid": ["q"], "docno": ["d2"], "relevance": [1]})
    assert evaluate(tied, qrels, ["P@1"])["P@1"] == 1.0  # trec_eval puts d2 first too


def test_queries_in_one_run_only_are_left_out_with_a_warning():
    run = random_run(n_queries=6)
    with pytest.warns(UserWarning, match=r"the 4 queries both.*1 only in run a, 1 only in run b"):
        frame = compare_rankings(run[run["qid"] != "q5"], run[run["qid"] != "q0"])
    assert list(frame.index) == ["q1", "q2", "q3", "q4"]
    with pytest.raises(ValueError, match="share no query"):
        compare_rankings(run[run["qid"] == "q0"], run[run["qid"] == "q1"])


@pytest.mark.parametrize("k, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError),
                                      ("10", TypeError)])
def test_k_must_be_a_positive_int(k, error):
    run = random_run(n_queries=1, n_docs=3)
    with pytest.raises(error, match="k must be"):
        compare_rankings(run, run, k=k)


def test_summary_refuses_other_frames():
    with pytest.raises(ValueError, match="compare_rankings frame"):
        summarize_comparison(pd.DataFrame({"shared": [1]}))
