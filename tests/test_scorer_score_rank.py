"""Scorer.score (vLLM's pairing rules) and Scorer.rank (sentence-transformers' CrossEncoder.rank)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

ATOL = 1e-5
QUERY = "how tall is everest"
DOCS = [
    "Everest is 8,849 m high.",
    "the cat sat on the mat",
    "Everest is 8,849 m high.",  # exact duplicate of 0: an exact tie
    "python is a programming language",
    "the cat sat on the mat",  # exact duplicate of 1
    "mountains of the himalaya",
    "",
]


# -- score -------------------------------------------------------------------------------------------
def test_score_of_two_strings_is_a_python_float_equal_to_predict_of_that_pair(scorer):
    got = scorer.score("q", "d")
    assert type(got) is float
    assert got == float(scorer.predict(("q", "d")))


def test_score_of_a_string_and_a_list_pairs_it_with_each_document(scorer):
    docs = DOCS[:4]
    want = scorer.predict([(QUERY, d) for d in docs])
    got = scorer.score(QUERY, docs)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (4,)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(scorer.score([QUERY], docs), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(scorer.score((QUERY,), tuple(docs)), want, rtol=0, atol=1e-6)


def test_score_of_equal_length_lists_pairs_them_one_to_one(scorer):
    text_1 = ["q1", "another query", "x"]
    text_2 = ["doc one", "doc two", "doc three"]
    got = scorer.score(text_1, text_2)
    assert got.shape == (3,)
    for i in range(3):
        assert abs(float(got[i]) - float(scorer.predict((text_1[i], text_2[i])))) < 1e-6
    assert len(set(got.tolist())) == 3, "distinct pairs, distinct scores: the zip order is observable"


@pytest.mark.parametrize(("n1", "n2"), [(2, 3), (3, 2), (3, 1)])
def test_score_rejects_lists_that_pair_neither_1_to_n_nor_n_to_n_naming_both_lengths(scorer, n1, n2):
    with pytest.raises(ValueError) as err:
        scorer.score(["q"] * n1, ["d"] * n2)
    assert str(n1) in str(err.value) and str(n2) in str(err.value)


@pytest.mark.parametrize(("text_1", "text_2"), [([], []), ("q", []), ([], ["d"]), ([], "d")], ids=str)
def test_score_rejects_an_empty_list_with_valueerror(scorer, text_1, text_2):
    with pytest.raises(ValueError, match="empty"):
        scorer.score(text_1, text_2)


def test_score_on_a_three_label_model_raises_valueerror(scorer3):
    with pytest.raises(ValueError, match="label"):
        scorer3.score("q", "d")
    with pytest.raises(ValueError, match="label"):
        scorer3.score("q", ["d", "e"])


def test_score_rejects_a_non_list_side_with_typeerror(scorer):
    with pytest.raises(TypeError, match="text_2"):
        scorer.score("q", 5)


# -- rank --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def doc_scores(oracle):
    scores = oracle.predict([(QUERY, d) for d in DOCS])
    distinct = sorted(set(np.round(scores, 7).tolist()))
    # Precondition: distinct documents are far apart, so order comparisons across engines are meaningful.
    assert len(distinct) == 5 and min(np.diff(distinct)) > 1e-3, scores
    return scores


@pytest.mark.parametrize("return_documents", [False, True])
@pytest.mark.parametrize("top_k", [None, 3, 1, 100])
def test_rank_matches_crossencoder_rank_in_structure_order_and_scores(scorer, oracle, doc_scores, top_k, return_documents):
    got = scorer.rank(QUERY, DOCS, top_k=top_k, return_documents=return_documents)
    want = oracle.rank(QUERY, DOCS, top_k=top_k, return_documents=return_documents)
    assert len(got) == len(want) == min(top_k or len(DOCS), len(DOCS))
    assert [r["corpus_id"] for r in got] == [r["corpus_id"] for r in want]
    for g, w in zip(got, want):
        assert set(g) == set(w) == ({"corpus_id", "score", "text"} if return_documents else {"corpus_id", "score"})
        assert type(g["score"]) is float and type(g["corpus_id"]) is int
        assert abs(g["score"] - w["score"]) < ATOL
        if return_documents:
            assert g["text"] == w["text"] == DOCS[g["corpus_id"]]


def test_rank_sorts_by_score_descending_keeping_ties_in_corpus_order(scorer, doc_scores):
    ranking = scorer.rank(QUERY, DOCS)
    scores = [r["score"] for r in ranking]
    assert scores == sorted(scores, reverse=True)
    assert sorted(r["corpus_id"] for r in ranking) == list(range(len(DOCS)))
    by_id = {r["corpus_id"]: r["score"] for r in ranking}
    assert by_id[0] == by_id[2] and by_id[1] == by_id[4], "duplicate documents must tie exactly"
    ids = [r["corpus_id"] for r in ranking]
    assert ids.index(0) < ids.index(2) and ids.index(1) < ids.index(4)
    for a, b in itertools.pairwise(ranking):
        if a["score"] == b["score"]:
            assert a["corpus_id"] < b["corpus_id"]


def test_rank_top_k_is_a_prefix_of_the_full_ranking(scorer):
    full = scorer.rank(QUERY, DOCS)
    for k in range(1, len(DOCS) + 2):
        assert scorer.rank(QUERY, DOCS, top_k=k) == full[:k]


@pytest.mark.parametrize("top_k", [0, -1, -len(DOCS)])
def test_rank_top_k_below_one_is_refused_not_read_as_a_slice(scorer, top_k):
    with pytest.raises(ValueError, match=f"top_k must be a positive int or None .*got {top_k}"):
        scorer.rank(QUERY, DOCS, top_k=top_k)


def test_rank_of_no_documents_is_an_empty_list_like_the_oracle(scorer, oracle):
    assert scorer.rank(QUERY, []) == oracle.rank(QUERY, []) == []


def test_rank_on_a_three_label_model_raises_valueerror(scorer3, oracle3):
    with pytest.raises(ValueError):
        oracle3.rank(QUERY, DOCS)  # the contract
    with pytest.raises(ValueError, match="label"):
        scorer3.rank(QUERY, DOCS)


@pytest.mark.parametrize(("query", "documents"), [(None, ["d"]), ("q", "a single string"), (["q"], ["d"])], ids=str)
def test_rank_rejects_a_non_str_query_or_a_bare_string_corpus_with_typeerror(scorer, query, documents):
    with pytest.raises(TypeError):
        scorer.rank(query, documents)


def test_rank_accepts_a_numpy_array_of_documents_like_the_oracle(scorer, oracle, doc_scores):
    docs = np.array(DOCS)
    got, want = scorer.rank(QUERY, docs), oracle.rank(QUERY, docs)
    assert [r["corpus_id"] for r in got] == [r["corpus_id"] for r in want]


def test_rank_takes_a_numpy_top_k_and_ignores_the_old_flags_with_a_warning_like_the_oracle(scorer, oracle):
    assert scorer.rank(QUERY, DOCS, top_k=np.int64(3)) == scorer.rank(QUERY, DOCS, top_k=3)
    with pytest.warns(FutureWarning, match="ignores"):
        got = scorer.rank(QUERY, DOCS, apply_softmax=True, convert_to_tensor=True)
    assert got == scorer.rank(QUERY, DOCS)
    assert [r["corpus_id"] for r in got] == [r["corpus_id"] for r in oracle.rank(QUERY, DOCS, apply_softmax=True)]
    with pytest.raises(TypeError, match="unexpected keyword"):
        scorer.rank(QUERY, DOCS, pool=object())
    with pytest.raises(TypeError):
        scorer.rank(QUERY, DOCS, 2, False, 8)  # options past return_documents are keyword-only


def test_rank_takes_the_oracles_old_names_activation_fct_and_num_workers_with_a_warning(scorer, oracle):
    identity = torch.nn.Identity()
    with pytest.warns(FutureWarning, match="activation_fct"):
        got = scorer.rank(QUERY, DOCS, activation_fct=identity)
    assert got == scorer.rank(QUERY, DOCS, activation_fn=identity)
    want = {r["corpus_id"]: r["score"] for r in oracle.rank(QUERY, DOCS, activation_fct=identity)}
    # the raw logits (the oracle's duplicates differ in the last bits with their batch's padding: no exact ties there)
    np.testing.assert_allclose([r["score"] for r in got], [want[r["corpus_id"]] for r in got], rtol=0, atol=ATOL)
    assert min(r["score"] for r in got) < 0 < max(r["score"] for r in got), "logits, not sigmoid scores"
    with pytest.warns(FutureWarning, match=r"ignores \['num_workers'\]"):
        assert scorer.rank(QUERY, DOCS, num_workers=2) == scorer.rank(QUERY, DOCS)
    with pytest.raises(TypeError, match="both activation_fn and activation_fct"):
        scorer.rank(QUERY, DOCS, activation_fn=identity, activation_fct=identity)
