"""The core's pure rules that both doors follow at stage 3: which units to prefetch
along a recorded order, and a unit's reuse distance (DeepSpeed's
`stage3_prefetch_bucket_size` and `stage3_max_reuse_distance`)."""

from __future__ import annotations

from fzero.core.gathering import reuse_distance, units_to_prefetch

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


def test_bucket_accumulators_are_one_span_per_bucket_and_copies_are_not():
    import torch

    from fzero import partition
    from fzero.core.reduce import _span, bucket_accumulators

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    plan = partition.plan(partition.describe(model), world_size=1, stage=1)
    buckets = partition.reduction_buckets(plan, 10**6)
    grads = bucket_accumulators(plan, buckets, torch.device("cpu"))
    assert len(buckets) == 1 and [g.numel() for g in grads] == [u.numel for u in plan.units]
    span = _span([grads[i] for i in buckets[0]])
    assert span is not None and span.numel() == sum(g.numel() for g in grads)
    span.fill_(1.0)
    assert all(bool((g == 1).all()) for g in grads)  # views of the one buffer
    assert _span([grads[i].clone() for i in buckets[0]]) is None
    assert _span(list(reversed([grads[i] for i in buckets[0]]))) is None or len(grads) == 1


def test_a_reduction_launches_buckets_in_order_once_their_units_are_complete():
    import torch

    from fzero import partition
    from fzero.core.reduce import Reduction

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    plan = partition.plan(partition.describe(model), world_size=1, stage=2)
    buckets = partition.reduction_buckets(plan, plan.units[0].numel)  # a unit each
    kept: list[int] = []
    reduction = Reduction(
        plan,
        0,
        buckets,
        sizes=[len(u.placements) for u in plan.units],
        accumulator=lambda i: torch.zeros(0),
        keep=lambda i, part, at: kept.append(i),
        device=torch.device("cpu"),
    )
    reduction.begin(reduce=True)
    named = dict(model.named_parameters())
    first = buckets[0][0]
    order = [i for i in range(len(plan.units)) if i != first] + [first]
    for index in order:  # the first bucket's unit last: nothing launches before it
        for pl in plan.units[index].placements:
            reduction.add(index, pl, torch.ones_like(named[pl.fqn]))
            reduction.arrived(index)
        assert kept == ([] if index != first else [u for b in buckets for u in b])
    reduction.finish()
    assert kept == [u for b in buckets for u in b]
