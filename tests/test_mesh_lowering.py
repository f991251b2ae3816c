"""Every split per kind `validate` accepts is one the doors run, holding what it says.

`partition.mesh_plan` lowers a preset's per-kind splits (a `KindPlan`) to the `Plan`
both doors run (`executable`). Over every way of splitting each kind
of a unit on a 2x2 mesh (each kind over no axis, one axis or both in either order, with
or without hpZ's secondary copy) — every unit alike, or one unit so beside units split
as ZeRO-3, MiCS or the optimizer over the world with the gradients in the node — a plan
`validate` accepts must lower, and each rank must hold of each kind exactly the elements
the split says (`kind_slices`) in the plan the doors run; a plan it refuses must be
refused naming the unit and the kind."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from fzero import partition
from fzero.partition import KINDS, Mesh, PlanError, UnitSharding, kind_slices, validate
from fzero.partition._mesh_plan import KindPlan, as_kind_plan, executable
from fzero.partition._queries import _slices_in
from tests.test_mesh_plan import MANIFEST  # five tensors in two groups

MESH = Mesh({"node": 2, "local": 2})
SPLITS = [(), ("node",), ("local",), ("node", "local"), ("local", "node")]
SECONDARY = [None, ("node",), ("local",)]
BASE = as_kind_plan(partition.mesh_plan(MANIFEST, MESH, "zero3", persistence_threshold=0))
OTHERS = {
    "alike": None,
    "zero3": BASE.shardings[0],
    "mics": UnitSharding(*(MESH.sharding("local"),) * 3),
    # the optimizer over the world, the gradients within the node (a ZeRO-2 shape)
    "finer": UnitSharding(MESH.replicated, MESH.sharding("local"), MESH.sharding("local", "node")),
}


def _sharding(params, grads, optimizer, secondary) -> UnitSharding:
    return UnitSharding(
        MESH.sharding(*params),
        MESH.sharding(*grads),
        MESH.sharding(*optimizer),
        None if secondary is None else MESH.sharding(*secondary),
    )


def _held(plan: partition.Plan, rank: int, kind: str) -> set[tuple[str, int]]:
    return {(s.fqn, i) for s in kind_slices(plan, rank, kind) for i in range(s.start, s.stop)}


def _said(plan: KindPlan, rank: int, kind: str) -> set[tuple[str, int]]:
    """What `plan` says process `rank` holds of `kind`."""
    found = set()
    for index, (unit, sharding) in enumerate(zip(plan.units, plan.shardings)):
        if sharding.of(kind) is not None:
            for s in _slices_in(index, unit, *plan.shard_range(index, kind, rank)):
                found |= {(s.fqn, i) for i in range(s.start, s.stop)}
    return found


def _cases():
    for params, grads, optimizer, secondary in itertools.product(SPLITS, SPLITS, SPLITS, SECONDARY):
        one = _sharding(params, grads, optimizer, secondary)
        for name, other in OTHERS.items():
            rest = one if other is None else other
            yield name, one, (one,) + (rest,) * (len(BASE.units) - 1)


def _check_ranges(plan: partition.Plan, mp: KindPlan) -> None:
    """The ranges the doors use, per process and unit: its gradient (and stage 3's
    parameter) shard `Plan.grads_range` and its optimizer shard `Plan.shard_range` of its
    plan rank, as the mesh plan says (also where the optimizer's order is not the
    gradients')."""
    on = plan.mesh
    for process in range(MESH.size):
        rank = MESH.index_in_group(process, on.shard) if on is not None else process
        for index, unit in enumerate(plan.units):
            stage = plan.stage_of(unit)
            if stage >= 1:
                said = mp.shard_range(index, "optimizer", process)
                assert plan.shard_range(unit, rank) == said, (process, unit.name, "optimizer")
            if stage >= 2:
                said = mp.shard_range(index, "grads", process)
                assert plan.grads_range(unit, rank) == said, (process, unit.name, "grads")


def test_every_plan_validate_accepts_lowers_to_what_it_says():
    accepted = refused = 0
    for name, one, shardings in _cases():
        mp = dataclasses.replace(BASE, shardings=shardings)
        try:
            validate(mp)
        except PlanError as error:
            refused += 1
            message = str(error)
            assert re.search(r"unit '[\w.]+'", message), (one, message)
            assert any(kind in message for kind in KINDS), (one, message)
            continue
        accepted += 1
        stage_plan = executable(mp)  # what both doors run, which says it per kind again
        for rank, kind in itertools.product(range(MESH.size), KINDS[:3]):
            assert _held(stage_plan, rank, kind) == _said(mp, rank, kind), (name, one, rank, kind)
        _check_ranges(stage_plan, mp)
        for index, sharding in enumerate(shardings):
            second = sharding.params_secondary
            if second is None or second.shard == sharding.params.shard:
                continue  # as fine as the primary: the primary serves backward
            assert stage_plan.shardings[index].params_secondary is not None, (name, one)
            for rank in range(MESH.size):
                assert _held(stage_plan, rank, "params_secondary") == _said(
                    mp, rank, "params_secondary"
                ), (name, one, rank)
    # ZeRO-0..3, MiCS, HSDP, hpZ, the finer optimizer splits and units on their own axes
    # (MiCS or ZeRO-1 within the node beside the others over the world, beside a finer
    # split or beside hpZ) are accepted
    assert accepted >= 64 and refused > accepted, (accepted, refused)  # 64 and 1,436 today


@pytest.mark.parametrize(
    ("params", "grads", "optimizer", "secondary"),
    [
        ((), (), (), None),  # ZeRO-0
        ((), (), ("node", "local"), None),  # ZeRO-1
        ((), ("node", "local"), ("node", "local"), None),  # ZeRO-2
        (("node", "local"), ("node", "local"), ("node", "local"), None),  # ZeRO-3
        (("node", "local"), ("node", "local"), ("node", "local"), ("local",)),  # hpZ
        (("local",), ("local",), ("local",), None),  # MiCS
        ((), ("local",), ("local",), None),  # HSDP's gradients, ZeRO-2 within the node
        (("local",), ("local",), ("local", "node"), None),  # the optimizer over the world
        ((), ("local",), ("local", "node"), None),
    ],
)
def test_what_zero_fsdp_mics_and_hpz_run_is_accepted(params, grads, optimizer, secondary):
    one = _sharding(params, grads, optimizer, secondary)
    mp = validate(dataclasses.replace(BASE, shardings=(one,) * len(BASE.units)))
    expected = MESH.group_size(optimizer) if optimizer else MESH.size  # ZeRO-0: the world
    assert executable(mp).world_size == expected
