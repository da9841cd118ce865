"""``xenc-lab score IN OUT``: a table of (text_1, text_2) pairs in (parquet, JSON lines or CSV), the same table with
a score column out; in this process, or on a Ray cluster with ``--ray-address``."""
from __future__ import annotations

import argparse
import os

READERS = {"parquet": "read_parquet", "jsonl": "read_json", "csv": "read_csv"}


def add_parser(sub, positive_int) -> None:
    p = sub.add_parser("score", help="score a table of pairs (parquet, jsonl, csv), here or on a Ray cluster",
                       description="Adds a score column to a table of (text_1, text_2) pairs and writes it. With "
                                   "--ray-address, a pool of Scorer actors scores it on that Ray cluster ('auto': "
                                   "the one this machine belongs to; 'local': a Ray instance started here) and OUT "
                                   "is a folder of files, as Ray writes them.")
    p.add_argument("input", metavar="IN", help="a .parquet, .jsonl or .csv file (or, with --ray-address, a folder)")
    p.add_argument("output", metavar="OUT", help="where to write the scored table (.parquet, .jsonl or .csv)")
    p.add_argument("--model", default=None, help="model directory or hub id (default: the offline MiniLM-L6 "
                                                 "cross-encoder, untrained head)")
    p.add_argument("--text-1", default="text_1", help="the column of first texts (queries; default text_1)")
    p.add_argument("--text-2", default="text_2", help="the column of second texts (documents; default text_2)")
    p.add_argument("--column", default="score", help="the score column to add (default score)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--max-length", type=positive_int, default=None)
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="score on this Ray cluster ('auto', 'local' or ray://host:port)")
    p.add_argument("--concurrency", type=positive_int, default=1, help="Scorer actors on the cluster (default 1)")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per actor (default 0)")
    p.set_defaults(func=run_command)


def kind_of(path: str) -> str:
    name = path.lower().removesuffix(".gz")
    for kind, ends in (("parquet", (".parquet",)), ("jsonl", (".jsonl", ".json")), ("csv", (".csv",))):
        if name.endswith(ends):
            return kind
    raise ValueError(f"{path}: expected a .parquet, .jsonl or .csv file")


def read_frame(path: str):
    import pandas as pd

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    kind = kind_of(path)
    return pd.read_json(path, lines=True) if kind == "jsonl" else getattr(pd, READERS[kind])(path)


def write_frame(frame, path: str) -> None:
    kind = kind_of(path)
    if kind == "parquet":
        frame.to_parquet(path, index=False)
    elif kind == "jsonl":
        frame.to_json(path, orient="records", lines=True, force_ascii=False)
    else:
        frame.to_csv(path, index=False)


def run_command(args: argparse.Namespace) -> int:
    if os.path.exists(args.output) and not args.overwrite:
        raise FileExistsError(f"{args.output} exists: pass --overwrite to replace it")
    kind_of(args.output)  # a bad OUT is refused before any scoring
    model = args.model
    if model is None:
        from .zoo import minilm_cross_encoder

        model = str(minilm_cross_encoder())
        print(f"Model: real MiniLM-L6 weights with a seeded, UNTRAINED head ({model}). Pass --model for yours.")
    options = {"dtype": args.dtype, "compile": args.compile, "max_length": args.max_length}
    if args.ray_address is None:
        from .scorer import Scorer

        frame = read_frame(args.input)
        scorer = Scorer(model, device=args.device, **options)
        write_frame(scorer.score_frame(frame, args.text_1, args.text_2, args.column), args.output)
        print(f"wrote {args.output}: {len(frame)} rows")
        return 0
    from .distributed import _ray, score_dataset

    ray = _ray()
    ray.init(address=None if args.ray_address == "local" else args.ray_address, ignore_reinit_error=True)
    ds = score_dataset(args.input, model, args.text_1, args.text_2, args.column, concurrency=args.concurrency,
                       num_gpus=args.num_gpus, **({"device": args.device} if args.device else {}), **options)
    getattr(ds, {"parquet": "write_parquet", "jsonl": "write_json", "csv": "write_csv"}[kind_of(args.output)])(
        args.output)
    print(f"wrote {args.output} (a folder of {kind_of(args.output)} files, as Ray writes them)")
    return 0
