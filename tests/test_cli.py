"""``xenc-lab demo``, the quick start's main job, and how the command line answers bad input."""
from __future__ import annotations

import re

import pytest
import torch

from xenc_lab.cli import DEMO_PAIRS, main


@pytest.mark.slow
def test_demo_scores_the_pairs_beside_the_oracle_and_reports_each_engines_best_rate_and_their_ratio(
        tiny_dir, capsys, monkeypatch):
    """On a clock where xenc_lab's two timed runs take 0.5 and 0.25 s and sentence-transformers' 0.5 and 1 s, 16
    pairs are 64 and 32 pairs/s (each engine's faster run), and the ratio is 2.00x."""
    from types import SimpleNamespace

    from xenc_lab import cli

    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.5, 3.0, 4.0])  # a start and an end per timed run, ours first
    monkeypatch.setattr(cli, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert main(["demo", "--model", str(tiny_dir), "--device", "cpu", "--pairs", "16"]) == 0
    out = capsys.readouterr().out
    assert "Scorer(model=" in out and all(q[:20] in out for q, _ in DEMO_PAIRS)
    assert "on 16 mixed-length pairs" in out
    assert "xenc_lab 64.0 pairs/s, sentence-transformers 32.0 pairs/s, ratio 2.00x" in out
    assert next(ticks, None) is None  # both engines were timed twice, nothing else read the clock
    worst = float(re.search(r"max \|delta\| over the table: (\S+)", out).group(1))
    assert worst < 1e-4


@pytest.mark.parametrize("argv, message", [
    (["demo", "--pairs", "0"], "expected a positive integer, got 0"),
    (["bench", "--repeats", "0"], "expected a positive integer, got 0"),
    (["bench", "--threads", "0"], "expected a positive integer, got 0"),
    (["demo", "--model", "/no/such/model-dir"], "xenc-lab demo: error: '/no/such/model-dir' is neither"),
    (["demo", "--device", "tpu"], "xenc-lab demo: error: device must be"),
], ids=["demo-pairs", "bench-repeats", "bench-threads", "demo-model", "demo-device"])
def test_bad_arguments_get_a_one_line_error_not_a_traceback(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA GPU is visible")
def test_demo_on_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--device", "cuda"])
    assert "torch sees no CUDA GPU here" in capsys.readouterr().err


def test_bench_threads_set_torchs_threads_for_the_run_and_its_report(monkeypatch):
    from xenc_lab import bench

    seen = {}

    def fake_run(*args, **kwargs):
        seen["threads"], seen["machine"] = torch.get_num_threads(), bench.machine()
        return []

    monkeypatch.setattr(bench, "run", fake_run)
    before = torch.get_num_threads()
    try:
        assert main(["bench", "--workloads", "short", "--dtypes", "float32", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen["threads"] == 1 and ", 1 threads," in seen["machine"]
