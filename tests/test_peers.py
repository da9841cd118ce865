"""The peers driver's pure parts, with no peer installed: results read back, fidelity statistics, the report's table,
the pair layout, and one real worker process-free run of the engines the project itself carries."""
import json
import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from xenc_lab.bench.peers import EngineResult, fidelity, parse_result, rows, table
from xenc_lab.bench.peers.report import write_report
from xenc_lab.bench.peers.run import CALIBRATION_SEED, encoder_lists

ROOT = Path(__file__).resolve().parent.parent


def _result(engine, scores, seconds=(2.0, 1.0, 3.0), **extra):
    return {"engine": engine, "pairs": len(scores), "seconds": list(seconds), "busy_cpu": [0.5, 0.7, 0.6],
            "scores": list(scores), "versions": {"lib": "1.0"}, **extra}


def test_a_result_is_read_back_with_pairs_per_second_over_the_median_pass():
    r = parse_result(_result("onnxruntime-fp32", [0.1, 0.2, 0.3, 0.4]))
    assert r.ok and r.pairs == 4 and r.pairs_per_s == pytest.approx(4 / 2.0)
    assert r.versions == {"lib": "1.0"} and r.scores.dtype == np.float64


def test_an_error_or_a_skip_is_a_result_without_speed():
    failed = parse_result({"engine": "openvino-int8", "error": "RuntimeError: boom", "traceback": "..."})
    skipped = parse_result({"engine": "xenc_lab-int8", "skipped": "no quantization here"})
    assert not failed.ok and failed.error == "RuntimeError: boom" and math.isnan(failed.pairs_per_s)
    assert not skipped.ok and skipped.skipped == "no quantization here"


@pytest.mark.parametrize("bad, match", [
    ({"scores": [1.0]}, "engine"),
    ({"engine": "x", "scores": [1.0]}, "scores and seconds"),
    ({"engine": "x", "pairs": 3, "scores": [1.0, 2.0], "seconds": [1.0]}, "expected 3 scores"),
    ({"engine": "x", "scores": [1.0], "seconds": [0.0]}, "positive pass times"),
    ({"engine": "x", "scores": [1.0], "seconds": []}, "positive pass times"),
])
def test_a_malformed_result_is_a_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_result(bad)


def test_a_result_of_another_pair_count_than_expected_is_refused():
    with pytest.raises(ValueError, match="expected 5 scores"):
        parse_result(_result("x", [1.0, 2.0]), expected_pairs=5)


def test_fidelity_of_identical_scores_is_perfect_and_of_reversed_ones_is_minus_one():
    oracle = np.arange(24, dtype=float)
    same = fidelity(oracle, oracle, [12, 12])
    assert same == {"max_abs_delta": 0.0, "spearman": 1.0, "top_overlap": 1.0}
    flipped = fidelity(-oracle, oracle, [12, 12])
    assert flipped["spearman"] == pytest.approx(-1.0) and flipped["max_abs_delta"] == 46.0
    assert flipped["top_overlap"] == pytest.approx(8 / 10)  # of 12, all but the two at either end are in both top 10s


def test_fidelity_is_per_query_list_and_matches_scipy():
    rng = np.random.default_rng(0)
    oracle = rng.normal(size=30)
    scores = oracle + rng.normal(scale=0.5, size=30)
    got = fidelity(scores, oracle, [20, 10])
    rhos = [spearmanr(scores[:20], oracle[:20]).statistic, spearmanr(scores[20:], oracle[20:]).statistic]
    assert got["spearman"] == pytest.approx(np.mean(rhos))
    assert got["max_abs_delta"] == pytest.approx(np.max(np.abs(scores - oracle)))
    assert 0 <= got["top_overlap"] <= 1


def test_a_swap_across_the_tenth_rank_costs_a_tenth_of_the_overlap():
    oracle = np.arange(12, 0, -1, dtype=float)  # ranks 1..12 in order
    scores = oracle.copy()
    scores[9], scores[10] = scores[10], scores[9]  # the 10th and 11th trade places
    got = fidelity(scores, oracle, [12])
    assert got["top_overlap"] == pytest.approx(0.9)
    assert got["spearman"] == pytest.approx(1 - 6 * 2 / (12 * (12 ** 2 - 1)))


def test_a_list_shorter_than_ten_is_compared_whole():
    oracle = np.array([3.0, 2.0, 1.0, 0.0])
    assert fidelity(oracle[::-1].copy(), oracle, [4])["top_overlap"] == 1.0


@pytest.mark.parametrize("scores, oracle, lists", [
    (np.zeros(4), np.zeros(5), [5]), (np.zeros(4), np.zeros(4), [3]), (np.zeros(4), np.zeros(4), [3, 1]),
])
def test_fidelity_refuses_mismatched_inputs(scores, oracle, lists):
    with pytest.raises(ValueError, match="expected two score arrays"):
        fidelity(scores, oracle, lists)


def _results():
    oracle = parse_result(_result("st-fp32", [1.0, 2.0, 3.0, 4.0], seconds=(4.0, 4.0, 4.0)))
    fast = parse_result(_result("xenc_lab-fp32", [1.0, 2.0, 3.5, 3.4], seconds=(1.0, 1.0, 1.0)))
    failed = EngineResult("openvino-int8", error="RuntimeError: no calibration\nmore lines")
    return [oracle, fast, failed]


def test_rows_give_ratios_and_fidelity_against_sentence_transformers_fp32():
    oracle, fast, failed = rows(_results(), [4])
    assert oracle.ratio == 1.0 and oracle.max_abs_delta == 0.0
    assert fast.ratio == pytest.approx(4.0) and fast.pairs_per_s == pytest.approx(4.0)
    assert fast.max_abs_delta == pytest.approx(0.6) and fast.spearman == pytest.approx(0.8)
    assert fast.busy_cpu == pytest.approx(0.6)
    assert math.isnan(failed.ratio) and failed.note == "failed: RuntimeError: no calibration"


def test_without_the_oracle_nothing_is_set_against_it():
    got = rows(_results()[1:], [4])
    assert math.isnan(got[0].ratio) and math.isnan(got[0].spearman) and got[0].pairs_per_s == pytest.approx(4.0)


def test_the_table_is_markdown_with_n_a_for_what_did_not_run():
    text = table(rows(_results(), [4]))
    lines = text.splitlines()
    assert lines[0].startswith("| engine | pairs/s | x ST fp32 |") and len(lines) == 5
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| xenc_lab-fp32 | 4.00 | 4.00 | 6.00e-01 | 0.8000 | 1.000 | 60% |" in text
    assert "| openvino-int8 | n/a | n/a |" in text and "failed: RuntimeError: no calibration |" in text


def test_the_report_names_machine_load_and_command_and_keeps_json(tmp_path):
    path = tmp_path / "peers.md"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("")
    args = Namespace(repeats=3, threads=2, note="")
    write_report(path, {"encoder": (_results(), [4], {"model": "no-such-model", "pairs": pairs})}, args, [9.0, 10.0])
    text = path.read_text()
    assert text.startswith("# Peers") and "Machine: " in text and "Regenerate with `tox -e peers`." in text
    assert "9.0, 10.0" in text and "loaded by other work" in text and "| xenc_lab-fp32 | 4.00 |" in text
    data = json.loads(path.with_suffix(".json").read_text())
    assert [r["engine"] for r in data["sections"]["encoder"]["rows"]] == ["st-fp32", "xenc_lab-fp32", "openvino-int8"]


def test_encoder_pairs_are_consecutive_query_lists_held_out_from_calibration():
    pairs = encoder_lists(3, 4)
    assert len(pairs) == 12 and pairs == encoder_lists(3, 4)
    assert [len({q for q, _ in pairs[i:i + 4]}) for i in range(0, 12, 4)] == [1, 1, 1]
    assert len({q for q, _ in pairs}) == 3 and len({d for _, d in pairs}) == 12
    calibration = encoder_lists(3, 4, seed=CALIBRATION_SEED)
    assert not {d for _, d in pairs} & {d for _, d in calibration}


def test_the_driver_imports_no_peer():
    code = ("import sys, xenc_lab.bench.peers, xenc_lab.bench.peers.run, xenc_lab.bench.peers.report; "
            "print(sorted(m for m in ('onnxruntime', 'openvino', 'nncf', 'optimum', 'llama_cpp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_worker_times_the_project_s_own_engine_and_reports_a_missing_mode(tiny_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps([f"query {i}", f"passage number {i}"]) + "\n" for i in range(6)))
    for engine in ("xenc_lab-fp32", "st-fp32"):
        out = tmp_path / f"{engine}.json"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "peers" / "worker.py"), "--engine", engine, "--model",
                        str(tiny_dir), "--pairs", str(pairs), "--out", str(out), "--work", str(tmp_path),
                        "--repeats", "2", "--warmup", "2"], cwd=ROOT, check=True, timeout=600,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
        result = parse_result(json.loads(out.read_text()), expected_pairs=6)
        assert result.ok and len(result.seconds) == 2, result
    ours = parse_result(json.loads((tmp_path / "xenc_lab-fp32.json").read_text()))
    theirs = parse_result(json.loads((tmp_path / "st-fp32.json").read_text()))
    assert fidelity(ours.scores, theirs.scores, [6])["max_abs_delta"] < 1e-4


def test_a_part_left_out_of_a_run_is_kept_from_the_last_report_and_marked(tmp_path):
    from xenc_lab.bench.peers.report import kept_sections

    path = tmp_path / "peers.md"
    args = Namespace(repeats=3, threads=2, note="")
    write_report(path, {"decoder": (_results(), [4], {"model": "dec", "tokens": 12.0})}, args, [1.0])
    kept = kept_sections(path, ["decoder", "encoder"])
    assert list(kept) == ["decoder"]
    results, lists, meta = kept["decoder"]
    assert lists == [4] and meta["kept"] and [r.engine for r in results] == ["st-fp32", "xenc_lab-fp32", "openvino-int8"]
    assert np.array_equal(results[1].scores, _results()[1].scores) and results[2].error.startswith("RuntimeError")
    write_report(path, {"encoder": (_results()[:2], [4], {"model": "enc"})} | kept, args, [2.0])
    text = path.read_text()
    assert text.index("## Encoder") < text.index("## Decoder") and "This part is kept from the run written" in text
    assert text.count("| xenc_lab-fp32 | 4.00 |") == 2
