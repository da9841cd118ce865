"""The arbitration rule on made-up numbers: what it lets through, what it refuses, and when it asks for float64."""
from __future__ import annotations

import numpy as np
import pytest

from .arbitration import arbitrate, scaled_tolerance, within


class Recorder:
    def __init__(self):
        self.calls = []

    def arbitrated(self, name, theirs, ours):
        self.calls.append((name, theirs, ours))


def never():
    raise AssertionError("float64 asked for where the tolerance held")


def test_the_scale_widens_the_absolute_tolerance_only_above_one():
    assert scaled_tolerance(0.3) == {"atol": 1e-5, "rtol": 1e-4}
    assert scaled_tolerance(20.0, rtol=1e-5) == {"atol": pytest.approx(2e-4), "rtol": 1e-5}
    assert within([1.0, 2.0], [1.0 + 1.1e-4, 2.0], scaled_tolerance(1.0)).tolist() == [True, True]
    assert within([1.0], [1.0 + 1.2e-4], scaled_tolerance(1.0)).tolist() == [False]


def test_within_tolerance_needs_no_float64_and_records_nothing():
    recorder = Recorder()
    arbitrate("m", [0.5, -3.0], [0.5 + 5e-6, -3.0], {"atol": 1e-5, "rtol": 0}, recorder, never)
    assert recorder.calls == []


def test_off_by_as_much_as_the_oracle_on_an_ill_conditioned_input_passes_and_is_recorded():
    recorder = Recorder()
    truth = np.array([1.0, 2.0])
    arbitrate("m", truth - [3e-5, 0], truth + [3e-5, 0], {"atol": 1e-5, "rtol": 0}, recorder, lambda: truth)
    assert recorder.calls == [("m", pytest.approx(3e-5), pytest.approx(3e-5))]


def test_a_wrong_score_far_from_both_fails_with_the_numbers():
    truth = np.array([1.0, 2.0])
    with pytest.raises(AssertionError, match=r"m: \|ours - CrossEncoder\| is 9\.99e-04.*twice CrossEncoder's fp32 error"):
        arbitrate("m", truth + [1e-3, 0], truth + [1e-6, 0], {"atol": 1e-5, "rtol": 0}, Recorder(), lambda: truth)
