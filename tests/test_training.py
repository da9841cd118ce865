"""The offline trained reranker: a split whose evaluation queries (and their documents) training never sees, a
cache key that follows what decides the weights, and a model that beats BM25 on the held-out queries."""
from dataclasses import replace

import pytest

pytest.importorskip("bm25s")
pytest.importorskip("ir_measures")

from xenc_lab import training  # noqa: E402
from xenc_lab.ir import read_qrels, significance  # noqa: E402


@pytest.fixture(scope="module")
def examples():
    return training.training_examples()


def _split(folder):
    paths = training.pydocs_split(folder)
    return paths, read_qrels(paths["train"]), read_qrels(paths["test"])


def test_split_is_disjoint_in_queries_and_documents_and_the_same_every_time(tmp_path):
    paths, train, test = _split(tmp_path / "a")
    _, train_again, test_again = _split(tmp_path / "b")
    assert train.equals(train_again) and test.equals(test_again)
    assert not set(train["qid"]) & set(test["qid"]) and not set(train["docno"]) & set(test["docno"])
    n_queries = sum(1 for _ in open(paths["queries"], encoding="utf-8"))
    assert len(train) + len(test) == n_queries
    assert 0.3 < len(test) / n_queries < 0.5, (len(test), n_queries)  # eval_fraction 0.4


def test_split_seed_moves_queries_between_sides(tmp_path):
    _, _, test = _split(tmp_path / "a")
    other = training.pydocs_split(tmp_path / "b", replace(training.TrainingSettings(), split_seed=1))
    assert set(read_qrels(other["test"])["qid"]) != set(test["qid"])


def test_training_examples_hold_no_evaluation_query_or_document(tmp_path, examples):
    from xenc_lab.ir import read_corpus, read_queries

    paths, _, test = _split(tmp_path)
    queries, corpus = read_queries(paths["queries"]), read_corpus(paths["corpus"])
    eval_queries = {queries[q] for q in test["qid"]}
    eval_docs = {corpus[d] for d in test["docno"]}
    settings = training.TrainingSettings()
    assert len(examples) == settings.groups_per_query * (len(queries) - len(test))
    for row in examples:
        assert row["query"] not in eval_queries
        assert not set(row["docs"]) & eval_docs
        assert row["labels"] == [1] + [0] * settings.negatives and len(set(row["docs"])) == len(row["docs"])


def test_training_examples_are_seeded_and_each_round_draws_new_negatives(examples):
    assert training.training_examples() == examples
    assert training.training_examples(replace(training.TrainingSettings(), seed=99)) != examples
    second = training.training_examples(round=1)
    assert second != examples and sorted(r["query"] for r in second) == sorted(r["query"] for r in examples)


def test_cache_key_follows_examples_settings_and_base_weights(tmp_path, examples):
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"weights")
    settings = training.TrainingSettings()
    key = training.cache_key(examples, settings, base)
    assert training.cache_key(examples, settings, base) == key
    assert training.cache_key(examples[:-1], settings, base) != key
    assert training.cache_key(examples, replace(settings, learning_rate=1e-5), base) != key
    assert training.cache_key(examples, replace(settings, rounds=5), base) == key  # a round is its examples and base
    (base / "model.safetensors").write_bytes(b"other weights")
    assert training.cache_key(examples, settings, base) != key


def test_settings_refuse_an_empty_split_or_too_few_candidates():
    with pytest.raises(ValueError, match="eval_fraction"):
        training.TrainingSettings(eval_fraction=1.0)
    with pytest.raises(ValueError, match="negatives"):
        training.TrainingSettings(negatives=5, negative_pool=3)


@pytest.mark.slow
def test_trained_reranker_beats_bm25_on_the_held_out_queries(tmp_path):
    """Trains once per machine (cached after); reranks BM25's top 20 of each held-out query."""
    from xenc_lab.zoo import trained_reranker

    paths, run, reranked = training.heldout_runs(trained_reranker(), tmp_path)
    tests = significance(run, reranked, paths["test"], ["nDCG@10"])
    row = tests.loc["nDCG@10"]
    print(tests.to_string())
    assert row["n_queries"] == len(read_qrels(paths["test"]))
    assert row["delta"] > 0 and row["p-value"] < 0.01 and row["p-value (randomization)"] < 0.01, tests


def test_the_collection_ignores_what_the_calling_process_patched(tmp_path, monkeypatch):
    """The docstrings are read in a fresh interpreter: a function patched here (as pytest patches
    threading.excepthook, or a notebook kernel its hooks) leaves the collection as a plain script sees it."""
    import threading
    from pathlib import Path

    from xenc_lab.ir.pydocs import python_docs_collection

    def settrace(func):
        """A stand-in patched over threading.settrace by the calling process, long enough to be collected if read."""

    clean = Path(python_docs_collection(tmp_path / "a")["corpus"]).read_text(encoding="utf-8")
    monkeypatch.setattr(threading, "settrace", settrace)
    patched = Path(python_docs_collection(tmp_path / "b")["corpus"]).read_text(encoding="utf-8")
    assert patched == clean and "threading.settrace" in clean and "stand-in" not in patched
