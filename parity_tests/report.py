"""Collects |ours - oracle| per (architecture, dtype, quantity) and writes reports/parity.md."""
from __future__ import annotations

import datetime
import platform
from collections import defaultdict
from pathlib import Path

import numpy as np


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

    def write(self, path: Path, device: str = "cpu") -> None:
        where = ""
        if device != "cpu":
            import torch

            where = f" xenc_lab ran on {torch.cuda.get_device_name(device)} (`XENC_LAB_PARITY_DEVICE={device}`), the oracle on the CPU."
        lines = [
            "# Parity with sentence-transformers' CrossEncoder",
            "",
            (
                f"Written by `pytest parity_tests` on {datetime.date.today()} ({platform.machine()}, "
                f"{platform.python_version()}). Each value is |xenc_lab - CrossEncoder.predict| over every "
                "hypothesis-generated pair checked in that run; `spread` is the std of the oracle's values over "
                "the same pairs (parity is meaningful only when it is far above the deltas)." + where
            ),
            "",
            "| architecture | dtype | quantity | values checked | max abs delta | mean abs delta | spread (std) |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for arch, dtype, quantity, n, mx, mean, spread in self.rows():
            lines.append(f"| {arch} | {dtype} | {quantity} | {n} | {mx:.2e} | {mean:.2e} | {spread:.3g} |")
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
