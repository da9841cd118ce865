"""The experiment files are read as their formats say, and a bad line is refused with its file and line number."""
import gzip
import json

import pandas as pd
import pytest

from xenc_lab.ir.files import FormatError, read_corpus, read_qrels, read_queries, read_run, write_run


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_trec_run_is_read_in_file_order_with_its_ranks_and_scores(tmp_path):
    run = read_run(write(tmp_path / "r.trec", "q1 Q0 d1 1 2.5 bm25\nq1 Q0 d2 2 1.5 bm25\n\nq2 Q0 d1 1 -3e-1 bm25\n"))
    assert run.to_dict("list") == {"qid": ["q1", "q1", "q2"], "docno": ["d1", "d2", "d1"], "rank": [1, 2, 1],
                                   "score": [2.5, 1.5, -0.3]}


def test_gzipped_run_reads_like_the_plain_file(tmp_path):
    text = "q1 Q0 d1 1 2.5 bm25\nq1 Q0 d2 2 1.5 bm25\n"
    with gzip.open(tmp_path / "r.trec.gz", "wt") as f:
        f.write(text)
    assert read_run(tmp_path / "r.trec.gz").equals(read_run(write(tmp_path / "r.trec", text)))


@pytest.mark.parametrize("line", ["q1 Q0 d1 1 2.5", "q1 Q0 d1 one 2.5 t", "q1 Q0 d1 1 high t", "q1 d1 1 2.5 t x y"])
def test_malformed_run_line_is_refused_with_file_and_line(tmp_path, line):
    path = write(tmp_path / "bad.trec", f"q1 Q0 d0 1 3.0 t\n{line}\n")
    with pytest.raises(FormatError, match=r"bad\.trec, line 2: expected 6 fields 'qid Q0 docno rank score tag'"):
        read_run(path)


def test_a_document_twice_in_a_query_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"1 \(qid, docno\) pairs appear more than once, e.g. \['q1/d1'\]"):
        read_run(write(tmp_path / "r.trec", "q1 Q0 d1 1 2 t\nq1 Q0 d1 2 1 t\n"))


def test_run_frame_takes_the_fields_other_names_and_numbers_ranks_when_absent():
    run = read_run(pd.DataFrame({"query_id": [1, 1, 2], "doc_id": ["a", "b", "a"], "score": [3, 2, 1]}))
    assert run.to_dict("list") == {"qid": ["1", "1", "2"], "docno": ["a", "b", "a"], "rank": [1, 2, 1],
                                   "score": [3.0, 2.0, 1.0]}
    with pytest.raises(ValueError, match=r"a run frame needs a column 'score'.*it has \['qid', 'docno'\]"):
        read_run(pd.DataFrame({"qid": ["1"], "docno": ["a"]}))


def test_write_run_then_read_run_round_trips_exact_scores(tmp_path):
    run = pd.DataFrame({"qid": ["q", "q"], "docno": ["a", "b"], "rank": [1, 2], "score": [0.1 + 0.2, 1 / 3]})
    write_run(run, tmp_path / "r.trec", tag="mine")
    assert read_run(tmp_path / "r.trec").equals(run)
    assert (tmp_path / "r.trec").read_text().splitlines()[0] == f"q Q0 a 1 {0.1 + 0.2!r} mine"
    with pytest.raises(ValueError, match="a run tag must be a non-empty str without spaces"):
        write_run(run, tmp_path / "r2.trec", tag="two words")


def test_trec_and_beir_qrels_read_alike(tmp_path):
    trec = read_qrels(write(tmp_path / "qrels.txt", "q1 0 d1 1\nq1 0 d2 0\nq2 0 d3 2\n"))
    beir = read_qrels(write(tmp_path / "test.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t0\nq2\td3\t2\n"))
    assert trec.equals(beir)
    assert trec.to_dict("list") == {"qid": ["q1", "q1", "q2"], "docno": ["d1", "d2", "d3"], "relevance": [1, 0, 2]}


@pytest.mark.parametrize("line", ["q1 0 d1", "q1 0 d1 relevant", "q1 0 d1 1 extra"])
def test_malformed_qrels_line_is_refused_with_file_and_line(tmp_path, line):
    with pytest.raises(FormatError, match=r"qrels\.txt, line 2: expected 'qid 0 docno relevance'"):
        read_qrels(write(tmp_path / "qrels.txt", f"q0 0 d0 1\n{line}\n"))


def test_beir_corpus_joins_title_and_text_with_a_space_where_a_title_exists(tmp_path):
    rows = [{"_id": "d1", "title": "Everest", "text": "is high."}, {"_id": 2, "title": "", "text": "no title"},
            {"_id": "d3", "text": "no title field"}]
    path = write(tmp_path / "corpus.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    assert read_corpus(path) == {"d1": "Everest is high.", "2": "no title", "d3": "no title field"}
    assert read_corpus(path, title_sep=None)["d1"] == "is high."
    assert read_corpus(path, title_sep=". ")["d1"] == "Everest. is high."
    assert read_corpus(path, ids={"d3"}) == {"d3": "no title field"}  # only a run's candidates are held


def test_ms_marco_tsvs_keep_tabs_and_spaces_inside_text(tmp_path):
    corpus = read_corpus(write(tmp_path / "collection.tsv", "0\tThe passage,\twith a tab.\n7\t  spaced  \n"))
    assert corpus == {"0": "The passage,\twith a tab.", "7": "  spaced  "}
    assert read_queries(write(tmp_path / "queries.tsv", "101\twhat is a tsv\n")) == {"101": "what is a tsv"}


@pytest.mark.parametrize("line, expected", [
    ('{"_id": "d2", "text": ', 'a JSON object with "_id" and a str "text"'),
    ('{"text": "no id"}', 'a JSON object with "_id"'),
    ('["d2", "text"]', 'a JSON object with "_id"'),
])
def test_malformed_jsonl_line_is_refused_with_file_and_line(tmp_path, line, expected):
    path = write(tmp_path / "corpus.jsonl", '{"_id": "d1", "text": "fine"}\n' + line + "\n")
    with pytest.raises(FormatError, match=rf"corpus\.jsonl, line 2: expected {expected}"):
        read_corpus(path)


def test_tsv_line_without_a_tab_is_refused_with_file_and_line(tmp_path):
    with pytest.raises(FormatError, match=r"queries\.tsv, line 1: expected 'id<TAB>text'"):
        read_queries(write(tmp_path / "queries.tsv", "101 what is a tsv\n"))


def test_frames_and_dicts_are_read_as_files_are():
    frame = pd.DataFrame({"_id": ["d1", "d2"], "title": ["T", None], "text": ["x", "y"]})
    assert read_corpus(frame) == {"d1": "T x", "d2": "y"}
    assert read_corpus({"d1": {"title": "T", "text": "x"}, "d2": "y"}) == {"d1": "T x", "d2": "y"}
    assert read_queries(pd.DataFrame({"qid": [1], "text": ["q"]})) == {"1": "q"}
    with pytest.raises(FileNotFoundError, match="no such file: .*nowhere.jsonl"):
        read_queries("nowhere.jsonl")
