"""Memory of a fresh process scoring many pairs: the probe (run as ``python -m xenc_lab.bench.memory ARGS``) and the
report's sentence on two probes."""
from __future__ import annotations

import json
import resource
import sys

import torch


def _status(key: str) -> float | None:
    """VmRSS / VmHWM in MB, where /proc has them."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration):
        return None


def _probe(path, n, workload, dtype, device, max_batch_tokens, threads) -> dict:
    from ..scorer import Scorer
    from ..zoo import minilm_cross_encoder
    from .workloads import make_pairs

    torch.set_num_threads(threads)
    budget = {} if max_batch_tokens is None else {"max_batch_tokens": max_batch_tokens}
    scorer = Scorer(path or minilm_cross_encoder(), device=device, dtype=dtype, **budget)
    scorer.predict(make_pairs(workload, 16, seed=8))
    out = {"loaded_rss": _status("VmRSS")}
    pairs = make_pairs(workload, n, seed=7)
    out["input_rss"] = _status("VmRSS")
    try:  # the high-water mark, reset to what the process holds now: the peak below is scoring's own
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        out["peak_is_scoring_s"] = True
    except OSError:
        out["peak_is_scoring_s"] = False
    scores = scorer.predict(pairs, show_progress_bar=False)
    assert len(scores) == n
    out["peak_rss"] = _status("VmHWM") if out["peak_is_scoring_s"] else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["batch_shapes"] = len(scorer.runner.shapes)
    out["token_counts"] = len({T for T, _, _ in scorer.runner.shapes})
    if scorer.device.type == "cuda":
        out["peak_gpu"] = torch.cuda.max_memory_allocated(scorer.device) / 2**20
    return out


def _stream_probe(path, n, dtype, threads, distinct: int = 4096) -> dict:
    """Scores a generator of ``n`` short pairs (``distinct`` pairs over and over, so that every score can be checked
    in place against the distinct pairs' own) and reports resident memory as ``_probe`` does."""
    import time

    import numpy as np

    from ..scorer import Scorer
    from .workloads import make_pairs

    torch.set_num_threads(threads)
    scorer = Scorer(path, device="cpu", dtype=dtype)
    base = [(q[:60], d[:120]) for q, d in make_pairs("short", distinct, seed=5)]
    want = scorer.predict(base, show_progress_bar=False)
    out = {"loaded_rss": _status("VmRSS"), "input_rss": _status("VmRSS")}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    got = scorer.predict((base[i % distinct] for i in range(n)), show_progress_bar=False)
    out["seconds"] = time.perf_counter() - start
    out["peak_rss"] = _status("VmHWM")
    out["max_abs_delta_in_place"] = float(np.abs(got - np.resize(want, n)).max())
    out["scores"] = len(got)
    return out


def stream_memory_mb(n_pairs: int, model_path, dtype: str = "float32", threads: int | None = None) -> dict:
    """``_stream_probe`` in a fresh process (Linux: it reads /proc): resident memory when ``n_pairs`` short pairs
    stream through ``Scorer.predict`` from a generator, the peak over what the process held before, and the largest
    difference between a score and its pair's own score (every score in its place)."""
    import subprocess

    args = json.dumps(["stream", str(model_path), n_pairs, dtype, threads or torch.get_num_threads()])
    out = subprocess.run([sys.executable, "-m", "xenc_lab.bench.memory", args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def peak_memory_mb(
    n_pairs: int,
    model_path=None,
    workload: str = "mixed",
    dtype: str = "float32",
    device: str = "cpu",
    max_batch_tokens: int | None = None,
    threads: int | None = None,
) -> dict:
    """Memory (MB) of a fresh process that scores ``n_pairs`` pairs on ``device`` with ``max_batch_tokens`` (default:
    the Scorer's) and ``threads`` (default: this process's): resident memory after loading the model and scoring 16 pairs
    (``loaded_rss``), after building the input (``input_rss``), and the peak while scoring (``peak_rss``); how many
    batch shapes (``batch_shapes``) and token counts (``token_counts``) the model met, loading included. On Linux
    the kernel's high-water mark is reset before scoring, so the peak is scoring's own (``peak_is_scoring_s``);
    elsewhere it is the process's lifetime peak, which loading may set. On CUDA also the most GPU memory torch held
    at once (``peak_gpu``)."""
    import subprocess
    import sys

    threads = threads or torch.get_num_threads()
    args = json.dumps([str(model_path) if model_path else None, n_pairs, workload, dtype, str(device),
                       max_batch_tokens, threads])
    out = subprocess.run([sys.executable, "-m", "xenc_lab.bench.memory", args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_facts(small: dict, large: dict, sizes: tuple[int, int] = (2000, 20000)) -> dict:
    """What the report says of two ``peak_memory_mb`` probes of ``sizes`` pairs, as numbers (MB, counts), each a
    (small, large) pair: ``held`` with the model and the input, ``loaded`` before the input, ``peak`` and ``growth`` (peak
    over held), the input ``ratio``, whether the peaks are scoring's own (``scoring_peak``: else the process's lifetime
    peak), ``token_counts``, ``batch_shapes`` and, on a GPU, ``peak_gpu``."""
    both = lambda key: (small[key], large[key])
    facts = {"sizes": tuple(sizes), "held": both("input_rss"), "loaded": both("loaded_rss"), "peak": both("peak_rss"),
             "growth": (small["peak_rss"] - small["input_rss"], large["peak_rss"] - large["input_rss"]),
             "ratio": sizes[1] // sizes[0], "scoring_peak": bool(small["peak_is_scoring_s"] and large["peak_is_scoring_s"]),
             "token_counts": both("token_counts"), "batch_shapes": both("batch_shapes")}
    if "peak_gpu" in small:
        facts["peak_gpu"] = both("peak_gpu")
    return facts


def memory_note(small: dict, large: dict, dtype: str, device: str, sizes: tuple[int, int] = (2000, 20000),
                workload: str = "mixed") -> str:
    """The report's sentence on two ``peak_memory_mb`` probes of ``sizes`` pairs (``memory_facts`` in words)."""
    f = memory_facts(small, large, sizes)
    what = "the peak while scoring" if f["scoring_peak"] else (
        "the process's lifetime peak (loading included: no high-water mark to reset here)")
    note = (
        f"Memory of a fresh process scoring {workload} pairs in {dtype} on {device}: with the model loaded and the input "
        f"built it held {f['held'][0]:.0f} MB for {f['sizes'][0]:,} pairs and {f['held'][1]:.0f} MB for "
        f"{f['sizes'][1]:,} ({f['loaded'][0]:.0f} and {f['loaded'][1]:.0f} MB before the input); {what} was "
        f"{f['peak'][0]:.0f} and {f['peak'][1]:.0f} MB, {f['growth'][0]:+.0f} and {f['growth'][1]:+.0f} MB over that "
        f"for {f['ratio']}x the input. The runs met {f['token_counts'][0]} and {f['token_counts'][1]} batch "
        f"token counts ({f['batch_shapes'][0]} and {f['batch_shapes'][1]} batch shapes)."
    )
    if "peak_gpu" in f:
        note += f" Peak GPU memory held by torch: {f['peak_gpu'][0]:.0f} MB and {f['peak_gpu'][1]:.0f} MB."
    return note


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(json.dumps(_stream_probe(*args[1:]) if args[0] == "stream" else _probe(*args)))
