"""Scorer.score_frame: a DataFrame's (text_1, text_2) rows scored into new columns of a copy, index and order kept."""
from __future__ import annotations

import numpy as np
import pytest

pd = pytest.importorskip("pandas")

ATOL = 1e-5
QUERIES = ["how tall is everest", "q", "hello world", "python", "", "café naïve"]
PASSAGES = ["Everest is 8,849 m high.", "d", "", "Python is a programming language.", "an empty query", "日本語 🙂"]


@pytest.fixture
def frame():
    # A non-default, unsorted index, and an extra column that must come through untouched.
    return pd.DataFrame({"query": QUERIES, "passage": PASSAGES, "source": list("abcdef")},
                        index=pd.Index([17, 3, 42, 0, 8, 5], name="row"))


def pairs_of(df, text_1="query", text_2="passage"):
    return list(zip(df[text_1], df[text_2]))


def test_score_column_equals_predict_and_the_crossencoder_on_the_same_pairs(scorer, oracle, frame):
    out = scorer.score_frame(frame)
    got = out["score"].to_numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, scorer.predict(pairs_of(frame)))
    want = oracle.predict(pairs_of(frame))
    delta = np.abs(got - want)
    print(f"max |delta| {delta.max():.2e}, mean |delta| {delta.mean():.2e}")
    assert delta.max() <= ATOL
    assert len(set(got.tolist())) == len(frame), "distinct pairs, distinct scores: a row mix-up would show"


def test_the_index_row_order_and_other_columns_are_kept_and_the_input_is_unchanged(scorer, frame):
    before = frame.copy(deep=True)
    out = scorer.score_frame(frame)
    pd.testing.assert_frame_equal(frame, before)
    assert "score" not in frame.columns
    pd.testing.assert_index_equal(out.index, frame.index)
    pd.testing.assert_frame_equal(out[list(frame.columns)], frame)
    # Row 42 holds the third pair wherever it sits.
    assert out.loc[42, "score"] == scorer.predict((QUERIES[2], PASSAGES[2]))


def test_a_three_label_model_gives_one_column_per_label_named_after_it(scorer3, oracle3, frame):
    out = scorer3.score_frame(frame, column="nli")
    names = [f"nli_{label}" for label in scorer3.labels]
    assert names == ["nli_contradiction", "nli_entailment", "nli_neutral"]
    assert list(out.columns) == list(frame.columns) + names
    got = out[names].to_numpy()
    np.testing.assert_array_equal(got, scorer3.predict(pairs_of(frame)))
    delta = np.abs(got - oracle3.predict(pairs_of(frame)))
    print(f"max |delta| {delta.max():.2e}, mean |delta| {delta.mean():.2e}")
    assert delta.max() <= ATOL


@pytest.mark.slow
def test_other_column_names_and_predict_options_are_used(scorer, frame):
    renamed = frame.rename(columns={"query": "q", "passage": "doc"})
    out = scorer.score_frame(renamed, "q", "doc", column="relevance", apply_softmax=False, batch_size=2,
                             prompt="query: ")
    want = scorer.predict(pairs_of(renamed, "q", "doc"), prompt="query: ")
    np.testing.assert_array_equal(out["relevance"].to_numpy(), want)
    assert not np.allclose(want, scorer.predict(pairs_of(renamed, "q", "doc"))), "the prompt must change the scores"


def test_an_empty_frame_gets_an_empty_float32_column(scorer, scorer3, frame):
    out = scorer.score_frame(frame.iloc[:0])
    assert len(out) == 0 and out["score"].dtype == np.float32
    out3 = scorer3.score_frame(frame.iloc[:0])
    assert [out3[f"score_{label}"].dtype for label in scorer3.labels] == [np.float32] * 3


def test_an_existing_output_column_is_refused_unless_overwrite(scorer, frame):
    scored = scorer.score_frame(frame)
    with pytest.raises(ValueError, match=r"already has the column\(s\) \['score'\].*overwrite=True"):
        scorer.score_frame(scored)
    stale = scored.assign(score=np.float32(-1.0))
    again = scorer.score_frame(stale, overwrite=True)
    np.testing.assert_array_equal(again["score"].to_numpy(), scored["score"].to_numpy())
    assert (stale["score"] == -1.0).all(), "overwrite replaces the copy's column, not the input's"


@pytest.mark.parametrize("df", [[("q", "d")], {"query": ["q"], "passage": ["d"]}, None], ids=["list", "dict", "None"])
def test_a_non_dataframe_is_refused_with_typeerror_naming_its_type(scorer, df):
    with pytest.raises(TypeError, match=f"df must be a pandas DataFrame, got {type(df).__name__}"):
        scorer.score_frame(df)


def test_a_series_is_refused_with_typeerror(scorer, frame):
    with pytest.raises(TypeError, match="got Series"):
        scorer.score_frame(frame["query"])


@pytest.mark.parametrize(("kwargs", "missing"), [({"text_1": "question"}, "question"), ({"text_2": "doc"}, "doc")])
def test_a_missing_text_column_is_refused_listing_the_frames_columns(scorer, frame, kwargs, missing):
    with pytest.raises(ValueError, match=rf"'{missing}' is not a column of df; its columns are "
                                         r"\['query', 'passage', 'source'\]"):
        scorer.score_frame(frame, **kwargs)


@pytest.mark.parametrize("hole", [None, np.nan], ids=["None", "NaN"])
def test_none_or_nan_in_a_text_column_is_refused_naming_the_column_and_rows(scorer, frame, hole):
    bad = frame.astype({"passage": object})
    bad.loc[[42, 5], "passage"] = hole
    with pytest.raises(ValueError, match=r"column 'passage' must hold str values, got NaN/None in rows \[42, 5\]"):
        scorer.score_frame(bad)


def test_a_non_str_value_in_a_text_column_is_refused_with_typeerror_naming_rows(scorer, frame):
    bad = frame.astype({"query": object})
    bad.loc[3, "query"] = 7
    bad.loc[0, "query"] = b"bytes"
    with pytest.raises(TypeError, match=r"column 'query' must hold str values, got int \(e\.g\. 7\) in rows \[3, 0\]"):
        scorer.score_frame(bad)


def test_only_the_first_five_offending_rows_are_named(scorer):
    bad = pd.DataFrame({"query": [None] * 8, "passage": ["d"] * 8})
    with pytest.raises(ValueError, match=r"in rows \[0, 1, 2, 3, 4\]$"):
        scorer.score_frame(bad)


def test_a_text_column_name_held_twice_is_refused(scorer, frame):
    doubled = pd.concat([frame, frame[["query"]]], axis=1)
    with pytest.raises(ValueError, match="text_1='query' names 2 columns"):
        scorer.score_frame(doubled)


@pytest.mark.parametrize("kwargs", [{"convert_to_tensor": True}, {"convert_to_numpy": False}], ids=str)
def test_output_type_options_are_refused(scorer, frame, kwargs):
    with pytest.raises(ValueError, match="score_frame writes float32 columns"):
        scorer.score_frame(frame, **kwargs)


def test_a_non_str_output_column_and_a_non_bool_overwrite_are_refused_with_typeerror(scorer, frame):
    with pytest.raises(TypeError, match="column must be a str, got int"):
        scorer.score_frame(frame, column=1)
    with pytest.raises(TypeError, match="overwrite"):
        scorer.score_frame(frame, overwrite="yes")
