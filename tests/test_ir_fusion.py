"""Fusion against values computed by hand: reciprocal rank fusion, min-max and z-score interpolation, and the weight
chosen on a dev split."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from xenc_lab import experiment, interpolate, rrf, tune_interpolation

A = pd.DataFrame({"qid": ["q1"] * 3, "docno": ["d1", "d2", "d3"], "score": [3.0, 2.0, 1.0]})
B = pd.DataFrame({"qid": ["q1"] * 3, "docno": ["d3", "d1", "d4"], "score": [9.0, 5.0, 1.0]})


def scores(run):
    return dict(zip(run["docno"], run["score"]))


def test_rrf_sums_reciprocal_ranks_with_k_60():
    fused = rrf([A, B])
    assert list(fused["docno"]) == ["d1", "d3", "d2", "d4"] and list(fused["rank"]) == [1, 2, 3, 4]
    want = {"d1": 1 / 61 + 1 / 62, "d3": 1 / 63 + 1 / 61, "d2": 1 / 62, "d4": 1 / 63}
    assert scores(fused) == pytest.approx(want, abs=1e-15)
    weighted = rrf({"a": A, "b": B}, k=0, weights=[2, 1])
    assert scores(weighted) == pytest.approx({"d1": 2 / 1 + 1 / 2, "d2": 2 / 2, "d3": 2 / 3 + 1 / 1, "d4": 1 / 3})


def test_rrf_ranks_by_trec_evals_order_not_the_rank_column():
    tied = pd.DataFrame({"qid": ["q1"] * 2, "docno": ["a", "b"], "score": [1.0, 1.0], "rank": [1, 2]})
    fused = rrf([tied, tied])
    assert scores(fused) == pytest.approx({"b": 2 / 61, "a": 2 / 62})  # ties: docno descending first


def test_min_max_interpolation_by_hand():
    fused = interpolate(A, B, 0.3)
    # A: d1 1, d2 .5, d3 0 (d4 absent: A's lowest, 0); B: d3 1, d1 .5, d4 0 (d2 absent: 0)
    want = {"d1": 0.3 * 1 + 0.7 * 0.5, "d2": 0.3 * 0.5, "d3": 0.7 * 1, "d4": 0.0}
    assert scores(fused) == pytest.approx(want, abs=1e-15)
    assert list(fused["docno"]) == ["d3", "d1", "d2", "d4"]
    assert list(interpolate(A, B, 1.0)["docno"]) == ["d1", "d2", "d4", "d3"]  # d3, d4 tie at 0: docno descending
    assert list(interpolate(A, B, 0.0)["docno"][:1]) == ["d3"]


def test_z_score_interpolation_by_hand():
    z = 1 / math.sqrt(2 / 3)  # A's scores 3, 2, 1: mean 2, population std sqrt(2/3)
    sb = math.sqrt(((9 - 5) ** 2 + 0 + (1 - 5) ** 2) / 3)  # B's: mean 5
    zb = {"d3": 4 / sb, "d1": 0.0, "d4": -4 / sb}
    za = {"d1": z, "d2": 0.0, "d3": -z}
    fused = interpolate(A, B, 0.5, norm="z-score")
    want = {"d1": 0.5 * za["d1"] + 0.5 * zb["d1"], "d2": 0.5 * za["d2"] + 0.5 * zb["d4"],
            "d3": 0.5 * za["d3"] + 0.5 * zb["d3"], "d4": 0.5 * za["d3"] + 0.5 * zb["d4"]}
    assert scores(fused) == pytest.approx(want, abs=1e-12)


def test_equal_scores_normalise_to_zero():
    flat = A.assign(score=1.0)
    assert set(interpolate(flat, flat, 0.5)["score"]) == {0.0}


def test_the_weight_is_chosen_on_the_dev_split_and_fused_runs_are_systems():
    rng = np.random.default_rng(0)
    docs = [f"d{i}" for i in range(20)]
    rows_a, rows_b, qrels = [], [], []
    for q in range(12):
        rel = docs[q % 20]
        for d in docs:
            rows_a.append((f"q{q}", d, rng.random() + (0.6 if d == rel else 0)))  # first stage: some signal
            rows_b.append((f"q{q}", d, rng.random() + (0.6 if d == rel else 0)))  # reranker: independent signal
        qrels.append((f"q{q}", rel, 1))
    columns = ["qid", "docno", "score"]
    first, second = pd.DataFrame(rows_a, columns=columns), pd.DataFrame(rows_b, columns=columns)
    qrels = pd.DataFrame(qrels, columns=["qid", "docno", "label"])
    dev = qrels[qrels["qid"].isin([f"q{q}" for q in range(6)])]
    best, grid = tune_interpolation(first, second, dev, "nDCG@10", weights=[0, 0.25, 0.5, 0.75, 1])
    assert list(grid.index) == [0, 0.25, 0.5, 0.75, 1] and best == grid.idxmax()
    from xenc_lab import evaluate

    for w in grid.index:  # each grid value is the dev split's nDCG@10 of that interpolation, and nothing else
        assert grid[w] == pytest.approx(evaluate(interpolate(first, second, w), dev, ["nDCG@10"]).iloc[0])
    test = qrels[~qrels["qid"].isin(dev["qid"])]
    table = experiment({"first": first, "fused": interpolate(first, second, best), "rrf": rrf([first, second])},
                       None, test, ["nDCG@10"], baseline="first")
    assert list(table["name"]) == ["first", "fused", "rrf"]


@pytest.mark.parametrize("call, match", [
    (lambda: rrf([A]), "two or more runs"),
    (lambda: rrf([A, B], k=-1), "k must be a non-negative number"),
    (lambda: rrf([A, B], weights=[1]), "weights has 1 entries for 2 runs"),
    (lambda: interpolate(A, B, 1.5), "weight must be a number in"),
    (lambda: interpolate(A, B, 0.5, norm="l2"), "norm must be one of"),
    (lambda: tune_interpolation(A, B, A.assign(label=1), weights=[2]), "weights must be a non-empty sequence"),
])
def test_bad_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
