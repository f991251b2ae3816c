"""A plan as text: `format_plan`, the table of units, what each rank holds and the
padding it carries (per kind and process on a mesh). Pure, over `_queries`."""

from __future__ import annotations

from dataclasses import fields

from fzero.partition._mesh import KINDS
from fzero.partition._plan import Memory, Plan, Unit
from fzero.partition._queries import kind_slices, local_slices, owned_numel

__all__ = ["format_plan"]


def format_plan(plan: Plan) -> str:
    """A table of units: tensors, buffer size and which elements each rank owns, with the
    padding each rank's shard carries; then the plan's padding (elements every rank
    allocates beyond the model) and its imbalance (the most elements a rank owns over
    the mean), which equal shards turn into padding. A plan on a mesh shows, per unit,
    each kind's axes and block, and per rank (with its mesh coordinate) the buffer range
    of each kind and the tensor elements its optimizer block updates."""
    if plan.mesh is not None:
        return _format_mesh_plan(plan)
    lines = [
        f"plan: strategy={plan.strategy} stage={plan.stage} world_size={plan.world_size} "
        f"alignment={plan.alignment} units={len(plan.units)} params={plan.manifest.numel:,}"
        + _memory_text(plan.memory)
    ]
    slices = [local_slices(plan, rank) for rank in range(plan.world_size)]
    for index, unit in enumerate(plan.units):
        flags = _unit_flags(unit)
        padding = unit.numel - sum(pc.numel for pl in unit.placements for pc in pl.pieces)
        lines.append(
            f"  unit {index} {unit.name!r} module={unit.module or '<root>'} group={unit.group} "
            f"{unit.dtype} numel={unit.numel:,} "
            f"shard={'uneven, at most ' if unit.bounds else ''}{unit.shard_numel:,} "
            f"padding={padding:,}{flags}"
        )
        for rank in range(plan.world_size):
            owned = [s for s in slices[rank] if s.unit == index]
            size = unit.shard_size(plan.shard_index(unit, rank))
            empty = "(none)" if size == 0 else "(padding only)"
            text = ", ".join(f"{s.fqn}[{s.start}:{s.stop}]" for s in owned) or empty
            pad = size - sum(s.stop - s.start for s in owned)
            replica = plan.unit_replica(unit, rank)
            also = (
                f" (replica {replica} of shard {plan.shard_index(unit, rank)})" if replica else ""
            )
            lines.append(
                f"    rank {rank}: {text}" + (f" (+{pad:,} padding)" if pad else "") + also
            )
    lines.append(_padding_line(plan, owned_numel(plan), "owned"))
    return "\n".join(lines)


def _padding_line(plan: Plan, owned: list[int], what: str) -> str:
    """The plan's padding (elements every rank allocates beyond the model) and the
    imbalance of `owned`, the elements each rank owns (`what`)."""
    buffers = sum(u.numel for u in plan.units)
    padding = buffers - sum(pc.numel for u in plan.units for pl in u.placements for pc in pl.pieces)
    mean = sum(owned) / len(owned)
    imbalance = max(owned) / mean if mean else 1.0
    return (
        f"padding: {padding:,} elements ({100 * padding / max(buffers, 1):.1f}% of the unit "
        f"buffers); {what} per rank: min {min(owned):,}, max {max(owned):,} "
        f"(imbalance {imbalance:.2f}x)"
    )


_UNIT_MEMORY = {  # a unit's own memory fields, named as `Memory`'s
    "params": "params_memory",
    "optimizer": "optimizer_memory",
    "master": "master_dtype",
    "states": "states_dtype",
    "grads": "grads_dtype",
}


def _unit_flags(unit: Unit) -> str:
    """What a unit says beyond its layout: persistent, its own stage, its own axes, and
    where its states live or their dtypes where it differs from the plan's `memory`."""
    flags = " persistent" if unit.persistent else ""
    flags += f" stage={unit.stage}" if unit.stage is not None else ""
    flags += f" over={'+'.join(unit.shard_axes)}" if unit.shard_axes is not None else ""
    said = [
        f"{name}:{getattr(unit, field)}"
        for name, field in _UNIT_MEMORY.items()
        if getattr(unit, field) is not None
    ]
    return flags + (f" memory={','.join(said)}" if said else "")


def _memory_text(memory: Memory) -> str:
    """The fields of `memory` off their defaults, as " memory=optimizer:nvme,states:bf16"."""
    said = [
        f"{f.name}:{getattr(memory, f.name)}"
        for f in fields(memory)
        if getattr(memory, f.name) != f.default
    ]
    return f" memory={','.join(said)}" if said else ""


def _format_mesh_plan(plan: Plan) -> str:
    mesh = plan.process_mesh
    lines = [
        f"plan: strategy={plan.strategy} preset={plan.preset} stage={plan.stage} mesh={mesh} "
        f"({mesh.size} processes; {plan.world_size} shards over {', '.join(plan.mesh.shard)}) "
        f"alignment={plan.alignment} units={len(plan.units)} params={plan.manifest.numel:,}"
        + _memory_text(plan.memory)
    ]
    shardings = plan.shardings
    kinds = [k for k in KINDS if any(s.of(k) is not None for s in shardings)]
    updates = [kind_slices(plan, rank, "optimizer") for rank in range(mesh.size)]
    for index, (unit, sharding) in enumerate(zip(plan.units, shardings)):
        padding = unit.numel - sum(pc.numel for pl in unit.placements for pc in pl.pieces)
        flags = _unit_flags(unit)
        flags += " hierarchical-gather" if sharding.hierarchical_params_gather else ""
        lines.append(
            f"  unit {index} {unit.name!r} module={unit.module or '<root>'} group={unit.group} "
            f"{unit.dtype} numel={unit.numel:,} padding={padding:,}{flags}"
        )
        for kind in kinds:
            split = sharding.of(kind)
            if split is not None:
                block = unit.numel // mesh.group_size(split.shard)
                lines.append(f"    {kind:<17}{split!s:<40}{block:>12,} per rank")
        for rank in range(mesh.size):
            where = ", ".join(f"{a}={c}" for a, c in mesh.coordinate(rank).items())
            ranges = " ".join(
                f"{kind}[{lo}:{hi})"
                for kind in kinds
                if sharding.of(kind) is not None
                for lo, hi in [plan.kind_range(unit, kind, rank)]
            )
            owned = [s for s in updates[rank] if s.unit == index]
            low, high = plan.kind_range(unit, "optimizer", rank)
            empty = "(none)" if high == low else "(padding only)"
            text = ", ".join(f"{s.fqn}[{s.start}:{s.stop}]" for s in owned) or empty
            lines.append(f"    rank {rank} ({where}): {ranges}; updates {text}")
    owned_by = [sum(s.numel for s in slices) for slices in updates]
    lines.append(_padding_line(plan, owned_by, "optimizer elements"))
    return "\n".join(lines)
