"""Two of `fzero.partition.validate`'s rules for a stage plan, each about one field of
it: where its states live and their dtypes (`validate_memory`), and a unit split over
fewer of the plan's mesh axes than the plan (`validate_shard_axes`). Pure functions of
the plan; `_plan.validate` runs them. (`plan` is a `Plan`, `unit` one of its units:
typed `Any` here, as this module sits below `_plan` in the import graph.)"""

from __future__ import annotations

from typing import Any

from fzero.partition._placement import (
    DEEPSPEED_DEVICE,
    GRAD_DTYPES,
    MEMORY_DTYPES,
    MEMORY_KINDS,
    Memory,
    PlanError,
)

__all__ = ["validate_memory", "validate_shard_axes"]


def validate_memory(plan: Any) -> None:
    """Where the plan's states live and their dtypes (`Memory`): known values; the
    optimizer off the device only where every unit has an optimizer partition (stage 1
    or more: DeepSpeed never offloads stage 0); parameters off the device only at stage
    3 (only its parameters are shards between uses); the swap file's masters and moments
    each in one dtype, the plan's, and its gradient accumulators (stages 2-3) too, fp32 or
    bf16."""
    memory = plan.memory
    if not isinstance(memory, Memory):
        raise PlanError(f"memory is a {type(memory).__name__}; expected partition.Memory")
    for name, allowed in (
        ("params", MEMORY_KINDS),
        ("optimizer", MEMORY_KINDS),
        ("master", MEMORY_DTYPES),
        ("states", MEMORY_DTYPES),
        ("grads", GRAD_DTYPES),
    ):
        if getattr(memory, name) not in allowed:
            raise PlanError(
                f"memory.{name} is {getattr(memory, name)!r}; allowed: {', '.join(allowed)}"
            )
    for unit in plan.units:
        if unit.optimizer_memory not in (None, *MEMORY_KINDS):
            raise PlanError(
                f"unit {unit.name!r}: optimizer_memory is {unit.optimizer_memory!r}; allowed: "
                f"None (the plan's memory.optimizer), {', '.join(MEMORY_KINDS)}"
            )
        if unit.params_memory not in (None, *MEMORY_KINDS):
            raise PlanError(
                f"unit {unit.name!r}: params_memory is {unit.params_memory!r}; allowed: "
                f"None (the plan's memory.params), {', '.join(MEMORY_KINDS)}"
            )
        if unit.states_dtype not in (None, *MEMORY_DTYPES):
            raise PlanError(
                f"unit {unit.name!r}: states_dtype is {unit.states_dtype!r}; allowed: None "
                f"(the plan's memory.states), {', '.join(MEMORY_DTYPES)}"
            )
        if plan.states_dtype(unit) != memory.states and plan.optimizer_memory(unit) == "nvme":
            raise PlanError(
                f"unit {unit.name!r}: states_dtype is {unit.states_dtype!r} with its optimizer "
                f"on 'nvme', where the swap file keeps every unit's moments in the plan's "
                f"memory.states ({memory.states!r}); give it the plan's dtype or keep its "
                "optimizer on the device or host"
            )
        if unit.params_memory not in (None, "device") and plan.stage_of(unit) < 3:
            raise PlanError(
                f"unit {unit.name!r}: params_memory is {unit.params_memory!r} but the unit "
                f"is split as stage {plan.stage_of(unit)}"
                + (" (persistent: its parameters stay whole)" if unit.persistent else "")
                + "; only stage 3's parameters are shards between uses: keep them on the "
                "device"
            )
        where = plan.optimizer_memory(unit)
        if where != "device" and plan.stage_of(unit) == 0:
            said = (
                f"memory.optimizer is {where!r} (DeepSpeed's "
                "zero_optimization.offload_optimizer.device is "
                f"{DEEPSPEED_DEVICE[where]!r})"
                if unit.optimizer_memory is None
                else f"unit {unit.name!r}'s optimizer_memory is {where!r}"
            )
            raise PlanError(
                f"{said} but unit {unit.name!r} is split as stage 0 (every rank updates it "
                "whole); the optimizer lives off the device only at stage 1, 2 or 3 (give "
                "that unit stage 1 or more, or keep its optimizer on the device)"
            )
        if unit.master_dtype not in (None, *MEMORY_DTYPES):
            raise PlanError(
                f"unit {unit.name!r}: master_dtype is {unit.master_dtype!r}; allowed: None "
                f"(the plan's memory.master), {', '.join(MEMORY_DTYPES)}"
            )
        if where == "nvme" and plan.master_dtype(unit) != memory.master:
            raise PlanError(
                f"unit {unit.name!r}: master_dtype is {unit.master_dtype!r} with its optimizer "
                f"on 'nvme', where the swap file keeps every unit's master in the plan's "
                f"memory.master ({memory.master!r}); give it the plan's dtype or keep its "
                "optimizer on the device or host"
            )
        if unit.grads_dtype not in (None, *GRAD_DTYPES):
            raise PlanError(
                f"unit {unit.name!r}: grads_dtype is {unit.grads_dtype!r}; allowed: None "
                f"(the plan's memory.grads), {', '.join(GRAD_DTYPES)}"
            )
        grads = plan.grads_dtype(unit)
        if where == "nvme" and plan.stage_of(unit) >= 2 and grads != memory.grads:
            raise PlanError(
                f"unit {unit.name!r}: grads_dtype is {grads!r} with its optimizer on 'nvme' "
                f"at stage {plan.stage_of(unit)}: its gradient accumulator lives in the swap "
                "file, which keeps every unit's accumulator in the plan's memory.grads "
                f"({memory.grads!r}); give it the plan's dtype or keep its optimizer on the "
                "device or host"
            )
        if where == "nvme" and plan.stage_of(unit) >= 2 and grads == "fp16":
            raise PlanError(
                "memory.grads is 'fp16' (DeepSpeed's data_types.grad_accum_dtype) with unit "
                f"{unit.name!r}'s optimizer on 'nvme' at stage {plan.stage_of(unit)}: its "
                "gradient accumulator lives in the swap file, which holds fp32 or bf16 "
                "accumulators; accumulate in fp32 (grad_accum_dtype 'fp32' or null) or keep "
                "the optimizer on the device or host"
            )
    if memory.params != "device" and plan.stage != 3:
        raise PlanError(
            f"memory.params is {memory.params!r} (DeepSpeed's "
            "zero_optimization.offload_param.device is "
            f"{DEEPSPEED_DEVICE[memory.params]!r}) but the plan is stage {plan.stage}: only "
            "stage 3's parameters are shards between uses; keep them on the device"
        )


def validate_shard_axes(plan: Any, unit: Any) -> None:
    """A unit split over fewer of the plan's shard axes than the plan (`Unit.shard_axes`):
    some of them, in their order (none of a finer optimizer split's extra axes; all of
    hpZ's secondary axes), on a plan with no hierarchical gather, even, split as stage 1
    or more; `numel` its shards' elements."""
    where = f"unit {unit.name!r}"
    on = plan.mesh
    axes = unit.shard_axes
    if on is None:
        raise PlanError(
            f"{where}: shard_axes is {axes!r} but the plan is not on a mesh; a unit splits "
            "over fewer axes than its plan only on a mesh (fzero.partition.mesh_plan)"
        )
    inside = tuple(a for a in on.shard if a in (axes or ()))
    if not isinstance(axes, tuple) or not axes or inside != axes or axes == on.shard:
        raise PlanError(
            f"{where}: shard_axes is {axes!r}; allowed: None (the plan's {on.shard}) or "
            f"some of them, not all, in that order"
        )
    why = next(
        (
            reason
            for reason, found in (
                ("uneven bounds", bool(unit.bounds)),
                (f"stage {plan.stage_of(unit)} (nothing split)", plan.stage_of(unit) == 0),
                (
                    f"hpZ's secondary copy over {on.secondary}, not within them",
                    bool(on.secondary) and not set(on.secondary) <= set(axes),
                ),
                ("a hierarchical gather in the plan", on.hierarchical),
                (
                    f"the plan's optimizer split finer, over {on.optimizer_extra}",
                    any(a in on.optimizer_extra for a in axes),
                ),
            )
            if found
        ),
        None,
    )
    if why is not None:
        raise PlanError(
            f"{where}: split over {axes}, fewer axes than the plan's {on.shard}, with {why}; "
            "fzero runs a unit on its own axes only as an even split at stages 1-3 beside "
            "plain splits (not run yet otherwise)"
        )
    shards = plan.shards_of(unit)
    if unit.numel != unit.shard_numel * shards:
        raise PlanError(
            f"{where}: numel {unit.numel} != {shards} shards (over {axes}) "
            f"x shard_numel {unit.shard_numel}"
        )
