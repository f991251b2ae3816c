"""All ranks run one plan: a strategy whose result depends on the rank is named on every
rank, in both doors and at restore, before any state is built (`core.groups.check_same_plan`);
the pure parts (`partition.plan_digest`, `plan_parts`, `part_fields`) in one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import fzero
from fzero import partition
from tests._dist import run_world


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 4))


def _rank_dependent(manifest: partition.Manifest, *, world_size: int, stage: int, **options):
    """What a profiling-based owner map computed per rank without an all-reduce does: the
    plan's uneven bounds depend on who computed them."""
    even = partition.flat_even(manifest, world_size=world_size, stage=stage, **options)
    rank = torch.distributed.get_rank()
    units = []
    for unit in even.units:
        cut = unit.numel if rank == 0 else 0  # rank 0: "I own it all"; rank 1: "you do"
        bounds = (0, cut, unit.numel) if world_size == 2 else ()
        size = unit.numel if bounds else unit.shard_numel
        units.append(dataclasses.replace(unit, bounds=bounds, shard_numel=size))
    return dataclasses.replace(even, units=tuple(units), strategy="profiled_owners")


def test_digest_parts_and_fields_are_pure_and_name_what_differs():
    manifest = partition.describe(_model())
    a = partition.plan(manifest, world_size=2, stage=3)
    b = partition.plan(manifest, world_size=2, stage=3, strategy=partition.per_tensor_dim0)
    again = partition.plan(manifest, world_size=2, stage=3)
    assert partition.plan_digest(a) == partition.plan_digest(again)
    assert partition.plan_digest(a) != partition.plan_digest(b)
    parts_a, parts_b = partition.plan_parts(a), partition.plan_parts(b)
    assert [p.name for p in parts_a[:2]] == ["the plan's header", "the manifest"]
    assert parts_a[1] == parts_b[1]  # the same model
    assert parts_a[0] != parts_b[0]  # the strategy's name
    assert partition.part_fields(a, 0)["strategy"] == "'flat_even'"
    assert partition.part_fields(b, 0)["strategy"] == "'per_tensor_dim0'"
    assert "absent" in partition.part_fields(a, 99)["(part)"]
    mesh = partition.mesh_plan(manifest, partition.Mesh({"node": 2, "local": 2}), "mics")
    fields = partition.part_fields(mesh, 2)
    assert fields["optimizer split over"] == "['local']"
    assert len(partition.plan_digest(mesh)) == 32


def _door_case(rank: int, world: int, door: str) -> str:
    model = _model()
    try:
        if door == "engine":
            fzero.shard(model, stage=3, strategy=_rank_dependent)
        elif door == "init":
            fzero.comm.init_distributed()
            manifest = partition.describe(model)
            plan = _rank_dependent(manifest, world_size=world, stage=3)
            fzero.init(model, plan, fzero.optim.adamw(lr=1e-3))
        else:  # train_step with a plan built per rank, after a state built on an even plan
            fzero.comm.init_distributed()
            manifest = partition.describe(model)
            fzero.train_step(lambda p, b: 0, _rank_dependent(manifest, world_size=world, stage=2))
    except fzero.comm.RankDisagreement as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("door", ["engine", "init", "train_step"])
def test_a_rank_dependent_strategy_is_named_on_every_rank(door):
    message = run_world(_door_case, 2, door)  # rank 0's; rank 1 raising fails run_world
    assert "the ranks hold different plans" in message
    assert "unit 0 ('" in message and "field 'bounds'" in message
    assert "rank 0: [0, " in message and "rank 1: [0, 0, " in message
    assert "broadcast" in message


def _every_rank_raises(rank: int, world: int) -> list[str]:
    model = _model()
    try:
        fzero.shard(model, stage=3, strategy=_rank_dependent)
    except fzero.comm.RankDisagreement as error:
        seen = [str(error)]
    else:
        seen = ["no error"]
    out = [None] * world
    torch.distributed.all_gather_object(out, seen[0])
    return out


def test_every_rank_gets_the_same_message():
    messages = run_world(_every_rank_raises, 2)
    assert messages[0] == messages[1]
    assert "different plans" in messages[0]


def _restore_case(rank: int, world: int, directory: str) -> str:
    model = _model()
    fzero.comm.init_distributed()
    manifest = partition.describe(model)
    plan = partition.plan(manifest, world_size=world, stage=2)
    optimizer = fzero.optim.adamw(lr=1e-3)
    state = fzero.init(model, plan, optimizer)
    fzero.checkpoint.save(directory, state, optimizer=optimizer, tag="t")
    # a state whose plan differs by rank (made without fzero.init, so unchecked so far)
    other = _rank_dependent(manifest, world_size=world, stage=2)
    like = dataclasses.replace(state, plan=other) if rank == 1 else state
    try:
        fzero.checkpoint.restore(directory, like, optimizer=optimizer, tag="t")
    except fzero.comm.RankDisagreement as error:
        return str(error)
    return "no error"


def test_restore_checks_the_plan_too(tmp_path):
    message = run_world(_restore_case, 2, str(tmp_path))
    assert "fzero.checkpoint.restore: the ranks hold different plans" in message
    assert "the plan's header" in message and "field 'strategy'" in message


def _same_plan_case(rank: int, world: int) -> float:
    engine = fzero.shard(_model(), stage=3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return float(loss)


def test_equal_plans_train_as_before():
    assert run_world(_same_plan_case, 2) > 0
