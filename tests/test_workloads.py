"""xenc_lab.workloads.make_pairs: deterministic, shaped as documented, and strict about its arguments."""
from __future__ import annotations

import pytest

from xenc_lab.workloads import WORKLOADS, make_pairs

WORDS = {"short": ((5, 15), (50, 100)), "long": ((5, 15), (470, 560)), "mixed": ((4, 20), (10, 600))}


@pytest.mark.parametrize("kind", WORKLOADS)
def test_make_pairs_is_deterministic_for_the_same_arguments(kind):
    assert make_pairs(kind, 25, seed=3) == make_pairs(kind, 25, seed=3)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_make_pairs_differs_across_seeds_and_kinds(kind):
    base = make_pairs(kind, 10, seed=0)
    assert make_pairs(kind, 10, seed=1) != base
    assert all(make_pairs(other, 10, seed=0) != base for other in WORKLOADS if other != kind)


def test_make_pairs_of_n_is_a_prefix_of_make_pairs_of_more():
    assert make_pairs("mixed", 50, seed=7)[:20] == make_pairs("mixed", 20, seed=7)


@pytest.mark.parametrize("kind", WORKLOADS)
def test_make_pairs_gives_n_str_pairs_with_word_counts_in_the_kinds_ranges(kind):
    pairs = make_pairs(kind, 60, seed=11)
    assert len(pairs) == 60
    (q_lo, q_hi), (d_lo, d_hi) = WORDS[kind]
    for query, passage in pairs:
        assert isinstance(query, str) and isinstance(passage, str)
        assert query.endswith("?") and passage.endswith(".")
        assert q_lo <= len(query.split()) <= q_hi
        assert d_lo <= len(passage.split()) <= d_hi


def test_make_pairs_of_zero_is_empty():
    assert make_pairs("short", 0) == []


@pytest.mark.parametrize("kind", ["medium", "", None, "SHORT"])
def test_make_pairs_rejects_an_unknown_kind(kind):
    with pytest.raises(ValueError, match="kind"):
        make_pairs(kind, 3)


@pytest.mark.parametrize("n", [-1, 2.0, "3", None])
def test_make_pairs_rejects_n_that_is_not_a_non_negative_int(n):
    with pytest.raises(ValueError, match="n must"):
        make_pairs("short", n)


def test_make_pairs_rejects_a_bool_count():
    with pytest.raises(ValueError, match="n must"):
        make_pairs("short", True)
