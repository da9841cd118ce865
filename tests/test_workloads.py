"""xenc_lab.bench.workloads.make_pairs: deterministic, shaped as documented, and strict about its arguments."""
from __future__ import annotations

import pytest

from xenc_lab.bench.workloads import WORKLOADS, load_pairs, make_pairs

WORDS = {"short": ((5, 15), (50, 100)), "long": ((5, 15), (470, 560)), "mixed": ((4, 20), (10, 600))}


@pytest.mark.parametrize("kind", WORKLOADS)
def test_make_pairs_is_deterministic_for_the_same_arguments(kind):
    assert make_pairs(kind, 25, seed=3) == make_pairs(kind, 25, seed=3)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_make_pairs_differs_across_seeds_and_kinds(kind):
    base = make_pairs(kind, 10, seed=0)
    assert make_pairs(kind, 10, seed=1) != base
    assert all(make_pairs(other, 10, seed=0) != base for other in WORKLOADS if other != kind)


def test_make_pairs_of_n_is_a_prefix_of_make_pairs_of_more():
    assert make_pairs("mixed", 50, seed=7)[:20] == make_pairs("mixed", 20, seed=7)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_make_pairs_gives_n_str_pairs_with_word_counts_in_the_kinds_ranges(kind):
    pairs = make_pairs(kind, 60, seed=11)
    assert len(pairs) == 60
    (q_lo, q_hi), (d_lo, d_hi) = WORDS[kind]
    for query, passage in pairs:
        assert isinstance(query, str) and isinstance(passage, str)
        assert query.endswith("?") and passage.endswith(".")
        assert q_lo <= len(query.split()) <= q_hi
        assert d_lo <= len(passage.split()) <= d_hi


def test_make_pairs_of_zero_is_empty():
    assert make_pairs("short", 0) == []


@pytest.mark.parametrize("kind", ["medium", "", None, "SHORT"])
def test_make_pairs_rejects_an_unknown_kind(kind):
    with pytest.raises(ValueError, match="kind"):
        make_pairs(kind, 3)


@pytest.mark.parametrize("n", [-1, 2.0, "3", None])
def test_make_pairs_rejects_n_that_is_not_a_non_negative_int(n):
    with pytest.raises(ValueError, match="n must"):
        make_pairs("short", n)


def test_make_pairs_rejects_a_bool_count():
    with pytest.raises(ValueError, match="n must"):
        make_pairs("short", True)


def test_load_pairs_reads_jsonl_objects_and_lists(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"query": "q1", "passage": "p1"}\n\n["q2", "p2"]\n{"text_1": "q3", "document": "p\\t3"}\n'
        '{"sentence1": "q4", "sentence2": "p4", "label": 1}\n'
    )
    assert load_pairs(path) == [("q1", "p1"), ("q2", "p2"), ("q3", "p\t3"), ("q4", "p4")]


def test_load_pairs_reads_tsv_with_or_without_a_header(tmp_path):
    headed = tmp_path / "headed.tsv"
    headed.write_text("qid\tquery\tpassage\n1\twhat is x?\tx is y.\n2\twho\tcomma, text\n")
    assert load_pairs(headed) == [("what is x?", "x is y."), ("who", "comma, text")]
    bare = tmp_path / "bare.csv"
    bare.write_text('what is x?,"x, y and z."\n')
    assert load_pairs(bare) == [("what is x?", "x, y and z.")]


def test_load_pairs_reads_rerank_lists_triplets_and_ms_marco_top1000_rows(tmp_path):
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text(
        '{"query": "q1", "documents": ["d1", "d2", "d3"]}\n'  # one query, many documents
        '{"anchor": "q2", "positive": "p2", "negative": "n2"}\n'  # sentence-transformers' triplets
        '{"query": "q3", "positive": "p3", "negatives": ["n3", "m3"]}\n'
        '{"question": "q4", "answer": "a4"}\n'
    )
    assert load_pairs(jsonl) == [("q1", "d1"), ("q1", "d2"), ("q1", "d3"), ("q2", "p2"), ("q2", "n2"), ("q3", "p3"),
                                 ("q3", "n3"), ("q3", "m3"), ("q4", "a4")]
    headed = tmp_path / "triplets.csv"
    headed.write_text("query,positive,negative\nq,p,n\n")
    assert load_pairs(headed) == [("q", "p"), ("q", "n")]
    top1000 = tmp_path / "top1000.dev.tsv"  # qid, pid, query, passage, no header
    top1000.write_text("188714\t1000052\tfoods to lower blood sugar\tWatch portion sizes.\n2\t7\tq\tp\n")
    assert load_pairs(top1000) == [("foods to lower blood sugar", "Watch portion sizes."), ("q", "p")]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("a.txt", "q\tp\n", "expected a .jsonl, .tsv or .csv file"),
        ("b.jsonl", '{"query": "q"}\n', "b.jsonl:1: expected a query field"),
        ("c.jsonl", '{"query": "q", "passage": "p"}\nnot json\n', "c.jsonl:2: not JSON"),
        ("d.jsonl", '["q", 3]\n', "d.jsonl:1: query and passage must be strings"),
        ("e.tsv", "a\tb\tc\n", "e.tsv:1: expected two columns"),
        ("f.tsv", "query\tpassage\nq\n", "f.tsv:2: expected 2 fields"),
        ("g.jsonl", "\n", "no pairs found"),
        ("h.jsonl", '{"query": "q", "documents": ["a", 3]}\n', "h.jsonl:1: query and passage must be strings .* got int"),
        ("i.jsonl", '{"query": null, "passage": "p"}\n', "i.jsonl:1: query and passage must be strings .* got NoneType"),
        ("j.tsv", "q\tx\tq\tp\n", "j.tsv:1: expected two columns .* four .* got 4 columns"),
    ],
)
def test_load_pairs_names_the_file_and_line_of_bad_input(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_pairs(path)


def test_load_pairs_refuses_a_missing_or_undecodable_file_naming_it_and_reads_document_long_fields(tmp_path):
    with pytest.raises(ValueError, match=r"missing.jsonl: \[Errno 2\]"):
        load_pairs(tmp_path / "missing.jsonl")
    (tmp_path / "latin1.csv").write_bytes("café,x\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.csv: 'utf-8' codec can't decode"):
        load_pairs(tmp_path / "latin1.csv")
    (tmp_path / "long.tsv").write_text("q\t" + "word " * 50_000 + "\n")  # 250,000 characters: past csv's default limit
    assert len(load_pairs(tmp_path / "long.tsv")[0][1]) == 250_000
    import csv

    assert csv.field_size_limit() == 131072  # csv's own limit is as it was


def test_load_pairs_reads_tsv_quotes_as_text_and_skips_a_byte_order_mark(tmp_path):
    tsv = tmp_path / "quotes.tsv"
    tsv.write_text('what is "x"\t"quoted" passage\nan "unmatched quote\tsecond\nthird\tthe "end\n', encoding="utf-8")
    assert load_pairs(tsv) == [('what is "x"', '"quoted" passage'), ('an "unmatched quote', "second"), ("third", 'the "end')]
    csv_file = tmp_path / "bom.csv"
    csv_file.write_text('\ufeffquery,passage\n"a, b",c\n', encoding="utf-8")
    assert load_pairs(csv_file) == [("a, b", "c")]
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_text('\ufeff{"query": "q", "passage": "p"}\n', encoding="utf-8")
    assert load_pairs(jsonl) == [("q", "p")]
