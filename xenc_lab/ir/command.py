"""``xenc-lab rerank``: a first-stage run reranked into a TREC file, then evaluated where qrels are given."""
from __future__ import annotations

import argparse
import os

from ..config import QUANTIZATION_HELP, QUANTIZATIONS
from .metrics import DEFAULT_MEASURES
from .systems import DEFAULT_DEPTH


def add_parser(sub, positive_int) -> None:
    p = sub.add_parser("rerank", help="rerank a first-stage TREC run with a cross-encoder; evaluate it with qrels",
                       description="Reranks each query's top DEPTH candidates of RUN and writes a TREC run, query by "
                                   "query (--resume continues an interrupted one). With --qrels, prints the metrics "
                                   "of the first-stage and the reranked run and a paired test between them.")
    p.add_argument("--model", required=True, help="the reranker: a model directory or hub id")
    p.add_argument("--beir", default=None, metavar="DIR",
                   help="a BEIR dataset folder: corpus.jsonl, queries.jsonl and qrels/SPLIT.tsv fill in --corpus, "
                        "--queries and --qrels")
    p.add_argument("--split", default="test", help="the BEIR qrels split (default: test)")
    p.add_argument("--queries", default=None, help="queries: BEIR queries.jsonl or an MS MARCO 'qid<TAB>query' TSV")
    p.add_argument("--corpus", default=None, help="documents: BEIR corpus.jsonl or an MS MARCO 'pid<TAB>passage' TSV")
    p.add_argument("--run", required=True, help="the first-stage run: a TREC run file (qid Q0 docno rank score tag)")
    p.add_argument("--depth", type=positive_int, default=DEFAULT_DEPTH,
                   help=f"candidates reranked per query (default {DEFAULT_DEPTH}); those below keep their first-stage "
                        "order, ranked under the reranked ones")
    p.add_argument("--output", required=True, metavar="OUT.trec", help="the reranked TREC run to write")
    p.add_argument("--resume", action="store_true", help="continue OUT.trec from its last complete query")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT.trec")
    p.add_argument("--skip-missing", action="store_true",
                   help="leave out queries without text and candidates missing from the corpus (counted) instead of "
                        "refusing the run")
    p.add_argument("--no-title", action="store_true", help="score a document's text alone (default: title, space, text)")
    p.add_argument("--tag", default="xenc_lab", help="the run tag in OUT.trec's last column")
    p.add_argument("--qrels", default=None, help="TREC qrels or BEIR qrels TSV: evaluate both runs")
    p.add_argument("--measures", nargs="+", default=list(DEFAULT_MEASURES), metavar="MEASURE",
                   help=f"ir-measures names (default: {' '.join(DEFAULT_MEASURES)})")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help=QUANTIZATION_HELP)
    p.add_argument("--max-length", type=positive_int, default=None, help="truncate pairs to this many tokens")
    p.add_argument("--batch-size", type=positive_int, default=None, help="cap on pairs per batch")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--prompt", default=None, help="a prompt (an instruction) for every query")
    p.add_argument("--long-documents", default=None, choices=["truncate", "max", "mean", "first"],
                   help="a document longer than the model's window: truncated (default), or scored in windows and "
                        "their max or mean taken ('first': the first window)")
    p.add_argument("--window-stride", type=positive_int, default=None, metavar="TOKENS",
                   help="tokens between windows with --long-documents max/mean (default: half a window)")
    p.add_argument("--cache", default=None, metavar="FILE",
                   help="a score cache (SQLite) read and filled: a rerun reads its scores (xenc-lab cache info FILE)")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="score on this Ray cluster ('auto', 'local' or ray://host:port) with a pool of Scorer actors")
    p.add_argument("--concurrency", type=positive_int, default=1, help="Scorer actors with --ray-address (default 1)")
    p.set_defaults(func=run_command)
    from .evaluate_command import add_parser as add_evaluate

    add_evaluate(sub)


def _beir_paths(args) -> None:
    if args.beir is None:
        missing = [name for name in ("queries", "corpus") if getattr(args, name) is None]
        if missing:
            raise ValueError(f"give --{' and --'.join(missing)}, or --beir DIR for a BEIR folder")
        return
    folder = args.beir
    args.queries = args.queries or os.path.join(folder, "queries.jsonl")
    args.corpus = args.corpus or os.path.join(folder, "corpus.jsonl")
    qrels = os.path.join(folder, "qrels", f"{args.split}.tsv")
    if args.qrels is None and os.path.exists(qrels):
        args.qrels = qrels


def run_command(args: argparse.Namespace) -> int:
    from .. import Scorer
    from . import read_run, rerank
    from .experiments import experiment, format_table

    _beir_paths(args)
    first = read_run(args.run)  # a malformed run is refused before a model loads
    loading = {"dtype": args.dtype, "compile": args.compile}
    loading.update({k: v for k, v in (("long_documents", args.long_documents), ("window_stride", args.window_stride),
                                      ("quantization", args.quantization))
                    if v is not None})
    per_call = {}
    if args.ray_address is None:
        scorer = Scorer(args.model, device=args.device, cache=args.cache, **loading)
        print(scorer)
    else:  # each engine call's pairs become a Ray Dataset: large calls keep the actors busy
        if args.cache is not None:
            raise ValueError("--cache works in one process; drop it with --ray-address")
        from ..distributed import RayScorer, _ray

        _ray().init(address=None if args.ray_address == "local" else args.ray_address, ignore_reinit_error=True)
        scorer = RayScorer(args.model, concurrency=args.concurrency, **loading,
                           **({"device": args.device} if args.device else {}))
        per_call = {"pairs_per_call": 65536}
    options = {k: v for k, v in (("max_length", args.max_length), ("batch_size", args.batch_size),
                                 ("prompt", args.prompt)) if v is not None}
    ranked = rerank(scorer, args.queries, args.corpus, first, depth=args.depth, output=args.output,
                    resume=args.resume, overwrite=args.overwrite, tag=args.tag, skip_missing=args.skip_missing,
                    title_sep=None if args.no_title else " ", **per_call, **options)
    print(f"wrote {args.output}: {ranked['qid'].nunique()} queries, {len(ranked)} lines")
    if args.qrels is not None:
        table = experiment({"first stage": first, "reranked": args.output}, None, args.qrels, args.measures,
                           baseline="first stage", correction=None)
        print(format_table(table))
    return 0
