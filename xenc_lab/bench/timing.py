"""Side-by-side throughput: xenc_lab against sentence-transformers' CrossEncoder, in one process.

Both engines score the same pairs at the same dtype and thread count, tokenization included, in alternating runs;
the ratio of their pairs/s is the result (these machines are noisy, ratios less so). Scores are checked on the same
run against sentence-transformers in fp32; at a 16-bit dtype, xenc_lab's error is also given over
sentence-transformers' own at that dtype (docs/benchmarking.md).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..config import DTYPES, resolve_device, whole_number
from ..attention_paths import attention_rates
from ..cpu.info import native_half_units
from ..cpu.int8 import int8_products
from ..st_args import split_pairs
from .flops import attention_heads, gemm_rate, model_gflop
from .workloads import WORKLOADS, make_pairs


@dataclass
class BenchRow:
    workload: str
    dtype: str
    engine: str
    pairs: int
    mean_tokens: float
    pairs_per_s: float
    ratio: float  # pairs/s over sentence-transformers' at the same dtype
    gflops: float  # achieved GFLOP/s of the model's math
    ceiling_share: float  # gflops / GEMM rate measured at the model's shapes
    max_abs_delta: float  # against sentence-transformers fp32 on the same pairs
    seconds: float
    oracle_drift: float = 0.0  # max |change| of sentence-transformers' fp32 logits between two identical calls
    compiled_graphs: int = 0  # xenc_lab with compile=True: graphs compiled so far in this dtype
    batch_shapes: int = 0  # distinct (tokens, sequences, attention length) batch shapes they ran
    compile_seconds: float = 0.0  # time of the calls that compiled a graph
    bf16_gemm: str = ""  # bfloat16 rows: how xenc_lab's bf16 GEMMs ran ("native", "fp32" or "fp16", cpu.gemm.bf16_gemm)
    native_bf16_gflops: float = 0.0  # where they did not run native: oneDNN's native bf16 rate
    fp32_bf16_gflops: float = 0.0  # where they ran in fp16: the rate of the fp32 route
    attention_path: str = ""  # xenc_lab rows: where its CPU attention ran ("kernel", "tiles" or "sdpa")
    kernel_attention_gflops: float = 0.0  # attention alone at the model's head shapes and the workload's mean length:
    sdpa_attention_gflops: float = 0.0  # xenc_lab's kernel and torch's SDPA (pairs laid out with a key mask),
    tiles_attention_gflops: float = 0.0  # and the kernel's tile path where it runs (bf16/fp16; 0: not measured)
    device: str = "cpu"  # where both engines ran ("cpu" or "cuda")
    mean_abs_delta: float = 0.0  # against sentence-transformers fp32, as max_abs_delta
    # xenc_lab rows at a dtype other than float32: its error against sentence-transformers fp32 over
    # sentence-transformers' own at that dtype, by the mean and by the max of the abs deltas (0: not applicable)
    error_ratio: float = 0.0
    max_error_ratio: float = 0.0
    int8_route: str = ""  # "xenc_lab int8" rows: what multiplied its codes ("kernel, brgemm", "kernel, own", "torch")



def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16, read from the CPU's flags (never assumed)."""
    return bool(native_half_units("bfloat16"))


def _check_run(device, dtypes, repeats, n_pairs) -> tuple[torch.device, list[str]]:
    """The device and dtypes of a run, and its counts, checked before anything is loaded or timed."""
    device = resolve_device(device)
    if isinstance(dtypes, str):
        dtypes = [dtypes]
    dtypes = list(dtypes)
    unknown = [d for d in dtypes if d not in DTYPES]
    if not dtypes or unknown:
        raise ValueError(f"dtypes must be a non-empty list of {tuple(DTYPES)}, got {dtypes!r}")
    if device.type == "cpu" and set(dtypes) == {"bfloat16"} and not cpu_has_fast_bf16():
        raise ValueError("bfloat16 is skipped on this CPU (neither AMX nor AVX512-BF16) and no other dtype was asked "
                         "for: nothing would run")
    whole_number("repeats", repeats)
    whole_number("n_pairs", n_pairs)
    return device, dtypes


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _resolve_workloads(workloads, n_pairs: int, seed: int) -> list[tuple[str, list]]:
    """(name, pairs) for each workload: a built-in name ('short', 'mixed', 'long'), a (name, pairs)
    tuple, or a mapping of names to pairs. All are checked before anything is timed."""
    if isinstance(workloads, str) or (isinstance(workloads, tuple) and len(workloads) == 2 and isinstance(workloads[0], str)
                                      and not isinstance(workloads[1], str)):
        workloads = [workloads]  # one workload: a name, or a (name, pairs) tuple
    items = list(workloads.items()) if isinstance(workloads, dict) else list(workloads)
    if not items:
        raise ValueError("workloads must name at least one workload")
    resolved = []
    for item in items:
        if isinstance(item, str):
            if item not in WORKLOADS:
                raise ValueError(f"workload {item!r} is not a built-in one {WORKLOADS}; pass (name, pairs) for your own")
            resolved.append((item, make_pairs(item, n_pairs, seed=seed)))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, pairs = item
            if not isinstance(pairs, (list, tuple)) or not pairs:
                raise ValueError(f"workload {name!r}: expected a non-empty list of (query, passage) pairs, got {type(pairs).__name__}")
            split_pairs(pairs)
            resolved.append((name, [tuple(p) for p in pairs]))
        else:
            raise TypeError(f"each workload must be a built-in name or a (name, pairs) tuple, got {type(item).__name__}")
    names = [name for name, _ in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"workload names must be distinct, got {names}")
    return resolved


def run(
    model_path=None,
    workloads=("short", "mixed", "long"),
    dtypes=("float32", "bfloat16"),
    n_pairs: int = 256,
    repeats: int = 3,
    compile: bool = False,
    st_batch_size: int = 32,
    seed: int = 0,
    device: str | torch.device = "cpu",
    max_batch_tokens: int | None = None,
    log=print,
    int8: bool = False,
) -> list[BenchRow]:
    """Benchmark rows for each (workload, dtype): sentence-transformers, xenc_lab, and with ``compile``
    xenc_lab with compile=True as a third engine, both engines on ``device`` ("cpu" or "cuda").

    ``workloads`` are built-in names (``n_pairs`` pairs each, from ``seed``), ``(name, pairs)`` tuples
    of your own (``xenc_lab.bench.workloads.load_pairs`` reads them from a file), or a dict of name to pairs.
    ``max_batch_tokens``: xenc_lab's token budget per batch (default: the Scorer's).
    ``int8``: on the CPU, also time xenc_lab with ``quantization="int8"`` at each dtype (the "xenc_lab int8" rows).
    ``max_abs_delta`` is always taken against sentence-transformers in fp32 on the CPU, the parity suite's
    oracle, computed once per workload."""
    from sentence_transformers import CrossEncoder

    from ..scorer import Scorer
    from ..zoo import minilm_cross_encoder

    device, dtypes = _check_run(device, dtypes, repeats, n_pairs)
    budget = {} if max_batch_tokens is None else {"max_batch_tokens": whole_number("max_batch_tokens", max_batch_tokens)}
    on_cpu = device.type == "cpu"
    workloads = _resolve_workloads(workloads, n_pairs, seed)
    path = str(model_path or minilm_cross_encoder())
    identity = torch.nn.Identity()
    rows: list[BenchRow] = []
    reference = CrossEncoder(path, device="cpu")
    references: dict[str, tuple[np.ndarray, float]] = {}  # workload -> (the oracle's logits, their drift)
    if not on_cpu:
        log(f"device: {device_name(device)}")
    for dtype in dtypes:
        if on_cpu and dtype == "bfloat16" and not cpu_has_fast_bf16():
            log("skipping bfloat16: this CPU has neither AMX nor AVX512-BF16")
            continue
        torch_dtype = getattr(torch, dtype)
        if on_cpu and dtype == "float32":
            theirs = reference
        else:
            theirs = CrossEncoder(path, device=str(device), model_kwargs={"dtype": torch_dtype})
        ours = {"xenc_lab": Scorer(path, device=device, dtype=dtype, **budget)}
        if compile:
            ours["xenc_lab compiled"] = Scorer(path, device=device, dtype=dtype, compile=True, **budget)
        if int8 and on_cpu:
            ours["xenc_lab int8"] = Scorer(path, device=device, dtype=dtype, quantization="int8", **budget)
        config = ours["xenc_lab"].hf_config
        ceiling = gemm_rate(config, torch_dtype, device=device)
        gemm, native, fp32_route = "", 0.0, 0.0
        if on_cpu and dtype == "bfloat16":
            gemm = ours["xenc_lab"].choices.bf16_gemm
            if gemm != "native":
                native = gemm_rate(config, torch_dtype, bf16_gemm="native")
                fp32_route = gemm_rate(config, torch_dtype, bf16_gemm="fp32") if gemm == "fp16" else 0.0
                log(f"bfloat16: xenc_lab's bf16 GEMMs run in {gemm} here, {ceiling:.0f} GFLOP/s; native bf16 GEMMs "
                    f"{native:.0f}" + (f", the fp32 route {fp32_route:.0f}" if fp32_route else ""))
        for workload, pairs in workloads:
            enc = ours["xenc_lab"].tokenizer([p[0] for p in pairs], [p[1] for p in pairs])
            gflop = model_gflop(config, enc.lengths)
            attention, attention_path = {}, ""
            # CPU attention alone, where the family runs the shared attention ops (DeBERTa's is its own, padded)
            if on_cpu and ours["xenc_lab"].model.head_shape() is not None:
                heads, head_dim = attention_heads(config)
                attention = attention_rates(heads, head_dim, torch_dtype, round(float(enc.lengths.mean())))
                attention_path = ours["xenc_lab"].choices.attention
                log(f"{workload} {dtype}: attention alone, GFLOP/s: "
                    + ", ".join(f"{name} {rate:.0f}" for name, rate in attention.items()) + f"; xenc_lab runs {attention_path}")
            oracle = references.get(workload)
            first = reference.predict(pairs, activation_fn=identity, batch_size=st_batch_size) if oracle is None else None
            warm = pairs[: min(64, len(pairs))]
            engines = {
                "sentence-transformers": lambda theirs=theirs, pairs=pairs: theirs.predict(
                    pairs, activation_fn=identity, batch_size=st_batch_size
                )
            }
            for name, scorer in ours.items():
                # Compiled: a first pass over every pair compiles what the timed runs will need, outside them.
                scorer.predict(pairs if scorer.config.compile else warm, activation_fn=identity)
                engines[name] = lambda scorer=scorer, pairs=pairs: scorer.predict(pairs, activation_fn=identity)
            theirs.predict(warm, activation_fn=identity, batch_size=st_batch_size)
            times = {name: [] for name in engines}
            outs = {}
            order = list(engines)
            for r in range(repeats):  # rotate which engine goes first
                for name in order[r % len(order):] + order[: r % len(order)]:
                    seconds, outs[name] = _timed(engines[name])
                    times[name].append(seconds)
            # The reference should not move; where it does (MKL's kernel choice is not fixed), say by how much.
            # Deltas are taken against its last call: where it moved, its first call was the odd one out.
            if oracle is None:
                exact = reference.predict(pairs, activation_fn=identity, batch_size=st_batch_size)
                oracle = references[workload] = exact, float(np.abs(exact - first).max())
                if oracle[1]:
                    log(f"{workload}: sentence-transformers' fp32 logits moved by up to {oracle[1]:.1e} between two identical calls")
            exact, drift = oracle
            base = None
            measured = []
            for name in engines:
                seconds = statistics.median(times[name])
                rate = len(pairs) / seconds
                base = base or rate
                delta = np.abs(np.asarray(outs[name]) - exact)
                row = BenchRow(
                    workload=workload, dtype=dtype, engine=name, pairs=len(pairs),
                    mean_tokens=float(enc.lengths.mean()), pairs_per_s=rate, ratio=rate / base,
                    gflops=gflop / seconds, ceiling_share=gflop / seconds / ceiling,
                    max_abs_delta=float(delta.max()), seconds=seconds,
                    oracle_drift=drift, bf16_gemm=gemm, native_bf16_gflops=native, fp32_bf16_gflops=fp32_route,
                    device=device.type, mean_abs_delta=float(delta.mean()),
                )
                if name in ours and attention:
                    row.attention_path = attention_path
                    row.kernel_attention_gflops = attention.get("kernel", 0.0)
                    row.sdpa_attention_gflops = attention["sdpa"]
                    row.tiles_attention_gflops = attention.get("tiles", 0.0)
                if name == "xenc_lab int8":
                    products = int8_products()  # None where the kernel does not run
                    row.int8_route = f"kernel, {products}" if products else "torch"
                if name in ours and ours[name].config.compile:
                    runner = ours[name].runner
                    row.compiled_graphs, row.batch_shapes, row.compile_seconds = runner.graphs, len(runner.shapes), runner.compile_seconds
                measured.append(row)
            set_error_ratios(measured)
            rows += measured
            if "xenc_lab int8" in ours:
                rate = {row.engine: row.pairs_per_s for row in measured}
                log(f"{workload:>5} {dtype:>8}: int8 {rate['xenc_lab int8'] / rate['xenc_lab']:.2f}x xenc_lab's "
                    f"{dtype} pairs/s, {rate['xenc_lab int8'] / rate['sentence-transformers']:.2f}x "
                    f"sentence-transformers' {dtype}")
            for row in measured:
                log(
                    f"{workload:>5} {dtype:>8} {row.engine:>21}: {row.pairs_per_s:8.1f} pairs/s  x{row.ratio:.2f}  "
                    f"{row.gflops:7.1f} GFLOP/s ({100 * row.ceiling_share:.0f}% of {ceiling:.0f})  "
                    f"max|delta| vs ST fp32 {row.max_abs_delta:.1e}"
                    + (f", error {row.error_ratio:.2f}x ST's own (max {row.max_error_ratio:.2f}x)" if row.error_ratio else "")
                )
        # A busy moment during one measurement lowers it: measure the ceiling again and keep the higher.
        settled = max(ceiling, gemm_rate(config, torch_dtype, device=device))
        if settled > ceiling:
            log(f"{dtype}: GEMM ceiling re-measured at {settled:.0f} GFLOP/s (first {ceiling:.0f}); shares use it")
            for row in rows:
                if row.dtype == dtype:
                    row.ceiling_share = row.gflops / settled
        if compile:
            runner = ours["xenc_lab compiled"].runner
            log(f"compiled graphs ({dtype}): {runner.graphs} for {len(runner.shapes)} batch shapes, compile time {runner.compile_seconds:.1f} s")
    return rows


def device_name(device: str | torch.device = "cuda") -> str:
    """A CUDA device as a report names it: model, memory, compute capability, CUDA version."""
    device = torch.device(device)
    props = torch.cuda.get_device_properties(device)
    return (f"{props.name} ({props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}, "
            f"CUDA {torch.version.cuda})")


def set_error_ratios(rows: list[BenchRow]) -> None:
    """For each (workload, dtype) other than float32, each xenc_lab row's error against sentence-transformers fp32
    over sentence-transformers' own error at that dtype on the same pairs: the bf16 goal's measure (at most 1.5)."""
    theirs = {(r.workload, r.dtype): r for r in rows if r.engine == "sentence-transformers"}
    for r in rows:
        st = theirs.get((r.workload, r.dtype))
        if r.dtype != "float32" and r.engine != "sentence-transformers" and st and st.mean_abs_delta:
            r.error_ratio = r.mean_abs_delta / st.mean_abs_delta
            r.max_error_ratio = r.max_abs_delta / st.max_abs_delta
