"""reports/peers.md (and peers.json beside it): the machine, how the engines ran, and per model one table of speed
beside fidelity, every ratio against sentence-transformers fp32 timed in the same session."""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from ...provenance import provenance
from .stats import ORACLE, rows, table

COMMAND = "tox -e peers"

METHOD = (
    "Each engine runs in a process of its own (ONNX Runtime's memory arena slows torch in a shared one), in an "
    "environment of its own where its pins conflict with the project's (OpenVINO: scripts/peers/openvino.txt), on the "
    "same pair file, written once. Each loads, scores a warm-up slice untimed, then times {repeats} passes over all "
    "pairs, tokenization included, at {threads} threads (torch, ONNX Runtime's intra-op pool, OpenVINO's "
    "INFERENCE_NUM_THREADS, llama.cpp's -t/-tb); pairs/s is over the median pass. Scores are raw (logits; for the "
    "decoder logit(yes) - logit(no), llama.cpp's softmax score turned back into it), compared with "
    "sentence-transformers fp32's on the same pairs: max |delta|, Spearman per query list (mean), and the share of "
    "its top 10 the engine also ranks top 10. Busy CPU is the whole machine's over the timed passes: above the "
    "engine's own share, other work was running."
)


def _engine_versions(results) -> str:
    lines = []
    for r in results:
        if r.versions:
            lines.append(f"- {r.engine}: " + ", ".join(f"{k} {v}" for k, v in r.versions.items()))
    return "\n".join(lines)


def _mean_tokens(model: str, pairs_file: Path) -> float:
    from transformers import AutoTokenizer

    from ...zoo import cache_dir

    tokenizer = AutoTokenizer.from_pretrained(str(cache_dir() / model))
    pairs = [json.loads(line) for line in pairs_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    lengths = [len(tokenizer(q, d, truncation=True)["input_ids"]) for q, d in pairs]
    return sum(lengths) / len(lengths)


def section(title: str, results, lists, meta: dict) -> str:
    peer_rows = rows(results, lists)
    size = f"{len(lists)} x {lists[0]}" if len(set(lists)) == 1 else f"{sum(lists)} pairs in {len(lists)} lists"
    try:
        tokens = f", mean {_mean_tokens(meta['model'], meta['pairs']):.0f} tokens a pair (template excluded)"
    except (OSError, ValueError, KeyError):
        tokens = ""
    text = [f"## {title}", "", f"Model `{meta['model']}`; {size} pairs{tokens}.", "", table(peer_rows), ""]
    if meta.get("note"):
        text += [meta["note"], ""]
    if not any(r.engine == ORACLE and r.ok for r in results):
        text += [f"{ORACLE} did not run: no ratio or fidelity could be computed.", ""]
    versions = _engine_versions(results)
    if versions:
        text += ["Versions inside each engine's process:", "", versions, ""]
    return "\n".join(text)


TITLES = {"encoder": "Encoder: MiniLM-L6 cross-encoder, 'mixed' workload",
          "decoder": "Decoder: random Qwen3-Reranker-0.6B-shaped checkpoint, one query ('short' workload)"}


def write_report(path: Path, sections: dict, args, load: list[float]) -> None:
    """reports/peers.md and reports/peers.json from the sections' (results, query-list sizes, meta)."""
    loaded = max(load) if load else math.nan
    state = (f"Load average (1 min) at the start and after each part: {', '.join(f'{x:.1f}' for x in load)} "
             f"on {__import__('os').cpu_count()} CPUs" + (": the machine was loaded by other work, so the absolute "
                                                          "figures are low and the ratios noisy." if loaded > 3 else "."))
    body = ["# Peers: speed beside fidelity on the same pairs", "", provenance(COMMAND), "", state
            + (f" {args.note}" if args.note else ""), "", METHOD.format(repeats=args.repeats, threads=args.threads), ""]
    data = {"load": load, "repeats": args.repeats, "threads": args.threads, "sections": {}}
    for name, (results, lists, meta) in sections.items():
        body.append(section(TITLES[name], results, lists, meta))
        data["sections"][name] = {"model": meta["model"], "lists": lists,
                                  "rows": [asdict(r) for r in rows(results, lists)],
                                  "versions": {r.engine: r.versions for r in results if r.versions}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(body).rstrip() + "\n", encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(data, indent=1, default=float) + "\n", encoding="utf-8")
