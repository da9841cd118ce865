"""Interop: PyTerrier's frames everywhere frames go, Scorer.as_pyterrier() inside pt.Experiment, collections by
name (a BEIR folder, an ir_datasets id with a local copy, never a download), BEIR's ignore_identical_ids in evaluate,
bm25 public."""
from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest

from xenc_lab import bm25, evaluate, experiment, load_collection, rerank
from xenc_lab.ir.irds import NotLocal
from xenc_lab.ir.pydocs import python_docs_collection

QUERIES = {"q1": "rivers of europe", "q2": "tall mountains", "q3": "python lists"}
DOCS = {"d1": "The Danube is a river of Europe.", "d2": "Everest is the tallest mountain.",
        "d3": "Lists in Python hold items.", "d4": "Rivers flow to the sea.", "d5": "Mountains rise high."}
QRELS = pd.DataFrame({"qid": ["q1", "q2", "q3"], "docno": ["d1", "d2", "d3"], "label": [1, 1, 1]})  # PyTerrier's


@pytest.fixture(scope="module")
def pt_frames():
    topics = pd.DataFrame({"qid": list(QUERIES), "query": list(QUERIES.values())})
    corpus = pd.DataFrame({"docno": list(DOCS), "text": list(DOCS.values())})
    results = bm25(topics, corpus, k=5)
    results = results.merge(topics, on="qid").merge(corpus, on="docno")  # PyTerrier results: + query, text
    return topics, corpus, results


def test_pyterrier_frames_are_accepted_by_bm25_rerank_and_experiment(pt_frames, scorer):
    topics, corpus, results = pt_frames
    assert set(results.columns) >= {"qid", "docno", "score", "rank", "query", "text"}
    by_frames = rerank(scorer, None, None, results, depth=3, show_progress_bar=False)  # texts from the frame
    by_dicts = rerank(scorer, QUERIES, DOCS, results[["qid", "docno", "score"]], depth=3, show_progress_bar=False)
    assert by_frames.equals(by_dicts)
    table = experiment({"bm25": results, "ce": scorer}, topics, QRELS, ["RR@10"], first_stage="bm25",
                       corpus=corpus, depth=3, baseline="bm25", show_progress_bar=False)
    assert table.loc[1, "RR@10"] == pytest.approx(evaluate(by_dicts, QRELS, ["RR@10"]).iloc[0])
    with pytest.raises(ValueError, match="give queries, or a run DataFrame with a 'query' column"):
        rerank(scorer, None, DOCS, results[["qid", "docno", "score"]])


def test_as_pyterrier_reranks_inside_pt_experiment_as_experiment_does(pt_frames, scorer):
    pt = pytest.importorskip("pyterrier")
    topics, corpus, results = pt_frames
    reranker = scorer.as_pyterrier()
    assert isinstance(reranker, pt.Transformer)
    out = reranker(results)
    want = scorer.predict(list(zip(results["query"], results["text"])))
    np.testing.assert_array_equal(out["score"].to_numpy(), want.astype("float64"))
    first = out[out["qid"] == "q1"].sort_values("rank")
    assert list(first["rank"]) == list(range(len(first))) and first["score"].is_monotonic_decreasing
    pipeline = pt.Transformer.from_df(results) >> reranker
    from ir_measures import nDCG

    theirs = pt.Experiment([pt.Transformer.from_df(results), pipeline], topics, QRELS, [nDCG @ 10],
                           names=["bm25", "ce"], baseline=0)
    ours = experiment({"bm25": results, "ce": scorer}, topics, QRELS, ["nDCG@10"], first_stage="bm25",
                      corpus=corpus, depth=None, baseline="bm25", correction=None, show_progress_bar=False)
    for column in ["nDCG@10", "nDCG@10 +", "nDCG@10 -", "nDCG@10 p-value"]:
        np.testing.assert_allclose(ours[column].to_numpy(float), theirs[column].to_numpy(float), rtol=1e-9)
    with pytest.raises(ValueError, match="missing \\['text'\\]"):
        reranker(results.drop(columns="text"))


def test_as_pyterrier_without_pyterrier_says_what_to_install(scorer, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyterrier", None)
    with pytest.raises(ImportError, match="pip install 'xenc-lab\\[pyterrier\\]'"):
        scorer.as_pyterrier()


def test_identical_ids_are_dropped_by_evaluate_as_beir_does():
    run = pd.DataFrame({"qid": ["d1", "d1"], "docno": ["d1", "d2"], "score": [2.0, 1.0]})  # a query that is a doc
    qrels = pd.DataFrame({"qid": ["d1"], "docno": ["d2"], "label": [1]})
    with pytest.warns(UserWarning, match="dropped 1 results whose docno equals the qid"):
        assert evaluate(run, qrels, ["RR@10"]).iloc[0] == 1.0
    assert evaluate(run, qrels, ["RR@10"], ignore_identical_ids=False).iloc[0] == 0.5


def test_a_beir_folder_loads_by_its_path(tmp_path):
    paths = python_docs_collection(tmp_path, max_chars=100, max_queries=4)
    collection = load_collection(tmp_path)
    assert collection.queries == paths["queries"] and collection.qrels == paths["qrels"]
    with pytest.raises(FileNotFoundError, match="missing"):
        load_collection(tmp_path, split="dev")


@pytest.fixture
def irds(tmp_path, monkeypatch):
    ir_datasets = pytest.importorskip("ir_datasets")
    from ir_datasets.datasets.base import Dataset
    from ir_datasets.formats import TrecQrels, TsvDocs, TsvQueries
    from ir_datasets.util import Download, LocalDownload
    from ir_datasets.util.download import RequestsDownload

    (tmp_path / "docs.tsv").write_text("".join(f"{k}\t{v}\n" for k, v in DOCS.items()))
    (tmp_path / "queries.tsv").write_text("".join(f"{k}\t{v}\n" for k, v in QUERIES.items()))
    (tmp_path / "qrels.txt").write_text("".join(f"{q} 0 {d} 1\n" for q, d in zip(QRELS["qid"], QRELS["docno"])))
    registry = ir_datasets.registry
    monkeypatch.setattr(registry, "_allow_overwrite", True, raising=False)
    local = Dataset(TsvDocs(LocalDownload(tmp_path / "docs.tsv")), TsvQueries(LocalDownload(tmp_path / "queries.tsv")),
                    TrecQrels(LocalDownload(tmp_path / "qrels.txt"), {1: "relevant"}))
    remote_docs = Download([RequestsDownload("http://127.0.0.1:9/docs.tsv")], cache_path=str(tmp_path / "absent.tsv"))
    remote = Dataset(TsvDocs(remote_docs), TsvQueries(LocalDownload(tmp_path / "queries.tsv")),
                     TrecQrels(LocalDownload(tmp_path / "qrels.txt"), {1: "relevant"}))
    registry.register("xenc-lab-test/local", local)
    registry.register("xenc-lab-test/remote", remote)
    yield
    for name in ("xenc-lab-test/local", "xenc-lab-test/remote"):
        registry._registered.pop(name, None)


def test_an_ir_datasets_collection_with_a_local_copy_loads_by_name(irds, scorer):
    collection = load_collection("xenc-lab-test/local")
    assert collection.queries == QUERIES and collection.corpus == DOCS
    assert list(collection.qrels.columns) == ["qid", "docno", "relevance"] and len(collection.qrels) == 3
    run = bm25(collection.queries, collection.corpus, k=3)
    table = experiment({"bm25": run}, collection.queries, collection.qrels, ["RR@10"])
    assert 0 < table.loc[0, "RR@10"] <= 1


def test_an_ir_datasets_collection_without_a_local_copy_is_refused_not_downloaded(irds, monkeypatch):
    from ir_datasets.util.download import RequestsDownload

    def no_network(self):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(RequestsDownload, "stream", no_network)  # the loader must replace this, never call it
    with pytest.raises(NotLocal, match="is not on this machine .* does not download"):
        load_collection("xenc-lab-test/remote")
    assert RequestsDownload.stream is no_network  # restored afterwards
    with pytest.raises(ValueError, match="neither a local folder nor an ir_datasets id"):
        load_collection("no-such/collection")


def test_bm25_is_public_and_the_old_name_still_works(tmp_path):
    from xenc_lab.ir.pydocs import bm25_run

    run = bm25(QUERIES, DOCS, k=2)
    assert list(run.columns) == ["qid", "docno", "rank", "score"] and run.groupby("qid").size().max() <= 2
    with pytest.warns(DeprecationWarning, match="now xenc_lab.bm25"):
        assert bm25_run(QUERIES, DOCS, k=2).equals(run)
    with pytest.raises(ValueError, match="k must be a positive int"):
        bm25(QUERIES, DOCS, k=0)
