"""reports/peers.md (and peers.json beside it): the machine, how the engines ran, and per model one table of speed
beside fidelity, every ratio against sentence-transformers fp32 timed in the same session."""
from __future__ import annotations

import datetime
import json
import math
from dataclasses import asdict
from pathlib import Path

from ...provenance import provenance
from .stats import ORACLE, EngineResult, parse_result, rows, table

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


def raw(result: EngineResult) -> dict:
    """A result as the worker wrote it, for peers.json (so that a later run of one part can keep the other)."""
    if not result.ok:
        return {"engine": result.engine, "error": result.error, "skipped": result.skipped}
    return {"engine": result.engine, "pairs": result.pairs, "seconds": result.seconds, "busy_cpu": result.busy_cpu,
            "scores": result.scores.tolist(), "versions": result.versions}


def kept_sections(path: Path, names) -> dict:
    """The sections ``names`` of an earlier run's peers.json beside ``path`` (absent ones are left out), each marked
    with when it was written."""
    try:
        data = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    kept = {}
    for name in names:
        part = data.get("sections", {}).get(name)
        if part and "results" in part:
            meta = {k: part[k] for k in ("model", "tokens", "note", "written", "load") if k in part}
            kept[name] = ([parse_result(r) for r in part["results"]], part["lists"], meta | {"kept": True})
    return kept


def section(title: str, results, lists, meta: dict) -> str:
    peer_rows = rows(results, lists)
    size = f"{len(lists)} x {lists[0]}" if len(set(lists)) == 1 else f"{sum(lists)} pairs in {len(lists)} lists"
    tokens = f", mean {meta['tokens']:.0f} tokens a pair (template excluded)" if meta.get("tokens") else ""
    text = [f"## {title}", "", f"Model `{meta['model']}`; {size} pairs{tokens}.", "", table(peer_rows), ""]
    if meta.get("kept"):
        text += [f"This part is kept from the run written {meta.get('written', '(unknown)')}, load average "
                 f"{meta.get('load', 'n/a')} then: this run left it out.", ""]
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
    written = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    for name in TITLES:
        if name not in sections:
            body += [f"## {TITLES[name]}", "", "Not run: this run left it out, and no earlier report's part was there "
                     "to keep.", ""]
            continue
        results, lists, meta = sections[name]
        if "pairs" in meta and "tokens" not in meta:
            try:
                meta = meta | {"tokens": _mean_tokens(meta["model"], meta["pairs"])}
            except (OSError, ValueError):
                pass
        if not meta.get("kept"):
            meta = meta | {"written": written, "load": ", ".join(f"{x:.1f}" for x in load)}
        body.append(section(TITLES[name], results, lists, meta))
        data["sections"][name] = {"lists": lists, "rows": [asdict(r) for r in rows(results, lists)],
                                  "results": [raw(r) for r in results],
                                  **{k: v for k, v in meta.items() if k in ("model", "tokens", "note", "written",
                                                                           "load")}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(body).rstrip() + "\n", encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(data, indent=1, default=float) + "\n", encoding="utf-8")
