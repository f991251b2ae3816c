"""The plan: how every trainable tensor is laid out and split across ranks.

A plan groups tensors into units. A unit is one flat buffer of `numel` elements
(one all-gather / one reduce-scatter); rank `r` owns the contiguous range
`[r * shard_numel, (r + 1) * shard_numel)` of it, or with uneven shards
`[bounds[r], bounds[r + 1])` (some maybe empty: whole tensors owned by one rank, no
padding). Where each tensor lies in the
buffer is a list of pieces, so a plan can place a tensor in one run (flat split)
or in one run per rank (dim-0 split). Which states use the split is the stage:
0 none, 1 optimizer state, 2 + gradients, 3 + parameters (ZeRO, Rajbhandari et
al. 2020, section 5).

A plan may run on a mesh of more processes than it has ranks (`OnMesh`): its
`world_size` ranks are then one group along the mesh's `shard` axes, and each such group
holds the same shards (replicas along the other axes: MiCS/HSDP), optionally with
ZeRO++ hpZ's `secondary` parameter split within fewer ranks (`fzero.partition.mesh_plan`
makes such a plan from a preset that says each kind's axes).

Whatever made it, the plan is one type and says everything the doors run: per unit and
kind of state, the axes it is split over (`Plan.sharding_of`, JAX's `PartitionSpec`;
`Plan.kind_range` the elements a process holds), where it lives (`Plan.params_memory`,
`Plan.optimizer_memory`: JAX's `memory_kind`) and its dtype (`Plan.master_dtype`,
`Plan.states_dtype`, `Plan.grads_dtype`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fzero.partition._manifest import Manifest, TensorSpec
from fzero.partition._mesh import Mesh, OnMesh, UnitSharding, validate_on_mesh
from fzero.partition._placement import MEMORY_KINDS, Memory, PlanError
from fzero.partition._plan_checks import validate_memory, validate_shard_axes

__all__ = [
    "MEMORY_KINDS",
    "Memory",
    "OnMesh",
    "Piece",
    "Placement",
    "Plan",
    "PlanError",
    "Unit",
    "unit_stage",
    "validate",
    "with_memory",
]


@dataclass(frozen=True)
class Piece:
    """`numel` elements of a flattened tensor, from element `start`, at buffer `offset`."""

    start: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Placement:
    """Where one tensor lies in its unit's flat buffer."""

    fqn: str
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Unit:
    """One flat, padded buffer of tensors sharing optimizer group and dtype.

    `module` is the module path whose forward uses all of the unit's tensors
    ("" is the root): stage 3 gathers the unit when that module runs.
    `persistent` units keep their parameters whole in stage 3. `bounds`: uneven shards,
    rank r's from `bounds[r]` to `bounds[r + 1]` (world size + 1 offsets from 0 to
    `numel`; `shard_numel` is then the largest); () for equal shards. `stage`: the ZeRO
    stage this unit is split as, at most the plan's (None: the plan's): "ZeRO-1 for the
    embeddings, ZeRO-3 for the blocks" in one plan. `Plan.stage_of` reads it.
    `optimizer_memory`: where this unit's masters and optimizer state live, one of
    `MEMORY_KINDS` (None: the plan's `memory.optimizer`): "nvme" units beside units in
    memory in one plan. `Plan.optimizer_memory` reads it. `params_memory`: where its
    stage-3 parameter shard lives between uses (None: the plan's `memory.params`);
    `Plan.params_memory` reads it. `states_dtype`: its optimizer moments' dtype, one of
    `MEMORY_DTYPES` (None: the plan's `memory.states`): bf16 moments for a large
    embedding beside fp32 ones; `Plan.states_dtype` reads it. `grads_dtype`: its
    gradient accumulator's, one of `GRAD_DTYPES` (None: the plan's `memory.grads`);
    `Plan.grads_dtype` reads it. `master_dtype`: its masters', one of `MEMORY_DTYPES`
    (None: the plan's `memory.master`; "bf16" masters are the unit's bf16 parameters
    themselves); `Plan.master_dtype` reads it. `shard_axes`: on a mesh, the axes of the
    plan's `OnMesh.shard` this unit's split states are split over when they are fewer
    (in that order; None: all of them): MiCS's blocks within a node beside ZeRO-3's
    other units over the world. Its `numel` is then `shard_numel` times their group's
    size, and the processes along the plan's other shard axes hold the same shards
    (replicas of the unit: gradients averaged over them, its shard counted once);
    `Plan.shard_index` says which shard a plan rank holds.
    """

    name: str
    module: str
    group: int
    dtype: str
    placements: tuple[Placement, ...]
    shard_numel: int
    numel: int
    persistent: bool = False
    bounds: tuple[int, ...] = ()
    stage: int | None = None
    optimizer_memory: str | None = None
    params_memory: str | None = None
    states_dtype: str | None = None
    grads_dtype: str | None = None
    master_dtype: str | None = None
    shard_axes: tuple[str, ...] | None = None

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Shard `rank`'s part of the buffer as `(start, stop)` element offsets (the plan
        rank's, but for a unit with its own `shard_axes`: `Plan.shard_index`)."""
        if self.bounds:
            return self.bounds[rank], self.bounds[rank + 1]
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_size(self, rank: int) -> int:
        """Elements of rank `rank`'s part (`shard_numel` but with uneven shards)."""
        start, stop = self.shard_range(rank)
        return stop - start

    def owner(self, offset: int) -> int:
        """The shard (`shard_range`'s index) that holds buffer element `offset`."""
        if self.bounds:
            return bisect.bisect_right(self.bounds, offset, hi=len(self.bounds) - 1) - 1
        return offset // self.shard_numel


def with_memory(plan: Plan, memory: Memory, said_by: str = "the config") -> Plan:
    """`plan` with each field of its `memory` that it leaves at the default taken from
    `memory` (what `said_by` states); a field both state differently raises `PlanError`
    naming it and both values."""
    merged = {}
    default = Memory()
    for name in ("params", "optimizer", "master", "states", "grads"):
        own, other = getattr(plan.memory, name), getattr(memory, name)
        if own != getattr(default, name) and other not in (own, getattr(default, name)):
            raise PlanError(
                f"the plan's memory.{name} is {own!r} but {said_by} says {other!r}: state it "
                "in one place or make them agree"
            )
        merged[name] = own if own != getattr(default, name) else other
    return validate(replace(plan, memory=Memory(**merged)))


def _reorder(index: int, sizes: dict[str, int], of: tuple[str, ...], to: tuple[str, ...]) -> int:
    """The index along the axes `to` (row-major) of the rank whose index along `of` is
    `index`: `of` in another order, or some of its axes (a projection)."""
    coordinate = {}
    for axis in reversed(of):
        index, coordinate[axis] = divmod(index, sizes[axis])
    for axis in to:
        index = index * sizes[axis] + coordinate[axis]
    return index


def unit_stage(plan_stage: int, unit: Unit) -> int:
    """The ZeRO stage `unit` runs as in a plan of stage `plan_stage`: its own `stage`, or
    the plan's when it has none; a persistent unit (parameters kept whole) at stage 3
    runs as stage 2. What it decides, per unit: 1 and up, the optimizer state (and fp32
    master) is this rank's shard; 2 and up, the gradient is reduce-scattered into the
    shard (else all-reduced whole, at the accumulation boundary); 3, the parameters are
    a shard between uses, gathered when the unit's module runs."""
    stage = plan_stage if unit.stage is None else unit.stage
    return 2 if stage == 3 and unit.persistent else stage


@dataclass(frozen=True)
class Plan:
    """A complete, validated sharding plan: plain data, hashable, serialisable.
    `mesh`: None for a plan whose ranks are the processes; else `OnMesh`. `stage` is the
    largest stage any unit is split as; a unit may say a lower one (`Unit.stage`), so
    what a unit's state is (whole or a shard) is `stage_of(unit)`'s, and what the run
    sets up at all (stage 3's gathering) is `stage`'s or `runs_stage`'s."""

    manifest: Manifest
    world_size: int
    stage: int
    alignment: int
    units: tuple[Unit, ...]
    strategy: str = "custom"
    mesh: OnMesh | None = None
    memory: Memory = field(default_factory=Memory)

    @property
    def processes(self) -> int:
        """Processes the plan runs on (`world_size` but on a mesh with replicas)."""
        return self.world_size if self.mesh is None else self.mesh.processes

    @property
    def replicas(self) -> int:
        """Processes holding each rank's shards (1 but with a mesh's replicate axes)."""
        return self.processes // self.world_size

    @property
    def shards_optimizer(self) -> bool:
        """Whether any unit's optimizer state is split (`stage_of` says which)."""
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:
        """Whether any unit's gradients are split (`stage_of` says which)."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        """Whether any unit's parameters may be split (`stage_of` says which)."""
        return self.stage >= 3

    @property
    def optimizer_extra_size(self) -> int:
        """Optimizer shards per gradient shard: 1, or on a mesh whose optimizer state is
        split over more axes than its gradients (`OnMesh.optimizer_extra`) the size of
        the group along those axes."""
        if self.mesh is None or not self.mesh.optimizer_extra:
            return 1
        sizes = dict(self.mesh.axes)
        return math.prod(sizes[axis] for axis in self.mesh.optimizer_extra)

    @property
    def grads_world_size(self) -> int:
        """Ranks of the group gradients (and stage 3's parameters) are split over:
        `world_size`, over `optimizer_extra_size` with a finer optimizer split."""
        return self.world_size // self.optimizer_extra_size

    def rank_in_gradient_order(self, rank: int) -> int:
        """Plan rank `rank`'s index along `OnMesh.gradient_order`: the optimizer block the
        accumulation boundary's reduce-scatter leaves it (its gradient shard's index times
        `optimizer_extra_size`, plus its index along the extra axes). `rank` itself but
        where the optimizer's order is `OnMesh.permuted`."""
        if self.mesh is None or not self.mesh.permuted:
            return rank
        return _reorder(rank, dict(self.mesh.axes), self.mesh.shard, self.mesh.gradient_order)

    def rank_in_plan_order(self, index: int) -> int:
        """The plan rank whose `rank_in_gradient_order` is `index` (its inverse)."""
        if self.mesh is None or not self.mesh.permuted:
            return index
        return _reorder(index, dict(self.mesh.axes), self.mesh.gradient_order, self.mesh.shard)

    def optimizer_finer(self, unit: Unit | int) -> bool:
        """Whether `unit`'s (a `Unit` of this plan or its index) optimizer shard is a part
        of its gradient shard (and stage 3's parameter shard) rather than all of it: the
        plan splits the optimizer state finer than the gradients (`optimizer_extra_size`
        > 1) and the unit is not on its own `shard_axes` (whose optimizer, gradients and
        parameters are split alike). Where it is not, a stage-3 fp32 master can be the
        parameter shard itself."""
        if isinstance(unit, int):
            unit = self.units[unit]
        return self.optimizer_extra_size > 1 and unit.shard_axes is None

    def grads_rank(self, rank: int) -> int:
        """Plan rank `rank`'s index in the gradients' group (`grads_world_size` ranks)."""
        return self.rank_in_gradient_order(rank) // self.optimizer_extra_size

    def shards_of(self, unit: Unit) -> int:
        """How many shards `unit`'s gradients (stages 2-3) and parameters (stage 3) are
        split into: the group size of its own `shard_axes`, else `grads_world_size`."""
        if unit.shard_axes is None or self.mesh is None:
            return self.grads_world_size
        sizes = dict(self.mesh.axes)
        return math.prod(sizes[axis] for axis in unit.shard_axes)

    @property
    def process_mesh(self) -> Mesh:
        """The processes the plan runs on, as a mesh: `mesh` (an `OnMesh` is a `Mesh`), or
        for a plan of the whole world the one axis `dp` of `world_size` ranks."""
        return self.mesh if self.mesh is not None else Mesh.single(self.world_size)

    @property
    def preset(self) -> str:
        """The name of the placement: the mesh preset's (`OnMesh.preset`), else
        "zero<stage>", or "custom" where units say their own stages."""
        if self.mesh is not None:
            return self.mesh.preset
        return "custom" if self.mixed else f"zero{self.stage}"

    def sharding_of(self, unit: Unit | int) -> UnitSharding:
        """How each kind of `unit`'s state (a `Unit` of this plan or its index) is split
        over `process_mesh`'s axes, as JAX's `PartitionSpec` says it per array: the
        optimizer state (and master) over the mesh's `shard` axes (or the unit's own
        `shard_axes`) from stage 1, the gradients over the gradients' axes from stage 2,
        the parameters from stage 3 (a persistent unit's whole), hpZ's secondary copy over
        `OnMesh.secondary`; each whole (replicated) otherwise. `kind_range` says which
        elements a process holds."""
        if isinstance(unit, int):
            unit = self.units[unit]
        mesh, stage = self.process_mesh, self.stage_of(unit)
        on = self.mesh
        if on is None:
            split = optimizer = mesh.split_everywhere
        elif unit.shard_axes is not None:  # its own axes: a plain split over them
            split = optimizer = mesh.sharding(*unit.shard_axes)
        else:
            split, optimizer = mesh.sharding(*on.grads_shard), mesh.sharding(*on.shard)
        whole = mesh.replicated
        params = split if stage == 3 else whole
        secondary = None
        if on is not None and on.secondary and stage == 3 and unit.shard_axes != on.secondary:
            secondary = mesh.sharding(*on.secondary)
        return UnitSharding(
            params,
            split if stage >= 2 else whole,
            optimizer if stage >= 1 else whole,
            secondary,
            hierarchical_params_gather=on is not None and on.hierarchical and stage == 3,
        )

    @property
    def shardings(self) -> tuple[UnitSharding, ...]:
        """Every unit's `sharding_of`, in unit order: the plan said per unit and kind."""
        return tuple(self.sharding_of(unit) for unit in self.units)

    def kind_range(self, unit: Unit | int, kind: str, process: int) -> tuple[int, int]:
        """`(start, stop)` of `unit`'s buffer (a `Unit` of this plan or its index) that
        process `process` (a rank of `process_mesh`) holds of `kind`, one of
        `partition.KINDS`: its block along the kind's shard axes (`sharding_of`), the
        whole buffer for a kind split over none. A unit without hpZ's secondary copy has
        no `params_secondary` (a `PlanError`)."""
        if isinstance(unit, int):
            unit = self.units[unit]
        split = self.sharding_of(unit).of(kind)
        if split is None:
            raise PlanError(f"unit {unit.name!r} has no {kind}")
        if not split.shard:
            return 0, unit.numel
        mesh = self.process_mesh
        position = mesh.index_in_group(process, split.shard)
        if unit.bounds:  # uneven shards: one per plan rank (the index along the shard axes)
            return unit.shard_range(position)
        block = unit.numel // mesh.group_size(split.shard)
        return position * block, (position + 1) * block

    def shard_index(self, unit: Unit, rank: int) -> int:
        """The shard of `unit` plan rank `rank` holds (`Unit.shard_range`'s index): `rank`,
        or for a unit with its own `shard_axes` the rank's index along them."""
        if unit.shard_axes is None or self.mesh is None:
            return rank
        return _reorder(rank, dict(self.mesh.axes), self.mesh.shard, unit.shard_axes)

    def unit_replica(self, unit: Unit, rank: int) -> int:
        """Plan rank `rank`'s index among the plan ranks holding its shard of `unit` (0
        but for a unit with its own `shard_axes`, whose shard the plan ranks along the
        other shard axes hold too): replica 0 counts the shard in norms and writes it to
        checkpoints."""
        if unit.shard_axes is None or self.mesh is None:
            return 0
        rest = tuple(a for a in self.mesh.shard if a not in unit.shard_axes)
        return _reorder(rank, dict(self.mesh.axes), self.mesh.shard, rest)

    def shard_writer(self, unit: Unit, shard: int) -> int:
        """The plan rank holding `unit`'s shard `shard` as its replica 0, which counts it
        and writes it to checkpoints: `shard`, but for a unit on its own `shard_axes`."""
        if unit.shard_axes is None or self.mesh is None:
            return shard
        return next(
            r
            for r in range(self.world_size)
            if self.shard_index(unit, r) == shard and not self.unit_replica(unit, r)
        )

    def shard_range(self, unit: Unit, rank: int) -> tuple[int, int]:
        """`(start, stop)` of `unit`'s buffer plan rank `rank`'s optimizer partition (and
        master) holds at stages 1-3: `unit.shard_range(shard_index(unit, rank))`."""
        return unit.shard_range(self.shard_index(unit, rank))

    def grads_range(self, unit: Unit, rank: int) -> tuple[int, int]:
        """`(start, stop)` of `unit`'s buffer that plan rank `rank`'s gradient shard
        (stages 2-3) and parameter shard (stage 3) hold: its shard (`Unit.shard_range`),
        or with a finer optimizer split the `optimizer_extra_size` consecutive optimizer
        shards of its gradient shard (`grads_rank`)."""
        if self.optimizer_extra_size == 1 or unit.shard_axes is not None:
            return self.shard_range(unit, rank)
        size = self.optimizer_extra_size * unit.shard_numel
        start = self.grads_rank(rank) * size
        return start, start + size

    def grads_size(self, unit: Unit, rank: int) -> int:
        """Elements of `grads_range(unit, rank)`."""
        start, stop = self.grads_range(unit, rank)
        return stop - start

    def optimizer_in_grads(self, unit: Unit, rank: int) -> slice:
        """Where rank `rank`'s optimizer shard's gradient is kept in its gradient shard
        (stages 2-3): all of it, or with a finer optimizer split the block the
        accumulation boundary's reduce-scatter over `OnMesh.optimizer_extra` leaves there
        (in a `permuted` order, the block another rank's shard, exchanged for this one's:
        the slot holds this rank's optimizer shard's gradient, not these elements')."""
        if unit.shard_axes is not None:  # its gradient shard is its optimizer's
            return slice(0, unit.shard_numel)
        start, stop = unit.shard_range(self.rank_in_gradient_order(rank))
        base = self.grads_range(unit, rank)[0]
        return slice(start - base, stop - base)

    def stage_of(self, unit: Unit | int) -> int:
        """The ZeRO stage `unit` (a `Unit` of this plan or its index) runs as:
        `unit_stage(self.stage, unit)` (its own stage, else the plan's; a persistent unit
        at stage 3 runs as 2)."""
        if isinstance(unit, int):
            unit = self.units[unit]
        return unit_stage(self.stage, unit)

    @property
    def stages(self) -> tuple[int, ...]:
        """Every unit's `stage_of`, in unit order."""
        return tuple(unit_stage(self.stage, unit) for unit in self.units)

    @property
    def mixed(self) -> bool:
        """Whether some unit says a stage below the plan's (`Unit.stage`)."""
        return any(u.stage is not None and u.stage != self.stage for u in self.units)

    def runs_stage(self, test: Callable[[int], bool]) -> bool:
        """Whether any unit's `stage_of` passes `test` (e.g. `lambda s: s < 2`: some
        unit's gradients are all-reduced whole)."""
        return any(test(stage) for stage in self.stages)

    def optimizer_memory(self, unit: Unit | int) -> str:
        """Where `unit`'s (a `Unit` of this plan or its index) masters and optimizer state
        live: its own `optimizer_memory`, else the plan's `memory.optimizer`."""
        if isinstance(unit, int):
            unit = self.units[unit]
        return self.memory.optimizer if unit.optimizer_memory is None else unit.optimizer_memory

    def params_memory(self, unit: Unit | int) -> str:
        """Where `unit`'s (a `Unit` of this plan or its index) stage-3 parameter shard
        lives between uses: its own `params_memory`, else the plan's `memory.params`;
        "device" for a unit whose parameters are whole (below stage 3, or persistent)."""
        if isinstance(unit, int):
            unit = self.units[unit]
        if self.stage_of(unit) < 3:
            return "device"
        return self.memory.params if unit.params_memory is None else unit.params_memory

    def master_dtype(self, unit: Unit | int) -> str:
        """The dtype of `unit`'s (a `Unit` of this plan or its index) masters: its own
        `master_dtype`, else the plan's `memory.master`."""
        if isinstance(unit, int):
            unit = self.units[unit]
        return self.memory.master if unit.master_dtype is None else unit.master_dtype

    def states_dtype(self, unit: Unit | int) -> str:
        """The dtype of `unit`'s (a `Unit` of this plan or its index) optimizer moments:
        its own `states_dtype`, else the plan's `memory.states`."""
        if isinstance(unit, int):
            unit = self.units[unit]
        return self.memory.states if unit.states_dtype is None else unit.states_dtype

    def grads_dtype(self, unit: Unit | int) -> str:
        """The dtype of `unit`'s (a `Unit` of this plan or its index) gradient
        accumulator: its own `grads_dtype`, else the plan's `memory.grads`."""
        if isinstance(unit, int):
            unit = self.units[unit]
        return self.memory.grads if unit.grads_dtype is None else unit.grads_dtype

    def unit_of(self, fqn: str) -> int:
        """Index of the unit that holds tensor `fqn` (a name or an alias)."""
        for index, unit in enumerate(self.units):
            for placement in unit.placements:
                if placement.fqn == fqn:
                    return index
        for spec in self.manifest.tensors:
            if fqn in spec.aliases:
                return self.unit_of(spec.fqn)
        raise KeyError(f"tensor {fqn!r} is in no unit of the plan")


def validate(plan: Plan) -> Plan:
    """Check every invariant the engine relies on; return the plan or raise `PlanError`.

    - `world_size >= 1`, `stage` in 0..3, `alignment >= 1`, unit names unique;
    - units cover the manifest: every tensor in exactly one unit, nothing else;
    - a unit's tensors share its optimizer group and dtype (a unit never mixes
      hyper-parameters);
    - `numel == world_size * shard_numel`, shards a multiple of `alignment`, so
      every rank's shard has the same size (what the collectives need); or uneven
      `bounds`: world_size + 1 non-decreasing offsets from 0 to `numel`, the largest
      shard `shard_numel`;
    - each tensor's pieces cover it exactly once and no two pieces overlap in
      the buffer: every element is owned by exactly one rank;
    - a unit's own `stage` in 0..3 and at most the plan's, which some unit uses (the plan's
      stage is the largest of its units'); `persistent` units only at stage 3;
    - on a mesh, `world_size` is the size of the `shard` axes' group, and a `secondary`
      split names some of them, at stage 3; `optimizer_extra` names some of them (not
      all, in mesh order), at stage 2 or 3, its units even.
    """
    if plan.world_size < 1:
        raise PlanError(f"world_size is {plan.world_size}; it must be >= 1")
    if plan.mesh is not None:
        uneven = next((u.name for u in plan.units if u.bounds), None)
        validate_on_mesh(plan.mesh, plan.world_size, plan.stage, uneven)
    if plan.stage not in (0, 1, 2, 3):
        raise PlanError(f"stage is {plan.stage!r}; allowed: 0, 1, 2, 3")
    if plan.alignment < 1:
        raise PlanError(f"alignment is {plan.alignment}; it must be >= 1")
    specs = {spec.fqn: spec for spec in plan.manifest.tensors}
    placed: set[str] = set()
    names: set[str] = set()
    for unit in plan.units:
        if unit.name in names:
            raise PlanError(f"unit name {unit.name!r} is used twice")
        names.add(unit.name)
        _validate_unit(plan, unit, specs, placed)
    missing = [fqn for fqn in specs if fqn not in placed]
    if missing:
        raise PlanError(f"tensors in no unit: {missing}")
    said = [plan.stage if u.stage is None else u.stage for u in plan.units]
    if said and max(said) != plan.stage:
        raise PlanError(
            f"plan stage is {plan.stage} but its units are split as stages {sorted(set(said))}; "
            "the plan's stage is the largest of its units' (set it to "
            f"{max(said)}, or leave a unit's stage None to take the plan's)"
        )
    validate_memory(plan)
    return plan


def _validate_unit(plan: Plan, unit: Unit, specs: dict[str, TensorSpec], placed: set[str]) -> None:
    where = f"unit {unit.name!r}"
    if unit.bounds:
        _validate_bounds(where, unit, plan.world_size)
    elif unit.shard_numel < 0 or unit.shard_numel % plan.alignment:
        raise PlanError(
            f"{where}: shard_numel {unit.shard_numel} is not a multiple of "
            f"alignment {plan.alignment}"
        )
    if unit.shard_axes is not None:
        validate_shard_axes(plan, unit)
    elif not unit.bounds and unit.numel != unit.shard_numel * plan.world_size:
        raise PlanError(
            f"{where}: numel {unit.numel} != world_size {plan.world_size} "
            f"x shard_numel {unit.shard_numel}"
        )
    if unit.stage is not None and (
        isinstance(unit.stage, bool) or unit.stage not in (0, 1, 2, 3) or unit.stage > plan.stage
    ):
        raise PlanError(
            f"{where}: stage is {unit.stage!r}; allowed: None (the plan's) or 0 to the "
            f"plan's stage {plan.stage}"
        )
    said = plan.stage if unit.stage is None else unit.stage
    if unit.persistent and said != 3:
        raise PlanError(f"{where} is persistent, which only stage 3 allows (stage {said})")
    spans: list[tuple[int, int, str]] = []
    for placement in unit.placements:
        spec = specs.get(placement.fqn)
        if spec is None:
            raise PlanError(f"{where} places {placement.fqn!r}, which is not in the manifest")
        if placement.fqn in placed:
            raise PlanError(f"tensor {placement.fqn!r} is placed in more than one unit")
        placed.add(placement.fqn)
        if spec.group != unit.group or spec.dtype != unit.dtype:
            raise PlanError(
                f"{where} (group {unit.group}, {unit.dtype}) holds {spec.fqn!r} "
                f"(group {spec.group}, {spec.dtype}); a unit never mixes groups or dtypes"
            )
        _validate_pieces(where, spec, placement.pieces, unit.numel)
        spans += [(p.offset, p.offset + p.numel, spec.fqn) for p in placement.pieces if p.numel]
    spans.sort()
    for (_, stop, a), (start, _, b) in itertools.pairwise(spans):
        if start < stop:
            raise PlanError(f"{where}: tensors {a!r} and {b!r} overlap at buffer offset {start}")


def _validate_bounds(where: str, unit: Unit, world_size: int) -> None:
    bounds = unit.bounds
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    if (
        len(bounds) != world_size + 1
        or bounds[0] != 0
        or bounds[-1] != unit.numel
        or min(sizes) < 0
        or max(sizes) != unit.shard_numel
    ):
        raise PlanError(
            f"{where}: bounds {list(bounds)} are not {world_size + 1} non-decreasing offsets "
            f"from 0 to numel {unit.numel} whose largest step is shard_numel "
            f"{unit.shard_numel}"
        )


def _validate_pieces(where: str, spec: TensorSpec, pieces: tuple[Piece, ...], size: int) -> None:
    covered = 0
    for piece in sorted(pieces, key=lambda p: p.start):
        if piece.numel < 0 or piece.start != covered:
            raise PlanError(
                f"{where}: pieces of {spec.fqn!r} do not cover it exactly once "
                f"(piece starts at {piece.start}, expected {covered})"
            )
        if piece.offset < 0 or piece.offset + piece.numel > size:
            raise PlanError(
                f"{where}: a piece of {spec.fqn!r} lies at [{piece.offset}, "
                f"{piece.offset + piece.numel}), outside the buffer of {size} elements"
            )
        covered += piece.numel
    if covered != spec.numel:
        raise PlanError(f"{where}: pieces of {spec.fqn!r} cover {covered} of {spec.numel} elements")
