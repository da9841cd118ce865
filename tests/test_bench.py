"""The benchmark harness: its arithmetic, its report, and one tiny end-to-end run through the CLI."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertConfig

from xenc_lab import bench
from xenc_lab.bench.workloads import make_pairs
from xenc_lab.cli import main
from xenc_lab.bench.report import TABLE_COLUMNS
from xenc_lab.cpu.gemm import onednn_bf16
from xenc_lab.cpu.kernels import widened_gemm_available


def read_table(text: str) -> list[dict]:
    """The rows of a throughput report's table, as {column: cell}."""
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| workload |")]
    return [dict(zip(TABLE_COLUMNS, (c.strip() for c in line.strip("|").split("|")))) for line in lines]


def assert_table_is_rows(text: str, rows) -> None:
    """The report's table holds ``rows``, in order, each number at its printed precision."""
    table = read_table(text)
    assert len(table) == len(rows)
    for cells, r in zip(table, rows):
        assert (cells["workload"], cells["dtype"], cells["engine"], int(cells["pairs"])) == (
            r.workload, r.dtype, r.engine, r.pairs)
        assert float(cells["mean tokens"]) == pytest.approx(r.mean_tokens, abs=0.5)
        assert float(cells["pairs/s"]) == pytest.approx(r.pairs_per_s, abs=0.05)
        assert float(cells["ratio"].removesuffix("x")) == pytest.approx(r.ratio, abs=0.005)
        assert float(cells["GFLOP/s"]) == pytest.approx(r.gflops, abs=0.5)
        assert float(cells["ceiling"].removesuffix("%")) == pytest.approx(100 * r.ceiling_share, abs=0.5)
        assert float(cells["max abs delta"]) == pytest.approx(r.max_abs_delta, rel=0.05, abs=1e-12)
        if r.error_ratio:
            mean, most = cells["error vs ST's own"].removesuffix(")").split(" (max ")
            assert (float(mean), float(most)) == (pytest.approx(r.error_ratio, abs=0.005),
                                                  pytest.approx(r.max_error_ratio, abs=0.005))


def test_model_gflop_counts_non_embedding_matmuls_and_attention():
    config = BertConfig(hidden_size=384, num_hidden_layers=6, intermediate_size=1536)
    per_pair = bench.model_gflop(config, np.array([128]))
    weights = 6 * (4 * 384**2 + 2 * 384 * 1536)  # 10.6M, the MiniLM-L6 figure
    assert abs(per_pair - (2 * weights * 128 + 4 * 6 * 384 * 128**2) / 1e9) < 1e-12
    assert 2.8 < per_pair < 3.0  # the field's ~2.87 GFLOP per 128-token MiniLM-L6 pair


def _deberta_v3(**size):
    from transformers import DebertaV2Config

    return DebertaV2Config(relative_attention=True, position_buckets=16, max_relative_positions=-1,
                           pos_att_type=["p2c", "c2p"], position_biased_input=False, share_att_key=True,
                           norm_rel_ebd="layer_norm", type_vocab_size=0, **size)


def _family_configs():
    from transformers import DistilBertConfig, ElectraConfig, ModernBertConfig, RobertaConfig

    size = {"vocab_size": 300, "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 96, "max_position_embeddings": 128, "num_labels": 1}
    return {
        "bert": BertConfig(**size),
        "roberta": RobertaConfig(**size),
        "distilbert": DistilBertConfig(vocab_size=300, n_layers=2, dim=64, n_heads=4, hidden_dim=96, num_labels=1),
        "electra": ElectraConfig(embedding_size=32, **size),
        "modernbert": ModernBertConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
                                       global_attn_every_n_layers=1, **size),
        "deberta-v3": _deberta_v3(**size),
    }


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "electra", "modernbert", "deberta-v3"])
def test_model_gflop_is_the_math_transformers_own_model_does_per_family(family):
    """Counted against torch's FLOP counter on transformers' model (the oracle's), 8 pairs of 40 tokens: the
    classification head and pooler (per pair) and DeBERTa's once-a-batch projection of its relative embeddings are
    the difference, which is left out by design."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForSequenceClassification

    config = _family_configs()[family]
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(5, 250, (8, 40))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    counted = counter.get_total_flops() / 1e9
    if family == "deberta-v3":  # pos_key and pos_query: 2 x (2 x 16 relative embeddings) x d^2 per layer
        counted -= 2 * 2 * (2 * 2 * 16) * 64 * 64 / 1e9
    head = 8 * 2 * (64 * 64 + 64) / 1e9  # a pooler or dense layer and the classifier, once a pair
    assert counted - head * 1.5 <= bench.model_gflop(config, np.full(8, 40)) <= counted, family


def test_the_gemm_ceiling_is_measured_at_modernberts_geglu_width():
    from transformers import ModernBertConfig

    config = ModernBertConfig(hidden_size=64, intermediate_size=96)
    assert bench.projection_shapes(config) == [(64, 192), (64, 64), (64, 192), (96, 64)]
    assert bench.projection_shapes(BertConfig(hidden_size=64, intermediate_size=96))[2:] == [(64, 96), (96, 64)]


def test_report_has_a_row_per_measurement_and_a_figure(tmp_path):
    import matplotlib.pyplot as plt

    figures = plt.get_fignums()
    rows = [
        bench.BenchRow("short", "float32", engine, 8, 90.0, rate, rate / 10.0, 100.0, 0.5, delta, 0.8)
        for engine, rate, delta in (("sentence-transformers", 10.0, 0.0), ("xenc_lab", 14.0, 3e-6))
    ]
    path = bench.write_report(rows, tmp_path, "xenc-lab bench")
    assert_table_is_rows(path.read_text(), rows)
    assert (tmp_path / "throughput.png").stat().st_size > 1000
    assert plt.get_fignums() == figures  # drawn without pyplot: no figure left open in a notebook's session
    facts = bench.report_facts(rows)  # float32 only: no error column, no bf16 note; nothing drifted or compiled
    assert (facts.errors, facts.bf16_gemm, facts.drift, facts.compiled, facts.attention) == (False, "", {}, {}, {})
    assert facts.ceilings == {"float32": 200.0}  # 100 GFLOP/s at 50% of the GEMM rate
    record = json.loads((tmp_path / "throughput.json").read_text())
    assert record["command"] == "xenc-lab bench" and record["machine"] == bench.machine()
    assert [bench.BenchRow(**r) for r in record["rows"]] == rows


def test_plot_draws_a_bar_per_workload_and_mode_at_its_pairs_per_s():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        bench.BenchRow(workload, dtype, engine, 8, 90.0, rate, 1.0, 100.0, 0.5, 0.0, 0.8)
        for workload, dtype, engine, rate in (
            ("short", "float32", "sentence-transformers", 10.0), ("short", "float32", "xenc_lab", 14.0),
            ("mixed", "float32", "sentence-transformers", 5.0), ("mixed", "float32", "xenc_lab", 9.0),
            ("short", "bfloat16", "xenc_lab", 30.0),  # no mixed bf16 row: a zero-height bar
        )
    ]
    fig, ax = plt.subplots()
    assert bench.plot(rows, ax=ax) is fig
    bars = {text.get_text(): [b.get_height() for b in c] for c, text in zip(ax.containers, ax.get_legend().get_texts())}
    assert bars == {"xenc_lab bfloat16": [30.0, 0], "sentence-transformers float32": [10.0, 5.0],
                    "xenc_lab float32": [14.0, 9.0]}
    assert [t.get_text() for t in ax.get_xticklabels()] == ["short", "mixed"]
    plt.close(fig)
    with pytest.raises(ValueError, match="no benchmark rows"):
        bench.plot([])


def test_report_says_how_bf16_gemms_ran_here(tmp_path):
    rows = [
        bench.BenchRow("short", dtype, "xenc_lab", 8, 90.0, 10.0, 1.4, gflops, 0.9, 1e-2, 0.8, native_bf16_gflops=native)
        for dtype, gflops, native in (("float32", 200.0, 0.0), ("bfloat16", 180.0, 130.0))
    ]
    facts = bench.report_facts(rows)  # fp32 GEMMs on the bf16 values, beside oneDNN's native rate
    assert facts.ceilings == {"float32": pytest.approx(200 / 0.9), "bfloat16": pytest.approx(180 / 0.9)}
    assert (facts.bf16_gemm, facts.native_bf16_gflops, facts.own_fp32_gemm) == ("fp32", 130.0, widened_gemm_available())
    rows[1].bf16_gemm, rows[1].fp32_bf16_gflops = "fp16", 290.0  # where the fp16 GEMM ran
    facts = bench.report_facts(rows)
    assert (facts.bf16_gemm, facts.native_bf16_gflops, facts.fp32_bf16_gflops, facts.own_fp32_gemm) == (
        "fp16", 130.0, 290.0, False)
    rows[1].bf16_gemm, rows[1].native_bf16_gflops, rows[1].fp32_bf16_gflops = "native", 0.0, 0.0  # AMX, AMD cores
    assert bench.report_facts(rows).bf16_gemm == "native"
    assert bench.report_facts(rows[:1]).bf16_gemm == ""  # no bf16 row, no note


def test_the_report_states_the_figures_of_its_facts(tmp_path):
    """Each fact's figure is in the text, at the precision the report gives it."""
    rows = [bench.BenchRow("long", "bfloat16", "xenc_lab", 8, 500.0, 5.0, 2.0, 180.0, 0.9, 5e-2, 1.6,
                           native_bf16_gflops=130.0, bf16_gemm="fp16", fp32_bf16_gflops=290.0, attention_path="tiles",
                           kernel_attention_gflops=190.4, sdpa_attention_gflops=45.2, tiles_attention_gflops=420.7,
                           oracle_drift=1.4e-4, compiled_graphs=3, batch_shapes=12, compile_seconds=13.2)]
    facts = bench.report_facts(rows)
    text = bench.write_report(rows, tmp_path, "xenc-lab bench").read_text()
    figures = [f"{facts.ceilings['bfloat16']:.0f}", f"{facts.native_bf16_gflops:.0f}", f"{facts.fp32_bf16_gflops:.0f}",
               *(f"{rate:.0f}" for path, rate in facts.attention[("long", "bfloat16")].items() if path != "ran"),
               f"{facts.drift[('long', 'bfloat16')]:.1e}", *(f"{n:.0f}" for n in facts.compiled["bfloat16"])]
    assert figures == ["200", "130", "290", "190", "421", "45", "1.4e-04", "3", "13", "12"]
    assert [f for f in figures if f not in text] == []


def test_error_ratios_are_ours_over_sentence_transformers_own_at_the_same_dtype(tmp_path):
    """The bf16 goal's measure: xenc_lab's error against sentence-transformers fp32 over sentence-transformers' own at
    that dtype, on the same pairs (mean and max of the abs deltas); float32 rows have none."""
    def row(dtype, engine, mean, most, workload="short"):
        return bench.BenchRow(workload, dtype, engine, 8, 90.0, 10.0, 1.0, 100.0, 0.5, most, 0.8, mean_abs_delta=mean)

    rows = [row("float32", "sentence-transformers", 0.0, 0.0), row("float32", "xenc_lab", 1e-6, 5e-6),
            row("bfloat16", "sentence-transformers", 0.02, 0.07), row("bfloat16", "xenc_lab", 0.018, 0.056),
            row("bfloat16", "xenc_lab compiled", 0.03, 0.07), row("bfloat16", "sentence-transformers", 0.04, 0.1, "long"),
            row("bfloat16", "xenc_lab", 0.02, 0.12, "long")]
    bench.set_error_ratios(rows)
    assert [(r.error_ratio, r.max_error_ratio) for r in rows[:3]] == [(0.0, 0.0)] * 3
    assert [(round(r.error_ratio, 6), round(r.max_error_ratio, 6)) for r in rows[3:]] == [
        (0.9, 0.8), (1.5, 1.0), (0.0, 0.0), (0.5, 1.2)]
    assert bench.report_facts(rows).errors  # the table has the column
    text = bench.write_report(rows, tmp_path, "xenc-lab bench").read_text()
    assert_table_is_rows(text, rows)
    assert [cells["error vs ST's own"] for cells in read_table(text)][:2] == ["", ""]  # float32: no error ratio


def test_report_gives_both_attention_paths_rates_and_the_one_taken(tmp_path):
    row = bench.BenchRow("long", "bfloat16", "xenc_lab", 8, 500.0, 5.0, 2.0, 100.0, 0.5, 5e-2, 1.6,
                         attention_path="kernel", kernel_attention_gflops=190.4, sdpa_attention_gflops=45.2)
    assert bench.report_facts([row]).attention == {("long", "bfloat16"): {"kernel": 190.4, "sdpa": 45.2, "ran": "kernel"}}
    row.tiles_attention_gflops, row.attention_path = 420.7, "tiles"  # where the tile path runs
    assert bench.report_facts([row]).attention == {
        ("long", "bfloat16"): {"kernel": 190.4, "tiles": 420.7, "sdpa": 45.2, "ran": "tiles"}}
    row.attention_path = ""  # sentence-transformers' rows, and runs that did not measure attention
    assert bench.report_facts([row]).attention == {}


def test_gemm_rate_takes_each_bf16_route_asked_for_at_its_flops_over_the_best_repeat(monkeypatch):
    """On a clock that reads 0.5 s, then 0.25 s, for the two timed repeats: the rate is the projections' FLOPs over
    the faster one, and the layers timed took the bf16 route asked for (fp16 falls back to fp32 where it cannot run)."""
    from types import SimpleNamespace

    from xenc_lab.cpu.kernels import half_gemm_available
    from xenc_lab.cpu.prepacked import PrepackedLinear

    if not onednn_bf16():
        pytest.skip("no oneDNN bfloat16 GEMM on this CPU")
    config = BertConfig(hidden_size=64, num_hidden_layers=1, intermediate_size=128)
    flop = sum(2 * 64 * k * n for k, n in bench.projection_shapes(config))
    built = []

    class Recorded(PrepackedLinear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.gemm)

    monkeypatch.setattr(bench.flops, "PrepackedLinear", Recorded)
    for gemm in ("native", "fp32", "fp16"):
        ticks = iter([10.0, 10.5, 20.0, 20.25])
        monkeypatch.setattr(bench.flops, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
        built.clear()
        rate = bench.gemm_rate(config, torch.bfloat16, tokens=64, repeats=2, bf16_gemm=gemm)
        assert rate == pytest.approx(flop / 0.25 / 1e9, rel=1e-12), gemm
        assert next(ticks, None) is None  # the clock was read once before and once after each repeat
        ran = gemm if gemm != "fp16" or half_gemm_available() else "fp32"
        assert built == [ran] * len(bench.projection_shapes(config)), gemm


def test_report_says_when_the_reference_drifted_and_what_compiling_cost(tmp_path):
    row = bench.BenchRow("mixed", "float32", "xenc_lab", 8, 140.0, 5.0, 1.5, 100.0, 0.5, 3e-6, 1.6,
                         oracle_drift=1.4e-4, compiled_graphs=1, batch_shapes=12, compile_seconds=13.2)
    later = dataclasses.replace(row, engine="xenc_lab compiled", compiled_graphs=2, batch_shapes=14, compile_seconds=3.2,
                                oracle_drift=0.0)
    facts = bench.report_facts([row, later])
    assert facts.drift == {("mixed", "float32"): 1.4e-4}
    assert facts.compiled == {"float32": (2, 3.2, 14)}  # the dtype's last counts: they cover its runs so far


ENGINES = ("sentence-transformers", "xenc_lab", "xenc_lab compiled")


def _assert_rows_are_each_others_arithmetic(rows, scorer, workloads, dtypes, n_pairs):
    """A row for every (dtype, workload, engine), in run order, and figures that agree: pairs/s from the median
    seconds, the ratio over sentence-transformers' pairs/s at that dtype, the GFLOP/s from the model's math on the
    workload's pairs, one GEMM ceiling under every share of a dtype, compile counts only on the compiled engine."""
    expected = [(d, w, e) for d in dtypes for w in workloads for e in ENGINES]
    assert [(r.dtype, r.workload, r.engine) for r in rows] == expected
    for workload in workloads:
        enc = scorer.tokenizer(*map(list, zip(*make_pairs(workload, n_pairs, seed=0))))
        gflop = bench.model_gflop(scorer.hf_config, enc.lengths)
        for r in (r for r in rows if r.workload == workload):
            st = next(s for s in rows if (s.workload, s.dtype) == (workload, r.dtype) and s.engine == ENGINES[0])
            assert r.pairs == n_pairs and r.mean_tokens == pytest.approx(float(enc.lengths.mean())), r
            assert r.pairs_per_s == pytest.approx(r.pairs / r.seconds), r
            assert r.ratio == pytest.approx(r.pairs_per_s / st.pairs_per_s) and st.ratio == 1.0, r
            assert r.gflops == pytest.approx(gflop / r.seconds), r
            assert (r.compiled_graphs >= 1 and r.batch_shapes >= 1) is (r.engine == "xenc_lab compiled"), r
    for dtype in dtypes:
        ceilings = [r.gflops / r.ceiling_share for r in rows if r.dtype == dtype]
        assert ceilings == pytest.approx([ceilings[0]] * len(ceilings)), dtype


@pytest.mark.slow
def test_cli_bench_rows_cover_each_dtype_and_engine_and_agree_in_rates_ratios_and_shares(
        tiny_dir, scorer, tmp_path, capsys):
    dtypes = ["float32", "bfloat16"] if bench.cpu_has_fast_bf16() else ["float32"]
    assert main(["bench", "--model", str(tiny_dir), "--workloads", "short", "--dtypes", *dtypes,
                 "--pairs", "8", "--repeats", "2", "--compile", "--report", str(tmp_path)]) == 0
    rows = [bench.BenchRow(**r) for r in json.loads((tmp_path / "throughput.json").read_text())["rows"]]
    _assert_rows_are_each_others_arithmetic(rows, scorer, ["short"], dtypes, 8)
    assert_table_is_rows((tmp_path / "throughput.md").read_text(), rows)
    facts = bench.report_facts(rows)
    assert set(facts.compiled) == set(dtypes) and set(facts.attention) == {("short", d) for d in dtypes}
    assert all(a["kernel"] > 0 and a["sdpa"] > 0 for a in facts.attention.values())
    for r in rows:  # xenc_lab's distance from sentence-transformers fp32: measured, mean below max, and in float32
        if r.engine != "sentence-transformers":  # within parity's tolerance
            assert 0 < r.mean_abs_delta <= r.max_abs_delta < (1e-4 if r.dtype == "float32" else 1.0), r
    for r in rows:  # bf16: each xenc_lab row's error over sentence-transformers' own bf16 error, in the log and table
        if r.dtype == "bfloat16" and r.engine != "sentence-transformers":
            st = next(s for s in rows if (s.dtype, s.engine) == ("bfloat16", "sentence-transformers"))
            assert 0 < st.mean_abs_delta <= st.max_abs_delta
            assert r.error_ratio == pytest.approx(r.mean_abs_delta / st.mean_abs_delta)
            assert r.max_error_ratio == pytest.approx(r.max_abs_delta / st.max_abs_delta)


@pytest.mark.slow
def test_bench_runs_a_workload_of_ones_own_from_a_file(tiny_dir, tmp_path, capsys):
    pairs = tmp_path / "heldout.jsonl"
    pairs.write_text("".join(f'{{"query": "question {i}?", "passage": "{"word " * (3 * i + 1)}end."}}\n' for i in range(12)))
    assert main(["bench", "--model", str(tiny_dir), "--pairs-file", str(pairs), "--pairs", "10",
                 "--dtypes", "float32", "--repeats", "1", "--report", str(tmp_path)]) == 0
    rows = [bench.BenchRow(**r) for r in json.loads((tmp_path / "throughput.json").read_text())["rows"]]
    assert [(r.workload, r.dtype, r.engine, r.pairs) for r in rows] == [
        ("heldout", "float32", "sentence-transformers", 10), ("heldout", "float32", "xenc_lab", 10)]
    assert_table_is_rows((tmp_path / "throughput.md").read_text(), rows)


@pytest.mark.slow
def test_bench_api_takes_named_pairs_and_checks_them_before_timing_anything(tiny_dir):
    logged = []
    rows = bench.run(tiny_dir, workloads={"mine": [("a query?", "a passage."), ("b?", "b.")] * 4},
                     dtypes=("float32",), repeats=1, log=logged.append)
    assert [(r.workload, r.engine, r.pairs) for r in rows] == [
        ("mine", "sentence-transformers", 8), ("mine", "xenc_lab", 8)]
    assert rows[1].max_abs_delta < 1e-4 and logged
    for workloads, error, message in (
        ([("mine", [("q", 3)])], TypeError, r"pairs\[0\]\[1\] is int \(3\); expected str \(text_2\)"),
        ([("mine", [])], ValueError, "non-empty list"),
        (["medium"], ValueError, "not a built-in one"),
        ([42], TypeError, "built-in name or a \\(name, pairs\\) tuple"),
        (["short", ("short", [("q", "p")])], ValueError, "distinct"),
        ([], ValueError, "at least one"),
    ):
        logged.clear()
        with pytest.raises(error, match=message):
            bench.run(tiny_dir, workloads=workloads, dtypes=("float32",), log=logged.append)
        assert not logged  # refused before any engine was loaded or timed


def test_cli_bench_refuses_a_non_positive_pair_count(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--pairs", "0"])
    assert "expected a positive integer, got 0" in capsys.readouterr().err


def test_bench_refuses_an_unknown_device_or_dtype_before_loading_anything(tiny_dir):
    cases = [({"device": "tpu"}, ValueError, "device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
             ({"device": "mps"}, ValueError, "xenc_lab runs on 'cpu' or 'cuda', got device 'mps'"),
             ({"device": 0.5}, TypeError, "device must be"),
             ({"dtypes": ("float64",)}, ValueError, "dtypes must be a non-empty list"),
             ({"dtypes": ()}, ValueError, "dtypes must be a non-empty list"),
             ({"repeats": 0}, ValueError, "repeats must be an int >= 1, got 0"),
             ({"n_pairs": 0}, ValueError, "n_pairs must be an int >= 1, got 0")]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda", "dtypes": ("float16",)}, ValueError, "sees no CUDA GPU"))
    for kwargs, error, message in cases:
        logged = []
        with pytest.raises(error, match=message):
            bench.run(tiny_dir, workloads=["short"], **{"dtypes": ("float32",), **kwargs}, log=logged.append)
        assert not logged


@pytest.mark.slow
def test_bench_takes_one_workload_given_alone(tiny_dir):
    mine = [("a query?", "a passage."), ("b?", "b.")] * 4
    for workloads, name in (("short", "short"), (("mine", mine), "mine")):
        rows = bench.run(tiny_dir, workloads=workloads, dtypes="float32", n_pairs=8, repeats=1, log=lambda line: None)
        assert {r.workload for r in rows} == {name} and len(rows) == 2


def test_an_int8_row_says_what_multiplied_its_codes(tiny_dir):
    from xenc_lab.cpu.int8 import int8_products, int8_route

    rows = bench.run(tiny_dir, workloads="short", dtypes="float32", n_pairs=8, repeats=1, int8=True,
                     log=lambda line: None)
    int8 = [r for r in rows if r.engine == "xenc_lab int8"]
    assert len(int8) == 1 and not any(r.int8_route for r in rows if r.engine != "xenc_lab int8")
    assert int8[0].int8_route == ("torch" if int8_route() == "torch" else f"kernel, {int8_products()}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA GPU is visible")
def test_cli_bench_on_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--device", "cuda"])
    assert "xenc-lab bench: error: device 'cuda' was asked for, but torch sees no CUDA GPU here" in capsys.readouterr().err


def test_a_cuda_report_names_the_gpu_and_keeps_to_one_device(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.report, "device_name", lambda device="cuda": "NVIDIA Example (80 GiB, compute capability 9.0)")
    rows = [bench.BenchRow("short", "float16", engine, 8, 90.0, rate, rate / 100.0, 1e4, 0.5, 2e-3, 0.1, device="cuda")
            for engine, rate in (("sentence-transformers", 100.0), ("xenc_lab", 250.0))]
    assert bench.report_facts(rows).machine.startswith("NVIDIA Example (80 GiB, compute capability 9.0); host ")
    assert_table_is_rows(bench.write_report(rows, tmp_path, "xenc-lab bench --device cuda").read_text(), rows)
    with pytest.raises(ValueError, match="one device"):
        bench.write_report([rows[0], dataclasses.replace(rows[1], device="cpu")], tmp_path, "xenc-lab bench")


@pytest.mark.cuda
def test_cli_bench_on_cuda_runs_fp16_and_bf16_side_by_side_and_names_the_gpu(
        tiny_dir, scorer, tmp_path, capsys):
    assert main(["bench", "--model", str(tiny_dir), "--device", "cuda", "--workloads", "short", "mixed",
                 "--pairs", "32", "--repeats", "2", "--compile", "--report", str(tmp_path)]) == 0
    rows = [bench.BenchRow(**r) for r in json.loads((tmp_path / "throughput.json").read_text())["rows"]]
    _assert_rows_are_each_others_arithmetic(rows, scorer, ["short", "mixed"], ["float16", "bfloat16"], 32)
    assert all(r.device == "cuda" for r in rows)
    assert_table_is_rows((tmp_path / "throughput.md").read_text(), rows)
    facts = bench.report_facts(rows)  # CPU attention is not measured on a GPU
    assert torch.cuda.get_device_name() in facts.machine and set(facts.compiled) == {"float16", "bfloat16"}
    assert facts.attention == {}


def test_machine_names_the_cpu_by_family_and_model_and_its_16_bit_units(monkeypatch):
    from xenc_lab.cpu.info import CpuInfo

    zen5 = CpuInfo("AuthenticAMD", "AMD EPYC", frozenset({"avx512_bf16"}), "family 26, model 2")
    monkeypatch.setattr(bench.report, "cpu_info", lambda: zen5)
    assert bench.machine().startswith("AMD EPYC (family 26, model 2), ") and ", AVX512-BF16, torch " in bench.machine()
    sapphire = CpuInfo("GenuineIntel", "Xeon", frozenset({"avx512_bf16", "avx512_fp16"}))  # family unknown
    monkeypatch.setattr(bench.report, "cpu_info", lambda: sapphire)
    assert bench.machine().startswith("Xeon, ") and "AVX512-BF16, AVX512-FP16" in bench.machine()


def test_machine_names_the_versions_of_the_peer_the_ratios_are_against():
    import sentence_transformers
    import transformers

    line = bench.machine()
    assert f", torch {torch.__version__}, sentence-transformers {sentence_transformers.__version__}, " in line
    assert line.endswith(f", transformers {transformers.__version__}")


def test_an_exact_sentence_transformers_leaves_the_error_cell_saying_so(tmp_path):
    rows = [bench.BenchRow("short", "bfloat16", engine, 8, 90.0, 10.0, 1.0, 100.0, 0.5, most, 0.8, mean_abs_delta=most)
            for engine, most in (("sentence-transformers", 0.0), ("xenc_lab", 0.3))]
    bench.set_error_ratios(rows)
    assert rows[1].error_ratio == 0.0  # no ratio over an error of 0, and the cell says why
    text = bench.write_report(rows, tmp_path, "xenc-lab bench").read_text()
    assert [cells["error vs ST's own"] for cells in read_table(text)] == ["", "n/a (ST's own error is 0)"]


def test_a_report_of_no_rows_is_refused_and_leaves_the_last_one(tmp_path):
    (tmp_path / "throughput.md").write_text("the last report")
    with pytest.raises(ValueError, match="no benchmark rows to report"):
        bench.write_report([], tmp_path, "xenc-lab bench")
    assert (tmp_path / "throughput.md").read_text() == "the last report"


def test_bf16_alone_on_a_cpu_without_bf16_units_is_refused_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(bench.timing, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr("sentence_transformers.CrossEncoder", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit):
        main(["bench", "--dtypes", "bfloat16", "--workloads", "short"])
    assert "bfloat16 is skipped on this CPU (neither AMX nor AVX512-BF16) and no other dtype" in capsys.readouterr().err


@pytest.mark.slow
def test_the_memory_probe_reports_scorings_own_peak_over_the_loaded_model_and_input(tiny_dir):
    probe = bench.peak_memory_mb(300, tiny_dir, workload="short", dtype="float32", max_batch_tokens=512, threads=1)
    assert probe["loaded_rss"] > 100 and probe["input_rss"] >= probe["loaded_rss"] * 0.9
    if Path("/proc/self/clear_refs").exists():  # the high-water mark was reset before scoring
        assert probe["peak_is_scoring_s"] and probe["input_rss"] * 0.9 <= probe["peak_rss"] < probe["input_rss"] * 1.5
    # CPU batches are bucketed: at most 8 token counts within the budget, whatever the input
    assert 1 <= probe["token_counts"] <= 8 and probe["token_counts"] <= probe["batch_shapes"]


def test_the_memory_note_gives_scorings_growth_over_the_loaded_model_and_input():
    small = {"loaded_rss": 500.0, "input_rss": 504.0, "peak_rss": 650.0, "peak_is_scoring_s": True,
             "batch_shapes": 12, "token_counts": 6}
    large = {"loaded_rss": 500.0, "input_rss": 540.0, "peak_rss": 688.0, "peak_is_scoring_s": True,
             "batch_shapes": 15, "token_counts": 8}
    facts = bench.memory_facts(small, large)
    assert facts == {"sizes": (2000, 20000), "held": (504.0, 540.0), "loaded": (500.0, 500.0), "peak": (650.0, 688.0),
                     "growth": (146.0, 148.0), "ratio": 10, "scoring_peak": True, "token_counts": (6, 8),
                     "batch_shapes": (12, 15)}
    assert not bench.memory_facts({**small, "peak_is_scoring_s": False}, large)["scoring_peak"]
    assert bench.memory_facts({**small, "peak_gpu": 90.0}, {**large, "peak_gpu": 95.0})["peak_gpu"] == (90.0, 95.0)
    note = bench.memory_note(small, large, "bfloat16", "cpu")  # the sentence gives every figure
    assert [f for f in ("504", "540", "2,000", "20,000", "650", "688", "+146", "+148", "10x") if f not in note] == []


@pytest.mark.parametrize(("vendor", "model", "flags", "family", "slug"), [
    ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8480+", {"amx_tile", "avx512f"}, "family 6, model 143",
     "intel-xeon-amx"),
    ("AuthenticAMD", "AMD EPYC 9R14 96-Core Processor", {"avx512f", "avx512_bf16"}, "family 25, model 17",
     "amd-epyc-zen4"),
    ("AuthenticAMD", "AMD EPYC 7763", {"avx2"}, "family 25, model 1", "amd-epyc-zen3"),
    ("AuthenticAMD", "AMD EPYC 7571", {"avx2"}, "family 23, model 1", "amd-epyc-zen1"),
    ("AuthenticAMD", "AMD EPYC", {"avx512f"}, "family 26, model 2", "amd-epyc-zen5"),
    ("GenuineIntel", "Intel(R) Core(TM) i7-8700", {"avx2"}, "family 6, model 158", "intel-core-avx2"),
    ("", "Apple M2", set(), "", "apple-m2"),
])
def test_a_machines_reports_folder_is_named_from_its_cpu(vendor, model, flags, family, slug):
    from xenc_lab.cpu.info import CpuInfo

    assert bench.machine_slug(CpuInfo(vendor, model, frozenset(flags), family)) == slug


def _goal_rows(st_bf16: float) -> list:
    return [
        bench.BenchRow(workload, dtype, engine, 8, 90.0, rate, rate / st, 100.0, 0.5, 0.0, 0.8)
        for workload, st, bf16, int8 in (("short", st_bf16, 20.0, 33.0), ("mixed", 10.0, 20.0, 30.0))
        for dtype, engine, rate in (("bfloat16", "sentence-transformers", st), ("bfloat16", "xenc_lab", bf16),
                                    ("bfloat16", "xenc_lab int8", int8), ("float32", "xenc_lab int8", 2 * int8))
    ]


def test_the_report_checks_int8_against_xenc_labs_bf16_and_amxs_bf16_against_sentence_transformers(tmp_path,
                                                                                                      monkeypatch):
    rows = _goal_rows(st_bf16=16.0)
    assert bench.goals(rows, frozenset({"avx512_vnni"})) == [
        ("short: int8 >= 1.6x xenc_lab's bf16 pairs/s", "1.65x", True),
        ("mixed: int8 >= 1.6x xenc_lab's bf16 pairs/s", "1.50x", False),
    ]
    amx = bench.goals(rows, frozenset({"amx_tile", "amx_bf16"}))
    assert amx[2:] == [("short: bf16 >= 1.5x sentence-transformers' bf16 (AMX)", "1.25x", False),
                       ("mixed: bf16 >= 1.5x sentence-transformers' bf16 (AMX)", "2.00x", True)]
    monkeypatch.setattr(bench.report, "cpu_info", lambda: bench.report.CpuInfo("", "x", frozenset({"amx_bf16"})))
    text = bench.write_report(rows, tmp_path, "xenc-lab bench --int8").read_text()
    assert "- short: int8 >= 1.6x xenc_lab's bf16 pairs/s: 1.65x — met" in text
    assert "- short: bf16 >= 1.5x sentence-transformers' bf16 (AMX): 1.25x — **missed**" in text
    assert "int8 ran on" not in text  # rows that do not say what ran say nothing
    rows[2].int8_route = "kernel, own"
    text = bench.write_report(rows, tmp_path, "xenc-lab bench --int8").read_text()
    assert "int8 ran on: xenc_lab's int8 kernel, its products its own (256-bit VNNI" in text
    assert bench.goals([r for r in rows if r.engine != "xenc_lab int8"], frozenset()) == []


def test_a_new_encoder_report_keeps_the_decoder_and_serving_sections_of_the_last(tmp_path):
    rows = _goal_rows(st_bf16=16.0)
    bench.write_report(rows, tmp_path, "xenc-lab bench")
    bench.report.append_section(tmp_path / "throughput.md", "## Decoder rerankers\n\ndecoder rows\n")
    bench.report.append_section(tmp_path / "throughput.md", "## Serving\n\nserving rows\n")
    text = bench.write_report(rows[:4], tmp_path, "xenc-lab bench --workloads short").read_text()
    assert text.startswith("# Throughput: xenc_lab against sentence-transformers") and text.count("# Throughput") == 1
    assert text.endswith("## Decoder rerankers\n\ndecoder rows\n\n## Serving\n\nserving rows\n")
    assert "| mixed |" not in text  # the encoder part is the new run's alone


def test_one_command_runs_a_cpus_benchmarks_into_its_reports_folder(tmp_path, capsys):
    from xenc_lab.bench import cpu_reports as M

    commands = M.step_commands(tmp_path, bf16=False)
    assert list(commands) == ["encoders", "decoder", "peers"]
    assert commands["encoders"][2:] == ["xenc_lab.cli", "bench", "--int8", "--pairs", "256", "--repeats", "3",
                                        "--compile", "--memory", "--report", str(tmp_path)]
    decoder = commands["decoder"]
    assert decoder[decoder.index("--dtypes") + 1] == "float32" and "--int8" in decoder
    assert commands["peers"][-2:] == ["--report", str(tmp_path / "peers.md")]
    with pytest.raises(ValueError, match="steps are encoders, decoder, peers; got 'gpu'"):
        M.step_commands(tmp_path, ("gpu",))
    assert M.main(["--dry-run", "--steps", "decoder", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== decoder: ") and "-m xenc_lab.cli bench --decoder qwen3-0.6b --int8" in out
    assert not list(tmp_path.iterdir())  # a dry run writes nothing
