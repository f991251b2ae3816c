"""A plan said per kind: the units (flat buffers, tensor placements) on every process
of a mesh, and per unit and kind of state the mesh axes it is split over and replicated
over (`KindPlan`). It is what a mesh preset declares (`mesh_plan` lowers it at once) and
the view of any `Plan` that per-kind arithmetic reads (`as_kind_plan`, whose
`shardings` are `Plan.shardings`); `executable` lowers it to the `Plan` both doors run,
and every plan a user sees is that one type.

The unit layout is the one a stage plan has: a buffer of `numel = world_size *
shard_numel` elements, `Unit.shard_range(rank)` the finest split (over every axis, in
mesh order). A kind split over axes of group size g holds `numel / g` elements: block
`Mesh.index_in_group(rank, shard)` of g equal blocks, a multiple of the alignment
because g divides the world size. A kind split over every axis in mesh order holds
exactly `Unit.shard_range(rank)`: today's ZeRO-1/2/3 are the one-axis case
(`to_plan`).

What is executable (`validate`), as ZeRO and FSDP run it:

- each rank's optimizer state (and fp32 master) lies inside its reduced gradient:
  the gradients' shard axes are a prefix of the optimizer's (ZeRO-1: none of all; 2 and
  3: all of all; MiCS: `local` of `local`);
- each rank's parameter shard is the union of optimizer shards along the remaining
  axes, published by one all-gather over them after the update, and is reduced into as
  a gradient shard: the parameters' shard axes are a prefix of the gradients' (stage 3
  implies 2, as in DeepSpeed; FSDP reduces a gradient to its parameter's shard);
- ZeRO++ hpZ's secondary parameter copy is split over a subset of the primary's axes
  (a coarser split: more memory, a gather within fewer ranks).

Both doors run (`executable`) every unit's kinds split over one group of axes S, or
whole; and the optimizer state split over more axes than the gradients: over S then
axes E (other axes, in mesh order; any axis left holds pure replicas, over which each
micro-step's gradient shard is averaged, as MiCS's), the gradients over S (stages 2-3;
ZeRO-1 units beside them keep whole gradients, reduced at the boundary over S then E), e.g. on
`node` x `local` the optimizer over `("local", "node")` (a quarter each on 2x2) with the
gradients over `("local",)`. A micro-step reduce-scatters the gradients over S into their
shard, where they accumulate; the boundary reduce-scatters that shard over E into the
optimizer's (a reduce-scatter: half the bytes of an all-reduce, each rank receiving only
its block); after the update one all-gather over E gives the gradient shard's
parameters, and one over S the whole unit where the parameters are whole.

They also run units split over different groups, each unit's kinds over one group of its
own (or whole): MiCS for the blocks within the node beside ZeRO-3 over the world for the
rest, ZeRO-1 embeddings within the node beside ZeRO-3 units over the world. The stage
plan's ranks are then the group along every axis some unit splits over (U), and a unit
split over fewer (`Unit.shard_axes`) has replicas among them: its gradients are
reduce-scattered within its group and averaged over the rest of U (and any replica
axes), its parameters gathered within its group, its shard counted once in the norm and
written once to checkpoints (by replica 0, `Plan.unit_replica`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fzero.partition._manifest import Manifest
from fzero.partition._mesh import KINDS, Mesh, Sharding, UnitSharding
from fzero.partition._mesh_groups import (
    _finer,
    _in_mesh_order,
    _own_groups,
    _own_secondary,
    _significant,
)
from fzero.partition._plan import Memory, OnMesh, Plan, PlanError, Unit
from fzero.partition._plan import validate as _validate_stage_plan

__all__ = [
    "KindPlan",
    "as_kind_plan",
    "executable",
    "to_plan",
    "validate",
    "without_unit_axes",
]


@dataclass(frozen=True)
class KindPlan:
    """A plan said per kind on a mesh (format 2 on the wire, which `from_bytes` lowers):
    `units[i]` is laid out as in a plan of `mesh.size` ranks; `shardings[i]` says how
    each kind of its state is split. `strategy` names the layout's function, `preset`
    the shardings'. `memory`: where its states live and their dtypes (`Memory`). Not a
    plan a door runs or a query takes: `executable` makes that `Plan`."""

    manifest: Manifest
    mesh: Mesh
    alignment: int
    units: tuple[Unit, ...]
    shardings: tuple[UnitSharding, ...]
    strategy: str = "custom"
    preset: str = "custom"
    memory: Memory = field(default_factory=Memory)

    @property
    def world_size(self) -> int:
        """Ranks the plan is for: the mesh's size."""
        return self.mesh.size

    unit_of = Plan.unit_of  # the same lookup: by name or alias

    def shard_range(self, index: int, kind: str, rank: int) -> tuple[int, int]:
        """`(start, stop)` of unit `index`'s buffer that `rank` holds of `kind` (one of
        `KINDS`): the whole buffer for a kind split over no axis."""
        sharding = self.shardings[index].of(kind)
        if sharding is None:
            raise PlanError(f"unit {self.units[index].name!r} has no {kind}")
        block = self.units[index].numel // self.mesh.group_size(sharding.shard)
        position = self.mesh.index_in_group(rank, sharding.shard)
        return position * block, (position + 1) * block


def validate(plan: Plan) -> Plan:
    """Check every invariant of `plan` (see `fzero.partition._plan.validate`); return it
    or raise `PlanError` naming the unit, the kind and the axis at fault. A plan said
    per kind (`KindPlan`) is checked as one of its units on `mesh.size` ranks, then each
    unit's shardings (see the module docstring): what `executable` lowers."""
    if isinstance(plan, Plan):
        return _validate_stage_plan(plan)
    if not isinstance(plan, KindPlan):
        raise PlanError(f"expected a partition.Plan, found {type(plan).__name__}")
    if not isinstance(plan.mesh, Mesh):
        raise PlanError(f"mesh is a {type(plan.mesh).__name__}; expected partition.Mesh")
    if len(plan.shardings) != len(plan.units):
        raise PlanError(
            f"{len(plan.shardings)} shardings for {len(plan.units)} units; give one per unit"
        )
    _validate_stage_plan(_layout(plan))
    _check_even(plan.units)
    _check_no_unit_stage(plan.units)
    for unit, sharding in zip(plan.units, plan.shardings):
        _validate_sharding(plan.mesh, unit, sharding)
    _check_runs(plan)
    return plan  # type: ignore[return-value]  # a KindPlan, checked


def _check_runs(plan: KindPlan) -> None:
    """What both doors run (`executable`), checked here so that a plan `validate`
    accepts is one they run: the errors name the unit, kind and axes."""
    _groups(plan)


def _groups(
    plan: KindPlan,
) -> tuple[tuple[str, ...], tuple[str, ...], list[tuple[str, ...] | None] | None]:
    """How the doors run `plan`: (the group S every split is over, the optimizer's axes
    where it is split over S and more (else ()), None), checked unit by unit; or, where
    units split over different groups of axes each over its own one, (their union, (),
    each unit's own axes: `_own_groups`). A plan neither way raises the one-group
    `PlanError` naming the unit, kind and axes."""
    try:
        group, finer = _shard_group(plan)
        _unit_stages(plan, group, finer)
        _secondary(plan, group)
        return group, finer, None
    except PlanError:
        own = _own_groups(plan)
        if own is None:
            raise
        union, axes = own
        _own_stages(plan, union, axes)
        _own_secondary(plan)
        return union, (), axes


def _check_even(units: tuple[Unit, ...]) -> None:
    uneven = [u.name for u in units if u.bounds]
    if uneven:
        raise PlanError(
            f"unit {uneven[0]!r} has uneven shards (bounds); a plan on a mesh splits each "
            "kind into equal blocks: use uneven units in a plan of the whole world"
        )


def _check_no_unit_stage(units: tuple[Unit, ...]) -> None:
    staged = [u for u in units if u.stage is not None]
    if staged:
        raise PlanError(
            f"unit {staged[0].name!r} has stage {staged[0].stage}; in a plan on a mesh the "
            "shardings say each unit's stage (e.g. partition.stage_shardings(mesh, "
            f"{staged[0].stage}, False)): leave Unit.stage None"
        )


def _layout(plan: KindPlan) -> Plan:
    """The units as a stage-3 plan (which allows persistent units), to check the layout."""
    return Plan(
        plan.manifest, plan.mesh.size, 3, plan.alignment, plan.units, plan.strategy,
        memory=plan.memory,
    )  # fmt: skip


def _validate_sharding(mesh: Mesh, unit: Unit, sharding: UnitSharding) -> None:
    where = f"unit {unit.name!r}"
    if not isinstance(sharding, UnitSharding):
        raise PlanError(f"{where}: sharding is a {type(sharding).__name__}; expected UnitSharding")
    for kind in KINDS:
        split = sharding.of(kind)
        if split is None and kind == "params_secondary":
            continue
        if not isinstance(split, Sharding):
            raise PlanError(f"{where} {kind}: {split!r} is not a partition.Sharding")
        problems = split.problems(mesh)
        if problems:
            raise PlanError(f"{where} {kind}: {problems[0]}")
    params, grads, optimizer = sharding.params, sharding.grads, sharding.optimizer
    if unit.persistent and params.shard:
        raise PlanError(
            f"{where} is persistent (parameters kept whole) but params are split over "
            f"{params.shard}; split them over no axis when unit.persistent, or plan with a "
            "lower persistence_threshold (units under it, DeepSpeed's 100,000 elements by "
            "default, keep whole parameters)"
        )
    _check_prefix(
        where + " params",
        params.shard,
        grads.shard,
        "the gradients",
        "a parameter shard is reduced into as a gradient shard (ZeRO stage 3 implies 2; "
        "FSDP reduces a gradient to its parameter's shard)",
    )
    _check_within(
        where + " grads",
        grads.shard,
        optimizer.shard,
        "the optimizer state",
        "each rank updates elements whose reduced gradient the ranks along the gradients' "
        "axes hold, so the optimizer state is split over the gradients' axes, in their "
        "order, and maybe more (e.g. gradients over ('local',), the optimizer over "
        "('local', 'node') or ('node', 'local'))",
    )
    secondary = sharding.params_secondary
    if secondary is not None:
        extra = [axis for axis in secondary.shard if axis not in params.shard]
        if extra:
            raise PlanError(
                f"{where} params_secondary: split over axis {extra[0]!r} where the primary "
                f"params ({params}) are not; hpZ's secondary copy is a coarser split of the "
                "primary (ZeRO++ hpZ)"
            )
    if sharding.hierarchical_params_gather and len(params.shard) < 2:
        raise PlanError(
            f"{where} params: hierarchical_params_gather needs params split over two or more "
            f"axes (one all-gather per axis); found {params}"
        )


def _check_within(
    where: str, inner: tuple[str, ...], outer: tuple[str, ...], of: str, why: str
) -> None:
    """Raise unless `outer` holds every axis of `inner` in `inner`'s order (more axes
    anywhere between), naming the first axis that breaks it."""
    found = tuple(a for a in outer if a in inner)
    for axis in inner:
        if axis not in outer:
            raise PlanError(
                f"{where}: split over {inner}, {of} over {outer}: axis {axis!r} is missing "
                f"there; {why}"
            )
    if found != inner:
        raise PlanError(
            f"{where}: split over {inner}, {of} over {outer}: these axes are in the order "
            f"{found} there; {why}"
        )


def _check_prefix(
    where: str, inner: tuple[str, ...], outer: tuple[str, ...], of: str, why: str
) -> None:
    """Raise unless `inner` is a prefix of `outer`, naming the first axis that breaks it."""
    for position, axis in enumerate(inner):
        if position >= len(outer) or outer[position] != axis:
            found = outer[position] if position < len(outer) else None
            raise PlanError(
                f"{where}: split over {inner}, {of} over {outer}: axis {axis!r} at position "
                f"{position} is {'missing' if found is None else f'{found!r}'} there; {why}"
            )


def stage_shardings(mesh: Mesh, stage: int, persistent: bool) -> UnitSharding:
    """ZeRO stage `stage`'s split of one unit on `mesh`: each kind either whole or split
    over every axis in mesh order (rank r holds `Unit.shard_range(r)`)."""
    every, whole = mesh.split_everywhere, mesh.replicated
    return UnitSharding(
        params=every if stage == 3 and not persistent else whole,
        grads=every if stage >= 2 else whole,
        optimizer=every if stage >= 1 else whole,
    )


def to_plan(plan: Plan | KindPlan) -> Plan:
    """The plan of the whole world (no `mesh`) that a plan on a mesh equals, for an engine
    that runs one group over the world; a `PlanError` names the unit, kind and axes that
    need process subgroups. A plan without a mesh is returned as it is.

    Equal means every kind of every unit is whole or split over every axis of size > 1
    in mesh order; units split as different ZeRO stages keep theirs (`Unit.stage`)."""
    if isinstance(plan, Plan):
        if plan.mesh is None:
            return _validate_stage_plan(plan)
        plan = as_kind_plan(plan)
    validate(plan)
    stage, units = _staged_units(plan, _unit_stages(plan, None))
    result = Plan(
        plan.manifest, plan.mesh.size, stage, plan.alignment, units, plan.strategy,
        memory=plan.memory,
    )  # fmt: skip
    return _validate_stage_plan(result)


def _unit_stages(
    plan: KindPlan, group: tuple[str, ...] | None, finer: tuple[str, ...] = ()
) -> list[int]:
    """The ZeRO stage each unit is split as over `group` (default every axis): each kind
    split over the whole group or whole (the optimizer over `finer` where given: `group`'s
    axes and more), else a `PlanError` naming the unit and kind. Units may differ
    (ZeRO-1 embeddings beside ZeRO-3 blocks: `Unit.stage`)."""
    return [_unit_stage(plan.mesh, u, s, group, finer) for u, s in zip(plan.units, plan.shardings)]


def _staged_units(plan: KindPlan, stages: list[int]) -> tuple[int, tuple[Unit, ...]]:
    """The stage plan's stage (the largest any unit is split as (`stages`, in unit
    order); a persistent unit's whole params count as stage 3's) and its units: a unit
    at the plan's stage as it is, a stage-2 unit of a stage-3 plan persistent (params
    whole, as today's stage-3 plans keep small tensors), any other lower one with its
    own `Unit.stage`."""
    said = [3 if u.persistent and s == 2 else s for u, s in zip(plan.units, stages)]
    stage = max(said, default=0)
    units = []
    for unit, unit_stage, declared in zip(plan.units, stages, said):
        if declared == stage or (stage == 3 and unit_stage == 2):
            units.append(replace(unit, persistent=stage == 3 and unit_stage == 2, stage=None))
        else:
            units.append(replace(unit, persistent=False, stage=unit_stage))
    return stage, tuple(units)


def _unit_stage(
    mesh: Mesh,
    unit: Unit,
    sharding: UnitSharding,
    every: tuple[str, ...] | None = None,
    finer: tuple[str, ...] = (),
) -> int:
    """The ZeRO stage one unit's shardings are over the group along `every` (default:
    every axis, in mesh order), or a `PlanError` naming the kind split otherwise (a
    persistent unit, params whole and the rest split, is stage 2). Without `every`, a
    secondary copy or a hierarchical gather is an error (they need subgroups). With
    `finer`, a split optimizer is over these axes (`every`'s and more)."""
    where = f"unit {unit.name!r}"
    if every is None and (
        sharding.params_secondary is not None or sharding.hierarchical_params_gather
    ):
        raise PlanError(
            f"{where} params: a secondary copy or a hierarchical gather needs process "
            "subgroups (one per axis); a stage plan has one group, the world"
        )
    names = mesh.names if every is None else every
    group = _significant(mesh, names)
    split = []
    for kind in ("optimizer", "grads", "params"):
        given = sharding.of(kind).shard  # axes of size 1 change nothing
        shard = _significant(mesh, given)
        if finer and kind == "optimizer" and shard:
            _check_finer(unit, sharding, group, finer, shard)
            shard = group
        if shard and shard != group:
            why = _ONE_GROUP if every is not None else _WORLD_ONLY
            raise PlanError(
                f"{where} {kind}: split over {given}, neither no axis nor {names}: {why}"
            )
        split.append(bool(shard) or (given == names and bool(names)))
    return sum(split)  # validated prefixes: optimizer, then grads, then params


_WORLD_ONLY = (
    "it needs process subgroups (one per axis); a stage plan has one group, the world "
    "(partition.mesh_plan runs it on subgroups)"
)
_ONE_GROUP = (
    "fzero runs plans whose every split is over one group of axes (each unit ZeRO-0/1/2/3 "
    "over it, replicas along the rest: MiCS/HSDP), or whose optimizer state is split over "
    "that group and more axes, or whose units each split every kind over one group of "
    "their own (MiCS blocks beside ZeRO-3 units); other splits over different groups per "
    "kind are not run yet"
)


def _check_finer(
    unit: Unit,
    sharding: UnitSharding,
    group: tuple[str, ...],
    finer: tuple[str, ...],
    shard: tuple[str, ...],
) -> None:
    """In a plan whose optimizer state is split over `finer` (`group`'s axes and more), a
    unit whose optimizer is split (over `shard`, its axes of size > 1) is so: its
    gradients split over `group` (stages 2-3) or whole (ZeRO-1: the whole gradient
    reduced at the accumulation boundary over `group`, then over the other axes, as a
    stage-2 shard is); or split over `group` only (`executable` puts it on its own axes:
    MiCS's, beside the finer units)."""
    where = f"unit {unit.name!r} optimizer: split over {sharding.optimizer.shard}"
    if shard != finer and shard != group:  # over the gradients' group: on its own axes
        raise PlanError(
            f"{where}, other units' over {finer} (gradients over {group}); "
            "fzero runs one optimizer split finer than the gradients; other units split "
            "their optimizer state over the gradients' axes (on their own axes, as MiCS's) "
            "or not at all"
        )


def without_unit_axes(plan: KindPlan) -> KindPlan:
    """`plan` with the axes of size 1 left out of every kind's split and replicas: the
    same groups (an axis of size 1 moves nothing), named as `executable` names them, so
    that rules comparing axes (a finer optimizer split, the gradients' group) read a
    hand-built plan as the run does."""
    mesh = plan.mesh
    if all(size > 1 for _, size in mesh.axes):
        return plan

    def strip(split: Sharding | None) -> Sharding | None:
        if split is None:
            return None
        return Sharding(_significant(mesh, split.shard), _significant(mesh, split.replicate))

    shardings = tuple(
        replace(
            s,
            params=strip(s.params),
            grads=strip(s.grads),
            optimizer=strip(s.optimizer),
            params_secondary=strip(s.params_secondary),
        )
        for s in plan.shardings
    )
    return replace(plan, shardings=shardings)


def executable(plan: KindPlan | Plan) -> Plan:
    """The plan both doors run for `plan` (said per kind): a stage plan over the group of
    ranks along the axes every kind is split over (its `world_size`), with `OnMesh`
    saying where those ranks lie and which axes hold replicas (MiCS/HSDP: gradients
    reduce-scattered within the group, then all-reduced across replicas) and hpZ's
    secondary split. ZeRO-1/2/3
    on every axis give the stage plan `to_plan` gives, on the mesh. A stage `Plan` is
    returned as it is.

    Run: every kind of every unit split over one set of axes S, in mesh order, or whole
    (as `to_plan` asks of the world's axes), each unit as its own ZeRO stage over S (the
    result's `Unit.stage` where below the plan's); hpZ's secondary over one subset of S, in
    mesh order; a hierarchical gather (MiCS's) as one all-gather per axis of S, the
    outermost first; the optimizer split over S and other axes E, in any order that keeps
    S's (the gradients of stage 2-3 units over S): the plan's ranks are then the
    optimizer's shards, along its axes in its order, and `OnMesh.optimizer_extra` is E
    (in mesh order); a unit beside them whose optimizer is split over S only is on its
    own axes S (`Unit.shard_axes`: replicas along E). Or units split over different
    groups, each unit every kind it splits over one group of its own, in mesh order
    (MiCS's blocks within the node beside ZeRO-3's other units over the world): the
    plan's ranks are the group along every axis any unit splits over, and a unit on
    fewer of them says so (`Unit.shard_axes`: its gradients reduce-scattered over them
    and averaged over the rest, its parameters gathered over them). Anything else is a
    `PlanError` naming the unit, kind and axes."""
    if isinstance(plan, Plan):
        return _validate_stage_plan(plan)
    validate(plan)
    mesh = plan.mesh
    group, finer, own = _groups(plan)
    if own is not None:
        return _on_own_groups(plan, group, own)
    stage, staged = _staged_units(plan, _unit_stages(plan, group, finer))
    secondary = _secondary(plan, group)
    shard = finer or group  # the plan's ranks: the optimizer's shards, in its order
    extra = tuple(a for a in mesh.names if a in finer and a not in group)
    size = mesh.group_size(shard)
    # beside a finer split, a unit whose optimizer is split over the gradients' group
    # only is on its own axes (MiCS's, or ZeRO-1/2 within the group)
    coarse = [
        bool(finer) and _significant(mesh, s.optimizer.shard) == group for s in plan.shardings
    ]
    units = tuple(
        replace(u, shard_numel=u.numel // mesh.group_size(group), shard_axes=group)
        if own
        else replace(u, shard_numel=u.numel // size)
        for u, own in zip(staged, coarse)
    )
    hierarchical = any(s.hierarchical_params_gather for s in plan.shardings)
    on = OnMesh(mesh.axes, shard, secondary, plan.preset, hierarchical, extra)
    result = Plan(plan.manifest, size, stage, plan.alignment, units, plan.strategy, on, plan.memory)
    return _validate_stage_plan(result)


def _own_stages(
    plan: KindPlan, union: tuple[str, ...], axes: list[tuple[str, ...] | None]
) -> list[int]:
    """Each unit's ZeRO stage over its own group of axes (`_own_groups`)."""
    return [
        _unit_stage(plan.mesh, u, s, own or union)
        for u, s, own in zip(plan.units, plan.shardings, axes)
    ]


def _on_own_groups(
    plan: KindPlan, union: tuple[str, ...], axes: list[tuple[str, ...] | None]
) -> Plan:
    """The stage plan of a mesh plan whose units split over different groups of axes
    (`_own_groups`): its ranks the group along `union`, each unit on its own axes
    (`Unit.shard_axes`) at its own stage."""
    mesh = plan.mesh
    stage, staged = _staged_units(plan, _own_stages(plan, union, axes))
    size = mesh.group_size(union)
    units = tuple(
        replace(u, shard_numel=u.numel // mesh.group_size(own or union), shard_axes=own)
        for u, own in zip(staged, axes)
    )
    on = OnMesh(mesh.axes, union, _own_secondary(plan), plan.preset)
    result = Plan(plan.manifest, size, stage, plan.alignment, units, plan.strategy, on, plan.memory)
    return _validate_stage_plan(result)


def as_kind_plan(plan: Plan) -> KindPlan:
    """`plan` said per kind (what per-kind arithmetic reads: `comm_volume`, the
    process groups, the pictures): its units on every process of `Plan.process_mesh`,
    each with `Plan.sharding_of`. A plan of the whole world with uneven shards has no
    such view (a `PlanError`: a kind's blocks on a mesh are equal); on a mesh uneven
    units keep their `bounds`, which the queries read through `Plan.kind_range`."""
    _validate_stage_plan(plan)
    if plan.mesh is None:
        _check_even(plan.units)
    mesh = plan.process_mesh
    units = tuple(
        replace(unit, shard_numel=unit.numel // mesh.size, stage=None, shard_axes=None)
        for unit in plan.units
    )
    return KindPlan(
        plan.manifest, Mesh(mesh.axes), plan.alignment, units, plan.shardings, plan.strategy,
        plan.preset, plan.memory,
    )  # fmt: skip


def _shard_group(plan: KindPlan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The one set of axes (size > 1) any unit's gradients and parameters are split over
    (or, where none are, its optimizer state), and the axes the optimizer state is split
    over where they are more (`_optimizer_axes`; () when none); a `PlanError` names two
    splits that differ.
    When nothing is split (stage 0), every axis: a stage-0 plan of the whole world, as
    `to_plan` gives."""
    mesh, found = plan.mesh, None
    for kinds in (("grads", "params"), ("optimizer",)):
        for unit, sharding in zip(plan.units, plan.shardings):
            for kind in kinds:
                axes = _significant(mesh, sharding.of(kind).shard)
                if not axes:
                    continue
                if found is None:
                    found = (axes, unit.name, kind)
                elif axes != found[0] and not (kind == "optimizer" and _finer(axes, found[0])):
                    raise PlanError(
                        f"unit {unit.name!r} {kind}: split over {axes}, unit {found[1]!r} "
                        f"{found[2]} over {found[0]}; {_ONE_GROUP}"
                    )
    if found is None:  # on one process, every axis (of size 1): the split said
        return _significant(mesh, mesh.names) or mesh.names, ()
    _in_mesh_order(mesh, found[0], f"unit {found[1]!r} {found[2]}")
    return found[0], _optimizer_axes(plan, found[0])


def _optimizer_axes(plan: KindPlan, group: tuple[str, ...]) -> tuple[str, ...]:
    """The axes (size > 1) a split optimizer state is split over where they are `group`'s
    (the gradients') and more, in the optimizer's order (() when none is): the first such
    unit's (`_check_finer` asks the same of the rest). Any axis in neither is a pure
    replica axis: each micro-step's gradient shard averaged over it, as MiCS's; hpZ's
    secondary copy (within the parameters' axes) and MiCS's hierarchical gather run
    beside it."""
    mesh = plan.mesh
    for sharding in plan.shardings:
        axes = _significant(mesh, sharding.optimizer.shard)
        if _finer(axes, group):
            return axes
    return ()


def _secondary(plan: KindPlan, group: tuple[str, ...]) -> tuple[str, ...]:
    """hpZ's secondary axes, one set for every unit with split params (they must agree)."""
    mesh, found = plan.mesh, None
    for unit, sharding in zip(plan.units, plan.shardings):
        if not _significant(mesh, sharding.params.shard):
            continue
        second = sharding.params_secondary
        axes = None if second is None else _significant(mesh, second.shard)
        if found is not None and axes != found[0]:
            raise PlanError(
                f"unit {unit.name!r} params_secondary: {axes}, unit {found[1]!r}: "
                f"{found[0]}; fzero runs one secondary split (hpZ) for every unit"
            )
        found = (axes, unit.name)
    axes = found[0] if found is not None else None
    if not axes or axes == group:  # a secondary as fine as the primary is the primary
        return ()
    _in_mesh_order(mesh, axes, f"unit {found[1]!r} params_secondary")
    return axes
