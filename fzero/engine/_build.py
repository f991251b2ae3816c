"""Building an engine: its plan, the module's floating tensors cast to the compute dtype,
each unit's buffers filled from the module's parameters (rank 0's, broadcast) and placed
where the plan, precision and offload say (`fzero.core.layout`), and its hooks."""

from __future__ import annotations

import inspect
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fzero import comm, partition
from fzero.config import Config
from fzero.core import nvme as _nvme
from fzero.core.layout import UnitRuntime, bind, scatter_pieces, unbind
from fzero.core.precision import init_state
from fzero.engine._forward import ForwardHooks
from fzero.engine.meta_init import MetaInitializer
from fzero.engine.zero3_attributes import describe_zero3_param
from fzero.partition import Plan, Unit

log = logging.getLogger("fzero")

__all__ = ["build_unit", "build_units", "cast_module", "install_hooks", "plan_for"]

Engine = Any  # fzero.engine.Engine (this module sits below it)


def plan_for(
    module: torch.nn.Module,
    groups: list[dict[str, Any]],
    config: Config,
    world_size: int,
    strategy: Callable[..., Plan] | None,
) -> Plan:
    """The engine's plan: the module's trainable tensors by group, split as the config's
    stage (and stage 3's persistence threshold) and `strategy` say (else the config's
    `strategy` key, else `flat_even`). DeepSpeed's `zero_hpz_partition_size` and
    `mics_shard_size` make it a plan on a mesh (`partition.from_zero_config`: hpZ's
    secondary copy within groups of that many ranks, or MiCS's shard groups), laid out
    by the same strategy; a strategy may also return a `MeshPlan` itself."""
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
    if zero.mics_hierarchical_params_gather and mesh.size > 1:
        log.info(
            "fzero: mics_hierarchical_params_gather: parameters are gathered by one "
            "all-gather over the shard group (the same values; the two-hop gather is not "
            "run yet)"
        )
    if preset.name != f"zero{zero.stage}":  # hpZ or MiCS groups
        laid_out = partition.mesh_plan(
            manifest, mesh, preset, strategy=strategy or partition.flat_even, **options
        )
        return partition.executable(laid_out)
    return partition.plan(
        manifest,
        world_size=world_size,
        stage=zero.stage,
        strategy=strategy or partition.flat_even,
        **options,
    )


def _takes(strategy: Callable[..., Plan], option: str) -> bool:
    """Whether `strategy`'s signature accepts `option` (by name or `**options`)."""
    parameters = inspect.signature(strategy).parameters.values()
    return any(p.name == option or p.kind is p.VAR_KEYWORD for p in parameters)


def cast_module(engine: Engine) -> None:
    """Compute dtype for frozen params and floating buffers (trainable ones are rebound)."""
    if engine.compute_dtype == torch.float32:
        return
    named = dict(engine.module.named_parameters())
    managed = {id(named[spec.fqn]) for spec in engine.plan.manifest.tensors}
    for p in engine.module.parameters():
        if id(p) not in managed and p.is_floating_point():
            p.data = p.data.to(engine.compute_dtype)
    for b in engine.module.buffers():
        if b.is_floating_point():
            b.data = b.data.to(engine.compute_dtype)


def build_units(
    engine: Engine,
    param_init_fn: Callable[[torch.nn.Module], None] | None,
    accumulators: Sequence[Tensor] | None,
) -> list[UnitRuntime]:
    """Every unit of the plan, built in order (a model on the meta device is materialised
    a few tensors at a time, as the units need them). `accumulators`: stages 0-1, each
    unit's fp32 gradient accumulator (views of the reduction's bucket buffers)."""
    module = engine.module
    named = dict(module.named_parameters())
    meta = None
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        meta = MetaInitializer(module, engine.device, param_init_fn)
    units = [
        build_unit(engine, i, unit, named, meta, accumulators[i] if accumulators else None)
        for i, unit in enumerate(engine.plan.units)
    ]
    if meta is not None:
        meta.finish()
    if engine.stage == 3:  # frozen parameters stay whole: DeepSpeed's attributes say so
        for p in module.parameters():
            if not hasattr(p, "ds_status"):
                describe_zero3_param(p, tuple(p.shape), persistent=True, available=True)
    if engine.residency.nvme is not None:
        _nvme.return_free_memory()
    return units


def install_hooks(engine: Engine) -> list[Any]:
    """The engine's hooks on its module and parameters: gradient reduction as gradients
    arrive, the root's forward hooks, stage 3's gathering. Returns their handles."""
    handles = []
    for rt in engine.units:
        for p, _, _ in rt.params:
            handles.append(p.register_post_accumulate_grad_hook(engine.reduction.on_grad))
            p._fzero_engine = weakref.ref(engine)  # for fzero.gathered_parameters
    handles += ForwardHooks(engine).install()
    if engine.stage == 3:
        engine.stage3.install_hooks(engine.module)
        handles += engine.stage3.hooks
    return handles


def build_unit(
    engine: Engine,
    index: int,
    unit: Unit,
    named: Mapping[str, torch.nn.Parameter],
    meta: MetaInitializer | None,
    accumulator: Tensor | None = None,
) -> UnitRuntime:
    """Unit `index`'s buffers on this rank, the module's parameters bound to them (or, in
    stage 3, left empty until gathered)."""
    fqns = [pl.fqn for pl in unit.placements]
    tensors = meta.until(fqns) if meta is not None else [named[fqn] for fqn in fqns]
    params = [(p, pl, tuple(p.shape)) for p, pl in zip(tensors, unit.placements)]
    flat = torch.zeros(unit.numel, dtype=torch.float32, device=engine.device)
    with torch.no_grad():
        for p, placement, _ in params:
            scatter_pieces(flat, p.detach().reshape(-1).float(), placement)
    if engine.world_size > 1:
        # every rank starts from rank 0's weights
        comm.broadcast(flat, 0, what=f"initial weights of unit {index} {unit.name!r}")
    keeps_full = engine.stage < 3 or unit.persistent
    part = engine.partition(unit)
    residency = engine.residency
    full = master = param_shard = None
    master_dtype = engine.dtypes.master_dtype
    shares_master = (
        engine.compute_dtype == master_dtype
        and not engine.offload
        and engine.param_offload == "none"
    )
    if keeps_full:
        full = flat if engine.compute_dtype == torch.float32 else flat.to(engine.compute_dtype)
        master = full[part] if shares_master else residency.to_host(flat[part], master_dtype)
    else:
        master = residency.to_host(flat[part], master_dtype)
        if not shares_master:
            param_shard = flat[part].to(engine.compute_dtype, copy=True)
    del flat
    # stages 0-1: a view of its bucket's buffer; NVMe offload: in the swap file
    grad_numel = 0 if residency.grads_on_disk else unit.shard_size(engine.plan_rank)
    if accumulator is None:
        accumulator = torch.zeros(grad_numel, dtype=torch.float32, device=engine.device)
    rt = UnitRuntime(
        index=index,
        unit=unit,
        params=params,
        master=master,
        # NVMe: moments are fp32 in memory, and bf16 (if so) only in the swap file
        state=init_state(
            engine.functional_optimizer,
            master,
            torch.float32 if residency.nvme is not None else engine.dtypes.state_dtype,
        ),
        grad=accumulator,
        hparams=engine.hyperparams.group_hparams[unit.group],
        full=full,
        param_shard=param_shard,
    )
    if engine.stage == 3:
        for p, _, shape in params:
            describe_zero3_param(p, shape, persistent=unit.persistent, available=keeps_full)
    if keeps_full:
        bind(rt)
    else:
        unbind(rt, engine.compute_dtype, engine.device)
        engine.stage3.store_param_shard(rt, rt.param_shard)
    if residency.nvme is not None:  # to the swap file; the host keeps nothing of it
        residency.swap_out(rt, rt.slot, wait=True)
        residency.evict(rt)
    return rt
