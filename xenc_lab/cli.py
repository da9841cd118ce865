"""``xenc-lab``: the command line. ``demo`` scores pairs beside sentence-transformers and shows both."""
from __future__ import annotations

import argparse
import shlex
import sys
import time

DEMO_PAIRS = [
    ("How many people live in Berlin?", "Berlin had a population of 3,520,031 registered inhabitants in 2014."),
    ("How many people live in Berlin?", "Berlin is well known for its museums."),
    ("what is the tallest mountain on earth", "Mount Everest is Earth's highest mountain above sea level, at 8,849 m."),
    ("what is the tallest mountain on earth", "The Mariana Trench is the deepest oceanic trench on Earth."),
    ("python list comprehension", "List comprehensions provide a concise way to create lists in Python."),
    ("python list comprehension", "Ball pythons are among the most popular pet snakes."),
    ("¿Dónde está la biblioteca?", "La biblioteca está al lado del museo."),
    ("東京の人口は？", "東京都の人口は約1400万人です。"),
]


def _throughput(fn, pairs, repeats: int = 2) -> float:
    fn(pairs[:16])  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(pairs)
        best = min(best, time.perf_counter() - start)
    return len(pairs) / best


def demo(args: argparse.Namespace) -> int:
    import numpy as np
    import pandas as pd
    import torch
    from sentence_transformers import CrossEncoder

    from . import Scorer
    from .bench.workloads import make_pairs
    from .zoo import minilm_cross_encoder

    if args.model is None:
        path = minilm_cross_encoder()
        print(f"Default model: real MiniLM-L6 encoder weights with a seeded, UNTRAINED head ({path}).")
        print("Its scores are not relevance judgements; they show that both engines compute the same numbers.\n")
    else:
        path = args.model
    scorer = Scorer(path, device=args.device, dtype=args.dtype)
    oracle = CrossEncoder(str(path), device=str(scorer.device), model_kwargs={"dtype": scorer.config.torch_dtype})
    print(scorer, "\n")

    ours = scorer.predict(DEMO_PAIRS)
    theirs = oracle.predict(DEMO_PAIRS)
    table = pd.DataFrame(
        {
            "query": [q for q, _ in DEMO_PAIRS],
            "passage": [d if len(d) <= 48 else d[:45] + "..." for _, d in DEMO_PAIRS],
            "xenc_lab": ours.tolist() if ours.ndim == 1 else [list(np.round(r, 4)) for r in ours],
            "sentence-transformers": theirs.tolist() if theirs.ndim == 1 else [list(np.round(r, 4)) for r in theirs],
            "|delta|": np.abs(ours - theirs).reshape(len(DEMO_PAIRS), -1).max(axis=1),
        }
    )
    with pd.option_context("display.max_colwidth", 50, "display.width", 200, "display.float_format", "{:.6g}".format):
        print(table.to_string(index=False), "\n")

    pairs = make_pairs("mixed", args.pairs, seed=1)
    ours_rate = _throughput(lambda p: scorer.predict(p), pairs)
    theirs_rate = _throughput(lambda p: oracle.predict(p, batch_size=32), pairs)
    print(
        f"Throughput on {len(pairs)} mixed-length pairs ({torch.get_num_threads()} threads, {scorer.config.dtype}): "
        f"xenc_lab {ours_rate:.1f} pairs/s, sentence-transformers {theirs_rate:.1f} pairs/s, "
        f"ratio {ours_rate / theirs_rate:.2f}x"
    )
    worst = float(np.abs(ours - theirs).max())
    print(f"max |delta| over the table: {worst:.2e}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from . import bench as B
    from .bench.workloads import load_pairs

    if args.serve:
        from .serve.bench import run_command as serve_bench

        return serve_bench(args)
    if args.decoder is not None:
        return decoder_bench(args)
    workloads = list(args.workloads or ([] if args.pairs_file else ["short", "mixed", "long"]))
    for file in args.pairs_file or []:
        pairs = load_pairs(file)
        if args.pairs is not None:
            pairs = pairs[: args.pairs]
        print(f"workload {Path(file).stem!r}: {len(pairs)} pairs from {file}")
        workloads.append((Path(file).stem, pairs))
    dtypes = args.dtypes or (["float16", "bfloat16"] if args.device == "cuda" else ["float32", "bfloat16"])
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)  # both engines, the ceiling and the report's machine line
    rows = B.run(
        args.model, workloads=workloads, dtypes=dtypes, n_pairs=args.pairs or 256,
        repeats=args.repeats, compile=args.compile, device=args.device, max_batch_tokens=args.max_batch_tokens,
        int8=args.int8,
    )
    notes = []
    if args.memory:
        # On the CPU bf16 where it has it: the point is memory, and this keeps the 20,000-pair run short. Mixed pairs
        # make batches of the most shapes.
        dtype = dtypes[0] if args.device == "cuda" else "bfloat16" if B.cpu_has_fast_bf16() else "float32"
        small, large = (
            B.peak_memory_mb(n, args.model, workload="mixed", dtype=dtype, device=args.device,
                             max_batch_tokens=args.max_batch_tokens, threads=args.threads)
            for n in (2000, 20000)
        )
        notes.append(B.memory_note(small, large, dtype, args.device, workload="mixed"))
        print(notes[-1])
    if args.report:
        command = "xenc-lab " + shlex.join(args.argv)
        path = B.write_report(rows, Path(args.report), command.strip(), "\n".join(notes))
        print(f"wrote {path}")
    return 0


def decoder_bench(args: argparse.Namespace) -> int:
    """``bench --decoder``: 1 query x N documents through Qwen3-Reranker's template, xenc_lab with prefix sharing on
    and off (and with ``--int8``, in int8) beside sentence-transformers; ``--report DIR`` writes (or replaces)
    DIR/throughput.md's decoder section."""
    import os
    from pathlib import Path

    from .bench import decoder
    from .bench.report import append_section, machine

    others = {"--model": args.model, "--workloads": args.workloads, "--pairs-file": args.pairs_file,
              "--memory": args.memory, "--device cuda": args.device != "cpu"}
    if given := [name for name, value in others.items() if value]:
        raise ValueError(f"--decoder takes its models as its own arguments and runs on the CPU: drop {', '.join(given)}")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    rows = decoder.run(args.decoder or decoder.DEFAULT_MODELS, dtypes=args.dtypes or ["float32", "bfloat16"],
                       n_docs=args.pairs, repeats=args.repeats, max_batch_tokens=args.max_batch_tokens,
                       compile=args.compile, int8=args.int8)
    for goal, value, met in decoder.goals(rows):
        print(f"{'met' if met else 'MISSED'}: {goal}: {value}")
    if args.report:
        command = "xenc-lab " + shlex.join(args.argv)
        notes = (f"Load average (1 min) when the run began and ended: {load:.1f} and {os.getloadavg()[0]:.1f}, on "
                 f"{os.cpu_count()} CPUs: other work on the machine slows the engines' many parallel regions unevenly.")
        path = append_section(Path(args.report) / "throughput.md",
                                      decoder.report_section(rows, command, machine(), notes))
        print(f"wrote the decoder section of {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xenc-lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="score pairs with xenc_lab and sentence-transformers side by side")
    p.add_argument("--model", default=None, help="model directory or hub id (default: the offline MiniLM-L6 cross-encoder)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--pairs", type=_positive_int, default=128, help="pairs in the throughput run")
    p.set_defaults(func=demo)
    b = sub.add_parser("bench", help="pairs/s of xenc_lab and sentence-transformers side by side")
    b.add_argument("--model", default=None, help="model directory or hub id (default: the offline MiniLM-L6 cross-encoder)")
    b.add_argument("--workloads", nargs="+", default=None, choices=["short", "mixed", "long"],
                   help="built-in workloads (default: all three, or none when --pairs-file is given)")
    b.add_argument("--pairs-file", nargs="+", default=None, metavar="FILE",
                   help="workloads of your own: .jsonl, .tsv or .csv files of (query, passage) pairs, named by file stem")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both engines run (default: cpu)")
    b.add_argument("--dtypes", nargs="+", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: float32 bfloat16 on the CPU, float16 bfloat16 on CUDA")
    b.add_argument("--pairs", type=_positive_int, default=None,
                   help="pairs per built-in workload (default 256); for --pairs-file, the first PAIRS of each file (default all)")
    b.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per engine (median is reported)")
    b.add_argument("--max-batch-tokens", type=_positive_int, default=None, metavar="TOKENS",
                   help="xenc_lab's token budget per batch (default: the Scorer's)")
    b.add_argument("--threads", type=_positive_int, default=None,
                   help="torch threads for both engines (default: torch's, e.g. from OMP_NUM_THREADS)")
    b.add_argument("--compile", action="store_true",
                   help="also time xenc_lab with compile=True, as a third engine (with --decoder: xenc_lab's engines "
                        "run compiled)")
    b.add_argument("--memory", action="store_true", help="also measure peak RSS for 2,000 vs 20,000 pairs")
    b.add_argument("--int8", action="store_true",
                   help="also time xenc_lab with quantization='int8' at each dtype (CPU; the 'xenc_lab int8' rows, or "
                        "with --decoder the 'xenc_lab int8 sharing on' rows)")
    b.add_argument("--decoder", nargs="*", default=None, metavar="MODEL",
                   help="time decoder rerankers instead: 1 query x N documents through Qwen3-Reranker's template, "
                        "xenc_lab with prefix sharing on and off beside sentence-transformers. MODELs: built-in "
                        "random-weight Qwen3s (qwen3-0.6b: Qwen3-Reranker-0.6B's shape, 16 documents; qwen3-small: "
                        "384 wide, 6 layers, 100 documents; qwen3-tiny) or decoder checkpoint directories (100 "
                        "documents); none: qwen3-0.6b and qwen3-small. --pairs sets the documents; --report DIR "
                        "writes DIR/throughput.md's '## Decoder rerankers' section, keeping the rest")
    b.add_argument("--serve", action="store_true",
                   help="time `xenc-lab serve` instead: --clients concurrent clients post /score requests of 16 pairs "
                        "for --seconds seconds in --repeats rounds; served pairs/s against Scorer.predict's on the "
                        "same pairs between the rounds (--pairs, default 512, of the first of --workloads, default "
                        "short); --report DIR writes "
                        "DIR/throughput.md's '## Serving' section, keeping the rest")
    b.add_argument("--clients", type=_positive_int, default=32, help="--serve: concurrent clients (default 32)")
    b.add_argument("--seconds", type=_positive_int, default=30, help="--serve: seconds of load (default 30)")
    b.add_argument("--report", default=None, metavar="DIR", help="write DIR/throughput.md and DIR/throughput.png")
    b.set_defaults(func=bench)
    from .ir.command import add_parser as add_rerank

    add_rerank(sub, _positive_int)
    from .report import add_parser as add_report
    from .table import add_parser as add_score

    add_score(sub, _positive_int)

    add_report(sub)
    from .serve.command import add_parser as add_serve

    add_serve(sub, _positive_int)
    from .score_cache import add_parser as add_cache

    add_cache(sub)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as err:  # the library's refusals of bad input: a message, not a traceback
        parser.exit(2, f"xenc-lab {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
