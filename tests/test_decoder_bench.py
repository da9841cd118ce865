"""The decoder bench (``xenc-lab bench --decoder``): its checkpoints, its rows against their definitions, its report
section. Timings are whatever the run gives; what is checked is how each row's numbers follow from the others."""
from __future__ import annotations

import math

import numpy as np
import pytest

from xenc_lab.bench import decoder
from xenc_lab.bench.report import append_section
from xenc_lab.bench.timing import cpu_has_fast_bf16
from xenc_lab.bench.workloads import _VOCAB
from xenc_lab.cli import main

QWEN3_RERANKER_PROMPT = (  # Qwen3-Reranker's model card: prefix, the pair, suffix
    '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return decoder.decoder_reranker("qwen3-tiny", tmp_path_factory.mktemp("decoder-bench"))


def test_the_template_renders_qwen3_rerankers_prompt_and_workload_words_are_single_tokens(tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    (query, doc), = decoder.rerank_pairs(1)
    messages = [{"role": "query", "content": query}, {"role": "document", "content": doc}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == QWEN3_RERANKER_PROMPT.format(
        instruction=decoder.INSTRUCTION, query=query, doc=doc)
    split = [w for w in _VOCAB for form in (" " + w, " " + w.capitalize())
             if len(tokenizer(form, add_special_tokens=False)["input_ids"]) != 1]
    assert split == [], f"{len(split)} workload words take more than one token: {split[:8]}"
    assert all(len(tokenizer.tokenize(w)) == 1 for w in ("yes", "no", "<think>", "</think>", "<|im_end|>"))


def test_the_same_name_and_seed_reuse_one_checkpoint(tiny):
    assert decoder.decoder_reranker("qwen3-tiny", tiny.parent) == tiny
    with pytest.raises(ValueError, match="name must be one of"):
        decoder.decoder_reranker("qwen3-huge", tiny.parent)


@pytest.mark.slow
def test_bench_decoder_rows_follow_their_definitions_and_the_report_keeps_the_rest(tiny, tmp_path, monkeypatch):
    """End to end through the CLI on the tiny model (6 documents, 1 repeat): per dtype one row per engine; sharing on
    computes fewer tokens than the pairs hold and sharing off all of them; ideal gain = total / computed, measured
    gain = pairs/s on over off, its share = their ratio, ratio = pairs/s over sentence-transformers'; fp32 scores
    within 1e-4 of sentence-transformers'; bf16 error ratios are ours over its own. The report's decoder section is
    appended after the existing text, and replaced (not repeated) by a second run."""
    from xenc_lab import Scorer, zoo

    monkeypatch.setattr(zoo, "cache_dir", lambda: tiny.parent)  # the module's checkpoint, not the user's cache
    seen = []
    run = decoder.run
    monkeypatch.setattr(decoder, "run", lambda *a, **k: seen.append(run(*a, **k)) or seen[-1])
    (tmp_path / "throughput.md").write_text("# Throughput\n\nthe encoder table\n")
    dtypes = ["float32", "bfloat16"] if cpu_has_fast_bf16() else ["float32"]
    argv = ["bench", "--decoder", "qwen3-tiny", "--pairs", "6", "--repeats", "1", "--dtypes", *dtypes,
            "--report", str(tmp_path)]
    assert main(argv) == 0
    rows = seen[0]
    assert [(r.dtype, r.engine) for r in rows] == [(d, e) for d in dtypes for e in decoder.ENGINES]
    pairs = decoder.rerank_pairs(6)
    enc = Scorer(tiny, device="cpu").tokenizer([q for q, _ in pairs], [d for _, d in pairs])
    for dtype in dtypes:
        st, on, off = (r for r in rows if r.dtype == dtype)
        assert {r.pairs for r in (st, on, off)} == {6} and {r.tokens_total for r in (st, on, off)} == {int(enc.lengths.sum())}
        assert off.tokens_computed == off.tokens_total and 0 < on.tokens_computed < on.tokens_total
        assert on.ideal_gain == on.tokens_total / on.tokens_computed
        assert math.isclose(on.measured_gain, on.pairs_per_s / off.pairs_per_s)
        assert math.isclose(on.gain_share, on.measured_gain / on.ideal_gain)
        assert st.ideal_gain == off.ideal_gain == 0.0  # the gain belongs to the sharing row
        for r in (st, on, off):
            assert math.isclose(r.pairs_per_s, 6 / r.seconds) and math.isclose(r.ratio, r.pairs_per_s / st.pairs_per_s)
            assert r.accuracy_pairs == len(decoder.accuracy_pairs(6)) >= decoder.ACCURACY_PAIRS
        if dtype == "float32":
            assert st.max_abs_delta == 0.0 and on.max_abs_delta < 1e-4 and off.max_abs_delta < 1e-4
            assert on.error_ratio == off.error_ratio == 0.0
        else:
            assert st.mean_abs_delta > 0
            for r in (on, off):
                assert math.isclose(r.error_ratio, r.mean_abs_delta / st.mean_abs_delta)
                assert math.isclose(r.max_error_ratio, r.max_abs_delta / st.max_abs_delta)
    text = (tmp_path / "throughput.md").read_text()
    assert text.startswith("# Throughput\n\nthe encoder table\n\n## Decoder rerankers\n")
    assert "Regenerate with `xenc-lab bench --decoder qwen3-tiny --pairs 6" in text
    on = rows[1]
    assert (f"| qwen3-tiny | float32 | xenc_lab sharing on | 6 | {on.tokens_total} | {on.tokens_computed} | "
            f"{on.ideal_gain:.2f}x | {on.measured_gain:.2f}x ({on.gain_share:.0%}) | {on.pairs_per_s:.2f} |") in text
    assert text.count("\n- qwen3-tiny ") == len(decoder.goals(rows)) == 2 * len(dtypes)
    append_section(tmp_path / "throughput.md", decoder.report_section(rows, "again", "here"))
    again = (tmp_path / "throughput.md").read_text()
    assert again.count("## Decoder rerankers") == 1 and "Regenerate with `again`" in again
    assert again.startswith("# Throughput\n\nthe encoder table\n\n## Decoder rerankers\n")


def test_a_section_is_replaced_in_place_and_what_follows_it_is_kept(tmp_path):
    path = tmp_path / "r.md"
    path.write_text("# R\n\n## Decoder rerankers\n\nold\n\n## Later\n\nkept\n")
    append_section(path, "## Decoder rerankers\n\nnew\n")
    assert path.read_text() == "# R\n\n## Decoder rerankers\n\nnew\n\n## Later\n\nkept\n"


def test_goals_hold_each_measure_to_its_bound():
    def row(dtype, engine, **kw):
        base = {"model": "m", "dtype": dtype, "engine": engine, "pairs": 4, "tokens_total": 100, "tokens_computed": 50,
                "pairs_per_s": 1.0, "ratio": 1.0, "max_abs_delta": 0.0, "mean_abs_delta": 0.0, "seconds": 4.0}
        return decoder.DecoderRow(**{**base, **kw})

    rows = [row("float32", decoder.ENGINES[0]),
            row("float32", decoder.ENGINES[1], ideal_gain=2.0, measured_gain=1.8, gain_share=0.9, ratio=2.1,
                max_abs_delta=2e-4),
            row("bfloat16", decoder.ENGINES[1], ideal_gain=2.0, measured_gain=1.6, gain_share=0.8, error_ratio=1.4,
                max_error_ratio=2.0)]
    assert [met for _, _, met in decoder.goals(rows)] == [True, False, False, True]  # 90%; 2.1x but 2e-4; 80%; 1.4x
    assert np.isclose(rows[1].gain_share, rows[1].measured_gain / rows[1].ideal_gain)


def test_bench_decoder_int8_adds_a_quantized_engine_timed_in_the_same_rounds(tiny, capsys):
    rows = decoder.run([str(tiny)], dtypes=["float32"], n_docs=4, repeats=2, int8=True)
    assert [r.engine for r in rows] == [*decoder.ENGINES, decoder.INT8_ENGINE]
    _, on, off, int8 = rows
    assert int8.pairs == 4 and math.isclose(int8.pairs_per_s, 4 / int8.seconds) and int8.over_sharing > 0
    assert 0 < int8.tokens_computed == on.tokens_computed < int8.tokens_total  # int8 shares the prefix too
    assert 0 < int8.max_abs_delta < 1 and on.max_abs_delta < 1e-4  # int8 moves the scores, a little
    assert on.over_sharing == off.over_sharing == 0.0
    assert "int8 over xenc_lab sharing on" in decoder.report_section(rows, "c", "m")
    assert not any("int8" in goal for goal, _, _ in decoder.goals(rows))  # the seconds goal is qwen3-0.6b's


def test_the_int8_goal_is_a_1_x_100_rerank_of_qwen3_0_6b_in_10_s():
    def row(seconds):
        return decoder.DecoderRow(model="qwen3-0.6b", dtype="bfloat16", engine=decoder.INT8_ENGINE, pairs=16,
                                  tokens_total=100, tokens_computed=50, pairs_per_s=16 / seconds, ratio=2.0,
                                  max_abs_delta=0.1, mean_abs_delta=0.05, seconds=seconds, over_sharing=1.8)
    (goal, value, met), = decoder.goals([row(1.5)])
    assert "1 x 100 in <= 10 s" in goal and value.startswith("9.4 s") and met
    assert not decoder.goals([row(1.7)])[0][2]  # 10.6 s


@pytest.mark.parametrize("extra", [["--memory"], ["--model", "x"], ["--workloads", "short"]])
def test_bench_decoder_refuses_the_encoder_benchs_options_in_one_line(extra, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--decoder", "qwen3-tiny", *extra])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--decoder takes its models as its own arguments and runs on the CPU: drop {extra[0]}" in err
    assert "Traceback" not in err


def test_bench_decoder_compile_compiles_xenc_labs_engines(monkeypatch):
    seen = []

    def time_engines(path, pairs, dtype, repeats, st_batch_size, budget, compile=False, check=None, int8=False):
        seen.append(compile)
        raise KeyboardInterrupt  # stop before any model runs

    monkeypatch.setattr(decoder, "_time_engines", time_engines)
    for argv in (["bench", "--decoder", "qwen3-tiny", "--dtypes", "float32"], ["bench", "--decoder", "qwen3-tiny",
                                                                                "--dtypes", "float32", "--compile"]):
        with pytest.raises(KeyboardInterrupt):
            main(argv)
    assert seen == [False, True]


def test_accuracy_is_measured_on_the_timed_pairs_and_more_queries():
    timed = decoder.rerank_pairs(16, seed=3)
    pairs = decoder.accuracy_pairs(16, seed=3)
    assert pairs[:16] == timed and len(pairs) == 64
    assert len({q for q, _ in pairs}) == 4  # four queries, each with its own documents
    assert decoder.accuracy_pairs(100) == decoder.rerank_pairs(100)


def test_ratios_are_medians_of_each_rounds_ratio():
    """A slow spell that falls on one round moves both engines of that round, not the ratio's median."""
    st, ours = [10.0, 30.0, 10.0], [5.0, 15.0, 4.0]  # round 2 three times slower for both
    assert decoder.paired_ratio(st, ours) == 2.0
    assert decoder.paired_ratio([3.0], [1.5]) == 2.0
    with pytest.raises(ValueError):
        decoder.paired_ratio([1.0, 2.0], [1.0])
