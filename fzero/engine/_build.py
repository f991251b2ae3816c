"""Building an engine's parts: its plan, the module's floating tensors cast to the
compute dtype, each unit's buffers filled from the module's parameters (rank 0's,
broadcast; or adopted from their construction-time partitions, `fzero.core.partitioned`)
by the core's unit builder (`fzero.core.build`) and bound to the module."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from fzero import partition
from fzero.config import Config
from fzero.core import nvme as _nvme
from fzero.core.build import Holding, build_unit_state, values_on_rank
from fzero.core.groups import check_same_plan
from fzero.core.layout import UnitRuntime, bind, unbind
from fzero.core.partitioned import is_partitioned, materialise, release_partition, shape_of
from fzero.core.precision import DTYPES, STATE_DTYPES, Precision, run_plan
from fzero.core.residency import Residency
from fzero.core.state import UnitState
from fzero.engine.meta_init import MetaInitializer
from fzero.engine.zero3_attributes import describe_zero3_param
from fzero.optim import Optimizer
from fzero.partition import Plan

log = logging.getLogger("fzero")

__all__ = ["build_units", "cast_module", "plan_for", "whole_frozen"]


def plan_for(
    module: torch.nn.Module,
    groups: list[dict[str, Any]],
    config: Config,
    world_size: int,
    strategy: Callable[..., Plan] | None,
    where: str,
    precision: Precision,
) -> tuple[Plan, Precision]:
    """The engine's plan: the module's trainable tensors by group, split as the config's
    stage (and stage 3's persistence threshold) and `strategy` say (else the config's
    `strategy` key, else `flat_even`), some units at lower stages where the config's
    `unit_stages` says so. DeepSpeed's `zero_hpz_partition_size` and
    `mics_shard_size` make it a plan on a mesh (`partition.from_zero_config`: hpZ's
    secondary copy within groups of that many ranks, or MiCS's shard groups), laid out
    by the same strategy; a strategy may also return a plan on a mesh (`mesh_plan`'s). Where its
    states live and their dtypes are the plan's, what it leaves unsaid the config's
    offload devices and `precision`'s (`run_plan`, which also gives the precision the
    engine runs). Every rank must hold the same plan: checked (`where` names the engine in
    the error)."""
    zero = config.zero_optimization
    if strategy is None and config.strategy is not None:
        strategy = partition.strategy_from_name(config.strategy)
    options: dict[str, Any] = {}
    if zero.stage == 3:
        options["persistence_threshold"] = zero.stage3_param_persistence_threshold
        leaves = partition.leaf_modules(module)  # DeepSpeed's set_z3_leaf_modules
        if leaves and _takes(strategy or partition.flat_even, "leaf_modules"):
            options["leaf_modules"] = leaves
        elif leaves:  # a strategy of the user's own decides its units (the flags recorded)
            log.info(
                "fzero: strategy %s takes no leaf_modules; the ZeRO-3 leaf flags on %s are "
                "not applied to its units",
                getattr(strategy, "__name__", strategy),
                list(leaves),
            )
    manifest = partition.describe(module, groups)
    keys = {
        "stage": zero.stage,
        "zero_hpz_partition_size": zero.zero_hpz_partition_size,
        "mics_shard_size": zero.mics_shard_size,
        "mics_hierarchical_params_gather": zero.mics_hierarchical_params_gather,
    }
    per_node = os.environ.get("NDEV_PER_NODE") or os.environ.get("LOCAL_WORLD_SIZE")
    mesh, preset = partition.from_zero_config(
        keys, world_size, ranks_per_node=int(per_node) if per_node else None
    )
    if preset.name != f"zero{zero.stage}":  # hpZ or MiCS groups
        plan = partition.mesh_plan(
            manifest, mesh, preset, strategy=strategy or partition.flat_even, **options
        )
        if config.unit_stages:
            plan = partition.set_unit_stages(plan, config.unit_stages)
    else:
        plan = partition.plan(
            manifest,
            world_size=world_size,
            stage=zero.stage,
            strategy=strategy or partition.flat_even,
            unit_stages=config.unit_stages,
            **options,
        )
    plan, precision = run_plan(plan, config, precision)
    check_same_plan(plan, where)  # before any state is built
    return plan, precision


def _takes(strategy: Callable[..., Plan], option: str) -> bool:
    """Whether `strategy`'s signature accepts `option` (by name or `**options`)."""
    parameters = inspect.signature(strategy).parameters.values()
    return any(p.name == option or p.kind is p.VAR_KEYWORD for p in parameters)


def whole_frozen(module: torch.nn.Module, plan: Plan) -> None:
    """Frozen parameters partitioned at construction made whole (every rank; collective):
    the engine keeps what it does not train whole, as DeepSpeed's attributes say."""
    managed = {spec.fqn for spec in plan.manifest.tensors}
    seen: set[int] = set()
    for fqn, p in module.named_parameters():
        if fqn not in managed and id(p) not in seen and is_partitioned(p):
            materialise(p)
        seen.add(id(p))


def cast_module(module: torch.nn.Module, plan: Plan, compute_dtype: torch.dtype) -> None:
    """Compute dtype for frozen params and floating buffers (trainable ones are rebound)."""
    if compute_dtype == torch.float32:
        return
    named = dict(module.named_parameters())
    managed = {id(named[spec.fqn]) for spec in plan.manifest.tensors}
    for p in module.parameters():
        if id(p) not in managed and p.is_floating_point():
            p.data = p.data.to(compute_dtype)
    for b in module.buffers():
        if b.is_floating_point():
            b.data = b.data.to(compute_dtype)


def build_units(
    module: torch.nn.Module,
    plan: Plan,
    *,
    rank: int,
    holding: Holding,
    residency: Residency,
    optimizer: Optimizer,
    group_hparams: Sequence[Any],
    param_init_fn: Callable[[torch.nn.Module], None] | None,
    accumulators: Sequence[Tensor | None] | None,
) -> Iterator[UnitRuntime]:
    """Every unit of the plan on plan rank `rank`, built in order by the core's unit
    builder (`fzero.core.build`), bound to the module's parameters and yielded one at a
    time (a model on the meta device is materialised a few tensors at a time, as the
    units need them; partitions made at construction are adopted one unit at a time and
    dropped as they are). Nothing of a unit is kept here once it is yielded: a consumer
    that places each unit's shard before taking the next (`ParamShardStore`, into its
    swap file) holds one unit's buffers at a time, not the rank's share; the last steps
    (the meta model finished, frozen parameters described) run when the iterator is
    exhausted. `accumulators`: units at stages 0-1, each one's fp32 gradient accumulator
    (views of the reduction's bucket buffers; None for a unit at stages 2-3);
    `group_hparams`: each param group's hyper-parameters."""
    named = dict(module.named_parameters())
    meta = None
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        meta = MetaInitializer(module, holding.device, param_init_fn)
    for index, unit in enumerate(plan.units):
        fqns = [pl.fqn for pl in unit.placements]
        tensors = meta.until(fqns) if meta is not None else [named[fqn] for fqn in fqns]
        values, start = values_on_rank(plan, index, tensors, rank=rank, device=holding.device)
        grad = accumulators[index] if accumulators else None
        if grad is None and residency.grad_on_disk(index):  # NVMe: in the swap file
            grad = torch.zeros(0, dtype=torch.float32, device=holding.device)
        state = build_unit_state(
            plan, index, values, rank=rank, holding=held_by(holding, residency, index),
            optimizer=optimizer, grad=grad, values_from=start,
        )  # fmt: skip
        del values
        for tensor in tensors:
            if is_partitioned(tensor):
                release_partition(tensor)
        unit_runtime = _bind_unit(
            plan, index, tensors, state, group_hparams, holding, residency, optimizer
        )
        del state  # the record holds what stays; the rest goes before the next unit
        yield unit_runtime
    if meta is not None:
        meta.finish()
    if plan.stage == 3:  # frozen parameters stay whole: DeepSpeed's attributes say so
        for p in module.parameters():
            if not hasattr(p, "ds_status"):
                describe_zero3_param(p, tuple(p.shape), persistent=True, available=True)
    if residency.nvme is not None:
        residency.step_pool.trim(0)  # the pieces' buffers (`write_in_pieces`): none kept
        _nvme.return_free_memory()


def held_by(holding: Holding, residency: Residency, index: int) -> Holding:
    """How unit `index` is held: on the host where its optimizer lives off the device
    (`Plan.optimizer_memory`), its master and moments fp32 in memory where they rest in
    the swap file (bf16 there, if so), its master aligned for the file there; its parameter shard
    off the device where the plan keeps it there (`Plan.params_memory`)."""
    return holding._replace(
        shards_offloaded=residency.plan.params_memory(index) != "device",
        grad_dtype=DTYPES[residency.plan.grads_dtype(index)],  # `Unit.grads_dtype`
        master_dtype=(
            torch.float32
            if residency.holds(index)
            else STATE_DTYPES[residency.plan.master_dtype(index)]  # `Unit.master_dtype`
        ),
        offload=residency.offloaded[index],
        state_dtype=(
            torch.float32
            if residency.holds(index)
            else STATE_DTYPES[residency.plan.states_dtype(index)]  # `Unit.states_dtype`
        ),
        to_file=residency.holds(index),
        in_pieces=residency.holds(index) and residency.sub_group > 0,
    )


def _bind_unit(
    plan: Plan,
    index: int,
    tensors: Sequence[torch.nn.Parameter],
    state: UnitState,
    group_hparams: Sequence[Any],
    holding: Holding,
    residency: Residency,
    optimizer: Optimizer,
) -> UnitRuntime:
    """Unit `index`'s runtime record over `state`'s buffers, the module's parameters bound
    to them (stage 3: left empty until gathered); NVMe: state moved to the swap file."""
    unit = plan.units[index]
    whole = plan.stage_of(unit) < 3
    params = [(p, pl, shape_of(p)) for p, pl in zip(tensors, unit.placements)]
    rt = UnitRuntime(
        index=index,
        unit=unit,
        params=params,
        master=state.master,
        state=state.optim,
        grad=state.grad,
        hparams=group_hparams[unit.group],
        full=state.params if whole else None,
        param_shard=None if whole else state.params,
    )
    if plan.stage == 3:
        for p, _, shape in params:
            describe_zero3_param(p, shape, persistent=whole, available=whole)
    if whole:
        bind(rt)
    else:  # where the shard lives between uses: `fzero.core.param_shards`
        unbind(rt, holding.compute_dtype, holding.device)
    if held_by(holding, residency, index).in_pieces:  # the state made as it is written
        residency.write_in_pieces(rt, optimizer)
    elif residency.holds(index):  # to the swap file; the host keeps nothing of it
        residency.swap_out(rt, rt.slot, wait=True)
        residency.evict(rt)
    return rt
