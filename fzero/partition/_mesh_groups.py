"""The groups of mesh axes a mesh plan's units split over: axes of size > 1
(`_significant`), an optimizer split finer than a group (`_finer`), mesh order
(`_in_mesh_order`), and where units split over different groups of their own, the
plan's group, each unit's axes (`_own_groups`) and hpZ's one secondary split beside
them (`_own_secondary`). `executable` lowers a plan from these (`plan` is a `KindPlan`:
typed `Any` here, as this module sits below `_mesh_plan` in the import graph)."""

from __future__ import annotations

from typing import Any

from fzero.partition._mesh import Mesh
from fzero.partition._plan import PlanError

__all__: list[str] = []


def _significant(mesh: Mesh, axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in axes if mesh.axis_size(a) > 1)


def _finer(axes: tuple[str, ...], group: tuple[str, ...]) -> bool:
    """Whether `axes` are `group`'s in its order and more (an optimizer split finer than
    the gradients: the extra axes anywhere)."""
    return len(axes) > len(group) and tuple(a for a in axes if a in group) == group


def _in_mesh_order(mesh: Mesh, axes: tuple[str, ...], where: str) -> None:
    order = [mesh.names.index(a) for a in axes]
    if order != sorted(order):
        raise PlanError(
            f"{where}: split over {axes}, not in mesh order {mesh.names}; fzero runs "
            "splits whose axes keep the mesh's order (a process group's ranks are in "
            "rank order)"
        )


def _own_groups(
    plan: Any,
) -> tuple[tuple[str, ...], list[tuple[str, ...] | None]] | None:
    """Where units split over different groups of axes, each unit every kind it splits
    over its one group, in mesh order (MiCS's blocks within the node beside ZeRO-3's
    other units over the world; ZeRO-1 units over the node beside ZeRO-3 units over the
    world): the plan's group (every axis any unit splits over, in mesh order) and each
    unit's own axes (None: the plan's, or nothing split). None where some unit's kinds
    split over different groups, or every unit's over one. A hierarchical gather beside
    them is a `PlanError` naming the unit (hpZ's secondary copy: `_own_secondary`)."""
    mesh = plan.mesh
    per_unit = []
    for sharding in plan.shardings:
        split = {
            _significant(mesh, sharding.of(kind).shard) for kind in ("params", "grads", "optimizer")
        } - {()}
        if len(split) > 1:
            return None
        per_unit.append(split.pop() if split else ())
    found = sorted({axes for axes in per_unit if axes})
    if len(found) < 2:
        return None
    for axes, unit in zip(per_unit, plan.units):
        if axes:
            _in_mesh_order(mesh, axes, f"unit {unit.name!r} params, grads and optimizer")
    for unit, sharding in zip(plan.units, plan.shardings):
        if sharding.hierarchical_params_gather:
            raise PlanError(
                f"unit {unit.name!r} params: a hierarchical gather where units split over "
                f"different groups of axes ({found}) is not run yet"
            )
    union = tuple(a for a in mesh.names if any(a in axes for axes in found))
    return union, [axes if axes and axes != union else None for axes in per_unit]


def _own_secondary(plan: Any) -> tuple[str, ...]:
    """hpZ's secondary axes beside units on their own axes (() for none): one set S2 for
    every unit whose parameters are split over more axes than S2, each such unit's
    secondary over S2; a unit whose parameters are split over S2 itself keeps no copy
    (its primary serves backward, as hpZ's copy would). A `PlanError` names a unit that
    differs."""
    mesh, found = plan.mesh, None
    for unit, sharding in zip(plan.units, plan.shardings):
        second = sharding.params_secondary
        axes = () if second is None else _significant(mesh, second.shard)
        if axes and axes != _significant(mesh, sharding.params.shard):
            if found is not None and axes != found[0]:
                raise PlanError(
                    f"unit {unit.name!r} params_secondary: {axes}, unit {found[1]!r}: "
                    f"{found[0]}; fzero runs one secondary split (hpZ) for every unit"
                )
            found = (axes, unit.name)
    if found is None:
        return ()
    secondary, first = found
    _in_mesh_order(mesh, secondary, f"unit {first!r} params_secondary")
    for unit, sharding in zip(plan.units, plan.shardings):
        params = _significant(mesh, sharding.params.shard)
        second = sharding.params_secondary
        axes = () if second is None else _significant(mesh, second.shard)
        if params and params != secondary and axes != secondary:
            raise PlanError(
                f"unit {unit.name!r} params_secondary: {axes or None}, unit {first!r}: "
                f"{secondary}; beside hpZ every unit whose parameters are split over more "
                f"axes than {secondary} keeps its secondary copy over them (a unit split "
                "over them alone needs none)"
            )
    return secondary
