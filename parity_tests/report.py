"""Collects |ours - oracle| per (architecture, dtype, quantity) and writes reports/parity.md."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

# The suite's loosest float32 bound (test_parity.logit_tolerance): |ours - oracle| <= ATOL * max(1, spread) + RTOL *
# |oracle|; each test may hold its values to a tighter one. Past it, a test settles the example against float64.
ATOL, RTOL = 1e-5, 1e-4


class ParityRecorder:
    def __init__(self):
        self.deltas: dict[tuple[str, str, str], list[np.ndarray]] = defaultdict(list)
        self.values: dict[tuple[str, str, str], list[np.ndarray]] = defaultdict(list)
        self.arbitrations: list[tuple[str, float, float]] = []  # (arch, oracle's fp32 error, ours) vs float64

    def arbitrated(self, arch: str, oracle_error: float, our_error: float) -> None:
        """An example outside tolerance, settled against the float64 oracle."""
        self.arbitrations.append((arch, oracle_error, our_error))

    def add(self, arch: str, dtype: str, quantity: str, ours, oracle) -> np.ndarray:
        ours, oracle = np.asarray(ours, dtype=np.float64), np.asarray(oracle, dtype=np.float64)
        delta = np.abs(ours - oracle).reshape(-1)
        self.deltas[arch, dtype, quantity].append(delta)
        self.values[arch, dtype, quantity].append(oracle.reshape(-1))
        return delta

    def spread(self, arch: str, dtype: str, quantity: str) -> float:
        values = self.values.get((arch, dtype, quantity))
        return float(np.concatenate(values).std()) if values else 0.0

    def rows(self):
        for key in sorted(self.deltas):
            delta = np.concatenate(self.deltas[key])
            yield (*key, len(delta), float(delta.max()), float(delta.mean()), self.spread(*key))

    def outside(self, arch: str, dtype: str, quantity: str) -> tuple[float, int]:
        """The bound's atol for these values and how many of them lie past ATOL * max(1, spread) + RTOL * |oracle|."""
        atol = ATOL * max(1.0, self.spread(arch, dtype, quantity))
        delta = np.concatenate(self.deltas[arch, dtype, quantity])
        oracle = np.abs(np.concatenate(self.values[arch, dtype, quantity]))
        return atol, int((delta > atol + RTOL * oracle).sum())

    def result(self, arch: str, dtype: str, quantity: str) -> tuple[str, str]:
        """(tolerance, pass/fail) for a float32 row; a 16-bit row is held to its error ratio instead, not a bound."""
        if dtype != "float32":
            return "n/a (16-bit: an error ratio)", "n/a"
        atol, past = self.outside(arch, dtype, quantity)
        if not past:
            return f"{atol:.1e} + {RTOL:g} x abs(oracle)", "pass"
        settled = any(a == arch for a, _, _ in self.arbitrations)
        return (f"{atol:.1e} + {RTOL:g} x abs(oracle)",
                f"{past} past it, settled vs float64" if settled else f"FAIL: {past} past it")

    def write(self, path: Path, device: str = "cpu") -> None:
        from xenc_lab.provenance import provenance

        where = ""
        if device != "cpu":
            import torch

            where = f" xenc_lab ran on {torch.cuda.get_device_name(device)} (`XENC_LAB_PARITY_DEVICE={device}`), the oracle on the CPU."
        lines = [
            "# Parity with sentence-transformers' CrossEncoder",
            "",
            provenance("python -m pytest parity_tests"),
            "",
            (
                "Each value is |xenc_lab - CrossEncoder.predict| over every hypothesis-generated pair checked in that "
                "run; `spread` is the std of the oracle's values over the same pairs (parity is meaningful only when "
                "it is far above the deltas). `tolerance` is the suite's loosest float32 bound, atol x max(1, spread) "
                "+ rtol x |oracle| (a test may hold its values to a tighter one); `result` says whether every value "
                "lies within it, or how many lie past it and were settled against the oracle in float64 (below). "
                "16-bit rows are held to an error ratio against the oracle's own 16-bit error, not a bound." + where
            ),
            "",
            "| architecture | dtype | quantity | values checked | max abs delta | mean abs delta | spread (std) "
            "| tolerance | result |",
            "|---|---|---|---:|---:|---:|---:|---|---|",
        ]
        for arch, dtype, quantity, n, mx, mean, spread in self.rows():
            tolerance, result = self.result(arch, dtype, quantity)
            lines.append(f"| {arch} | {dtype} | {quantity} | {n} | {mx:.2e} | {mean:.2e} | {spread:.3g} "
                         f"| {tolerance} | {result} |")
        if self.arbitrations:
            lines += [
                "",
                (
                    f"{len(self.arbitrations)} example(s) fell outside the tolerance and were checked against the "
                    "oracle in float64 (ill-conditioned inputs, where the oracle's own fp32 error exceeds the "
                    "tolerance; hypothesis's shrinking repeats a failing example, so one input can count more than "
                    "once):"
                ),
                "",
                "| architecture | CrossEncoder fp32 error vs float64 | xenc_lab error vs float64 |",
                "|---|---:|---:|",
            ] + [f"| {arch} | {theirs:.2e} | {ours:.2e} |" for arch, theirs, ours in self.arbitrations]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
