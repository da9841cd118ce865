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
                                   "pairs/s), precision (fp32 against bf16, compile and a shorter max_length, on "
                                   "scores, rankings and metrics: precision.md and precision.png), "
                                   "memory (a million pairs streamed through predict: memory.md), "
                                   "and notebooks (each executed and saved with its outputs). Needs a clone of the "
                                   "repository (its test suites and notebooks/).")
    p.add_argument("parts", nargs="*", default=None, metavar="PART",
                   help=f"what to regenerate, of {', '.join(PARTS)} (default: all)")
    p.add_argument("--out", default=str(ROOT / "reports"), metavar="DIR", help="where reports go (default: reports/)")
    p.add_argument("--queries", type=int, default=100, help="queries in the precision experiment (default 100)")
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


def precision(out: Path, queries: int = 100, depth: int = 20, command: str = "xenc-lab report precision",
              model=None, variants: dict | None = None) -> Path:
    """reports/precision.md and precision.png: the docs collection's BM25 run reranked by ``model`` (default: the
    MiniLM-L6 cross-encoder) in fp32 and under each variant; what each changes in scores, rankings and metrics."""
    from .ir.first_stage import bm25
    from .ir.pydocs import python_docs_collection
    from .ir.variants import STANDARD_VARIANTS, rerank_variants
    from .zoo import minilm_cross_encoder

    variants = dict(STANDARD_VARIANTS if variants is None else variants)  # bf16 runs on any CPU: its numbers matter
    with tempfile.TemporaryDirectory() as tmp:
        paths = python_docs_collection(tmp, max_chars=1000, max_queries=queries)
        run = bm25(paths["queries"], paths["corpus"], k=100)
        result = rerank_variants(model or minilm_cross_encoder(), paths["queries"], paths["corpus"], run, variants,
                                 depth=depth, scorer_kwargs={"device": "cpu"}, show_progress_bar=False)
        deltas, ranks = result.score_deltas(), result.rankings(k=10)
        metrics = result.metrics(paths["qrels"], ("nDCG@10", "RR@10"))
        fig = result.plot(paths["qrels"], ("nDCG@10", "RR@10"))
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "precision.png", dpi=110)
    fmt = lambda frame: frame.to_markdown(floatfmt=".3g")  # needs tabulate (the bench extra)
    base = result.baseline
    about = ("the MiniLM-L6 cross-encoder (real encoder weights, seeded untrained head: the metrics show how much a "
             "setting moves them, not the model's quality)" if model is None else f"`{model}`")
    intro = (f"Python's standard-library docstrings as a test collection (`xenc_lab.ir.pydocs`: {queries} queries, "
             f"each judged by its function's own docstring), BM25 (bm25s) for the first stage, the top {depth} of each "
             f"query reranked by {about}. Each variant is compared with the {base} run on the same pairs "
             "(`xenc_lab.ir.rerank_variants`).")
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
        f"## Metrics against {base}: queries improved (+) and degraded (-), paired t-test, Holm's correction",
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
    options = ([] if args.queries == 100 else ["--queries", str(args.queries)]) + (
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
