"""``xenc-lab report``: regenerates every report in ``reports/`` on this machine (parity, throughput, decoder
throughput, serving throughput, precision and rankings) and executes the notebooks in place, so that they are stored
with their outputs."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .provenance import provenance

ROOT = Path(__file__).resolve().parent.parent  # a clone's root: the test suites and notebooks/ live there
PARTS = ("parity", "throughput", "decoder", "serving", "precision", "memory", "notebooks")


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="regenerate the reports in reports/ and the notebooks' stored outputs",
                       description="Regenerates the reports on this machine, each with the machine and versions: "
                                   "parity (the parity suite, pytest -m parity: reports/parity.md), throughput (bench --memory), "
                                   "decoder (bench --decoder), serving (bench --serve: served against offline "
                                   "pairs/s), precision (the trained reranker on the docs collection's held-out queries: "
                                   "fp32 against bf16, compile, another max_length and int8, on scores, rankings and "
                                   "metrics: precision.md and precision.png), "
                                   "memory (a million pairs streamed through predict: memory.md), "
                                   "and notebooks (each executed and saved with its outputs). Needs a clone of the "
                                   "repository (its test suites and notebooks/).")
    p.add_argument("parts", nargs="*", default=None, metavar="PART",
                   help=f"what to regenerate, of {', '.join(PARTS)} (default: all)")
    p.add_argument("--out", default=str(ROOT / "reports"), metavar="DIR", help="where reports go (default: reports/)")
    p.add_argument("--queries", type=int, default=None,
                   help="precision: the first N held-out queries of the docs collection (default: all of them)")
    p.set_defaults(func=run_command)


def _step(name: str, fn) -> None:
    start = time.perf_counter()
    print(f"== {name}", flush=True)
    fn()
    print(f"== {name}: done in {time.perf_counter() - start:.0f} s", flush=True)


def _need(path: Path) -> Path:
    if not path.exists():
        raise ValueError(f"{path} is not here: `xenc-lab report` runs from a clone of the repository")
    return path


def parity(out: Path) -> None:
    """The parity suite (the tests marked ``parity``) writes reports/parity.md itself: a pytest run in the clone, which
    the package never imports."""
    _need(ROOT / "pyproject.toml")
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "parity", "-q", "-p", "no:cacheprovider"], cwd=ROOT)
    if done.returncode == 5:  # pytest's "no tests collected"
        raise ValueError(f"no parity tests under {ROOT}: `xenc-lab report parity` runs from a clone of the repository")
    if done.returncode:
        raise subprocess.CalledProcessError(done.returncode, done.args)
    if out.resolve() != (ROOT / "reports").resolve():
        (out / "parity.md").write_text((ROOT / "reports" / "parity.md").read_text())


def _bench(*args: str) -> None:
    # In a process of its own: the benchmark's timings see no state left by the other reports.
    subprocess.run([sys.executable, "-m", "xenc_lab.cli", "bench", *args], check=True)


# The README's quoted runs: 256 pairs, 3 repeats, the compiled columns included.
THROUGHPUT = ("--pairs", "256", "--repeats", "3", "--compile")


def throughput(out: Path) -> None:
    _bench(*THROUGHPUT, "--memory", "--report", str(out))


def decoder(out: Path) -> None:
    _bench("--decoder", "--report", str(out))


def serving(out: Path) -> None:
    _bench("--serve", "--report", str(out))


def precision(out: Path, queries: int | None = None, depth: int = 20, command: str = "xenc-lab report precision",
              model=None, variants: dict | None = None) -> Path:
    """reports/precision.md and precision.png: the held-out queries of the docs collection (``training.pydocs_split``;
    ``queries``: the first N of them, default all), BM25's candidates reranked by ``model`` (default: the trained
    reranker, ``zoo.trained_reranker``) in fp32 and under each variant (default: ``STANDARD_VARIANTS``, with int8
    in bf16 too where the CPU has bf16 units); what each changes in scores, rankings and metrics."""
    import pandas as pd

    from .cpu.info import native_half_units
    from .ir.experiments import significance
    from .ir.files import read_qrels
    from .ir.first_stage import bm25
    from .ir.variants import STANDARD_VARIANTS, rerank_variants
    from .training import pydocs_split
    from .zoo import trained_reranker

    if queries is not None and (isinstance(queries, bool) or not isinstance(queries, int) or queries < 1):
        raise ValueError(f"queries must be a positive int or None (all held-out queries), got {queries!r}")
    if variants is None:
        variants = dict(STANDARD_VARIANTS)
        if native_half_units("bfloat16"):
            variants["int8, bfloat16"] = {"quantization": "int8", "dtype": "bfloat16"}
    with tempfile.TemporaryDirectory() as tmp:
        paths = pydocs_split(tmp)
        qrels = read_qrels(paths["test"])
        held_out = sorted(set(qrels["qid"]))[:queries]
        qrels = qrels[qrels["qid"].isin(held_out)]
        run = bm25(paths["queries"], paths["corpus"], k=100)
        run = run[run["qid"].isin(held_out)].reset_index(drop=True)
        result = rerank_variants(model or trained_reranker(show_progress_bar=False), paths["queries"], paths["corpus"],
                                 run, variants, depth=depth, scorer_kwargs={"device": "cpu"}, show_progress_bar=False)
        deltas, ranks = result.score_deltas(), result.rankings(k=10)
        measures = ("nDCG@10", "RR@10")
        metrics = result.metrics(qrels, measures)
        base = result.baseline
        tests = {name: significance(result.runs[base], result.runs[name], qrels, measures)
                 for name in result.runs if name != base}
        fig = result.plot(qrels, measures)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "precision.png", dpi=110)
    fmt = lambda frame: frame.to_markdown(floatfmt=".3g")  # needs tabulate (the bench extra)
    paired = pd.concat(tests, names=["variant", "measure"])[["mean_a", "mean_b", "delta", "+", "-", "p-value",
                                                            "p-value (randomization)", "n_queries"]]
    about = ("the trained reranker (`xenc_lab.zoo.trained_reranker`: MiniLM-L6 fine-tuned on the collection's "
             "training split, 64-token pairs)" if model is None else f"`{model}`")
    intro = (f"Python's standard-library docstrings as a test collection (`xenc_lab.training.pydocs_split`: the "
             f"{len(held_out)} held-out queries, each judged by its function's own docstring, never seen in "
             f"training), BM25 (bm25s) for the first stage, the top {depth} of each query reranked by {about}. "
             f"Each variant is compared with the {base} run on the same pairs (`xenc_lab.ir.rerank_variants`). "
             "BM25 finds fewer than "
             f"{depth} candidates for some queries: those are reranked as far as they go.")
    text = "\n".join([
        "# Precision and rankings: does a setting change the ranking?",
        "",
        provenance(command),
        "",
        intro,
        "",
        f"## Scores: |variant - {base}| over the reranked pairs",
        "",
        fmt(deltas),
        "",
        f"## Rankings against {base} (top 10)",
        "",
        fmt(ranks),
        "",
        f"## Metrics against {base}: paired t-test and randomization test per variant",
        "",
        (f"`xenc_lab.ir.significance({base} run, variant run)`: mean_a is {base}'s, mean_b the variant's; `+` / `-` "
         "count the queries the variant improves / degrades."),
        "",
        fmt(paired),
        "",
        f"## Metrics against {base}: pt.Experiment's table, Holm's correction over the variants",
        "",
        fmt(metrics),
        "",
        "![score deltas, changed top 10s and metric changes](precision.png)",
        "",
    ])
    (out / "precision.md").write_text(text)
    return out / "precision.md"


def memory(out: Path, command: str = "xenc-lab report memory") -> Path:
    """reports/memory.md: resident memory while a generator of short pairs streams through ``predict``, 10,000
    against 1,000,000 pairs on a tiny random BERT with MiniLM's tokenizer (the engine's own memory, at the speed of
    tokenization), and 10,000 against 100,000 on the MiniLM-L6 cross-encoder."""
    from .bench.memory import stream_memory_mb
    from .zoo import minilm_cross_encoder
    from .zoo.encoders import build_tiny

    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny BERT (2 layers, 32 wide)": (build_tiny(Path(tmp)), (10_000, 1_000_000)),
                  "MiniLM-L6 cross-encoder": (minilm_cross_encoder(), (10_000, 100_000))}
        rows = []
        for name, (path, sizes) in models.items():
            for n in sizes:
                probe = stream_memory_mb(n, path)
                print(f"   {name}, {n:,} pairs: {probe}", flush=True)
                rows.append(f"| {name} | {n:,} | {probe['loaded_rss']:.0f} | {probe['peak_rss']:.0f} | "
                            f"{probe['peak_rss'] - probe['loaded_rss']:+.1f} | {probe['seconds']:,.0f} | "
                            f"{probe['max_abs_delta_in_place']:.1e} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.md").write_text("\n".join([
        "# Memory: a million pairs through predict",
        "",
        provenance(command),
        "",
        ("A fresh process per row scores a generator of short pairs (4,096 distinct pairs over and over, 10-20 "
         "tokens a side) with `Scorer.predict`, in fp32. `held` is its resident memory with the model loaded and "
         "warmed up; `peak` the kernel's high-water mark while scoring, reset before it; the scores' array itself "
         "is 4 bytes a pair. `max abs delta in place` compares every score with its pair's own score from one call on "
         "the distinct pairs: each is where it belongs. `seconds` is for orientation, not a benchmark: "
         f"the load average was {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs when the report was written."),
        "",
        "| model | pairs | held (MB) | peak (MB) | peak - held (MB) | seconds | max abs delta in place |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]))
    return out / "memory.md"


# A progress bar's output: a widget (tqdm.auto in a kernel) or its text, "name:  40%|####      | 2/5 [...]".
WIDGET = "application/vnd.jupyter.widget-view+json"
PROGRESS = re.compile(r"^[^\n]*\d+%\|[^\n]*\|[^\n]*\]\s*$", re.MULTILINE)


def strip_progress_bars(nb) -> None:
    """Drop the progress bars from a notebook's outputs: stored, they show a bar frozen at whatever it read last."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.outputs:
            data = output.get("data", {})
            text = output.get("text", "") or data.get("text/plain", "")
            if WIDGET in data or (text and not PROGRESS.sub("", text.replace("\r", "\n")).strip()):
                continue
            kept.append(output)
        cell.outputs = kept
    nb.metadata.pop("widgets", None)


def notebooks(out: Path, names: list[str] | None = None) -> None:
    """Each notebook (or those named) executed top to bottom and saved in place with its outputs, progress bars
    left out."""
    import nbformat
    from nbclient import NotebookClient

    for path in sorted(_need(ROOT / "notebooks").glob("*.ipynb")):
        if names and path.name not in names:
            continue
        print(f"   {path.name}", flush=True)
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
                       ).execute()
        strip_progress_bars(nb)
        nbformat.write(nb, path)


def run_command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    parts = args.parts or list(PARTS)
    if unknown := [p for p in parts if p not in PARTS]:
        raise ValueError(f"unknown report part(s) {unknown}: choose from {', '.join(PARTS)}")
    # Each report names the command that regenerates it alone.
    options = ([] if args.queries is None else ["--queries", str(args.queries)]) + (
        [] if out.resolve() == (ROOT / "reports").resolve() else ["--out", str(out)])
    command = lambda part: shlex.join(["xenc-lab", "report", part, *options])
    steps = {
        "parity": lambda: parity(out),
        "throughput": lambda: throughput(out),
        "decoder": lambda: decoder(out),
        "serving": lambda: serving(out),
        "precision": lambda: print(f"wrote {precision(out, args.queries, command=command('precision'))}"),
        "memory": lambda: print(f"wrote {memory(out, command=command('memory'))}"),
        "notebooks": lambda: notebooks(out),
    }
    for part in parts:
        _step(part, steps[part])
    return 0
