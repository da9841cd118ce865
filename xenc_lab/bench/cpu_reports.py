"""A CPU's reports in one command: ``python -m xenc_lab.bench.cpu_reports`` (``tox -e machine``).

Each step runs in a process of its own and writes into reports/<machine>/, the folder named from the CPU
(``machine_slug``: e.g. reports/intel-xeon-amx/):

- ``encoders``: the encoder benchmark (``tox -e bench``'s: eager and compiled, memory) with int8 (throughput.md,
  with the issues' goals for this CPU);
- ``decoder``: the decoder benchmark at Qwen3-Reranker-0.6B's shape, 1 x 100, with int8 (its section of the same
  file);
- ``peers``: every CPU peer on the same held-out pairs (peers.md).

A step that fails is reported and the others still run; the exit status says whether all of them passed.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from .report import machine_slug
from .timing import cpu_has_fast_bf16

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("encoders", "decoder", "peers")


def step_commands(out: Path, steps: tuple[str, ...] = STEPS, bf16: bool | None = None) -> dict[str, list[str]]:
    """The command line of each step, writing into ``out``; the decoder runs in bf16 where the CPU multiplies it
    natively, else in float32."""
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise ValueError(f"steps are {', '.join(STEPS)}; got {', '.join(map(repr, unknown))}")
    bf16 = cpu_has_fast_bf16() if bf16 is None else bf16
    cli = [sys.executable, "-m", "xenc_lab.cli", "bench"]
    commands = {
        "encoders": cli + ["--int8", "--pairs", "256", "--repeats", "3", "--compile", "--memory", "--report", str(out)],
        "decoder": cli + ["--decoder", "qwen3-0.6b", "--int8", "--dtypes", "bfloat16" if bf16 else "float32",
                          "--pairs", "100", "--repeats", "2", "--report", str(out)],
        "peers": [sys.executable, "-m", "xenc_lab.bench.peers", "--report", str(out / "peers.md")],
    }
    return {s: commands[s] for s in steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xenc_lab.bench.cpu_reports", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS, help="default: all three")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the reports' folder (default: reports/{machine_slug()} of the checkout)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    out = args.out.resolve() if args.out else Path("reports") / machine_slug()  # relative to ROOT, where steps run
    failed = []
    for step, command in step_commands(out, tuple(args.steps)).items():
        print(f"== {step}: {shlex.join(command)}", flush=True)
        if args.dry_run:
            continue
        start = time.perf_counter()
        code = subprocess.call(command, cwd=ROOT)
        print(f"== {step}: {'done' if code == 0 else f'failed (exit status {code})'} in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        if code:
            failed.append(step)
    if failed:
        print(f"failed: {', '.join(failed)}; the other steps' reports are in {out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
