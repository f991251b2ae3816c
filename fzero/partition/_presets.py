"""Presets: pure functions `(mesh, unit) -> UnitSharding`, and `mesh_plan`, which lays
the units out with a strategy and asks a preset how to split each.

- `Zero(stage)`: DeepSpeed's ZeRO-1/2/3 (Rajbhandari et al. 2020): optimizer state, then
  gradients, then parameters split over every axis; on a one-axis mesh it is today's
  stage plan exactly (`to_plan`).
- `MiCS(shard_axes)`: MiCS (Zhang et al. 2022, arXiv:2205.00119) and FSDP's HSDP:
  every kind split within a group (`shard_axes`, by default the mesh's last axis: the
  ranks of a node where ranks are numbered node by node, as torchrun does) and
  replicated across the other axes. Per-rank model states are the model over the group
  size (the paper's scale-aware partitioning); gradients are reduce-scattered within the
  group every micro-step and all-reduced across groups once per step (DeepSpeed's
  `MiCS_Optimizer.allreduce_mics_shard_grads`, at the accumulation boundary).
- `HpZ(secondary_axes)`: ZeRO++'s hierarchical partitioning (Wang et al. 2023,
  arXiv:2306.10209): stage 3, plus a secondary copy of the parameters split within
  `secondary_axes` (by default the last axis) that backward gathers from, trading memory
  (a model/secondary-group-size copy per rank) for cross-node volume (backward's gather
  stays in the node: of ZeRO-3's 3M per step, 2M still cross nodes).
- `Custom(name, rule)`: any mix, per unit and kind, from your function.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fzero.partition._manifest import Manifest
from fzero.partition._mesh import Mesh, UnitSharding
from fzero.partition._mesh_plan import KindPlan, executable, stage_shardings
from fzero.partition._plan import Memory, Plan, PlanError, Unit
from fzero.partition._strategies import Strategy, flat_even, plan

__all__ = [
    "PRESETS",
    "Custom",
    "HpZ",
    "MiCS",
    "Preset",
    "Zero",
    "from_zero_config",
    "mesh_plan",
    "on_mesh",
    "preset_from_name",
]


class Preset(Protocol):
    """What `mesh_plan` takes: a name, the stage the layout is grouped for (stage 3 puts
    tensors under `persistence_threshold` in persistent units), and the split of a unit."""

    @property
    def name(self) -> str: ...

    @property
    def stage(self) -> int: ...

    def __call__(self, mesh: Mesh, unit: Unit) -> UnitSharding:
        """How `unit`'s kinds are split on `mesh`."""
        ...


def _axes(mesh: Mesh, axes: Sequence[str] | None) -> tuple[str, ...]:
    """`axes`, or the mesh's last axis when None."""
    return (mesh.names[-1],) if axes is None else tuple(axes)


@dataclass(frozen=True)
class Zero:
    """ZeRO stage `stage` over every axis of the mesh, in mesh order."""

    stage: int = 3

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise PlanError(f"ZeRO stage is {self.stage!r}; allowed: 0, 1, 2, 3")

    @property
    def name(self) -> str:
        return f"zero{self.stage}"

    def __call__(self, mesh: Mesh, unit: Unit) -> UnitSharding:
        return stage_shardings(mesh, self.stage, unit.persistent)


@dataclass(frozen=True)
class MiCS:
    """MiCS / HSDP: parameters, gradients and optimizer state split over `shard_axes`
    (None: the mesh's last axis), replicated over the others; stage 3's persistent
    units keep their parameters whole. `hierarchical_params_gather`: gather over the
    shard axes one axis at a time (DeepSpeed's `mics_hierarchical_params_gather`)."""

    shard_axes: tuple[str, ...] | None = None
    hierarchical_params_gather: bool = False
    name: str = "mics"
    stage: int = 3

    def __call__(self, mesh: Mesh, unit: Unit) -> UnitSharding:
        group = mesh.sharding(*_axes(mesh, self.shard_axes))
        params = mesh.replicated if unit.persistent else group
        hierarchical = self.hierarchical_params_gather and len(params.shard) > 1
        return UnitSharding(params, group, group, hierarchical_params_gather=hierarchical)


@dataclass(frozen=True)
class HpZ:
    """ZeRO++ hpZ: ZeRO-3 over every axis, and a secondary parameter copy split over
    `secondary_axes` (None: the mesh's last axis) that backward gathers from."""

    secondary_axes: tuple[str, ...] | None = None
    name: str = "hpz"
    stage: int = 3

    def __call__(self, mesh: Mesh, unit: Unit) -> UnitSharding:
        zero3 = stage_shardings(mesh, 3, unit.persistent)
        if unit.persistent:  # whole parameters: nothing to gather, no secondary
            return zero3
        secondary = mesh.sharding(*_axes(mesh, self.secondary_axes))
        return UnitSharding(zero3.params, zero3.grads, zero3.optimizer, secondary)


@dataclass(frozen=True)
class Custom:
    """Your preset: `rule(mesh, unit) -> UnitSharding` for every unit (any mix of axes
    per unit and kind that `validate` accepts), the layout grouped for `stage`."""

    name: str
    rule: Callable[[Mesh, Unit], UnitSharding]
    stage: int = 3

    def __call__(self, mesh: Mesh, unit: Unit) -> UnitSharding:
        return self.rule(mesh, unit)


PRESETS: dict[str, Preset] = {
    "zero0": Zero(0),
    "zero1": Zero(1),
    "zero2": Zero(2),
    "zero3": Zero(3),
    "mics": MiCS(),
    "hpz": HpZ(),
}


def preset_from_name(name: str, where: str = "preset") -> Preset:
    """A built-in preset by name (`PRESETS`), or `module:name` naming your own: a preset
    object (`Custom`, `Zero`, ...: anything with `name`, `stage` and a call) or a rule
    `(mesh, unit) -> UnitSharding` (run as `Custom(name, rule)`, grouped for stage 3).
    The error lists the names."""
    if name in PRESETS:
        return PRESETS[name]
    allowed = f"allowed: {', '.join(PRESETS)} or 'module:name' naming your preset or rule"
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise PlanError(f"{where} is {name!r}; {allowed}")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise PlanError(f"{where} is {name!r}, which cannot be loaded: {error}") from None
    if hasattr(found, "stage") and hasattr(found, "name") and callable(found):
        return found
    if callable(found):
        return Custom(name, found)
    raise PlanError(f"{where} is {name!r}, a {type(found).__name__}: {allowed}")


def mesh_plan(
    manifest: Manifest,
    mesh: Mesh,
    preset: Preset | str = "zero3",
    *,
    strategy: Strategy | Callable[..., Plan] = flat_even,
    memory: Memory | None = None,
    **options: object,
) -> Plan:
    """Lay `manifest` out with `strategy` on `mesh.size` ranks (with `options`, as
    `plan` runs it, grouped for `preset.stage`), split every unit as `preset` says, and
    return the `Plan` both doors run: its ranks the group along the axes the kinds are
    split over (`world_size`), `mesh` (an `OnMesh`) where they lie on the
    `processes`, `shardings` each unit's split per kind again. `mesh_plan(m,
    Mesh.single(W), "zero2")` is `plan(m, world_size=W, stage=2)` on that mesh
    (`to_plan` gives the latter). A split the doors do not run is a `PlanError` naming
    the unit, kind and axes. To hand it to an engine as its `strategy`, use
    `on_mesh(mesh, preset)`: the engine passes `world_size` and `stage`, which the mesh
    and the preset decide here. `memory`: where its states live and their dtypes
    (`Memory`), as `plan` takes it."""
    decided = sorted(set(options) & {"world_size", "stage"})
    if decided:
        raise PlanError(
            f"mesh_plan got {', '.join(decided)}: the mesh ({mesh.size} ranks) and the "
            "preset decide them. An engine's strategy receives them: pass "
            "strategy=partition.on_mesh(mesh, preset), which checks them and passes the "
            "other options on"
        )
    chosen = preset_from_name(preset) if isinstance(preset, str) else preset
    layout = plan(manifest, world_size=mesh.size, stage=chosen.stage, strategy=strategy, **options)
    said = KindPlan(
        manifest,
        mesh,
        layout.alignment,
        layout.units,
        tuple(chosen(mesh, unit) for unit in layout.units),
        strategy=layout.strategy,
        preset=chosen.name,
        memory=memory if memory is not None else Memory(),
    )
    return executable(said)


def on_mesh(
    mesh: Mesh,
    preset: Preset | str = "zero3",
    *,
    strategy: Strategy | Callable[..., Plan] = flat_even,
) -> Callable[..., Plan]:
    """A strategy the engine (or `plan`) takes: lays a model out with `mesh_plan(manifest,
    mesh, preset, strategy=strategy, **options)`, passing on every option it is given
    (`persistence_threshold`, `leaf_modules`, `unit_numel`, ...). The `world_size` it is
    called with must be the mesh's size, and the `stage` the preset's (the config's
    `zero_optimization.stage`): a `PlanError` names either that differs."""
    chosen = preset_from_name(preset) if isinstance(preset, str) else preset

    def strategy_on_mesh(
        manifest: Manifest, *, world_size: int, stage: int, **options: object
    ) -> Plan:
        if world_size != mesh.size:
            raise PlanError(
                f"on_mesh({mesh}, {chosen.name!r}): the run has {world_size} ranks, the mesh "
                f"{mesh.size}; give a mesh of the world size"
            )
        if stage != chosen.stage:
            raise PlanError(
                f"on_mesh({mesh}, {chosen.name!r}): the run is stage {stage}, the preset "
                f"stage {chosen.stage}; set zero_optimization.stage to {chosen.stage}"
            )
        return mesh_plan(manifest, mesh, chosen, strategy=strategy, **options)

    strategy_on_mesh.__name__ = f"on_mesh_{chosen.name}"
    return strategy_on_mesh


def _int_key(zero: Mapping[str, Any], key: str, default: int) -> int:
    value = zero.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"zero_optimization.{key} is {value!r}; it must be an integer")
    return value


def _divisor(key: str, value: int, of: int, what: str) -> None:
    if value < 1 or of % value:
        allowed = [d for d in range(1, of + 1) if of % d == 0]
        raise PlanError(f"zero_optimization.{key} is {value}; it must divide {what} {of} {allowed}")


def from_zero_config(
    zero: Mapping[str, Any], world_size: int, *, ranks_per_node: int | None = None
) -> tuple[Mesh, Preset]:
    """The mesh and preset DeepSpeed's `zero_optimization` block asks for on
    `world_size` ranks (pure: the block as a mapping, as in the JSON).

    - `zero_hpz_partition_size: h > 1` (stage 3): `Mesh({"node": W/h, "local": h})`,
      `HpZ(("local",))`; 1 (DeepSpeed's default) is off;
    - `mics_shard_size: m > 0` (stage 3): `Mesh({"replica": W/m, "shard": m})`,
      `MiCS(("shard",))`; -1 (the default) is off. With
      `mics_hierarchical_params_gather` and a shard group spanning nodes (m >
      `ranks_per_node`, which DeepSpeed reads from `NDEV_PER_NODE`):
      `Mesh({"replica": W/m, "node": m/ranks_per_node, "local": ranks_per_node})`, split
      over `("node", "local")`, gathered one axis at a time; within one node it has no
      effect, as in DeepSpeed;
    - otherwise `Mesh({"dp": W})` and `Zero(stage)`. Below stage 3 the three keys have no
      effect, as in DeepSpeed, where hpZ and MiCS are parts of stage 3.

    The engine builds its plan from these keys with this function; `fzero.init` and
    `train_step` are given the plan `mesh_plan` returns.
    """
    stage = _int_key(zero, "stage", 0)
    hpz = _int_key(zero, "zero_hpz_partition_size", 1)
    mics = _int_key(zero, "mics_shard_size", -1)
    hierarchical = zero.get("mics_hierarchical_params_gather", False)
    if not isinstance(hierarchical, bool):
        raise PlanError(
            f"zero_optimization.mics_hierarchical_params_gather is {hierarchical!r}; "
            "it must be true or false"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world_size is {world_size!r}; it must be an int >= 1")
    base = Mesh.single(world_size), Zero(stage)  # also checks the stage
    if stage < 3:
        return base
    if hpz > 1 and mics > 0:
        raise PlanError(
            f"zero_optimization.zero_hpz_partition_size is {hpz} and mics_shard_size is "
            f"{mics}; choose one: hpZ (a secondary copy in the node) or MiCS (shard groups)"
        )
    if hpz != 1:
        _divisor("zero_hpz_partition_size", hpz, world_size, "the world size")
        return Mesh({"node": world_size // hpz, "local": hpz}), HpZ(("local",))
    if mics <= 0:  # DeepSpeed: MiCS when mics_shard_size > 0
        return base
    _divisor("mics_shard_size", mics, world_size, "the world size")
    if not hierarchical:
        return Mesh({"replica": world_size // mics, "shard": mics}), MiCS(("shard",))
    if ranks_per_node is None:
        raise PlanError(
            "zero_optimization.mics_hierarchical_params_gather is true: give ranks_per_node "
            "(DeepSpeed reads NDEV_PER_NODE) to split the shard group into nodes"
        )
    if mics <= ranks_per_node:  # one node per shard group: nothing to gather across nodes
        return Mesh({"replica": world_size // mics, "shard": mics}), MiCS(("shard",))
    if mics % ranks_per_node:
        raise PlanError(
            f"zero_optimization.mics_shard_size is {mics}, which ranks_per_node "
            f"{ranks_per_node} does not divide: a hierarchical gather needs whole nodes"
        )
    mesh = Mesh(
        {"replica": world_size // mics, "node": mics // ranks_per_node, "local": ranks_per_node}
    )
    return mesh, MiCS(("node", "local"), hierarchical_params_gather=True)
