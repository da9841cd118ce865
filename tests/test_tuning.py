"""Where CPU attention runs: the kernel unless the CPU has AMX for the dtype; there, the path measured fastest
(kernel, its tile path where that runs, SDPA), measured once per kind of CPU and head shape and recorded; the
environment forces any."""
from __future__ import annotations

import json

import pytest
import torch

from xenc_lab import attention_paths as tuning
from xenc_lab.cpu import kernels, native
from xenc_lab.cpu.info import CpuInfo


@pytest.fixture
def cpu(monkeypatch, tmp_path):
    """A CPU with the given flags, a fresh cache directory, and no answers in this process yet."""
    monkeypatch.setenv("XENC_LAB_CACHE", str(tmp_path))
    monkeypatch.delenv("XENC_LAB_CPU_ATTENTION", raising=False)
    monkeypatch.setattr(tuning, "_choices", {})

    def with_flags(*flags: str) -> None:
        monkeypatch.setattr(tuning, "cpu_info", lambda: CpuInfo("GenuineIntel", "test CPU", frozenset(flags)))

    return with_flags


def fake_rates(monkeypatch, kernel: float, sdpa: float, tiles: float | None = None) -> list:
    """Rates by path; with ``tiles``, the tile path runs here too (a candidate), else it does not."""
    calls = []

    def rates(num_heads, head_dim, dtype, pair_tokens, **kwargs):
        calls.append((num_heads, head_dim, dtype, pair_tokens))
        return {"kernel": kernel, "sdpa": sdpa} | ({} if tiles is None else {"tiles": tiles})

    monkeypatch.setattr(tuning, "attention_rates", rates)
    monkeypatch.setattr(tuning.kernels, "tiles_available", lambda dtype: tiles is not None)
    return calls


def test_float32_and_cpus_without_amx_run_the_kernel_without_measuring(cpu, monkeypatch):
    calls = fake_rates(monkeypatch, kernel=1.0, sdpa=100.0)
    cpu("avx512f", "avx512_bf16")
    assert tuning.cpu_attention_path(torch.bfloat16, 12, 32) == "kernel"
    assert tuning.cpu_attention_path(torch.float16, 12, 32) == "kernel"
    cpu("amx_bf16", "amx_tile")
    assert tuning.cpu_attention_path(torch.float32, 12, 32) == "kernel"
    assert tuning.cpu_attention_path(torch.float16, 12, 32) == "kernel", "amx_bf16 does not speed up float16"
    assert calls == []


@pytest.mark.skipif(not native.available(), reason="the CPU attention kernel could not be built here")
@pytest.mark.parametrize("faster", ["kernel", "tiles", "sdpa"])
def test_with_amx_the_fastest_path_is_measured_once_and_recorded(cpu, monkeypatch, tmp_path, faster):
    calls = fake_rates(monkeypatch, kernel=200.0 if faster == "kernel" else 50.0, sdpa=100.0,
                       tiles=300.0 if faster == "tiles" else 80.0)
    cpu("amx_bf16", "amx_tile")
    assert tuning.cpu_attention_path(torch.bfloat16, 12, 32) == faster
    assert tuning.cpu_attention_path(torch.bfloat16, 12, 32) == faster
    assert [c[3] for c in calls] == list(tuning.TUNING_LENGTHS), "measured once, at each tuning length"
    record = json.loads(next(tmp_path.glob("kernels/*/*/attention-paths.json")).read_text())
    threads = torch.get_num_threads()
    key = f"bfloat16-12x32-{threads}threads-kernel+tiles+sdpa"
    assert record == {key: faster}
    # A new process reads the record instead of measuring again; another head shape is measured on its own.
    monkeypatch.setattr(tuning, "_choices", {})
    assert tuning.cpu_attention_path(torch.bfloat16, 12, 32) == faster
    assert len(calls) == len(tuning.TUNING_LENGTHS)
    tuning.cpu_attention_path(torch.bfloat16, 16, 64)
    assert len(calls) == 2 * len(tuning.TUNING_LENGTHS)
    record = json.loads(next(tmp_path.glob("kernels/*/*/attention-paths.json")).read_text())
    assert set(record) == {key, f"bfloat16-16x64-{threads}threads-kernel+tiles+sdpa"}


@pytest.mark.skipif(not native.available(), reason="the CPU attention kernel could not be built here")
def test_a_record_made_without_the_tile_path_is_measured_again_with_it(cpu, monkeypatch, tmp_path):
    """A record made where the tile path did not run (an older xenc_lab, or another torch) does not keep it out."""
    calls = fake_rates(monkeypatch, kernel=50.0, sdpa=100.0)
    cpu("amx_bf16")
    assert tuning.cpu_attention_path(torch.bfloat16, 12, 32) == "sdpa"
    monkeypatch.setattr(tuning, "_choices", {})
    again = fake_rates(monkeypatch, kernel=50.0, sdpa=100.0, tiles=300.0)
    assert tuning.cpu_attention_path(torch.bfloat16, 12, 32) == "tiles"
    assert len(calls) == len(again) == len(tuning.TUNING_LENGTHS)


@pytest.mark.skipif(not native.available(), reason="the CPU attention kernel could not be built here")
def test_the_measurement_times_every_path_on_this_cpu(cpu):
    """Unfaked: the paths that run here are timed at the model's head shapes and the choice is one of them."""
    rates = tuning.attention_rates(2, 8, torch.bfloat16, 40, tokens=400, repeats=2)
    expected = {"kernel", "sdpa"} | ({"tiles"} if kernels.tiles_available(torch.bfloat16) else set())
    assert set(rates) == expected
    cpu("amx_bf16")
    assert tuning.cpu_attention_path(torch.bfloat16, 2, 8) in expected


def test_a_paths_rate_is_its_attention_flops_over_its_best_repeat(monkeypatch):
    """On a fixed clock: each path keeps its fastest repeat, and its rate is 4 d n^2 per pair over that time."""
    paths = tuning.candidate_paths(torch.bfloat16)
    best = {path: 0.01 * (i + 1) for i, path in enumerate(paths)}
    durations = iter([2 * best[p] for p in paths] + [best[p] for p in paths] + [3 * best[p] for p in paths])
    clock = {"now": 0.0, "started": False}

    def perf_counter():  # every second call ends a timed run
        if clock["started"]:
            clock["now"] += next(durations)
        clock["started"] = not clock["started"]
        return clock["now"]

    monkeypatch.setattr(tuning.time, "perf_counter", perf_counter)
    rates = tuning.attention_rates(2, 8, torch.bfloat16, 40, tokens=400, repeats=3)
    pairs, d, n = 400 // 40, 2 * 8, 40
    assert rates == pytest.approx({p: 4 * d * n * n * pairs / best[p] / 1e9 for p in paths}, rel=1e-9)


def test_the_environment_forces_a_path(cpu, monkeypatch):
    calls = fake_rates(monkeypatch, kernel=1.0, sdpa=100.0)
    cpu("amx_bf16")
    monkeypatch.setenv("XENC_LAB_CPU_ATTENTION", "Kernel")
    assert tuning.cpu_attention_path(torch.bfloat16, 12, 32) == "kernel"
    monkeypatch.setenv("XENC_LAB_CPU_ATTENTION", "sdpa")
    assert tuning.cpu_attention_path(torch.float32, 12, 32) == "sdpa"
    monkeypatch.setenv("XENC_LAB_CPU_ATTENTION", "tiles")
    assert tuning.cpu_attention_path(torch.float32, 12, 32) == "tiles"  # float32 then runs the kernel
    assert calls == []
    monkeypatch.setenv("XENC_LAB_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="XENC_LAB_CPU_ATTENTION must be one of kernel, tiles, sdpa, got 'fast'"):
        tuning.cpu_attention_path(torch.float32, 12, 32)
