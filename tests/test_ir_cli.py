"""``xenc-lab rerank`` on a BEIR folder: writes the reranked run, evaluates both runs, resumes, and refuses bad
input with a message instead of a traceback."""
import json

import pytest

from xenc_lab.cli import main
from xenc_lab.ir import read_run
from xenc_lab import bm25
from xenc_lab.ir.pydocs import python_docs_collection


@pytest.fixture(scope="module")
def beir(tmp_path_factory):
    root = tmp_path_factory.mktemp("beir")
    paths = python_docs_collection(root, max_chars=200, max_queries=12)
    run = bm25(paths["queries"], paths["corpus"], k=15)
    with open(root / "bm25.trec", "w") as f:
        for row in run.itertuples():
            f.write(f"{row.qid} Q0 {row.docno} {row.rank} {row.score!r} bm25\n")
    return root


def test_the_docs_collection_judges_each_query_by_its_functions_docstring(beir):
    queries = [json.loads(line) for line in open(beir / "queries.jsonl")]
    corpus = {json.loads(line)["_id"] for line in open(beir / "corpus.jsonl")}
    qrels = [line.split("\t") for line in open(beir / "qrels" / "test.tsv")][1:]
    assert len(queries) == len(qrels) == 12 and len(corpus) > 300
    assert all(docno in corpus and q["_id"] == qid for q, (qid, docno, rel) in zip(queries, qrels))


def test_rerank_command_writes_the_run_and_prints_both_runs_metrics(beir, tiny_dir, capsys):
    out = beir / "reranked.trec"
    argv = ["rerank", "--model", str(tiny_dir), "--beir", str(beir), "--run", str(beir / "bm25.trec"), "--depth", "10",
            "--output", str(out), "--measures", "nDCG@10", "RR@10", "--device", "cpu"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    lines = len((beir / "bm25.trec").read_text().splitlines())
    assert f"wrote {out}: 12 queries, {lines} lines" in printed
    for name in ("| first stage", "| reranked", "nDCG@10 +", "nDCG@10 -", "nDCG@10 p-value", "RR@10 p-value"):
        assert name in printed
    ranked = read_run(out)
    first = read_run(beir / "bm25.trec")
    assert len(ranked) == len(first) and set(ranked["qid"]) == set(first["qid"])
    with pytest.raises(SystemExit) as exit_:  # an existing output is kept
        main(argv)
    assert exit_.value.code == 2 and "--resume" in capsys.readouterr().err
    assert main(argv + ["--resume"]) == 0
    assert read_run(out).equals(ranked)


def test_rerank_command_refuses_a_malformed_run_line_naming_file_and_line(beir, tiny_dir, tmp_path, capsys):
    bad = tmp_path / "bad.trec"
    bad.write_text("q0 Q0 doc 1 2.0 t\nq0 Q0 doc2 1\n")
    with pytest.raises(SystemExit) as exit_:
        main(["rerank", "--model", str(tiny_dir), "--beir", str(beir), "--run", str(bad), "--output",
              str(tmp_path / "o.trec"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "bad.trec, line 2: expected 6 fields" in err


def test_rerank_command_needs_queries_and_corpus_or_a_beir_folder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["rerank", "--model", "m", "--run", "r.trec", "--output", str(tmp_path / "o.trec")])
    assert "give --queries and --corpus, or --beir DIR" in capsys.readouterr().err


def test_rerank_command_needs_a_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["rerank", "--beir", str(tmp_path), "--run", "r.trec", "--output", str(tmp_path / "o.trec")])
    assert "the following arguments are required: --model" in capsys.readouterr().err


def test_rerank_command_scores_long_documents_in_windows_through_a_cache(beir, tiny_dir, tmp_path, capsys):
    from xenc_lab import Scorer, rerank

    out, cache = tmp_path / "long.trec", tmp_path / "scores.sqlite"
    argv = ["rerank", "--model", str(tiny_dir), "--beir", str(beir), "--run", str(beir / "bm25.trec"), "--depth", "5",
            "--output", str(out), "--device", "cpu", "--long-documents", "max", "--window-stride", "8",
            "--max-length", "32", "--cache", str(cache)]
    assert main(argv) == 0
    scorer = Scorer(tiny_dir, device="cpu", long_documents="max", window_stride=8)
    want = rerank(scorer, beir / "queries.jsonl", beir / "corpus.jsonl", beir / "bm25.trec", depth=5, max_length=32,
                  show_progress_bar=False)
    got = read_run(out)
    assert got["docno"].tolist() == want["docno"].tolist()
    assert got["score"].to_numpy() == pytest.approx(want["score"].to_numpy(), abs=1e-6)
    assert main(["cache", "info", str(cache)]) == 0 and "60 pairs" in capsys.readouterr().out


def test_rerank_command_passes_quantization_to_the_scorer_and_refuses_a_bad_one(beir, tiny_dir, tmp_path, capsys):
    from xenc_lab import Scorer, rerank

    out = tmp_path / "int8.trec"
    argv = ["rerank", "--model", str(tiny_dir), "--beir", str(beir), "--run", str(beir / "bm25.trec"), "--depth", "5",
            "--output", str(out), "--device", "cpu"]
    assert main(argv + ["--quantization", "int8"]) == 0
    assert "quantization='int8'" in capsys.readouterr().out
    want = rerank(Scorer(tiny_dir, device="cpu", quantization="int8"), beir / "queries.jsonl", beir / "corpus.jsonl",
                  read_run(beir / "bm25.trec"), depth=5, show_progress_bar=False)
    got = read_run(out)
    assert got[["qid", "docno"]].equals(want[["qid", "docno"]].reset_index(drop=True))
    assert (got["score"] - want["score"].to_numpy()).abs().max() < 1e-4  # the TREC file's printed digits
    with pytest.raises(SystemExit) as exit_:
        main(argv[:-4] + ["--output", str(tmp_path / "o.trec"), "--quantization", "int4"])
    assert exit_.value.code == 2 and "--quantization: invalid choice: 'int4'" in capsys.readouterr().err
