"""``rerank_variants`` and the precision report: one experiment under several settings, each compared with the
baseline on the same pairs; the baseline compared with itself shows no change."""
import pytest
import torch

from xenc_lab.cli import main
from xenc_lab import bm25
from xenc_lab.ir.pydocs import python_docs_collection
from xenc_lab.ir.variants import rerank_variants
from xenc_lab.report import precision

VARIANTS = {"fp32": {}, "bf16": {"dtype": "bfloat16"}, "short": {"max_length": 24}}


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, tiny_dir):
    paths = python_docs_collection(tmp_path_factory.mktemp("pydocs"), max_chars=200, max_queries=10)
    run = bm25(paths["queries"], paths["corpus"], k=12)
    result = rerank_variants(tiny_dir, paths["queries"], paths["corpus"], run, VARIANTS, depth=8,
                             scorer_kwargs={"device": "cpu"}, show_progress_bar=False)
    return paths, run, result


@pytest.mark.slow
def test_the_baseline_against_itself_shows_no_change_and_the_variants_some(experiment):
    paths, _, result = experiment
    deltas = result.score_deltas()
    assert deltas.loc["fp32", "max |delta|"] == 0 and deltas.loc["fp32", "equal"] == 1
    assert deltas.loc["bf16", "max |delta|"] > 0 and deltas.loc["short", "max |delta|"] > 0
    assert (deltas["pairs"] == deltas.loc["fp32", "pairs"]).all() and deltas.loc["fp32", "pairs"] > 40
    ranks = result.rankings(k=5)
    assert ranks.loc["fp32", "share_identical@5"] == 1 and ranks.loc["fp32", "max_shift@5"] == 0
    metrics = result.metrics(paths["qrels"], ("nDCG@10",), test="randomization", trials=200).set_index("name")
    assert list(metrics.columns[:2]) == ["nDCG@10", "mrt"] and (metrics["mrt"] > 0).all()
    assert metrics["nDCG@10 p-value"].isna()["fp32"] and metrics.loc["bf16", "nDCG@10 p-value"] <= 1
    from xenc_lab import experiment

    want = experiment(result.runs, None, paths["qrels"], ["nDCG@10"], baseline="fp32").set_index("name")
    assert metrics["nDCG@10"].equals(want["nDCG@10"])


def test_score_deltas_are_those_of_the_runs_on_the_same_pairs(experiment):
    _, _, result = experiment
    head = lambda name: result.runs[name][result.runs[name]["rank"] <= 8].set_index(["qid", "docno"])["score"]
    delta = (head("short") - head("fp32")).abs()
    assert result.score_deltas().loc["short", "max |delta|"] == pytest.approx(delta.max())
    assert result.score_deltas().loc["short", "mean |delta|"] == pytest.approx(delta.mean())


def test_variants_figure_has_a_panel_per_question(experiment):
    paths, _, result = experiment
    fig = result.plot(paths["qrels"], ("nDCG@10", "RR@10"), k=5)
    assert [ax.get_title() for ax in fig.axes] == ["score deltas", "top 5 changed vs fp32", "metric change"]


def test_bad_variants_are_refused(tiny_dir, experiment):
    paths, run, _ = experiment
    with pytest.raises(TypeError, match="variants must map names to dicts of Scorer arguments"):
        rerank_variants(tiny_dir, paths["queries"], paths["corpus"], run, {"a": "bfloat16"})
    with pytest.raises(ValueError, match="baseline 'fp16' is not one of the variants"):
        rerank_variants(tiny_dir, paths["queries"], paths["corpus"], run, VARIANTS, baseline="fp16")


def test_precision_report_writes_its_tables_machine_and_figure(tmp_path, tiny_dir):
    variants = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}}
    path = precision(tmp_path, queries=6, depth=5, model=tiny_dir, variants=variants)
    text = path.read_text()
    assert text.startswith("# Precision and rankings") and "Machine: " in text and "torch " in text
    for heading in ("## Scores", "## Rankings against float32", "## Metrics"):
        assert heading in text
    assert "| bfloat16 " in text and (tmp_path / "precision.png").stat().st_size > 10_000
    assert "held-out queries" in text and "p-value (randomization)" in text and "nDCG@10 p-value corrected" in text


def test_report_command_refuses_an_unknown_part(capsys):
    with pytest.raises(SystemExit):
        main(["report", "speed"])
    assert "unknown report part(s) ['speed']" in capsys.readouterr().err


def test_scores_frame_holds_each_variants_rescored_pairs_in_the_baselines_order(experiment):
    _, _, result = experiment
    scores = result.scores()
    assert list(scores.columns) == list(VARIANTS) and not scores.isna().any().any()
    base = result.head("fp32")
    assert list(scores.index) == list(zip(base["qid"], base["docno"]))
    assert scores["fp32"].tolist() == base["score"].tolist()


def test_a_query_has_a_swapped_neighbor_pair_exactly_where_its_order_changed(experiment):
    _, _, result = experiment
    taus = result.taus(k=5)
    assert (taus["fp32"].dropna() == 1).all()
    for name in VARIANTS:
        swaps = result.neighbor_swaps(name)
        assert set(swaps.columns) == {"qid", "docno", "below", "gap", "tied", "swapped"} and (swaps["gap"] >= 0).all()
        changed = swaps.groupby("qid")["swapped"].any()
        assert (changed == (taus[name].reindex(changed.index) < 1)).all(), name
    assert not result.neighbor_swaps("fp32")["swapped"].any()
    assert result.neighbor_swaps("short")["swapped"].any()  # the test can fail: max_length=24 reorders


def test_the_standard_variants_run_int8_where_the_scorers_run_on_the_cpu_only(experiment, tiny_dir, monkeypatch):
    from xenc_lab.ir import variants as module

    assert module.STANDARD_VARIANTS["int8"] == {"quantization": "int8"}
    paths, run, _ = experiment
    monkeypatch.setattr(module, "STANDARD_VARIANTS", {"float32": {}, "int8": {"quantization": "int8"}})
    result = rerank_variants(tiny_dir, paths["queries"], paths["corpus"], run, depth=8,
                             scorer_kwargs={"device": "cpu"}, show_progress_bar=False)
    assert list(result.runs) == ["float32", "int8"] and result.score_deltas().loc["int8", "max |delta|"] > 0
    monkeypatch.setattr(module, "resolve_device", lambda device: torch.device("cuda"))  # as if on a GPU
    result = rerank_variants(tiny_dir, paths["queries"], paths["corpus"], run, depth=8,
                             scorer_kwargs={"device": "cpu"}, show_progress_bar=False)
    assert list(result.runs) == ["float32"]
