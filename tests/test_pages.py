"""Properties of the page planner: plan_batches over random length arrays."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from xenc_lab.pages import ATTENTION_SLACK, pages_for, plan_batches

FAST = settings(max_examples=100, deadline=None)


@st.composite
def plans(draw):
    """(lengths, page_size, max_pages, max_pairs, slack) with every length fitting one batch's budget."""
    page_size = draw(st.integers(1, 32))
    max_pages = draw(st.integers(1, 48))
    budget = page_size * max_pages
    # Small alphabets of lengths make ties (and so the tie order) common.
    pool = draw(st.lists(st.integers(1, budget), min_size=1, max_size=6))
    lengths = draw(st.lists(st.sampled_from(pool), min_size=0, max_size=80))
    max_pairs = draw(st.none() | st.integers(1, 12))
    slack = draw(st.sampled_from([ATTENTION_SLACK, None]))  # None: attention on the packed stream
    return np.asarray(lengths, dtype=np.int64), page_size, max_pages, max_pairs, slack


@FAST
@given(plans())
def test_plan_batches_places_every_pair_exactly_once(plan):
    lengths, page_size, max_pages, max_pairs, slack = plan
    batches = plan_batches(lengths, page_size, max_pages, max_pairs, slack)
    placed = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    assert sorted(placed.tolist()) == list(range(len(lengths)))
    assert all(len(b) > 0 for b in batches), "no empty batches"


@FAST
@given(plans())
def test_plan_batches_keeps_each_batch_within_its_page_count(plan):
    lengths, page_size, max_pages, max_pairs, slack = plan
    for b in plan_batches(lengths, page_size, max_pages, max_pairs, slack):
        assert pages_for(int(lengths[b].sum()), page_size) <= max_pages, (lengths[b].tolist(), page_size, max_pages)


@FAST
@given(plans())
def test_plan_batches_keeps_padded_attention_within_the_slack_of_real_tokens(plan):
    lengths, page_size, max_pages, max_pairs, slack = plan
    assume(slack is not None)  # without a padded layout, batches fill to the budget (the closing test)
    for b in plan_batches(lengths, page_size, max_pages, max_pairs, slack):
        if len(b) > 1:  # a lone pair is its own layout
            assert len(b) * int(lengths[b].max()) <= slack * int(lengths[b].sum())


@FAST
@given(plans())
def test_plan_batches_puts_at_most_max_pairs_in_a_batch(plan):
    lengths, page_size, max_pages, max_pairs, slack = plan
    for b in plan_batches(lengths, page_size, max_pages, max_pairs, slack):
        assert max_pairs is None or len(b) <= max_pairs


@FAST
@given(plans())
def test_plan_batches_orders_pairs_longest_first_with_ties_in_input_order(plan):
    lengths, page_size, max_pages, max_pairs, slack = plan
    batches = plan_batches(lengths, page_size, max_pages, max_pairs, slack)
    flat = [int(i) for b in batches for i in b]
    assert flat == sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    for earlier, later in itertools.pairwise(batches):
        assert lengths[earlier].min() >= lengths[later].max()


@FAST
@given(plans())
def test_plan_batches_closes_a_batch_only_when_the_next_pair_would_break_a_limit(plan):
    lengths, page_size, max_pages, max_pairs, slack = plan
    batches = plan_batches(lengths, page_size, max_pages, max_pairs, slack)
    for b, nxt in itertools.pairwise(batches):
        grown = np.append(b, nxt[0])
        g = lengths[grown]
        assert (
            pages_for(int(g.sum()), page_size) > max_pages
            or (slack is not None and len(grown) * int(g.max()) > slack * int(g.sum()))
            or (max_pairs is not None and len(grown) > max_pairs)
        ), f"batch {lengths[b].tolist()} closed early; it could also hold {int(lengths[nxt[0]])}"


@FAST
@given(plans())
def test_plan_batches_is_deterministic(plan):
    lengths, page_size, max_pages, max_pairs, slack = plan
    first = plan_batches(lengths, page_size, max_pages, max_pairs, slack)
    again = plan_batches(lengths.copy(), page_size, max_pages, max_pairs, slack)
    assert [b.tolist() for b in first] == [b.tolist() for b in again]


def test_plan_batches_of_no_pairs_is_no_batches():
    assert plan_batches(np.zeros(0, dtype=np.int64), 16, 4) == []


def test_plan_batches_rejects_a_pair_longer_than_the_batch_budget():
    with pytest.raises(AssertionError):
        plan_batches(np.array([10, 65]), page_size=16, max_pages=4)


@pytest.mark.parametrize(("tokens", "page_size", "pages"), [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (33, 1, 33)])
def test_pages_for_rounds_up_to_whole_pages(tokens, page_size, pages):
    assert pages_for(tokens, page_size) == pages


def test_plan_batches_without_slack_fills_batches_that_padded_attention_would_split():
    # One long pair and many short ones: padded, the long pair's layout would hold 10x the real tokens.
    lengths = np.array([100] + [10] * 30, dtype=np.int64)
    assert len(plan_batches(lengths, 16, 32)) > 1
    assert [b.tolist() for b in plan_batches(lengths, 16, 32, slack=None)] == [list(range(31))]
