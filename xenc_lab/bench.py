"""Side-by-side throughput: xenc_lab against sentence-transformers' CrossEncoder, in one process.

Both engines score the same pairs at the same dtype and thread count, tokenization included, in
alternating runs; the ratio of their pairs/s is the result (these machines are noisy, ratios less so).
The model's math is counted as 2 x non-embedding matmul parameters x tokens plus attention, and shown
against a GEMM rate measured on the spot at the model's own shapes (the ceiling). Scores are checked on the same
run against sentence-transformers in fp32; at a 16-bit dtype, xenc_lab's error is also given over
sentence-transformers' own at that dtype.
"""
from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .config import DTYPES, resolve_device, whole_number
from .cpuinfo import cpu_info, native_half_units
from .kernels import widened_gemm_available
from .layers import PrepackedLinear
from .tuning import attention_rates, cpu_attention_path
from .workloads import make_pairs


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
    bf16_gemm: str = ""  # bfloat16 rows: how xenc_lab's bf16 GEMMs ran ("native", "fp32" or "fp16", layers.bf16_gemm)
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


def encoder_dims(config) -> tuple[int, int, int]:
    """(layers, hidden, intermediate) of an encoder config, whatever the family calls them."""
    layers = getattr(config, "num_hidden_layers", None) or config.n_layers
    hidden = getattr(config, "hidden_size", None) or config.dim
    inter = getattr(config, "intermediate_size", None) or config.hidden_dim
    return layers, hidden, inter


def attention_heads(config) -> tuple[int, int]:
    """(heads, head dim) of an encoder config whose attention runs in ``layers.packed_attention``."""
    _, d, _ = encoder_dims(config)
    heads = getattr(config, "num_attention_heads", None) or config.n_heads
    return heads, d // heads


def projection_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of each layer's projections: fused QKV, attention output, the feed-forward's two (ModernBERT's
    first one is GeGLU's, twice as wide)."""
    _, d, f = encoder_dims(config)
    up = 2 * f if getattr(config, "model_type", "") == "modernbert" else f
    return [(d, 3 * d), (d, d), (d, up), (f, d)]


def _relative_span(config) -> tuple[int, int]:
    """DeBERTa-v2's disentangled attention: (relative positions each token's c2p/p2c scores span, how many of the
    two terms the config turns on); (0, 0) elsewhere."""
    if getattr(config, "model_type", "") != "deberta-v2" or not getattr(config, "relative_attention", False):
        return 0, 0
    from .models.deberta_v2 import _pos_att_type

    buckets, max_relative = getattr(config, "position_buckets", -1), getattr(config, "max_relative_positions", -1)
    span = buckets if buckets > 0 else max_relative if max_relative > 0 else config.max_position_embeddings
    return 2 * span, len(_pos_att_type(config) & {"c2p", "p2c"})


def model_gflop(config, lengths: np.ndarray) -> float:
    """The full model's math in GFLOP, as both engines' work is counted: 2 x non-embedding matmul weights x tokens
    (ELECTRA's embedding projection included), attention's 4 x layers x d x n^2, and DeBERTa-v2's c2p/p2c scores,
    2 x layers x d x (2 x span) per token each. DeBERTa's projection of its relative embeddings, done once a batch
    (so per pair depending on batching: 2.3% of a 32-pair batch of 100-token pairs at v3-base size), is left out."""
    layers, d, _ = encoder_dims(config)
    weights = layers * sum(k * n for k, n in projection_shapes(config))
    embedding = getattr(config, "embedding_size", None)
    if getattr(config, "model_type", "") == "electra" and embedding and embedding != d:
        weights += embedding * d
    positions, terms = _relative_span(config)
    per_token = 2 * weights + terms * 2 * layers * d * positions
    lengths = lengths.astype(np.float64)
    return (per_token * lengths.sum() + 4 * layers * d * (lengths**2).sum()) / 1e9


def gemm_rate(
    config,
    dtype: torch.dtype,
    tokens: int | None = None,
    repeats: int = 10,
    bf16_gemm: str | None = None,
    device: str | torch.device = "cpu",
) -> float:
    """GFLOP/s of the fastest GEMM at the model's projection shapes (``projection_shapes``). On the
    CPU: oneDNN with prepacked weights where available, else torch's default; in bfloat16 that is the path
    xenc_lab takes (``layers.bf16_gemm``) unless ``bf16_gemm`` says which. On CUDA: torch's
    GEMM (cuBLAS) at torch's precision settings. ``tokens`` rows: 4,096 on the CPU (a batch's worth), 65,536 on
    CUDA, where a 4,096-row GEMM of a small model is over before the GPU fills."""
    device = torch.device(device)
    tokens = tokens or (4096 if device.type == "cpu" else 65536)
    shapes = projection_shapes(config)
    x = {k: torch.randn(tokens, k, dtype=dtype, device=device) for k in {k for k, _ in shapes}}
    linears = {}
    for k, n in shapes:
        linear = torch.nn.Linear(k, n, bias=False).to(device=device, dtype=dtype).requires_grad_(False)
        fast = PrepackedLinear.supported(dtype, device)
        linears[k, n] = PrepackedLinear(linear, bf16_gemm) if fast else linear
    flop = sum(2 * tokens * k * n for k, n in shapes)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    with torch.inference_mode():
        for k, n in shapes:  # warm up: oneDNN builds each shape's kernel on its first call (cuBLAS its handle)
            linears[k, n](x[k])
        sync()
        for _ in range(repeats):
            start = time.perf_counter()
            for k, n in shapes:
                linears[k, n](x[k])
            sync()
            best = min(best, time.perf_counter() - start)
    return flop / best / 1e9


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
    from .scorer import _split_pairs
    from .workloads import WORKLOADS

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
            _split_pairs(pairs)
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
) -> list[BenchRow]:
    """Benchmark rows for each (workload, dtype): sentence-transformers, xenc_lab, and with ``compile``
    xenc_lab with compile=True as a third engine, both engines on ``device`` ("cpu" or "cuda").

    ``workloads`` are built-in names (``n_pairs`` pairs each, from ``seed``), ``(name, pairs)`` tuples
    of your own (``xenc_lab.workloads.load_pairs`` reads them from a file), or a dict of name to pairs.
    ``max_batch_tokens``: xenc_lab's token budget per batch (default: the Scorer's).
    ``max_abs_delta`` is always taken against sentence-transformers in fp32 on the CPU, the parity suite's
    oracle, computed once per workload."""
    from sentence_transformers import CrossEncoder

    from . import Scorer
    from .zoo import minilm_cross_encoder

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
        config = ours["xenc_lab"].hf_config
        ceiling = gemm_rate(config, torch_dtype, device=device)
        gemm, native, fp32_route = "", 0.0, 0.0
        if on_cpu and dtype == "bfloat16":
            gemm = next((m.gemm for m in ours["xenc_lab"].model.modules() if isinstance(m, PrepackedLinear)), "native")
            if gemm != "native":
                native = gemm_rate(config, torch_dtype, bf16_gemm="native")
                fp32_route = gemm_rate(config, torch_dtype, bf16_gemm="fp32") if gemm == "fp16" else 0.0
                log(f"bfloat16: xenc_lab's bf16 GEMMs run in {gemm} here, {ceiling:.0f} GFLOP/s; native bf16 GEMMs "
                    f"{native:.0f}" + (f", the fp32 route {fp32_route:.0f}" if fp32_route else ""))
        for workload, pairs in workloads:
            enc = ours["xenc_lab"].tokenizer([p[0] for p in pairs], [p[1] for p in pairs])
            gflop = model_gflop(config, enc.lengths)
            attention, attention_path = {}, ""
            # CPU attention alone; DeBERTa's attention is its own, padded
            if on_cpu and not ours["xenc_lab"].architecture.startswith("DebertaV2"):
                heads, head_dim = attention_heads(config)
                attention = attention_rates(heads, head_dim, torch_dtype, round(float(enc.lengths.mean())))
                attention_path = cpu_attention_path(torch_dtype, heads, head_dim)
                if attention_path not in attention:  # forced where it does not run: what runs instead
                    attention_path = "kernel" if attention_path == "tiles" and "kernel" in attention else "sdpa"
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
                if name in ours and ours[name].config.compile:
                    runner = ours[name].runner
                    row.compiled_graphs, row.batch_shapes, row.compile_seconds = runner.graphs, len(runner.shapes), runner.compile_seconds
                measured.append(row)
            set_error_ratios(measured)
            rows += measured
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


def set_error_ratios(rows: list[BenchRow]) -> None:
    """For each (workload, dtype) other than float32, each xenc_lab row's error against sentence-transformers fp32
    over sentence-transformers' own error at that dtype on the same pairs: the bf16 goal's measure (at most 1.5)."""
    theirs = {(r.workload, r.dtype): r for r in rows if r.engine == "sentence-transformers"}
    for r in rows:
        st = theirs.get((r.workload, r.dtype))
        if r.dtype != "float32" and r.engine != "sentence-transformers" and st and st.mean_abs_delta:
            r.error_ratio = r.mean_abs_delta / st.mean_abs_delta
            r.max_error_ratio = r.max_abs_delta / st.max_abs_delta


def as_dicts(rows: list[BenchRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def device_name(device: str | torch.device = "cuda") -> str:
    """A CUDA device as a report names it: model, memory, compute capability, CUDA version."""
    device = torch.device(device)
    props = torch.cuda.get_device_properties(device)
    return (f"{props.name} ({props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}, "
            f"CUDA {torch.version.cuda})")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def machine(device: str | torch.device = "cpu") -> str:
    """The machine and the software a report's ratios belong to: CPU (or GPU and host), threads, bf16 units, and
    the versions of torch and of the peer, sentence-transformers with its transformers."""
    info = cpu_info()
    cpu, flags = info.model + (f" ({info.family})" if info.family else ""), info.flags
    units = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512_fp16", "AVX512-FP16"))
    bf16 = ", ".join(name for flag, name in units if flag in flags) or "no bf16 units"
    peers = ", ".join(f"{name} {_version(name)}" for name in ("sentence-transformers", "transformers"))
    host = f"{cpu}, {torch.get_num_threads()} threads, {bf16}, torch {torch.__version__}, {peers}"
    if torch.device(device).type == "cuda":
        return f"{device_name(device)}; host {host}"
    return host


_NATIVE_NOTE = (
    "bf16 GEMMs ran as oneDNN's native ones in both engines here (AMX tiles, or an AMD core's bf16 dot product, "
    "which does the work of two fp32 FMAs): the bf16 ceiling above is their rate, and the difference between the "
    "engines is what each does around the same GEMMs."
)
_FP32_NOTE = (
    "xenc_lab runs its bf16 products as fp32 GEMMs on the bf16 values instead: the products of bf16 numbers are exact "
    "in fp32, the sums are fp32 and the output is rounded to bf16 once, as in a bf16 GEMM."
)
_OWN_FP32_NOTE = (
    " Its GEMM is xenc_lab's own around oneDNN's fp32 brgemm ukernel: each block of input rows is widened in cache, "
    "and the bias, GELU or residual and the rounding are applied to each output tile in cache."
)
_FP16_NOTE = (
    "xenc_lab runs its bf16 GEMMs in fp16 instead (AVX512-FP16: 32 multiply-adds per FMA, twice an fp32 FMA's, at "
    "the same rate): bf16 values are exact in fp16 once scaled by powers of two, the sums run in fp16 over 64 "
    "consecutive products and in fp32 across them, and the output is rounded to bf16 once; the bias, GELU or "
    "residual and the rounding are applied to each output tile in cache. The fp32 route (fp32 GEMMs on the bf16 "
    "values, as exact as a bf16 GEMM) ran at {fp32:.0f} GFLOP/s; `XENC_LAB_BF16_GEMM=fp32` takes it. The fp16 "
    "sums' rounding shows in `max abs delta` next to sentence-transformers' own bf16 error."
)


def write_report(rows: list[BenchRow], out_dir: Path, command: str, notes: str = "") -> Path:
    """reports/throughput.md and reports/throughput.png from benchmark rows, and the rows themselves with the
    machine and the command in reports/throughput.json (for comparing runs)."""
    if not rows:
        raise ValueError(f"no benchmark rows to report: {out_dir} is left as it was")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    devices = sorted({r.device for r in rows})
    if len(devices) > 1:
        raise ValueError(f"a report covers one device, got rows from {devices}")
    compared = lambda r: r.dtype != "float32" and r.engine != "sentence-transformers"
    errors = any(compared(r) for r in rows)  # a column where some dtype is not float32
    lines = [
        "# Throughput: xenc_lab against sentence-transformers",
        "",
        f"Machine: {machine(devices[0])}. Regenerate with `{command}`.",
        (
            "Both engines in one process on the same pairs, alternating runs, tokenization included; "
            "`ratio` is pairs/s over sentence-transformers' `CrossEncoder.predict(batch_size=32)` at the same dtype. "
            "GFLOP/s counts the model's math (2 x non-embedding matmul weights x tokens + attention); "
            "`ceiling` is that as a share of a GEMM rate measured on the spot at the model's shapes "
            "(xenc_lab skips the last layer's work on all but the first token, so its share can pass 100%). "
            "`max abs delta` is against sentence-transformers in fp32 on the same pairs (raw logits)."
            + (" `error vs ST's own`, at a dtype other than float32: xenc_lab's mean abs delta (and max) over "
               "sentence-transformers' own at that dtype, on the same pairs." if errors else "")
        ),
        "",
        "| workload | dtype | engine | pairs | mean tokens | pairs/s | ratio | GFLOP/s | ceiling | max abs delta |"
        + (" error vs ST's own |" if errors else ""),
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if errors else ""),
    ]
    for r in rows:
        error = (f" {r.error_ratio:.2f} (max {r.max_error_ratio:.2f}) |" if r.error_ratio
                 else " n/a (ST's own error is 0) |" if compared(r) else " |")
        lines.append(
            f"| {r.workload} | {r.dtype} | {r.engine} | {r.pairs} | {r.mean_tokens:.0f} | {r.pairs_per_s:.1f} | "
            f"{r.ratio:.2f}x | {r.gflops:.0f} | {100 * r.ceiling_share:.0f}% | {r.max_abs_delta:.1e} |"
            + (error if errors else "")
        )
    ceilings = {r.dtype: r.gflops / r.ceiling_share for r in rows if r.ceiling_share}
    lines += ["", "GEMM rate measured at the model's shapes (the ceiling): "
              + ", ".join(f"{dtype} {rate:.0f} GFLOP/s" for dtype, rate in ceilings.items()) + "."]
    bf16 = next((r for r in rows if r.dtype == "bfloat16" and r.native_bf16_gflops), None)
    if bf16:
        lines += ["", f"On this CPU oneDNN's native bf16 GEMMs ran at {bf16.native_bf16_gflops:.0f} GFLOP/s: without AMX, an "
                  "Intel core issues one bf16 dot product (two multiply-adds per lane) per cycle against two fp32 FMAs. "
                  + (_FP16_NOTE.format(fp32=bf16.fp32_bf16_gflops) if bf16.bf16_gemm == "fp16" else _FP32_NOTE
                     + (_OWN_FP32_NOTE if widened_gemm_available() else ""))
                  + " The weights and activations stay bf16, and the bf16 ceiling above is the rate of the GEMM "
                  "xenc_lab ran. sentence-transformers' bf16 runs native."]
    elif any(r.dtype == "bfloat16" and r.bf16_gemm == "native" for r in rows):
        lines += ["", _NATIVE_NOTE]
    attention = {(r.workload, r.dtype): r for r in rows if r.attention_path}
    if attention:
        lines += ["", "Attention alone at the model's head shapes, on 4096-token batches of pairs of the workload's mean "
                  "length, GFLOP/s: " + "; ".join(
                      f"{w} {dt}: kernel {r.kernel_attention_gflops:.0f}, "
                      + (f"tiles {r.tiles_attention_gflops:.0f}, " if r.tiles_attention_gflops else "")
                      + f"SDPA {r.sdpa_attention_gflops:.0f} (ran: {r.attention_path})" for (w, dt), r in attention.items()) + ". "
                  "xenc_lab's kernel reads the packed stream in place; SDPA's time includes laying the pairs out and back. "
                  "Where the CPU has AMX for the dtype, the kernel's tile path (Q K^T and P V as oneDNN GEMMs on AMX "
                  "tiles) and SDPA are measured against the kernel at the model's head shapes and the fastest runs; "
                  "elsewhere the kernel (`XENC_LAB_CPU_ATTENTION` forces one)."]
    drifted = {(r.workload, r.dtype): r.oracle_drift for r in rows if r.oracle_drift}
    if drifted:
        lines += ["", "sentence-transformers' own fp32 logits moved between two identical calls in this run by up to "
                  + ", ".join(f"{d:.1e} ({w}, {dt})" for (w, dt), d in drifted.items())
                  + ": deltas against that reference are no finer than this."]
    compiled = [r for r in rows if r.compiled_graphs]
    if compiled:
        last = {r.dtype: r for r in compiled}
        lines += [""] + [
            f"compile=True, {dtype}: {r.compiled_graphs} graph(s) compiled in {r.compile_seconds:.0f} s for "
            f"{r.batch_shapes} distinct batch shapes (first calls, outside the timed runs)."
            for dtype, r in last.items()
        ]
    if notes:
        lines += ["", notes]
    lines += ["", "![pairs/s by mode and workload](throughput.png)", ""]
    (out_dir / "throughput.md").write_text("\n".join(lines))
    record = {"machine": machine(devices[0]), "command": command, "notes": notes, "rows": as_dicts(rows)}
    (out_dir / "throughput.json").write_text(json.dumps(record, indent=1) + "\n")

    from matplotlib.figure import Figure  # not pyplot: no backend is chosen for the process, no figure left open

    plot(rows, ax=Figure(figsize=(8, 4)).subplots()).savefig(out_dir / "throughput.png", dpi=120)
    return out_dir / "throughput.md"


def plot(rows: list[BenchRow], ax=None):
    """Bars of pairs/s by workload, one per (dtype, engine): the report's figure, for a notebook too. Draws on
    ``ax`` if given, else on a new pyplot figure, and returns the figure."""
    if not rows:
        raise ValueError("no benchmark rows to plot")
    if ax is None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
    else:
        fig = ax.figure
    modes = sorted({(r.dtype, r.engine) for r in rows})
    workloads = list(dict.fromkeys(r.workload for r in rows))
    width = 0.8 / len(modes)
    for i, (dtype, engine) in enumerate(modes):
        rates = [next((r.pairs_per_s for r in rows if (r.workload, r.dtype, r.engine) == (w, dtype, engine)), 0) for w in workloads]
        ax.bar(np.arange(len(workloads)) + i * width, rates, width, label=f"{engine} {dtype}")
    ax.set_xticks(np.arange(len(workloads)) + width * (len(modes) - 1) / 2, workloads)
    ax.set_ylabel("pairs/s")
    ax.set_title("Cross-encoder throughput (higher is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


_MEMORY_PROBE = """
import json, resource, sys, torch
from xenc_lab import Scorer
from xenc_lab.workloads import make_pairs
from xenc_lab.zoo import minilm_cross_encoder

def status(key):  # VmRSS / VmHWM in MB, where /proc has them
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration):
        return None

path, n, workload, dtype, device, max_batch_tokens, threads = json.loads(sys.argv[1])
torch.set_num_threads(threads)
budget = {} if max_batch_tokens is None else {"max_batch_tokens": max_batch_tokens}
scorer = Scorer(path or minilm_cross_encoder(), device=device, dtype=dtype, **budget)
scorer.predict(make_pairs(workload, 16, seed=8))
out = {"loaded_rss": status("VmRSS")}
pairs = make_pairs(workload, n, seed=7)
out["input_rss"] = status("VmRSS")
try:  # the high-water mark, reset to what the process holds now: the peak below is scoring's own
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out["peak_is_scoring_s"] = True
except OSError:
    out["peak_is_scoring_s"] = False
scores = scorer.predict(pairs, show_progress_bar=False)
assert len(scores) == n
out["peak_rss"] = status("VmHWM") if out["peak_is_scoring_s"] else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out["batch_shapes"] = len(scorer.runner.shapes)
out["token_counts"] = len({T for T, _, _ in scorer.runner.shapes})
if scorer.device.type == "cuda":
    out["peak_gpu"] = torch.cuda.max_memory_allocated(scorer.device) / 2**20
print(json.dumps(out))
"""


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
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_note(small: dict, large: dict, dtype: str, device: str, sizes: tuple[int, int] = (2000, 20000),
                workload: str = "mixed") -> str:
    """The report's sentence on two ``peak_memory_mb`` probes of ``sizes`` pairs."""
    (n_small, n_large), grow = sizes, lambda probe: probe["peak_rss"] - probe["input_rss"]
    what = "the peak while scoring" if small["peak_is_scoring_s"] and large["peak_is_scoring_s"] else (
        "the process's lifetime peak (loading included: no high-water mark to reset here)")
    note = (
        f"Memory of a fresh process scoring {workload} pairs in {dtype} on {device}: with the model loaded and the input "
        f"built it held {small['input_rss']:.0f} MB for {n_small:,} pairs and {large['input_rss']:.0f} MB for "
        f"{n_large:,} ({small['loaded_rss']:.0f} and {large['loaded_rss']:.0f} MB before the input); {what} was "
        f"{small['peak_rss']:.0f} and {large['peak_rss']:.0f} MB, {grow(small):+.0f} and {grow(large):+.0f} MB over that "
        f"for {n_large // n_small}x the input. The runs met {small['token_counts']} and {large['token_counts']} batch "
        f"token counts ({small['batch_shapes']} and {large['batch_shapes']} batch shapes)."
    )
    if "peak_gpu" in small:
        note += f" Peak GPU memory held by torch: {small['peak_gpu']:.0f} MB and {large['peak_gpu']:.0f} MB."
    return note
