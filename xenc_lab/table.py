"""``xenc-lab score IN OUT``: a table of (text_1, text_2) pairs in (parquet, JSON lines or CSV), the same table with
a score column out; in this process, or on a Ray cluster with ``--ray-address``."""
from __future__ import annotations

import argparse
import os

from .distributed import READERS, table_kind

WRITERS = {"parquet": "write_parquet", "jsonl": "write_json", "csv": "write_csv"}


def add_parser(sub, positive_int) -> None:
    p = sub.add_parser("score", help="score a table of pairs (parquet, jsonl, csv), here or on a Ray cluster",
                       description="Adds a score column to a table of (text_1, text_2) pairs and writes it. With "
                                   "--ray-address, a pool of Scorer actors scores it on that Ray cluster ('auto': "
                                   "the one this machine belongs to; 'local': a Ray instance started here); IN and "
                                   "OUT may then be folders or URIs Ray reads and writes (s3://...), and OUT is a "
                                   "folder of files, as Ray writes them.")
    p.add_argument("input", metavar="IN", help="a .parquet, .jsonl or .csv file (or, with --ray-address, a folder)")
    p.add_argument("output", metavar="OUT", help="where to write the scored table: a .parquet, .jsonl or .csv file "
                                                 "(with --ray-address, a folder; its format is IN's or --format)")
    p.add_argument("--model", default=None, help="model directory or hub id (default: the offline MiniLM-L6 "
                                                 "cross-encoder, untrained head)")
    p.add_argument("--text-1", default="text_1", help="the column of first texts (queries; default text_1)")
    p.add_argument("--text-2", default="text_2", help="the column of second texts (documents; default text_2)")
    p.add_argument("--column", default="score", help="the score column to add (default score)")
    p.add_argument("--format", choices=sorted(READERS), default=None,
                   help="the format of IN and OUT where their names do not say it (folders, URIs)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--max-length", type=positive_int, default=None)
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="score on this Ray cluster ('auto', 'local' or ray://host:port)")
    p.add_argument("--concurrency", type=positive_int, default=1, help="Scorer actors on the cluster (default 1)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs per actor (default: each node's CPUs but "
                                                                "one, shared by the actors placed there)")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per actor (default 0)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads per actor (default: its CPUs)")
    p.add_argument("--batch-size", type=positive_int, default=4096, help="rows per actor call (default 4096)")
    p.set_defaults(func=run_command)


def read_frame(path: str, format: str | None = None):
    import pandas as pd

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    kind = format or table_kind(path)
    return pd.read_json(path, lines=True) if kind == "jsonl" else getattr(pd, READERS[kind])(path)


def write_frame(frame, path: str, format: str | None = None) -> None:
    kind = format or table_kind(path)
    if kind == "parquet":
        frame.to_parquet(path, index=False)
    elif kind == "jsonl":
        frame.to_json(path, orient="records", lines=True, force_ascii=False)
    else:
        frame.to_csv(path, index=False)


def _output_kind(args: argparse.Namespace) -> str:
    """OUT's format: its suffix; on Ray, a folder without one takes --format or IN's format."""
    try:
        return table_kind(args.output)
    except ValueError:
        if args.ray_address is None and args.format is None:
            raise ValueError(f"{args.output}: expected a .parquet, .jsonl or .csv file (or --format)") from None
        remote = "://" in args.input
        return args.format or table_kind(args.input, None if remote else args.input)


def run_command(args: argparse.Namespace) -> int:
    remote_out = "://" in args.output and not args.output.startswith("file://")
    if not remote_out and os.path.exists(args.output) and not args.overwrite:
        raise FileExistsError(f"{args.output} exists: pass --overwrite to replace it")
    out_kind = _output_kind(args)  # a bad OUT is refused before any scoring
    model = args.model
    if model is None:
        from .zoo import minilm_cross_encoder

        model = str(minilm_cross_encoder())
        print(f"Model: real MiniLM-L6 weights with a seeded, UNTRAINED head ({model}). Pass --model for yours.")
    options = {"dtype": args.dtype, "compile": args.compile, "max_length": args.max_length}
    if args.ray_address is None:
        from .scorer import Scorer

        frame = read_frame(args.input, args.format)
        scorer = Scorer(model, device=args.device, **options)
        write_frame(scorer.score_frame(frame, args.text_1, args.text_2, args.column), args.output, out_kind)
        print(f"wrote {args.output}: {len(frame)} rows")
        return 0
    from .distributed import _ray, score_dataset

    ray = _ray()
    ray.init(address=None if args.ray_address == "local" else args.ray_address, ignore_reinit_error=True)
    ds = score_dataset(args.input, model, args.text_1, args.text_2, args.column, concurrency=args.concurrency,
                       num_cpus=args.num_cpus, num_gpus=args.num_gpus, threads=args.threads,
                       batch_size=args.batch_size, format=args.format,
                       **({"device": args.device} if args.device else {}), **options)
    mode = ray.data.SaveMode.OVERWRITE if args.overwrite else ray.data.SaveMode.ERROR
    getattr(ds, WRITERS[out_kind])(args.output, mode=mode)
    print(f"wrote {args.output} (a folder of {out_kind} files, as Ray writes them)")
    return 0
