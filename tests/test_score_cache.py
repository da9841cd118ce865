"""The persistent score cache: a rerun reads bitwise the scores it stored; every option that changes a score
changes the key; two processes write one file; size and clear; rerank/experiment with cache=."""
from __future__ import annotations

import multiprocessing
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from xenc_lab import Scorer, experiment, rerank
from xenc_lab.cli import main
from xenc_lab.ir.reranking import with_cache
from xenc_lab.score_cache import ScoreCache

PAIRS = [(f"query {i} about rivers", "a document on mountains and rivers " * (1 + i % 9)) for i in range(60)]


@pytest.fixture(scope="module")
def cached(tiny_dir, tmp_path_factory):
    return Scorer(tiny_dir, device="cpu", cache=tmp_path_factory.mktemp("cache") / "scores.sqlite")


def test_a_rerun_is_bitwise_identical_read_from_the_cache_and_equal_to_no_cache(cached, scorer):
    first = cached.predict(PAIRS)
    hits = cached.cache.hits
    again = cached.predict(PAIRS)
    assert cached.cache.hits == hits + len(PAIRS)
    assert np.array_equal(first, again) and first.dtype == again.dtype == np.float32
    assert np.array_equal(first, scorer.predict(PAIRS))  # one pair per row: the engine's own bits
    assert cached.cache.size()["pairs"] >= len(PAIRS)


@pytest.mark.parametrize("options", [
    {"max_length": 20}, {"prompt": "Judge: "}, {"activation_fn": torch.nn.Identity()}, {"apply_softmax": True},
    {"long_documents": "max", "max_length": 24}, {"long_documents": "mean", "max_length": 24, "window_stride": 5},
])
def test_options_that_change_scores_are_keyed_or_applied_after_reading(cached, scorer, options):
    want = scorer.predict(PAIRS[:20], **options)
    first = cached.predict(PAIRS[:20], **options)
    again = cached.predict(PAIRS[:20], **options)
    assert np.array_equal(first, again)
    np.testing.assert_allclose(first, want, rtol=0, atol=1e-6)  # windows: the same logits, rows regrouped


def test_dtype_quantization_and_weights_are_part_of_the_key(tiny_dir, tmp_path, scorer):
    path = tmp_path / "c.sqlite"
    fp32 = Scorer(tiny_dir, device="cpu", cache=path).predict(PAIRS)
    bf16 = Scorer(tiny_dir, device="cpu", dtype="bfloat16", cache=path).predict(PAIRS)
    assert np.array_equal(bf16, Scorer(tiny_dir, device="cpu", dtype="bfloat16").predict(PAIRS))
    assert not np.array_equal(fp32, bf16)
    int8 = Scorer(tiny_dir, device="cpu", quantization="int8", cache=path).predict(PAIRS)
    assert np.array_equal(int8, Scorer(tiny_dir, device="cpu", quantization="int8").predict(PAIRS))
    assert not np.array_equal(fp32, int8)
    other = tmp_path / "retrained"
    shutil.copytree(tiny_dir, other)
    weights = load_file(other / "model.safetensors")
    name = next(k for k in weights if k.startswith("classifier") and k.endswith("bias"))
    weights[name] = weights[name] + 0.5  # same shapes and header layout, other values
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    changed = Scorer(other, device="cpu", cache=path).predict(PAIRS)
    assert np.array_equal(changed, Scorer(other, device="cpu").predict(PAIRS)) and not np.array_equal(changed, fp32)


def _writer(path, start, n):
    cache = ScoreCache(path)
    for i in range(start, start + n):  # many small transactions, interleaving with the other process's
        cache.put({f"key{i}".encode(): np.float32([i]).tobytes()})


def test_two_processes_write_one_cache_file(tmp_path):
    path = tmp_path / "shared.sqlite"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, start, 300)) for start in (0, 150)]  # 150 keys overlap
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    cache = ScoreCache(path)
    assert cache.size()["pairs"] == 450
    got = cache.get([f"key{i}".encode() for i in range(450)])
    assert all(np.frombuffer(got[f"key{i}".encode()], np.float32)[0] == i for i in range(450))


def test_size_clear_and_the_cache_command(tmp_path, tiny_dir, capsys):
    path = tmp_path / "c.sqlite"
    scorer = Scorer(tiny_dir, device="cpu", cache=path)
    scorer.predict(PAIRS[:10])
    assert scorer.cache.size()["pairs"] == 10 and scorer.cache.size()["bytes"] > 0
    assert main(["cache", "info", str(path)]) == 0 and "10 pairs" in capsys.readouterr().out
    assert main(["cache", "clear", str(path)]) == 0 and "cleared" in capsys.readouterr().out
    assert scorer.cache.size()["pairs"] == 0
    with pytest.raises(SystemExit):
        main(["cache", "info", str(tmp_path / "none.sqlite")])
    assert "no score cache at" in capsys.readouterr().err


def test_rerank_and_experiment_fill_and_reuse_a_cache_leaving_the_scorer_as_it_was(scorer, tmp_path):
    first = __import__("pandas").DataFrame({"qid": ["q1"] * 6 + ["q2"] * 6, "docno": [f"d{i}" for i in range(12)],
                                            "score": np.arange(12, 0, -1, dtype=float)})
    queries, corpus = {"q1": "rivers", "q2": "mountains"}, {f"d{i}": f"document {i} " * i for i in range(12)}
    path = tmp_path / "c.sqlite"
    a = rerank(scorer, queries, corpus, first, depth=4, cache=path, show_progress_bar=False)
    assert scorer.cache is None and ScoreCache(path).size()["pairs"] == 8
    b = rerank(scorer, queries, corpus, first, depth=4, cache=path, show_progress_bar=False)
    assert a.equals(b)
    qrels = {"qid": ["q1", "q2"], "docno": ["d3", "d8"], "label": [1, 1]}
    table = experiment({"bm25": first, "ce": scorer}, queries, __import__("pandas").DataFrame(qrels), ["RR@10"],
                       corpus=corpus, first_stage="bm25", depth=4, cache=path, show_progress_bar=False)
    assert ScoreCache(path).size()["pairs"] == 8 and table.loc[1, "RR@10"] >= 0


def test_bad_caches_are_refused_before_loading(tiny_dir, tmp_path, oracle):
    with pytest.raises(TypeError, match="cache must be a path"):
        Scorer(tiny_dir, device="cpu", cache=3)
    with pytest.raises(ValueError, match="cache must be a file path, got the directory"):
        Scorer(tiny_dir, device="cpu", cache=tmp_path)
    with pytest.raises(TypeError, match="a score cache needs a xenc_lab Scorer"):
        with_cache(oracle, tmp_path / "c.sqlite")
