"""The core's pure rules that both doors follow at stage 3: which units to prefetch
along a recorded order, and a unit's reuse distance (DeepSpeed's
`stage3_prefetch_bucket_size` and `stage3_max_reuse_distance`)."""

from __future__ import annotations

from fzero.core.gather import reuse_distance, units_to_prefetch

NUMEL = {0: 10, 1: 20, 2: 30, 3: 40}.__getitem__


def test_prefetch_takes_units_ahead_until_the_budget_is_crossed():
    order = [3, 2, 1, 0]
    assert units_to_prefetch(order, 1, NUMEL, 0) == []
    assert units_to_prefetch(order, 1, NUMEL, 1) == [2]  # crossing the budget still counts
    assert units_to_prefetch(order, 1, NUMEL, 30) == [2]
    assert units_to_prefetch(order, 1, NUMEL, 31) == [2, 1]
    assert units_to_prefetch(order, 1, NUMEL, 10**9) == [2, 1, 0]
    assert units_to_prefetch(order, 4, NUMEL, 10**9) == []


def test_reuse_distance_counts_the_units_used_before_the_next_use():
    backward = [3, 2, 1]
    assert reuse_distance(backward, 3, NUMEL) == 0  # used first: kept at distance 0
    assert reuse_distance(backward, 1, NUMEL) == 40 + 30
    assert reuse_distance(backward, 0, NUMEL) is None  # not used again: released
