"""``rerank``: each query's top candidates ordered by the scorer, the rest kept in first-stage order, all queries
streamed through the engine pairs_per_call pairs at a time, the output written query by query so an interrupted run resumes to the same file."""
import numpy as np
import pandas as pd
import pytest

from xenc_lab.ir.files import read_run
from xenc_lab.ir.reranking import rerank

QUERIES = {f"q{i}": f"query {i} words {' '.join(f'w{j}' for j in range(i % 4 + 1))}" for i in range(7)}
CORPUS = {f"d{j}": {"title": f"title {j}", "text": " ".join(f"w{k}" for k in range(j % 5))} for j in range(30)}


def first_stage(n_docs: int = 12) -> pd.DataFrame:
    rows = [(q, f"d{(3 * i + j) % 30}", 100.0 - j) for i, q in enumerate(QUERIES) for j in range(n_docs)]
    return pd.DataFrame(rows, columns=["qid", "docno", "score"])


class Overlap:
    """A stand-in reranker: a pair's score is the words its two texts share, plus a small per-text offset; records
    each predict call's size and pairs."""

    num_labels = 1

    def __init__(self, interrupt_after: int | None = None, constant: bool = False):
        self.calls, self.pairs = [], []
        self.interrupt_after, self.constant = interrupt_after, constant

    def predict(self, pairs, show_progress_bar=None, **kwargs):
        if self.interrupt_after is not None and len(self.calls) == self.interrupt_after:
            raise KeyboardInterrupt
        self.calls.append(len(pairs))
        self.pairs += pairs
        if self.constant:
            return np.zeros(len(pairs), dtype=np.float32)
        return np.array([len(set(q.split()) & set(d.split())) + len(d) / 1000 for q, d in pairs], dtype=np.float32)


def test_top_depth_candidates_are_ordered_by_score_and_the_rest_keep_first_stage_order():
    scorer = Overlap()
    out = rerank(scorer, QUERIES, CORPUS, first_stage(), depth=5, show_progress_bar=False)
    assert list(out.columns) == ["qid", "docno", "score", "rank"]
    order = {q: list(g["docno"]) for q, g in first_stage().groupby("qid", sort=False)}
    for qid, group in out.groupby("qid", sort=False):
        docnos, scores = list(group["docno"]), list(group["score"])
        assert sorted(docnos[:5]) == sorted(order[qid][:5]) and docnos[5:] == order[qid][5:]
        expected = scorer.predict([(QUERIES[qid], "{title} {text}".format(**CORPUS[d])) for d in docnos[:5]])
        assert scores[:5] == sorted(expected.astype(float).tolist(), reverse=True)
        assert all(a > b for a, b in zip(scores[4:], scores[5:]))  # the kept tail sits strictly below
        assert list(group["rank"]) == list(range(1, 13))
    assert list(out["qid"].unique()) == list(QUERIES)


def test_texts_are_title_space_text_and_the_title_can_be_left_out():
    scorer = Overlap()
    rerank(scorer, QUERIES, CORPUS, first_stage(2), depth=1, show_progress_bar=False)
    assert scorer.pairs[0] == (QUERIES["q0"], "title 0 ")
    scorer = Overlap()
    rerank(scorer, QUERIES, CORPUS, first_stage(2), depth=1, title_sep=None, show_progress_bar=False)
    assert scorer.pairs[0] == (QUERIES["q0"], "")


def test_queries_stream_together_up_to_pairs_per_call_not_one_by_one():
    scorer = Overlap()
    rerank(scorer, QUERIES, CORPUS, first_stage(), depth=10, pairs_per_call=25, show_progress_bar=False)
    assert scorer.calls == [20, 20, 20, 10]  # whole queries, as many as a call holds
    scorer = Overlap()
    rerank(scorer, QUERIES, CORPUS, first_stage(), depth=10, pairs_per_call=5, show_progress_bar=False)
    assert scorer.calls == [10] * 7  # a query larger than a call still runs whole


def test_window_the_old_name_of_pairs_per_call_still_works_and_warns():
    scorer = Overlap()
    with pytest.warns(DeprecationWarning, match="rerank\\(window=\\) is deprecated: pass pairs_per_call="):
        rerank(scorer, QUERIES, CORPUS, first_stage(), depth=10, window=25, show_progress_bar=False)
    assert scorer.calls == [20, 20, 20, 10]


def test_ties_break_by_docno_descending_as_trec_eval_reads_them_so_reruns_write_the_same_file(tmp_path):
    run = first_stage()
    for name in ("a.trec", "b.trec"):
        rerank(Overlap(constant=True), QUERIES, CORPUS, run, depth=6, output=tmp_path / name, show_progress_bar=False)
    text = (tmp_path / "a.trec").read_text()
    assert text == (tmp_path / "b.trec").read_text()
    head = [line.split()[2] for line in text.splitlines()[:6]]
    assert head == sorted(head, reverse=True)


def test_output_file_holds_the_returned_frame_exactly(tmp_path):
    out = rerank(Overlap(), QUERIES, CORPUS, first_stage(), depth=4, output=tmp_path / "r.trec", tag="ce",
                 show_progress_bar=False)
    written = read_run(tmp_path / "r.trec")
    assert written[["qid", "docno", "score", "rank"]].equals(out)
    assert {line.split()[5] for line in (tmp_path / "r.trec").read_text().splitlines()} == {"ce"}


def test_an_interrupted_run_leaves_complete_queries_and_resumes_to_the_same_file(tmp_path):
    full = tmp_path / "full.trec"
    rerank(Overlap(), QUERIES, CORPUS, first_stage(), depth=5, output=full, pairs_per_call=10, show_progress_bar=False)
    part = tmp_path / "part.trec"
    with pytest.raises(KeyboardInterrupt):
        rerank(Overlap(interrupt_after=2), QUERIES, CORPUS, first_stage(), depth=5, output=part, pairs_per_call=10,
               show_progress_bar=False)
    lines = part.read_text().splitlines()
    assert len(lines) == 4 * 12 and full.read_text().startswith(part.read_text())  # 2 calls of 2 queries
    scorer = Overlap()
    out = rerank(scorer, QUERIES, CORPUS, first_stage(), depth=5, output=part, pairs_per_call=10, resume=True,
                 show_progress_bar=False)
    assert sum(scorer.calls) == 3 * 5  # only the three queries left were scored
    assert part.read_text() == full.read_text()
    assert len(out) == 7 * 12


def test_resume_drops_a_trailing_half_written_query(tmp_path):
    full = tmp_path / "full.trec"
    rerank(Overlap(), QUERIES, CORPUS, first_stage(), depth=5, output=full, show_progress_bar=False)
    lines = full.read_text().splitlines(keepends=True)
    part = tmp_path / "part.trec"
    part.write_text("".join(lines[:12 + 7]) + lines[19][:9])  # one query, 7 lines of the next and half a line
    scorer = Overlap()
    rerank(scorer, QUERIES, CORPUS, first_stage(), depth=5, output=part, resume=True, show_progress_bar=False)
    assert sum(scorer.calls) == 6 * 5 and part.read_text() == full.read_text()


def test_resume_refuses_the_output_of_another_run(tmp_path):
    out = tmp_path / "r.trec"
    out.write_text("q0 Q0 d99 1 1.0 t\n")
    with pytest.raises(ValueError, match=r"r\.trec: query 'q0' holds other candidates than the run's"):
        rerank(Overlap(), QUERIES, CORPUS, first_stage(1), depth=5, output=out, resume=True, show_progress_bar=False)
    out.write_text("zz Q0 d0 1 1.0 t\n")
    with pytest.raises(ValueError, match=r"line 1: query 'zz' is not in the run being reranked"):
        rerank(Overlap(), QUERIES, CORPUS, first_stage(1), depth=5, output=out, resume=True, show_progress_bar=False)


def test_an_existing_output_is_not_overwritten_unless_asked(tmp_path):
    out = tmp_path / "r.trec"
    out.write_text("precious\n")
    with pytest.raises(FileExistsError, match="pass resume=True .* or overwrite=True"):
        rerank(Overlap(), QUERIES, CORPUS, first_stage(), output=out, show_progress_bar=False)
    assert out.read_text() == "precious\n"
    rerank(Overlap(), QUERIES, CORPUS, first_stage(), output=out, overwrite=True, show_progress_bar=False)
    assert len(out.read_text().splitlines()) == 7 * 12


def test_missing_documents_and_queries_are_refused_with_a_few_ids_or_skipped_and_counted(tmp_path):
    corpus = {k: v for k, v in CORPUS.items() if k not in {"d0", "d1", "d2"}}
    queries = {k: v for k, v in QUERIES.items() if k != "q3"} | {"q5": "  "}
    with pytest.raises(ValueError, match=r"2 of its 7 queries have no text.*\('q3', 'q5'\); 3 candidate documents "
                                         r"are not in the corpus \('d0', 'd1', 'd2'\).*skip_missing=True"):
        rerank(Overlap(), queries, corpus, first_stage(), depth=12, output=tmp_path / "r.trec")
    assert not (tmp_path / "r.trec").exists()  # nothing is written for a refused run
    with pytest.warns(UserWarning, match="skipped 2 queries without text and 3 candidates missing from the corpus"):
        out = rerank(Overlap(), queries, corpus, first_stage(), depth=12, skip_missing=True, show_progress_bar=False)
    assert set(out["qid"]) == set(QUERIES) - {"q3", "q5"} and not set(out["docno"]) & {"d0", "d1", "d2"}
    assert out.attrs["skipped"] == {"queries": 2, "documents": 3}


def test_documents_below_depth_need_no_text():
    corpus = {k: v for k, v in CORPUS.items() if k in {f"d{(3 * i + j) % 30}" for i in range(7) for j in range(3)}}
    out = rerank(Overlap(), QUERIES, corpus, first_stage(), depth=3, show_progress_bar=False)
    assert len(out) == 7 * 12


def test_first_stage_order_is_score_descending_whatever_the_rank_column_says():
    run = pd.DataFrame({"qid": ["q0"] * 4, "docno": ["d1", "d2", "d3", "d4"], "rank": [4, 3, 2, 1],
                        "score": [4.0, 3.0, 2.0, 1.0]})
    out = rerank(Overlap(), QUERIES, CORPUS, run, depth=1, show_progress_bar=False)
    assert list(out["docno"]) == ["d1", "d2", "d3", "d4"]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"depth": 0}, ValueError, "depth must be a positive int or None"),
    ({"depth": 2.5}, ValueError, "depth must be a positive int or None"),
    ({"pairs_per_call": 0}, ValueError, "pairs_per_call must be a positive int"),
    ({"pairs_per_call": True}, ValueError, "pairs_per_call must be a positive int"),
    ({"pairs_per_call": 10, "window": 25}, TypeError, "pass pairs_per_call= alone: window= is its old name"),
    ({"convert_to_tensor": True}, TypeError, "rerank\\(\\) sets convert_to_tensor itself"),
    ({"tag": "a b"}, ValueError, "a run tag must be a non-empty str without spaces"),
    ({"resume": True}, ValueError, "resume=True needs an output file"),
])
def test_bad_arguments_are_refused_before_any_scoring(kwargs, error, match):
    scorer = Overlap()
    with pytest.raises(error, match=match):
        rerank(scorer, QUERIES, CORPUS, first_stage(), **kwargs)
    assert scorer.calls == []


def test_a_multi_label_model_or_an_object_without_predict_is_refused(scorer3):
    with pytest.raises(ValueError, match="rerank needs a one-label model .* 3 labels"):
        rerank(scorer3, QUERIES, CORPUS, first_stage())
    with pytest.raises(TypeError, match="scorer must be a Scorer, a model path or have a predict\\(\\) method"):
        rerank(42, QUERIES, CORPUS, first_stage())


def test_a_model_path_reranks_as_its_scorer_does(tiny_dir, scorer):
    by_path = rerank(tiny_dir, QUERIES, CORPUS, first_stage(), depth=3, show_progress_bar=False)
    assert by_path.equals(rerank(scorer, QUERIES, CORPUS, first_stage(), depth=3, show_progress_bar=False))


def test_a_decoder_reranker_shares_each_querys_prefix_across_its_candidates(tmp_path_factory):
    from xenc_lab.zoo.decoders import build_decoder
    from xenc_lab import Scorer

    scorer = Scorer(build_decoder("qwen3-reranker", tmp_path_factory.mktemp("qwen3")), device="cpu")
    run = first_stage(10)
    out = rerank(scorer, QUERIES, CORPUS, run, depth=10, prompt="Judge the document.", show_progress_bar=False)
    counts = scorer.token_counts  # of the last predict call: the whole run fits one call
    assert counts.computed < 0.8 * counts.total, counts
    pairs = [(QUERIES["q2"], "{title} {text}".format(**CORPUS[d])) for d in out[out["qid"] == "q2"]["docno"]]
    alone = scorer.predict(pairs, prompt="Judge the document.")
    assert out[out["qid"] == "q2"]["score"].to_numpy() == pytest.approx(alone, abs=1e-5)
