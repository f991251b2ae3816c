"""Which groups of mesh axes a plan's collectives run over on a mesh, per unit: the process
subgroups an engine creates (`process_groups`), the gathers that publish a unit's
updated parameters (`publish_hops`) and the optimizer blocks' exchange where their
order differs from the gradients' (`optimizer_exchange`). Pure functions of the plan."""

from __future__ import annotations

from fzero.partition._mesh import Mesh, UnitSharding
from fzero.partition._mesh_groups import _finer, _significant
from fzero.partition._mesh_plan import KindPlan, as_kind_plan, without_unit_axes
from fzero.partition._plan import Plan

__all__ = ["optimizer_exchange", "process_groups", "publish_hops"]


def process_groups(plan: Plan | KindPlan) -> tuple[tuple[str, ...], ...]:
    """Every set of axes a collective of `plan` runs over, in order of first use: the
    process subgroups an engine creates (`Mesh.groups(axes)` each), besides the world
    its control all-reduces (norms, flags) use. Per unit: the parameters' gather
    (`params.shard`, or each of its axes for a hierarchical gather), hpZ's backward
    gather (`params_secondary.shard`), the gradients' reduce-scatter (`grads.shard`) and
    all-reduce (`grads.replicate`), the optimizer blocks' exchange where their order
    differs (`optimizer_exchange`) and the publishing gathers after the update
    (`publish_hops`). Axes of size 1 are left out (`without_unit_axes`). A plan of the
    whole world (no mesh) runs on the world alone: ()."""
    if isinstance(plan, Plan):
        if plan.mesh is None:
            return ()
        plan = as_kind_plan(plan)
    plan = without_unit_axes(plan)
    found: dict[tuple[str, ...], None] = {}
    for sharding in plan.shardings:
        params = sharding.params.shard
        gathers = [(a,) for a in params] if sharding.hierarchical_params_gather else [params]
        secondary = sharding.params_secondary
        for axes in (
            *gathers,
            secondary.shard if secondary is not None else (),
            sharding.grads.shard,
            sharding.grads.replicate,
            optimizer_exchange(sharding, _gradients_group(plan), plan.mesh),
            *publish_hops(sharding, _gradients_group(plan), plan.mesh),
        ):
            if axes:
                found.setdefault(axes, None)
    return tuple(found)


def _gradients_group(plan: KindPlan) -> tuple[str, ...]:
    """The axes every unit with split gradients splits them over (() when none, or where
    units split over different groups of axes, each reduced over its own)."""
    found = {s.grads.shard for s in plan.shardings if s.grads.shard}
    return found.pop() if len(found) == 1 else ()


def publish_hops(
    sharding: UnitSharding, gradients: tuple[str, ...] = (), mesh: Mesh | None = None
) -> tuple[tuple[str, ...], ...]:
    """The all-gathers that publish a unit's updated parameters, in order, by their axes:
    the optimizer's axes after the parameters', as one gather; where the optimizer is
    split finer than split gradients, first over its axes beyond the gradients' (into the
    gradient shard; in `mesh`'s order where given), then over the gradients'
    beyond the parameters' (none at stage 3). `gradients`: the axes the plan's other
    units split their gradients over, which a ZeRO-1 unit's finer optimizer split follows
    the same way. Axes of size 1 are left to the caller (a gather over them moves
    nothing). Where the optimizer's axes are in another order than the gradients' then
    the rest, an exchange runs first (`optimizer_exchange`)."""
    optimizer, grads = sharding.optimizer.shard, _finer_grads(sharding, gradients)
    params = sharding.params.shard
    if grads and len(optimizer) > len(grads):
        order = optimizer if mesh is None else mesh.names
        beyond = tuple(a for a in order if a in optimizer and a not in grads)
        return beyond, grads[len(params) :]
    return (optimizer[len(params) :],)


def _finer_grads(sharding: UnitSharding, gradients: tuple[str, ...]) -> tuple[str, ...]:
    """The axes a unit's gradients are split over before its update: its own, or a ZeRO-1
    unit's beside a finer split the plan's others' (`gradients`), as it is reduced."""
    optimizer, grads = sharding.optimizer.shard, sharding.grads.shard
    if not grads and 0 < len(gradients) < len(optimizer) and _finer(optimizer, gradients):
        return gradients
    return grads


def optimizer_exchange(
    sharding: UnitSharding, gradients: tuple[str, ...], mesh: Mesh
) -> tuple[str, ...]:
    """The axes of the exchange a unit's optimizer blocks need (() when none): where its
    optimizer state is split finer than its gradients (or, ZeRO-1, the plan's others'
    `gradients`) and, over the axes of size > 1 of `mesh`, in another order than the
    gradients' axes then the rest in mesh order, the reduced gradient's blocks move to
    their optimizer shards' ranks at the accumulation boundary and the updated shards
    back before the publishing gathers, each an all-to-all over the optimizer's axes."""
    optimizer = _significant(mesh, sharding.optimizer.shard)
    grads = _significant(mesh, _finer_grads(sharding, gradients))
    if not grads or len(optimizer) <= len(grads):
        return ()
    rest = tuple(a for a in mesh.names if a in optimizer and a not in grads)
    return optimizer if optimizer != grads + rest else ()
