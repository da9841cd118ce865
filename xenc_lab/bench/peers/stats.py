"""The peers comparison's pure parts: a worker's JSON result read back, fidelity against the oracle's scores (max
|delta|, mean Spearman per query list, top-10 overlap), and the rows of the report's table."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

ORACLE = "st-fp32"  # sentence-transformers in fp32: every engine's scores and speed are set against it


@dataclass
class EngineResult:
    engine: str
    pairs: int = 0
    seconds: list[float] = field(default_factory=list)  # each timed pass
    busy_cpu: list[float] = field(default_factory=list)  # the machine's busy CPU share over each pass
    scores: np.ndarray | None = None  # the last pass's raw scores
    versions: dict = field(default_factory=dict)
    error: str = ""  # why it failed
    skipped: str = ""  # why it did not run (e.g. a mode this checkout lacks)

    @property
    def ok(self) -> bool:
        return self.scores is not None and not self.error and not self.skipped

    @property
    def pairs_per_s(self) -> float:
        """Pairs over the median pass."""
        return self.pairs / statistics.median(self.seconds) if self.ok and self.seconds else math.nan


def parse_result(data: dict, expected_pairs: int | None = None) -> EngineResult:
    """A worker's JSON object as an EngineResult. One with neither scores nor ``error``/``skipped``, scores whose count
    is not ``pairs`` (or ``expected_pairs``), or non-positive timings is a ValueError naming the engine."""
    if not isinstance(data, dict) or not isinstance(data.get("engine"), str):
        raise ValueError(f"expected a result object with an 'engine' name, got {str(data)[:80]!r}")
    engine = data["engine"]
    if data.get("error") or data.get("skipped"):
        return EngineResult(engine, error=str(data.get("error") or ""), skipped=str(data.get("skipped") or ""))
    if "scores" not in data or "seconds" not in data:
        raise ValueError(f"{engine}: a result needs scores and seconds, or an error, got keys {sorted(data)}")
    scores = np.asarray(data["scores"], dtype=np.float64)
    pairs = int(data.get("pairs", len(scores)))
    if scores.ndim != 1 or len(scores) != pairs or (expected_pairs is not None and pairs != expected_pairs):
        raise ValueError(f"{engine}: expected {expected_pairs if expected_pairs is not None else pairs} scores, "
                         f"got {scores.shape}")
    seconds = [float(s) for s in data["seconds"]]
    if not seconds or min(seconds) <= 0:
        raise ValueError(f"{engine}: expected positive pass times, got {seconds}")
    return EngineResult(engine, pairs, seconds, [float(b) for b in data.get("busy_cpu", [])], scores,
                        dict(data.get("versions", {})))


def fidelity(scores, oracle, lists: list[int], k: int = 10) -> dict:
    """``scores`` against ``oracle`` (both over the same pairs, laid out as consecutive query lists of the sizes in
    ``lists``): max |delta|, mean Spearman over the lists, and mean top-``k`` overlap (the share of the oracle's
    top k, or of the whole list where shorter, that ``scores`` also puts in its top k)."""
    from scipy.stats import spearmanr

    scores, oracle = np.asarray(scores, dtype=np.float64), np.asarray(oracle, dtype=np.float64)
    if scores.shape != oracle.shape or sum(lists) != len(oracle) or min(lists, default=0) < 2:
        raise ValueError(f"expected two score arrays of the lists' {sum(lists)} pairs (each list 2 or more), got "
                         f"{scores.shape} and {oracle.shape} for lists {lists}")
    rhos, overlaps, start = [], [], 0
    for size in lists:
        a, b = scores[start:start + size], oracle[start:start + size]
        start += size
        rho = spearmanr(a, b).statistic
        rhos.append(1.0 if np.isnan(rho) and np.array_equal(np.argsort(a), np.argsort(b)) else float(rho))
        top = min(k, size)
        overlaps.append(len(set(np.argsort(-a, kind="stable")[:top]) & set(np.argsort(-b, kind="stable")[:top])) / top)
    return {"max_abs_delta": float(np.max(np.abs(scores - oracle))), "spearman": float(np.mean(rhos)),
            "top_overlap": float(np.mean(overlaps))}


@dataclass
class PeerRow:
    engine: str
    pairs_per_s: float
    ratio: float  # pairs/s over sentence-transformers fp32's
    max_abs_delta: float
    spearman: float
    top_overlap: float
    busy_cpu: float  # the mean busy CPU share over the timed passes
    note: str = ""


def rows(results: list[EngineResult], lists: list[int], oracle: str = ORACLE) -> list[PeerRow]:
    """One row per result, in their order: speed as a ratio to ``oracle``'s, fidelity against its scores. A failed or
    skipped engine is a row with NaNs and the reason; without a working oracle every ratio and fidelity is NaN."""
    base = next((r for r in results if r.engine == oracle and r.ok), None)
    out = []
    for r in results:
        if not r.ok:
            out.append(PeerRow(r.engine, *[math.nan] * 6, note=("skipped: " + r.skipped) if r.skipped else
                               "failed: " + r.error.splitlines()[0][:160] if r.error else "no result"))
            continue
        if base is None:
            fid = {"max_abs_delta": math.nan, "spearman": math.nan, "top_overlap": math.nan}
        else:
            fid = fidelity(r.scores, base.scores, lists)
        ratio = r.pairs_per_s / base.pairs_per_s if base is not None else math.nan
        busy = float(np.mean(r.busy_cpu)) if r.busy_cpu else math.nan
        out.append(PeerRow(r.engine, r.pairs_per_s, ratio, fid["max_abs_delta"], fid["spearman"], fid["top_overlap"],
                           busy))
    return out


def _cell(value: float, fmt: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def table(peer_rows: list[PeerRow]) -> str:
    """The rows as a markdown table."""
    lines = ["| engine | pairs/s | x ST fp32 | max abs delta | mean Spearman | top-10 overlap | busy CPU | note |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in peer_rows:
        lines.append(f"| {r.engine} | {_cell(r.pairs_per_s, '.2f')} | {_cell(r.ratio, '.2f')} | "
                     f"{_cell(r.max_abs_delta, '.2e')} | {_cell(r.spearman, '.4f')} | {_cell(r.top_overlap, '.3f')} | "
                     f"{_cell(r.busy_cpu, '.0%')} | {r.note} |")
    return "\n".join(lines)
