"""``xenc-lab evaluate``: runs against qrels in one ``experiment`` table, printed as markdown, LaTeX or CSV."""
from __future__ import annotations

import argparse
import os
import sys

from .metrics import DEFAULT_MEASURES
from .paired import TESTS


def add_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="evaluate TREC runs against qrels in one table, with paired tests against a "
                                        "baseline (pt.Experiment's columns)",
                       description="Evaluates each RUN with ir-measures and prints one row per run; with --baseline, "
                                   "per measure the queries improved (+) and degraded (-), the paired test's p-value "
                                   "and its multiple-testing correction over the other runs.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="TREC run files (qid Q0 docno rank score tag)")
    p.add_argument("--qrels", required=True, help="TREC qrels or BEIR qrels TSV")
    p.add_argument("--names", nargs="+", default=None, metavar="NAME", help="a name per run (default: file names)")
    p.add_argument("--baseline", default=None, metavar="NAME",
                   help="the run the others are tested against: its name (see --names) or its path")
    p.add_argument("--measures", nargs="+", default=list(DEFAULT_MEASURES), metavar="MEASURE",
                   help=f"ir-measures names (default: {' '.join(DEFAULT_MEASURES)})")
    p.add_argument("--test", default="t", choices=list(TESTS), help="the paired test (default: t, scipy's ttest_rel)")
    p.add_argument("--correction", default="holm",
                   help="statsmodels multipletests method over the non-baseline runs: holm (default), bonferroni, "
                        "fdr_bh, holm-sidak...; 'none' for no correction")
    p.add_argument("--alpha", type=float, default=0.05, help="the level of --correction's reject column")
    p.add_argument("--queries", default=None, help="evaluate only these queries (BEIR queries.jsonl or a qid<TAB>text "
                                                   "TSV)")
    p.add_argument("--missing", default="zero", choices=["zero", "drop"],
                   help="a judged query a run lacks: scores 0 (zero, default, as ir-measures and trec_eval -c) or is "
                        "left out of that run's mean (drop, trec_eval's default)")
    p.add_argument("--keep-identical-ids", action="store_true",
                   help="keep results whose docno equals the qid (default: dropped, as BEIR's evaluation does)")
    p.add_argument("--format", default="markdown", choices=["markdown", "latex", "csv"], help="the table's format")
    p.add_argument("--digits", type=int, default=4, help="decimals of the measures (default 4)")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from .experiments import experiment, format_table

    names = args.names or [os.path.basename(r) for r in args.runs]
    if len(names) != len(args.runs):
        raise ValueError(f"--names gives {len(names)} names for {len(args.runs)} runs")
    baseline = args.baseline
    if baseline is not None and baseline not in names and baseline in args.runs:
        baseline = names[args.runs.index(baseline)]
    table = experiment(list(args.runs), args.queries, args.qrels, args.measures, names=names, baseline=baseline,
                       test=args.test, correction=None if args.correction.lower() == "none" else args.correction,
                       alpha=args.alpha, missing=args.missing, ignore_identical_ids=not args.keep_identical_ids)
    print(format_table(table, args.format, args.digits))
    notes = table.attrs
    print(f"{notes['queries']} judged queries; a query a run lacks "
          f"{'scores 0' if notes['missing_rule'] == 'zero' else 'is left out of its mean'}"
          + ("" if baseline is None else f"; {args.test} test against {baseline}"
             + ("" if notes["correction"] is None else f", {notes['correction']} correction at alpha={args.alpha}")),
          file=sys.stderr)  # stdout holds the table alone, for a file or a pipe
    return 0
