"""A reranking experiment end to end on real MiniLM-L6 weights: the reranked run written by ``rerank`` orders each
query's top candidates exactly as sentence-transformers' scores of the same texts do, keeps the rest in first-stage
order, and evaluates to ir-measures' own numbers read from the written file."""
from __future__ import annotations

import functools

import ir_measures
import numpy as np
import pytest

from xenc_lab.ir import evaluate, read_qrels, read_run, rerank
from xenc_lab.ir.pydocs import bm25_run, python_docs_collection

from .conftest import oracle, scorer

ARCH = "minilm-l6 (real weights)"
DEPTH, CANDIDATES, QUERIES = 20, 30, 40
MEASURES = ("nDCG@10", "RR@10", "R@20", "AP")
TOLERANCE = 2e-5  # the engines' largest score difference allowed (the parity suite's bound on these scores)


@functools.cache
def collection(root: str):
    paths = python_docs_collection(root, max_chars=300, max_queries=QUERIES)
    return paths, bm25_run(paths["queries"], paths["corpus"], k=CANDIDATES)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    root = tmp_path_factory.mktemp("pydocs")
    paths, run = collection(str(root))
    ours = rerank(scorer(ARCH), paths["queries"], paths["corpus"], run, depth=DEPTH, output=root / "ours.trec",
                  show_progress_bar=False)
    theirs = rerank(oracle(ARCH), paths["queries"], paths["corpus"], run, depth=DEPTH, output=root / "st.trec",
                    show_progress_bar=False)
    return paths, run, ours, theirs, root


def test_reranked_top_k_is_ordered_exactly_as_sentence_transformers_scores_and_the_rest_keeps_first_stage_order(
        experiment, recorder):
    _, run, ours, theirs, _ = experiment
    head = lambda frame: frame[frame["rank"] <= DEPTH]
    delta = recorder.add(ARCH, "float32", "rerank scores", head(ours)["score"], head(theirs)["score"])
    spread = float(head(theirs)["score"].std())
    print(f"\n{ours['qid'].nunique()} queries x {DEPTH}: max |delta| {delta.max():.2e}, score spread {spread:.3f}")
    assert spread > 0.05 and delta.max() < TOLERANCE  # scores vary far more than the two engines differ
    first = {q: list(g.sort_values(["score", "docno"], ascending=False)["docno"]) for q, g in run.groupby("qid")}
    gaps, differ = [], []
    for qid, group in ours.groupby("qid"):
        st = theirs[theirs["qid"] == qid].set_index("docno")["score"]
        assert sorted(group["docno"][:DEPTH]) == sorted(first[qid][:DEPTH])
        assert list(group["docno"][DEPTH:]) == first[qid][DEPTH:]
        # Our order read with sentence-transformers' scores never rises by more than the engines' difference.
        theirs_in_our_order = st[list(group["docno"][:DEPTH])].to_numpy()
        assert (np.diff(theirs_in_our_order) <= TOLERANCE).all(), f"query {qid}: the order disagrees beyond a tie"
        if list(group["docno"]) != list(st.index):
            differ.append(qid)
        gaps.append(np.diff(-st.to_numpy()[:DEPTH]).min())
    print(f"smallest gap between adjacent sentence-transformers scores: {min(gaps):.2e}; queries ordered "
          f"differently (near-ties only): {differ}")
    # Identical orders, but where two documents' scores are closer than the engines' difference.
    assert not differ or min(gaps) <= TOLERANCE


def test_metrics_of_the_written_run_equal_ir_measures_read_from_the_file(experiment):
    paths, _, ours, _, root = experiment
    measures = [ir_measures.parse_measure(m) for m in MEASURES]
    qrels = read_qrels(paths["qrels"]).rename(columns={"qid": "query_id", "docno": "doc_id"})
    direct = ir_measures.calc_aggregate(measures, qrels, ir_measures.read_trec_run(str(root / "ours.trec")))
    for source in (ours, root / "ours.trec"):
        got = evaluate(source, paths["qrels"], MEASURES)
        assert {str(m): v for m, v in direct.items()} == got.to_dict()
    assert read_run(root / "ours.trec")[["qid", "docno", "score", "rank"]].equals(ours)
