"""Reports of benchmark rows: reports/throughput.md, .json and .png, and the machine they belong to."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..cpu.info import CpuInfo, cpu_info
from ..cpu.kernels import widened_gemm_available
from ..provenance import provenance
from .timing import BenchRow, device_name


TABLE_COLUMNS = ("workload", "dtype", "engine", "pairs", "mean tokens", "pairs/s", "ratio", "GFLOP/s", "ceiling",
                 "max abs delta", "error vs ST's own")  # the last only where some row has an error ratio


# The issues' encoder goals: int8 over xenc_lab's own bf16 pairs/s (on CPUs with int8 dot products), and on a CPU with
# AMX, xenc_lab's bf16 over sentence-transformers' bf16 on every workload.
GOALS = {"int8_over_bf16": 1.6, "amx_bf16_ratio": 1.5}


_INT8_ROUTES = {
    "kernel, brgemm": "xenc_lab's int8 kernel, its products on ATen's brgemm (oneDNN: AVX512-VNNI or AMX-INT8)",
    "kernel, own": "xenc_lab's int8 kernel, its products its own (256-bit VNNI; ATen's brgemm refused this CPU)",
    "torch": "torch's ops (the torch route: xenc_lab's int8 kernel does not run here), slower than float32",
}


def goals(rows: list[BenchRow], flags: frozenset[str] | None = None) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) for the rows' workloads: int8 over xenc_lab's bf16 where both ran in bf16 (the pairs/s
    of one run, alternating), and xenc_lab's bf16 over sentence-transformers' where the CPU has AMX."""
    flags = cpu_info().flags if flags is None else flags
    rate = {(r.workload, r.dtype, r.engine): r for r in rows}
    out = []
    for (workload, dtype, engine), r in rate.items():
        bf16 = rate.get((workload, dtype, "xenc_lab"))
        if engine == "xenc_lab int8" and dtype == "bfloat16" and bf16:
            ratio = r.pairs_per_s / bf16.pairs_per_s
            out.append((f"{workload}: int8 >= {GOALS['int8_over_bf16']}x xenc_lab's bf16 pairs/s", f"{ratio:.2f}x",
                        ratio >= GOALS["int8_over_bf16"]))
    if "amx_bf16" in flags:
        for (workload, dtype, engine), r in rate.items():
            if engine == "xenc_lab" and dtype == "bfloat16":
                out.append((f"{workload}: bf16 >= {GOALS['amx_bf16_ratio']}x sentence-transformers' bf16 (AMX)",
                            f"{r.ratio:.2f}x", r.ratio >= GOALS["amx_bf16_ratio"]))
    return out


def as_dicts(rows: list[BenchRow]) -> list[dict]:
    return [asdict(r) for r in rows]


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


@dataclass
class ReportFacts:
    """What reports/throughput.md says beyond its rows, as the numbers and choices it is written from."""

    machine: str
    errors: bool  # the table has the `error vs ST's own` column: some xenc_lab row at a dtype other than float32
    ceilings: dict[str, float]  # dtype -> the GEMM rate at the model's shapes, GFLOP/s (gflops / ceiling_share)
    bf16_gemm: str  # how xenc_lab's bf16 GEMMs ran: "" (no note), "native", "fp32" or "fp16"
    native_bf16_gflops: float = 0.0  # where they did not run native: oneDNN's native bf16 rate
    fp32_bf16_gflops: float = 0.0  # where they ran in fp16: the fp32 route's rate
    own_fp32_gemm: bool = False  # the fp32 route is xenc_lab's own GEMM around oneDNN's ukernel
    # (workload, dtype) -> GFLOP/s of attention alone by path ("kernel", "tiles" where measured, "sdpa"), and "ran"
    attention: dict[tuple[str, str], dict] = field(default_factory=dict)
    drift: dict[tuple[str, str], float] = field(default_factory=dict)  # sentence-transformers' fp32 drift
    compiled: dict[str, tuple[int, float, int]] = field(default_factory=dict)  # dtype -> (graphs, seconds, shapes)


def machine_slug(info: CpuInfo | None = None) -> str:
    """The name of a CPU's folder under reports/: vendor, product line and what sets its speed apart, e.g.
    "intel-xeon-amx", "amd-epyc-zen4" (AMD's generation from its family and model numbers), "intel-core-avx2"."""
    info = info or cpu_info()
    vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(info.vendor, "")
    words = info.model.lower().replace("(r)", " ").replace("(tm)", " ").split()
    line = next((w for w in words if w in ("xeon", "epyc", "core", "ryzen", "threadripper", "atom")), "")
    family, model = (int(n) for n in re.findall(r"\d+", info.family)) if info.family else (0, 0)
    if "amx_tile" in info.flags:
        units = "amx"
    elif vendor == "amd" and family in (23, 25, 26):  # Zen 1/2, Zen 3/4, Zen 5
        units = {23: "zen1" if model < 0x30 else "zen2", 25: "zen4" if "avx512f" in info.flags else "zen3",
                 26: "zen5"}[family]
    else:
        units = "avx512" if "avx512f" in info.flags else "avx2" if "avx2" in info.flags else ""
    parts = [part for part in (vendor, line, units) if part]
    return "-".join(parts) if parts else re.sub(r"[^a-z0-9]+", "-", info.model.lower()).strip("-") or "cpu"


def report_facts(rows: list[BenchRow]) -> ReportFacts:
    """The facts the report states about ``rows`` (one device's)."""
    devices = sorted({r.device for r in rows})
    if len(devices) > 1:
        raise ValueError(f"a report covers one device, got rows from {devices}")
    facts = ReportFacts(machine=machine(devices[0]), errors=any(_compared(r) for r in rows),
                        ceilings={r.dtype: r.gflops / r.ceiling_share for r in rows if r.ceiling_share}, bf16_gemm="")
    bf16 = next((r for r in rows if r.dtype == "bfloat16" and r.native_bf16_gflops), None)
    if bf16:
        facts.bf16_gemm = "fp16" if bf16.bf16_gemm == "fp16" else "fp32"
        facts.native_bf16_gflops, facts.fp32_bf16_gflops = bf16.native_bf16_gflops, bf16.fp32_bf16_gflops
        facts.own_fp32_gemm = facts.bf16_gemm == "fp32" and widened_gemm_available()
    elif any(r.dtype == "bfloat16" and r.bf16_gemm == "native" for r in rows):
        facts.bf16_gemm = "native"
    for r in rows:
        if r.attention_path:
            facts.attention[(r.workload, r.dtype)] = {
                "kernel": r.kernel_attention_gflops, **({"tiles": r.tiles_attention_gflops} if r.tiles_attention_gflops
                                                        else {}), "sdpa": r.sdpa_attention_gflops, "ran": r.attention_path}
        if r.oracle_drift:
            facts.drift[(r.workload, r.dtype)] = r.oracle_drift
        if r.compiled_graphs:  # the last compiled row of a dtype: its counts cover the dtype's runs so far
            facts.compiled[r.dtype] = (r.compiled_graphs, r.compile_seconds, r.batch_shapes)
    return facts


def _compared(r: BenchRow) -> bool:
    return r.dtype != "float32" and r.engine != "sentence-transformers"


def write_report(rows: list[BenchRow], out_dir: Path, command: str, notes: str = "") -> Path:
    """reports/throughput.md and reports/throughput.png from benchmark rows, and the rows themselves with the
    machine and the command in reports/throughput.json (for comparing runs); the ``## `` sections of other runs in
    an earlier throughput.md are kept after the new table."""
    if not rows:
        raise ValueError(f"no benchmark rows to report: {out_dir} is left as it was")
    facts = report_facts(rows)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Throughput: xenc_lab against sentence-transformers",
        "",
        provenance(command, None if torch.device(rows[0].device).type == "cpu" else facts.machine),
        "",
        (
            "Both engines in one process on the same pairs, alternating runs, tokenization included; "
            "`ratio` is pairs/s over sentence-transformers' `CrossEncoder.predict(batch_size=32)` at the same dtype. "
            "GFLOP/s counts the model's math (2 x non-embedding matmul weights x tokens + attention); "
            "`ceiling` is that as a share of a GEMM rate measured on the spot at the model's shapes "
            "(xenc_lab skips the last layer's work on all but the first token, so its share can pass 100%). "
            "`max abs delta` is against sentence-transformers in fp32 on the same pairs (raw logits)."
            + (" `error vs ST's own`, at a dtype other than float32: xenc_lab's mean abs delta (and max) over "
               "sentence-transformers' own at that dtype, on the same pairs." if facts.errors else "")
        ),
        "",
        "| " + " | ".join(TABLE_COLUMNS[: len(TABLE_COLUMNS) - (not facts.errors)]) + " |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if facts.errors else ""),
    ]
    for r in rows:
        error = (f" {r.error_ratio:.2f} (max {r.max_error_ratio:.2f}) |" if r.error_ratio
                 else " n/a (ST's own error is 0) |" if _compared(r) else " |")
        lines.append(
            f"| {r.workload} | {r.dtype} | {r.engine} | {r.pairs} | {r.mean_tokens:.0f} | {r.pairs_per_s:.1f} | "
            f"{r.ratio:.2f}x | {r.gflops:.0f} | {100 * r.ceiling_share:.0f}% | {r.max_abs_delta:.1e} |"
            + (error if facts.errors else "")
        )
    lines += ["", "GEMM rate measured at the model's shapes (the ceiling): "
              + ", ".join(f"{dtype} {rate:.0f} GFLOP/s" for dtype, rate in facts.ceilings.items()) + "."]
    if facts.bf16_gemm in ("fp16", "fp32"):
        lines += ["", f"On this CPU oneDNN's native bf16 GEMMs ran at {facts.native_bf16_gflops:.0f} GFLOP/s: without "
                  "AMX, an Intel core issues one bf16 dot product (two multiply-adds per lane) per cycle against two fp32 "
                  "FMAs. " + (_FP16_NOTE.format(fp32=facts.fp32_bf16_gflops) if facts.bf16_gemm == "fp16" else _FP32_NOTE
                              + (_OWN_FP32_NOTE if facts.own_fp32_gemm else ""))
                  + " The weights and activations stay bf16, and the bf16 ceiling above is the rate of the GEMM "
                  "xenc_lab ran. sentence-transformers' bf16 runs native."]
    elif facts.bf16_gemm == "native":
        lines += ["", _NATIVE_NOTE]
    if facts.attention:
        lines += ["", "Attention alone at the model's head shapes, on 4096-token batches of pairs of the workload's mean "
                  "length, GFLOP/s: " + "; ".join(
                      f"{w} {dt}: " + ", ".join(f"{'SDPA' if path == 'sdpa' else path} {rate:.0f}"
                                                 for path, rate in a.items() if path != "ran") + f" (ran: {a['ran']})"
                      for (w, dt), a in facts.attention.items()) + ". "
                  "xenc_lab's kernel reads the packed stream in place; SDPA's time includes laying the pairs out and back. "
                  "Where the CPU has AMX for the dtype, the kernel's tile path (Q K^T and P V as oneDNN GEMMs on AMX "
                  "tiles) and SDPA are measured against the kernel at the model's head shapes and the fastest runs; "
                  "elsewhere the kernel (`XENC_LAB_CPU_ATTENTION` forces one)."]
    if facts.drift:
        lines += ["", "sentence-transformers' own fp32 logits moved between two identical calls in this run by up to "
                  + ", ".join(f"{d:.1e} ({w}, {dt})" for (w, dt), d in facts.drift.items())
                  + ": deltas against that reference are no finer than this."]
    lines += [""] * bool(facts.compiled) + [
        f"compile=True, {dtype}: {graphs} graph(s) compiled in {seconds:.0f} s for {shapes} distinct batch shapes "
        "(first calls, outside the timed runs)." for dtype, (graphs, seconds, shapes) in facts.compiled.items()]
    routes = sorted({r.int8_route for r in rows if r.int8_route})
    if routes:
        lines += ["", "int8 ran on: " + "; ".join(_INT8_ROUTES.get(route, route) for route in routes) + "."]
    met = goals(rows) if torch.device(rows[0].device).type == "cpu" else []
    if met:
        lines += ["", "Goals (the issues') against what was measured:", ""]
        lines += [f"- {goal}: {value} — {'met' if ok else '**missed**'}" for goal, value, ok in met]
    if notes:
        lines += ["", notes]
    lines += ["", "![pairs/s by mode and workload](throughput.png)", ""]
    # The sections other runs wrote (`## Decoder rerankers`, `## Serving`) stay: this run replaces the part above them.
    earlier = (out_dir / "throughput.md").read_text().splitlines() if (out_dir / "throughput.md").is_file() else []
    kept = next((earlier[i:] for i, line in enumerate(earlier) if line.startswith("## ")), [])
    (out_dir / "throughput.md").write_text("\n".join(lines + kept) + ("\n" if kept else ""))
    record = {"machine": facts.machine, "provenance": lines[2], "command": command, "notes": notes,
              "rows": as_dicts(rows)}
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


def append_section(path: str | os.PathLike, section: str) -> Path:
    """``section`` (a markdown ``## `` section) in the file at ``path``: replacing the section of the same heading
    where there is one, else appended; the rest of the file is kept."""
    path = Path(path)
    heading = section.splitlines()[0]
    text = path.read_text() if path.is_file() else ""
    lines = text.splitlines()
    if heading in lines:
        start = lines.index(heading)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = section.rstrip("\n").splitlines() + ([""] if end < len(lines) else [])
        text = "\n".join(lines) + "\n"
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
