"""A mesh of named axes over ranks, and what one kind of state is split over.

`Mesh({"node": 2, "local": 2})` lays 4 ranks out row-major, the last axis fastest, as
torch's `DeviceMesh` and JAX's `Mesh` do: rank 3 is `node=1, local=1`, and the ranks
along `local` through rank 2 are `(2, 3)`. A `Sharding` says which axes a kind of state
(parameters, gradients, optimizer state) is split over and which it is replicated
over, as JAX's `PartitionSpec` does per array; a `UnitSharding` says it for all kinds of
one plan unit. `OnMesh` is a mesh that also says where a plan's ranks lie on it (the
axes its states are split over). All of it is plain data: the engine turns
`Mesh.groups(axes)` into one process subgroup per set of axes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fzero.partition._placement import PlanError

__all__ = ["KINDS", "Mesh", "MeshError", "OnMesh", "Sharding", "UnitSharding", "validate_on_mesh"]

# The kinds of state a plan places, in the order plans store and print them.
KINDS = ("params", "grads", "optimizer", "params_secondary")


class MeshError(PlanError):
    """A mesh or a sharding is malformed; the message names the axis and the value."""


@dataclass(frozen=True, init=False)
class Mesh:
    """Named axes over `size` ranks; rank = row-major coordinate, last axis fastest."""

    axes: tuple[tuple[str, int], ...]

    def __init__(self, axes: Mapping[str, int] | Iterable[tuple[str, int]]) -> None:
        items = axes.items() if isinstance(axes, Mapping) else axes
        pairs = tuple((name, size) for name, size in items)
        if not pairs:
            raise MeshError("a mesh needs at least one axis, e.g. Mesh({'dp': world_size})")
        seen: set[str] = set()
        for name, size in pairs:
            if not isinstance(name, str) or not name.isidentifier():
                raise MeshError(f"mesh axis name {name!r} is not allowed; use an identifier")
            if name in seen:
                raise MeshError(f"mesh axis {name!r} is named twice; axis names are unique")
            seen.add(name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {name!r} has size {size!r}; it must be an int >= 1")
        object.__setattr__(self, "axes", pairs)

    @classmethod
    def single(cls, world_size: int, axis: str = "dp") -> Mesh:
        """The one-axis mesh of today's plans: every rank along `axis`."""
        return cls({axis: world_size})

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """`"node=2,local=2"` -> `Mesh({"node": 2, "local": 2})` (the command line's spelling)."""
        pairs = []
        for item in text.split(","):
            name, sep, size = item.strip().partition("=")
            if not sep or not size.strip().isdigit():
                raise MeshError(f"mesh {text!r}: {item.strip()!r} is not 'axis=size'")
            pairs.append((name.strip(), int(size)))
        return cls(pairs)

    @property
    def names(self) -> tuple[str, ...]:
        """The axis names, outermost (slowest) first."""
        return tuple(name for name, _ in self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The axis sizes, in `names` order."""
        return tuple(size for _, size in self.axes)

    @property
    def size(self) -> int:
        """Ranks in the mesh: the product of the axis sizes."""
        return math.prod(self.sizes)

    def __str__(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in self.axes)

    def axis_size(self, axis: str) -> int:
        """Ranks along `axis`; a `MeshError` names the axis and the mesh's axes."""
        for name, size in self.axes:
            if name == axis:
                return size
        raise MeshError(f"axis {axis!r} is not in the mesh ({self}); axes: {list(self.names)}")

    def group_size(self, axes: Iterable[str]) -> int:
        """Ranks in one group along `axes` (1 for no axes)."""
        return math.prod(self.axis_size(axis) for axis in axes)

    def check_world(self, world_size: int) -> None:
        """Raise unless the mesh covers exactly `world_size` ranks."""
        if self.size != world_size:
            raise MeshError(
                f"mesh {self} has {self.size} ranks but the world has {world_size}; "
                "the product of the axis sizes must equal the world size"
            )

    def coordinate(self, rank: int) -> dict[str, int]:
        """`rank`'s position on every axis (row-major, last axis fastest)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise MeshError(f"rank {rank!r} is out of range for mesh {self} ({self.size} ranks)")
        coordinate: dict[str, int] = {}
        for name, size in reversed(self.axes):
            rank, coordinate[name] = divmod(rank, size)
        return {name: coordinate[name] for name in self.names}

    def rank_at(self, coordinate: Mapping[str, int]) -> int:
        """The rank at `coordinate` (every axis given, each in range)."""
        missing = [name for name in self.names if name not in coordinate]
        unknown = [name for name in coordinate if name not in self.names]
        if missing or unknown:
            wrong = [
                f"{what} {names}"
                for what, names in (("missing axes", missing), ("unknown axes", unknown))
                if names
            ]
            raise MeshError(f"coordinate {dict(coordinate)} of mesh {self}: " + ", ".join(wrong))
        rank = 0
        for name, size in self.axes:
            if not 0 <= coordinate[name] < size:
                raise MeshError(
                    f"axis {name!r} coordinate {coordinate[name]} is not in 0..{size - 1}"
                )
            rank = rank * size + coordinate[name]
        return rank

    def index_in_group(self, rank: int, axes: Sequence[str]) -> int:
        """`rank`'s position in its group along `axes`: row-major over `axes` in the order
        given (the first the slowest), so a split over `("local", "node")` differs from one
        over `("node", "local")` as JAX's `PartitionSpec(("x", "y"))` does."""
        coordinate = self.coordinate(rank)
        index = 0
        for axis in axes:
            index = index * self.axis_size(axis) + coordinate[axis]
        return index

    def group(self, rank: int, axes: Sequence[str]) -> tuple[int, ...]:
        """The ranks along `axes` through `rank` (sharing its coordinate on every other
        axis), ordered by `index_in_group`: the process subgroup one collective over
        `axes` runs on. No axes: `(rank,)`."""
        self._check_axes(axes)
        base = self.coordinate(rank)
        members = []
        for index in range(self.group_size(axes)):
            coordinate = dict(base)
            for axis in reversed(axes):
                index, coordinate[axis] = divmod(index, self.axis_size(axis))
            members.append(self.rank_at(coordinate))
        return tuple(members)

    def groups(self, axes: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Every group along `axes`, in order of their lowest rank: the world cut into
        `size / group_size(axes)` disjoint groups. Every rank must create every group (the
        process-group constructor is collective), in one order: this one."""
        found: dict[tuple[int, ...], None] = {}
        for rank in range(self.size):
            found.setdefault(self.group(rank, axes), None)
        return tuple(sorted(found, key=min))

    def _check_axes(self, axes: Sequence[str]) -> None:
        if isinstance(axes, str):
            raise MeshError(f"axes {axes!r} is a string; give a tuple of axis names: ({axes!r},)")
        for axis in axes:
            self.axis_size(axis)
        if len(set(axes)) != len(axes):
            raise MeshError(f"axes {tuple(axes)} name an axis twice")

    def sharding(self, *shard: str) -> Sharding:
        """A `Sharding` split over `shard` (in that order) and replicated over every
        other axis of this mesh, in mesh order."""
        self._check_axes(shard)
        return Sharding(shard=shard, replicate=tuple(a for a in self.names if a not in shard))

    @property
    def replicated(self) -> Sharding:
        """Whole on every rank: split over no axis."""
        return self.sharding()

    @property
    def split_everywhere(self) -> Sharding:
        """Split over every axis in mesh order: rank r holds shard r, as today's plans."""
        return self.sharding(*self.names)


@dataclass(frozen=True)
class Sharding:
    """One kind of state of one unit: split over the `shard` axes (row-major in that
    order: rank's block index is `Mesh.index_in_group(rank, shard)`), whole copies of
    that split repeated along the `replicate` axes. On a mesh every axis is in exactly
    one of them (`validate` checks). Executed as a reduce-scatter (gradients) or an
    all-gather (parameters) over `shard` and an all-reduce over `replicate`."""

    shard: tuple[str, ...] = ()
    replicate: tuple[str, ...] = ()

    def __str__(self) -> str:
        split = f"shard({', '.join(self.shard)})" if self.shard else "whole"
        return split + (f" replicate({', '.join(self.replicate)})" if self.replicate else "")

    def problems(self, mesh: Mesh) -> list[str]:
        """What is wrong with this sharding on `mesh`, each naming the axis; [] if nothing."""
        found = []
        for role, axes in (("shard", self.shard), ("replicate", self.replicate)):
            if isinstance(axes, str) or not isinstance(axes, tuple):
                found.append(f"{role} is {axes!r}; give a tuple of axis names")
                return found
            for axis in axes:
                if axis not in mesh.names:
                    found.append(
                        f"{role} axis {axis!r} is not in the mesh ({mesh}); axes: "
                        f"{list(mesh.names)}"
                    )
        for axis in mesh.names:
            count = self.shard.count(axis) + self.replicate.count(axis)
            if count == 0:
                found.append(f"axis {axis!r} is neither shard nor replicate; name it in one")
            elif count > 1:
                found.append(f"axis {axis!r} is named {count} times; name it once")
        return found


@dataclass(frozen=True)
class UnitSharding:
    """How each kind of one unit's state is split (see the module docstring).

    - `params`: the primary parameter shards (stage 3's): what forward gathers;
    - `grads`: the reduced gradient accumulators;
    - `optimizer`: fp32 masters and optimizer states (always split alike);
    - `params_secondary`: ZeRO++ hpZ's secondary copy (Wang et al. 2023, arXiv:2306.10209):
      after forward's gather each rank keeps this split of the parameters, and backward
      gathers from it instead of from `params` (an in-node gather); None: no secondary;
    - `hierarchical_params_gather`: a parameter gather over several axes runs as one
      all-gather per axis, the first (outermost) axis first: MiCS's hierarchical
      all-gather (Zhang et al. 2022, arXiv:2205.00119; DeepSpeed's
      `mics_hierarchical_params_gather`), the same result with fewer cross-node messages.
    """

    params: Sharding
    grads: Sharding
    optimizer: Sharding
    params_secondary: Sharding | None = None
    hierarchical_params_gather: bool = False

    def of(self, kind: str) -> Sharding | None:
        """The sharding of `kind`, one of `KINDS`."""
        if kind not in KINDS:
            raise MeshError(f"kind {kind!r} is unknown; allowed: {list(KINDS)}")
        return getattr(self, kind)


@dataclass(frozen=True)
class OnMesh(Mesh):
    """Where a plan's ranks lie on a mesh of processes: a `Mesh` (its `axes`: name and size,
    row-major, the last fastest; every `Mesh` query answers for its processes). The
    plan's rank `i` is every process whose index along the `shard` axes (row-major in
    that order) is `i`; the processes along the other axes hold the same shards
    (replicas: their gradients are averaged by an all-reduce over those axes).
    `secondary`: stage 3's parameters are kept after forward split over these axes only
    (a subset of `shard`: ZeRO++ hpZ), and backward gathers from that copy. `preset`
    names the preset that split it (`mesh_plan`'s). `hierarchical`: stage 3's parameter
    gathers run one all-gather per `shard` axis, the outermost first (MiCS's hierarchical
    all-gather: fewer, larger messages over the slow axis). `optimizer_extra`: the axes
    of `shard` (in mesh order) that only the optimizer state (and fp32 master) is split
    over; gradients and stage 3's parameters are split over the other axes of `shard`
    (`grads_shard`), each such shard holding `Plan.optimizer_extra_size` optimizer shards
    (the optimizer split over the world, the gradients within a node: the gradients
    reduce-scattered over their axes every micro-step, then over these at the
    accumulation boundary into the optimizer's shard). `shard` is the optimizer's order:
    with the extra axes last (`grads_shard` then `optimizer_extra`) a rank's optimizer
    shard lies in its gradient shard; in another order (`permuted`: the optimizer over
    ("node", "local"), the gradients over ("local",)) it lies in another rank's, and the
    boundary's blocks are exchanged with it (`Plan.rank_in_gradient_order`)."""

    axes: tuple[tuple[str, int], ...]
    shard: tuple[str, ...]
    secondary: tuple[str, ...] = ()
    preset: str = "custom"
    hierarchical: bool = False
    optimizer_extra: tuple[str, ...] = ()

    @classmethod
    def single(cls, world_size: int, axis: str = "dp") -> OnMesh:
        """Every process along `axis`, the plan's ranks split over it: where a plan of the
        whole world's ranks lie (`Plan.process_mesh` of one has this mesh's axes)."""
        return cls(Mesh.single(world_size, axis).axes, (axis,))

    @classmethod
    def parse(cls, text: str) -> OnMesh:
        """`"node=2,local=2"` as the mesh the plan's ranks split over every axis of, in
        mesh order (as `Mesh.parse` reads it): ZeRO over the whole mesh."""
        mesh = Mesh.parse(text)
        return cls(mesh.axes, mesh.names)

    @property
    def processes(self) -> int:
        """Processes the plan runs on: the product of the axis sizes."""
        return math.prod(size for _, size in self.axes)

    @property
    def replicate(self) -> tuple[str, ...]:
        """The axes along which processes hold the same shards, in mesh order."""
        return tuple(name for name, _ in self.axes if name not in self.shard)

    @property
    def grads_shard(self) -> tuple[str, ...]:
        """The axes gradients and stage 3's parameters are split over: `shard` without
        `optimizer_extra` (with them, in mesh order)."""
        if not self.optimizer_extra:
            return self.shard
        return tuple(a for a, _ in self.axes if a in self.shard and a not in self.optimizer_extra)

    @property
    def gradient_order(self) -> tuple[str, ...]:
        """The axes in the order the accumulation boundary leaves optimizer blocks in:
        `grads_shard` then `optimizer_extra` (`shard` unless `permuted`)."""
        return self.grads_shard + self.optimizer_extra if self.optimizer_extra else self.shard

    @property
    def permuted(self) -> bool:
        """Whether the optimizer's shards are in another order than `gradient_order`
        (a rank's optimizer shard then lies in another rank's gradient shard); axes of
        size 1 order nothing."""
        sizes = dict(self.axes)
        moving = [a for a in self.gradient_order if sizes.get(a, 1) > 1]
        return moving != [a for a in self.shard if sizes.get(a, 1) > 1]


def validate_on_mesh(mesh: OnMesh, world_size: int, stage: int, uneven: str | None) -> None:
    """Raise `PlanError` unless `mesh` is where a plan of `world_size` ranks and stage
    `stage` can lie (`fzero.partition.validate`'s mesh rules); `uneven`: the name of the
    plan's first unit with uneven shards (None: none)."""
    sizes = dict(mesh.axes)
    named = [*mesh.shard, *mesh.secondary]
    unknown = [axis for axis in named if axis not in sizes]
    if unknown or len(sizes) != len(mesh.axes) or any(s < 1 for s in sizes.values()):
        raise PlanError(
            f"plan mesh {mesh.axes}: axes must be unique with sizes >= 1, and shard "
            f"{mesh.shard} / secondary {mesh.secondary} name only them (unknown: {unknown})"
        )
    group = math.prod(sizes[axis] for axis in mesh.shard)
    if group != world_size or len(set(mesh.shard)) != len(mesh.shard):
        raise PlanError(
            f"plan world_size {world_size} on mesh {mesh.axes} split over {mesh.shard}: "
            f"the shard axes' group has {group} ranks; they must be equal"
        )
    if mesh.hierarchical and (stage != 3 or mesh.secondary or len(mesh.grads_shard) < 2):
        raise PlanError(
            f"plan hierarchical gather over {mesh.grads_shard}: it is stage 3's (stage "
            f"{stage}), over two or more of the parameters' shard axes, and without "
            f"hpZ's secondary copy ({mesh.secondary})"
        )
    extra = mesh.optimizer_extra
    in_order = tuple(a for a, _ in mesh.axes if a in extra)
    if extra and (
        extra != in_order
        or len(set(extra)) != len(extra)
        or set(extra) - set(mesh.shard)
        or len(extra) == len(mesh.shard)
        or stage < 2
    ):
        raise PlanError(
            f"plan optimizer_extra {extra}: the optimizer's axes beyond the gradients' are "
            f"some of the shard axes {mesh.shard}, in mesh order, not all of them (the "
            f"gradients are split over at least one), at stage 2 or 3 (stage {stage})"
        )
    if extra and uneven is not None:
        raise PlanError(
            f"unit {uneven!r} optimizer: split over {mesh.shard}, finer than the "
            f"gradients ({mesh.grads_shard}), but the unit has uneven shards; a finer "
            "optimizer split runs for units with equal shards"
        )
    if mesh.secondary and (stage != 3 or set(mesh.secondary) - set(mesh.grads_shard)):
        raise PlanError(
            f"plan secondary split over {mesh.secondary}: hpZ's secondary copy is stage 3's "
            f"(stage {stage}) and a subset of the parameters' shard axes "
            f"{mesh.grads_shard}"
        )
