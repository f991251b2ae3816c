"""Built-in partitioning strategies and `plan`, the function that runs one.

A strategy is any function `(manifest, *, world_size, stage, **options) -> Plan`.
Two are built in:

- `flat_even` (DeepSpeed-like): a unit's tensors lie end to end in one flat
  buffer, cut into `world_size` equal, aligned shards; a tensor may straddle
  shards.
- `per_tensor_dim0` (FSDP2-like): every tensor is split along dim 0 into
  `ceil(rows / world_size)`-row chunks and rank r's chunks of all the unit's
  tensors are stored together, so a rank holds whole rows.
- `whole_tensors`: no tensor is split: each goes whole to one rank (uneven shards,
  no padding), for optimizers that need whole matrices (Muon) and studies of
  imbalance.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from fzero.partition._manifest import Manifest, TensorSpec
from fzero.partition._plan import (
    Memory,
    Piece,
    Placement,
    Plan,
    PlanError,
    Unit,
    validate,
    with_memory,
)

__all__ = [
    "BUILT_IN",
    "DEFAULT_PERSISTENCE_THRESHOLD",
    "Strategy",
    "flat_even",
    "group_units",
    "module_key",
    "per_tensor_dim0",
    "plan",
    "set_unit_memory",
    "set_unit_stages",
    "strategy_from_name",
    "whole_tensors",
    "with_unit_memory",
    "with_unit_stages",
]

# 16 fp32 elements = 64 bytes: one cache line, one AVX-512 register.
DEFAULT_ALIGNMENT = 16
# DeepSpeed's `stage3_param_persistence_threshold` default: at stage 3, tensors of fewer
# elements stay whole on every rank (persistent units): gathering them costs more in
# latency than their memory saves. The same default wherever a plan is made (the engine
# reads the config's, whose default this is).
DEFAULT_PERSISTENCE_THRESHOLD = 100_000


class Strategy(Protocol):
    def __call__(
        self, manifest: Manifest, *, world_size: int, stage: int, **options: object
    ) -> Plan:
        """Return a plan for `manifest`."""
        ...


@dataclass(frozen=True)
class UnitGroup:
    """Tensors that share one unit, before any layout: the output of `group_units`."""

    module: str
    group: int
    dtype: str
    persistent: bool
    tensors: tuple[TensorSpec, ...]


def module_key(fqn: str) -> str:
    """The module a tensor's unit hangs on: its path up to the first numbered
    child (one block of a ModuleList or Sequential), else its top-level child.

    `blocks.3.attn.weight` -> `blocks.3`; `bert.encoder.layer.0.x.bias` ->
    `bert.encoder.layer.0`; `embed.weight` -> `embed`; `bias` -> `""` (root). A model
    wrapped by `torch.compile` (its tensors under `_orig_mod.`) gets the units of the
    model it wraps: `_orig_mod.embed.weight` -> `_orig_mod.embed`.
    """
    path = fqn.split(".")[:-1]
    start = 0
    while start < len(path) and path[start] == "_orig_mod":  # torch.compile's wrapper
        start += 1
    for index in range(start, len(path)):
        if path[index].isdigit():
            return ".".join(path[: index + 1])
    return ".".join(path[: start + 1])


def _unit_key(fqn: str, leaf_modules: tuple[str, ...]) -> str:
    """`module_key(fqn)`, or the outermost leaf module holding the tensor where that is
    larger (DeepSpeed's `set_z3_leaf_modules`: a leaf's parameters are gathered whole)."""
    key = module_key(fqn)
    for leaf in leaf_modules:  # outermost first
        if leaf == "" or fqn.startswith(leaf + "."):
            return leaf if key == leaf or key.startswith(leaf + ".") or not leaf else key
    return key


def _common_module(keys: list[str]) -> str:
    split = [key.split(".") if key else [] for key in keys]
    common: list[str] = []
    for parts in zip(*split):
        if any(part != parts[0] for part in parts):
            break
        common.append(parts[0])
    return ".".join(common)


def group_units(
    manifest: Manifest,
    *,
    stage: int,
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
    unit_numel: int | None = None,
    leaf_modules: Sequence[str] = (),
) -> tuple[UnitGroup, ...]:
    """Group tensors into units, in manifest order of first appearance.

    Default: one unit per `module_key` (a tied tensor goes to the common parent
    of all its names); a tensor inside one of `leaf_modules` (module paths, "" the
    root) goes to that module's unit where it is larger (`leaf_modules(model)` reads
    DeepSpeed's flags), so ranks that run different submodules of it (experts) gather
    the same unit. With `unit_numel`, consecutive tensors are instead packed
    up to that many elements per unit (a size budget). Either way a unit holds
    one optimizer group and one dtype, and in stage 3 tensors with fewer than
    `persistence_threshold` elements go to separate persistent units.
    """
    if unit_numel is not None and unit_numel < 1:
        raise PlanError(f"unit_numel is {unit_numel}; it must be >= 1 or None")
    if isinstance(leaf_modules, str):
        raise PlanError(f"leaf_modules is {leaf_modules!r}; give a sequence of module paths")
    if leaf_modules and unit_numel is not None:
        raise PlanError(
            f"leaf_modules {list(leaf_modules)} with unit_numel={unit_numel}: a size budget "
            "packs tensors across modules and could split a leaf; give one of them"
        )
    leaves = tuple(sorted(set(leaf_modules), key=lambda p: (p.count(".") + bool(p), p)))
    buckets: dict[tuple[object, ...], list[TensorSpec]] = {}
    budget_index = 0
    budget_fill = 0
    for spec in manifest.tensors:
        persistent = stage == 3 and spec.numel < persistence_threshold
        if unit_numel is None:
            where: object = _common_module(
                [_unit_key(n, leaves) for n in (spec.fqn, *spec.aliases)]
            )
        else:
            if budget_fill and budget_fill + spec.numel > unit_numel:
                budget_index, budget_fill = budget_index + 1, 0
            budget_fill += spec.numel
            where = budget_index
        buckets.setdefault((where, spec.group, spec.dtype, persistent), []).append(spec)
    groups = []
    for (_, group, dtype, persistent), specs in buckets.items():
        keys = [_unit_key(n, leaves) for s in specs for n in (s.fqn, *s.aliases)]
        groups.append(UnitGroup(_common_module(keys), group, dtype, persistent, tuple(specs)))
    return tuple(groups)


def _unit_names(groups: tuple[UnitGroup, ...]) -> list[str]:
    names = []
    for group in groups:
        base = group.module or "<root>"
        siblings = [g for g in groups if g.module == group.module]
        if len(siblings) > 1:
            base += f"#g{group.group}" + ("/persistent" if group.persistent else "")
            if len({g.dtype for g in siblings}) > 1:
                base += f"/{group.dtype}"
        names.append(base)
    counts: dict[str, int] = {}
    unique = []
    for name in names:
        counts[name] = counts.get(name, 0) + 1
        unique.append(name if names.count(name) == 1 else f"{name}#{counts[name] - 1}")
    return unique


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def flat_even(
    manifest: Manifest,
    *,
    world_size: int,
    stage: int,
    alignment: int = DEFAULT_ALIGNMENT,
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
    unit_numel: int | None = None,
    leaf_modules: Sequence[str] = (),
) -> Plan:
    """DeepSpeed-like plan: each unit's tensors end to end, cut into equal aligned shards."""
    groups = group_units(
        manifest,
        stage=stage,
        persistence_threshold=persistence_threshold,
        unit_numel=unit_numel,
        leaf_modules=leaf_modules,
    )
    units = []
    for name, group in zip(_unit_names(groups), groups):
        placements, offset = [], 0
        for spec in group.tensors:
            pieces = (Piece(0, offset, spec.numel),) if spec.numel else ()
            placements.append(Placement(spec.fqn, pieces))
            offset += spec.numel
        shard = _round_up(-(-offset // world_size), alignment)
        units.append(_unit(name, group, tuple(placements), shard, world_size))
    return Plan(manifest, world_size, stage, alignment, tuple(units), strategy="flat_even")


def per_tensor_dim0(
    manifest: Manifest,
    *,
    world_size: int,
    stage: int,
    alignment: int = DEFAULT_ALIGNMENT,
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
    unit_numel: int | None = None,
    leaf_modules: Sequence[str] = (),
) -> Plan:
    """FSDP2-like plan: every tensor split on dim 0, rank r's row chunks stored together.

    A tensor of `rows` rows gives rank r rows `[r * c, min(rows, (r + 1) * c))`
    with `c = ceil(rows / world_size)`; a 0-dim tensor counts as one row.
    """
    groups = group_units(
        manifest,
        stage=stage,
        persistence_threshold=persistence_threshold,
        unit_numel=unit_numel,
        leaf_modules=leaf_modules,
    )
    units = []
    for name, group in zip(_unit_names(groups), groups):
        chunks = []  # per tensor: (rows per chunk, elements per row)
        for spec in group.tensors:
            rows = spec.shape[0] if spec.shape else 1
            chunks.append((-(-rows // world_size), spec.numel // rows if rows else 0))
        shard = _round_up(sum(c * r for c, r in chunks), alignment)
        placements, column = [], 0
        for spec, (chunk_rows, row_numel) in zip(group.tensors, chunks):
            pieces = []
            for rank in range(world_size):
                start = min(spec.numel, rank * chunk_rows * row_numel)
                stop = min(spec.numel, (rank + 1) * chunk_rows * row_numel)
                if stop > start:
                    pieces.append(Piece(start, rank * shard + column, stop - start))
            placements.append(Placement(spec.fqn, tuple(pieces)))
            column += chunk_rows * row_numel
        units.append(_unit(name, group, tuple(placements), shard, world_size))
    return Plan(manifest, world_size, stage, alignment, tuple(units), strategy="per_tensor_dim0")


def whole_tensors(
    manifest: Manifest,
    *,
    world_size: int,
    stage: int,
    alignment: int = DEFAULT_ALIGNMENT,
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
    unit_numel: int | None = None,
    leaf_modules: Sequence[str] = (),
) -> Plan:
    """Every tensor whole on one rank, units grouped as `flat_even` groups them: within a
    unit the tensors go to ranks largest first, each to the rank holding least so far
    (ties: the lower rank), and lie in the buffer by rank, so rank r's shard is its
    tensors end to end (uneven `Unit.bounds`, some maybe empty; no padding). A unit of
    fewer tensors than ranks leaves ranks without any: `format_plan` shows the
    imbalance. Muon's Newton-Schulz then runs on whole matrices without a gather."""
    groups = group_units(
        manifest,
        stage=stage,
        persistence_threshold=persistence_threshold,
        unit_numel=unit_numel,
        leaf_modules=leaf_modules,
    )
    units = []
    for name, group in zip(_unit_names(groups), groups):
        load, owned = [0] * world_size, [[] for _ in range(world_size)]
        for spec in sorted(group.tensors, key=lambda s: -s.numel):
            rank = min(range(world_size), key=lambda r: (load[r], r))
            owned[rank].append(spec)
            load[rank] += spec.numel
        placements, bounds, offset = {}, [0], 0
        for specs in owned:
            for spec in sorted(specs, key=group.tensors.index):
                placements[spec.fqn] = Placement(
                    spec.fqn, (Piece(0, offset, spec.numel),) if spec.numel else ()
                )
                offset += spec.numel
            bounds.append(offset)
        unit = _unit(name, group, tuple(placements[s.fqn] for s in group.tensors), 0, world_size)
        units.append(
            dataclasses.replace(unit, shard_numel=max(load), numel=offset, bounds=tuple(bounds))
        )
    return Plan(manifest, world_size, stage, alignment, tuple(units), strategy="whole_tensors")


def _unit(
    name: str,
    group: UnitGroup,
    placements: tuple[Placement, ...],
    shard_numel: int,
    world_size: int,
) -> Unit:
    return Unit(
        name=name,
        module=group.module,
        group=group.group,
        dtype=group.dtype,
        placements=placements,
        shard_numel=shard_numel,
        numel=shard_numel * world_size,
        persistent=group.persistent,
    )


def plan(
    manifest: Manifest,
    *,
    world_size: int,
    stage: int,
    strategy: Strategy | Callable[..., Plan] = flat_even,
    unit_stages: Mapping[str, int] | None = None,
    memory: Memory | None = None,
    unit_memory: Mapping[str, str | Mapping[str, str]] | None = None,
    **options: object,
) -> Plan:
    """Run `strategy` (a built-in or your own function) with `options` and validate what
    it returns. A strategy may return a plan on a mesh of `world_size` processes
    (`mesh_plan`'s, at stage `stage`): its ranks are then its shard group's. A
    strategy whose signature takes neither an option it is given nor `**options` is an
    error naming both (it would otherwise fail inside, or the option would be lost).
    The engine passes `persistence_threshold` at stage 3 (the config's
    `stage3_param_persistence_threshold`, DeepSpeed's default 100,000): to see the plan
    an engine runs, pass the same (or read `engine.plan`).

    `unit_stages` splits some units as a lower ZeRO stage than `stage` (`set_unit_stages`:
    keys are unit names or module paths, a path covering the modules under it): e.g.
    `stage=3, unit_stages={"embed": 1}` is ZeRO-1 for the embeddings, ZeRO-3 for the
    rest. The engine's doors take it as a strategy: `with_unit_stages`.

    `memory` says where the plan's states live and their dtypes (`Memory`, e.g.
    `Memory(optimizer="nvme", states="bf16")`: ZeRO-Infinity's optimizer with bf16
    moments); a door takes what the plan leaves at the defaults from its config.
    `unit_memory` keeps some units' states elsewhere (`set_unit_memory`: e.g.
    `{"embed": "nvme"}`, the embeddings' masters and moments in the swap file, the rest
    where `memory` says; `{"embed": {"params": "nvme"}}` their stage-3 parameter shards)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world_size is {world_size!r}; it must be an int >= 1")
    if stage not in (0, 1, 2, 3):
        raise PlanError(f"stage is {stage!r}; allowed: 0, 1, 2, 3")
    if unit_stages is not None:
        _check_unit_stages(unit_stages, stage)
    _check_accepts(strategy, options)
    result = strategy(manifest, world_size=world_size, stage=stage, **options)
    if not isinstance(result, Plan):
        raise PlanError(
            f"strategy {getattr(strategy, '__name__', strategy)!r} returned "
            f"{type(result).__name__}, expected fzero.partition.Plan"
        )
    if result.mesh is not None and result.processes != world_size:
        raise PlanError(
            f"strategy {getattr(strategy, '__name__', strategy)!r} returned a plan on "
            f"mesh {result.mesh} ({result.processes} processes) for world_size={world_size}; "
            "a plan on a mesh runs on as many processes as its mesh has: build the mesh "
            "from the world_size the strategy is given"
        )
    if result.mesh is not None:  # `mesh_plan`'s: its ranks are its shard group's
        world_size = result.world_size
    if (result.manifest, result.world_size, result.stage) != (manifest, world_size, stage):
        raise PlanError(
            f"strategy {getattr(strategy, '__name__', strategy)!r} returned a plan for "
            f"world_size={result.world_size}, stage={result.stage} or another manifest; "
            f"asked for world_size={world_size}, stage={stage}"
        )
    if unit_stages:
        result = set_unit_stages(result, unit_stages)
    if memory is not None:
        result = with_memory(result, memory, "the memory argument")
    if unit_memory:
        result = set_unit_memory(result, unit_memory)
    return validate(result)


def _check_unit_stages(unit_stages: Mapping[str, int], stage: int) -> None:
    if not isinstance(unit_stages, Mapping):
        raise PlanError(
            f"unit_stages is a {type(unit_stages).__name__}; give a mapping of unit name or "
            "module path to a ZeRO stage, e.g. {'embed': 1}"
        )
    for key, value in unit_stages.items():
        if not isinstance(key, str):
            raise PlanError(f"unit_stages key {key!r} is not a str (a unit name or module path)")
        if isinstance(value, bool) or value not in (0, 1, 2, 3) or value > stage:
            raise PlanError(
                f"unit_stages[{key!r}] is {value!r}; allowed: 0 to the plan's stage {stage} "
                "(the plan's stage is the largest any unit is split as: raise it to split "
                "units above the others)"
            )


def _matches(key: str, unit: Unit) -> int:
    """How specifically `key` names `unit`: its name (the most), its module path, or a
    module path above it (longer prefixes more); -1 when it does not name it."""
    if key == unit.name:
        return 1 << 20
    if key == unit.module or key == "":
        return len(key) + 1
    if unit.module.startswith(key + "."):
        return len(key)
    return -1


def set_unit_stages(plan: Plan, unit_stages: Mapping[str, int]) -> Plan:
    """`plan` with the units `unit_stages` names split as those ZeRO stages (each at most
    `plan.stage`), the rest as they were: a key is a unit's name, or a module path that
    covers the units of that module and of the modules under it ("blocks" covers
    "blocks.0", "blocks.1", ...; "" every unit); where keys overlap the most specific wins
    (a name, then the longest path). A key naming no unit is an error listing the units.
    A unit at stage 2 in a stage-3 plan is made persistent (its parameters kept whole),
    as stage 3's small tensors are; a persistent unit set below 2 stops being one."""
    _check_unit_stages(unit_stages, plan.stage)
    units = tuple(
        unit if key is None else _at_stage(unit, unit_stages[key], plan.stage)
        for unit, key in _named_by(plan, unit_stages, "unit_stages")
    )
    return validate(dataclasses.replace(plan, units=units))


def _named_by(plan: Plan, keys: Mapping[str, object], what: str) -> list[tuple[Unit, str | None]]:
    """Each unit of `plan` with the most specific of `keys` naming it (a name, then the
    longest module path: `_matches`), or None; a key naming no unit is an error (`what`
    names the mapping) listing the units."""
    named = []
    for unit in plan.units:
        found = [(_matches(k, unit), k) for k in keys if _matches(k, unit) >= 0]
        named.append((unit, max(found)[1] if found else None))
    unknown = [key for key in keys if not _names_any(key, plan)]
    if unknown:
        raise PlanError(
            f"{what} key {unknown[0]!r} names no unit of the plan (a unit name or a module "
            f"path above one); its units: {[u.name for u in plan.units]}"
        )
    return named


def set_unit_memory(plan: Plan, unit_memory: Mapping[str, str | Mapping[str, str]]) -> Plan:
    """`plan` with the states of the units `unit_memory` names kept where it says
    ("device", "host" or "nvme"), the rest where they were: a memory kind for the masters
    and optimizer state (`Unit.optimizer_memory`), or a mapping of `Memory`'s fields to
    what they say for the unit, `{"optimizer": ..., "params": ..., "master": ...,
    "states": ..., "grads": ...}` (any of them: `Unit.params_memory` is where a stage-3
    parameter shard lives between uses, `Unit.master_dtype` the masters' dtype and
    `Unit.states_dtype` the moments', "fp32" or "bf16", `Unit.grads_dtype` the gradient
    accumulator's, "fp32" or the compute dtype). Keys as
    `set_unit_stages`
    takes them (a unit name or a module path, the most specific winning). A key naming no
    unit, or another field, is an error naming it."""
    if not isinstance(unit_memory, Mapping):
        raise PlanError(
            f"unit_memory is a {type(unit_memory).__name__}; give a mapping of unit name or "
            "module path to a memory kind, e.g. {'embed': 'nvme'}, or to kinds, e.g. "
            "{'embed': {'params': 'nvme', 'optimizer': 'host'}}"
        )
    said = {key: _kinds_said(key, value) for key, value in unit_memory.items()}
    units = tuple(
        unit if key is None else dataclasses.replace(unit, **said[key])
        for unit, key in _named_by(plan, unit_memory, "unit_memory")
    )
    return validate(dataclasses.replace(plan, units=units))


_UNIT_MEMORY_FIELDS = {
    "optimizer": "optimizer_memory",
    "params": "params_memory",
    "master": "master_dtype",
    "states": "states_dtype",
    "grads": "grads_dtype",
}


def _kinds_said(key: str, value: str | Mapping[str, str]) -> dict[str, str]:
    """The `Unit` fields `unit_memory[key]` says: a memory kind is the optimizer's."""
    if not isinstance(value, Mapping):
        return {"optimizer_memory": value}
    unknown = [kind for kind in value if kind not in _UNIT_MEMORY_FIELDS]
    if unknown:
        raise PlanError(
            f"unit_memory[{key!r}] names kind {unknown[0]!r}; allowed: "
            f"{', '.join(_UNIT_MEMORY_FIELDS)}"
        )
    return {_UNIT_MEMORY_FIELDS[kind]: where for kind, where in value.items()}


def with_unit_memory(
    unit_memory: Mapping[str, str | Mapping[str, str]],
    strategy: Strategy | Callable[..., Plan] = flat_even,
) -> Callable[..., Plan]:
    """A strategy (for the engine's doors or `plan`) that lays a model out with
    `strategy` and keeps the optimizer of the units `unit_memory` names where it says
    (`set_unit_memory`): `fzero.shard(model, stage=2, strategy=with_unit_memory({"embed":
    "nvme"}), config=...)` keeps the embeddings' masters and moments in the swap file
    under the config's `offload_optimizer.nvme_path`, the rest in memory;
    `with_unit_memory({"embed": {"params": "nvme"}})` at stage 3 their parameter shards
    under `offload_param.nvme_path`."""
    return _laid_out_with(strategy, unit_memory=dict(unit_memory))


def _laid_out_with(strategy: Strategy | Callable[..., Plan], **said: object) -> Callable[..., Plan]:
    """A strategy running `plan` with `strategy` and `said` (`unit_stages`,
    `unit_memory`) beside the options a door gives; named as `strategy`."""

    def laid_out(manifest: Manifest, *, world_size: int, stage: int, **options: object) -> Plan:
        return plan(
            manifest, world_size=world_size, stage=stage, strategy=strategy,
            **said, **options,  # type: ignore[arg-type]
        )  # fmt: skip

    laid_out.__name__ = getattr(strategy, "__name__", "strategy")
    return laid_out


def _names_any(key: str, plan: Plan) -> bool:
    return any(_matches(key, unit) >= 0 for unit in plan.units)


def _at_stage(unit: Unit, stage: int, plan_stage: int) -> Unit:
    if stage == plan_stage:
        return dataclasses.replace(unit, stage=None)
    if plan_stage == 3 and stage == 2:  # params whole, the rest split: stage 3's persistent
        return dataclasses.replace(unit, stage=None, persistent=True)
    return dataclasses.replace(unit, stage=stage, persistent=False)


def with_unit_stages(
    unit_stages: Mapping[str, int],
    strategy: Strategy | Callable[..., Plan] = flat_even,
) -> Callable[..., Plan]:
    """A strategy (for `fzero.shard(..., strategy=)`, `fzero.initialize(..., strategy=)`
    or `plan`) that lays a model out with `strategy` and splits the units `unit_stages`
    names as those stages (`set_unit_stages`), the rest as the run's stage:
    `fzero.shard(model, stage=3, strategy=with_unit_stages({"embed": 1}))` is ZeRO-1 for
    the embeddings and ZeRO-3 for the rest. Checked when called (each stage at most the
    run's)."""
    return _laid_out_with(strategy, unit_stages=dict(unit_stages))


def _check_accepts(strategy: Callable[..., Plan], options: dict[str, object]) -> None:
    """Raise if `strategy`'s signature cannot take every option in `options`."""
    try:
        parameters = inspect.signature(strategy).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call say
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    names = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    for option, value in options.items():
        if option not in names:
            raise PlanError(
                f"strategy {getattr(strategy, '__name__', strategy)!r} does not take option "
                f"{option}={value!r}, which it is given (the engine gives "
                "persistence_threshold at stage 3, from zero_optimization."
                "stage3_param_persistence_threshold): add the parameter, or **options"
            )


BUILT_IN = ("flat_even", "per_tensor_dim0", "whole_tensors")


def strategy_from_name(name: str, where: str = "config key 'strategy'") -> Callable[..., Plan]:
    """The strategy a config names: a built-in's name (`BUILT_IN`) or `module:function`
    (imported; the function is your strategy). Errors name `where` it came from."""
    if name in BUILT_IN:
        return {
            "flat_even": flat_even,
            "per_tensor_dim0": per_tensor_dim0,
            "whole_tensors": whole_tensors,
        }[name]
    module_name, _, function = name.partition(":")
    if not module_name or not function:
        raise PlanError(
            f"{where} is {name!r}; allowed: {', '.join(BUILT_IN)} or "
            "'module:function' naming your own strategy"
        )
    try:
        found = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as error:
        raise PlanError(f"{where} is {name!r}, which cannot be loaded: {error}") from None
    if not callable(found):
        raise PlanError(f"{where} is {name!r}, a {type(found).__name__}: not callable")
    return found
