"""The parts an engine runs, built once from explicit arguments (torchtitan's recipe
shape): `build_runtime(module, plan, config, optimizer, ...)` returns a frozen `Runtime`
whose parts are each made from what they need — the plan, the config's sections, the
precision, the parts before it — and nothing is wired in after construction. The
`Engine` holds a `Runtime`, its counters and DeepSpeed's surface.

The order is the order of dependence: the units' buffers (`fzero.core.build`, bound to
the module), each placed as it is built where stage 3's shards live (`ParamShardStore`),
the one stage-3 `Gatherer`, the optimizer's application (publishing to the store), the
gradient reduction (reading its owner's counters through the `Owner` protocol), the
module hooks that drive the gatherer, and the root's forward hooks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fzero import comm, partition
from fzero.config import Config
from fzero.core.apply import OptimizerApplication
from fzero.core.build import Holding
from fzero.core.gathering import Gatherer, GatherSettings
from fzero.core.groups import Groups, groups_of
from fzero.core.layout import UnitRuntime, bind, unbind
from fzero.core.param_shards import ParamShardStore, PublishedShards
from fzero.core.precision import Precision, gradient_wire_dtype, loss_scaler
from fzero.core.reduce import bucket_accumulators
from fzero.core.reduce_pieces import reduction_piece
from fzero.core.residency import Residency
from fzero.core.stage3 import ModuleGathering
from fzero.core.state import partition_numel
from fzero.engine._build import build_units, cast_module, whole_frozen
from fzero.engine._forward import ForwardHooks
from fzero.engine._reduction import GradientReduction, Owner
from fzero.engine._step import Hyperparams
from fzero.engine.telemetry import Timers
from fzero.optim import DynamicLossScale, Optimizer, StaticLossScale
from fzero.optim._schedules import Schedule
from fzero.partition import Plan

__all__ = ["Runtime", "build_runtime"]


@dataclass(frozen=True)
class Runtime:
    """An engine's parts (see the module docstring). `groups.rank` is this process's rank
    in the plan; `units` each unit's buffers on it."""

    plan: Plan
    groups: Groups
    precision: Precision
    device: torch.device
    optimizer: Optimizer
    schedule: Schedule | None
    loss_scaler: DynamicLossScale | StaticLossScale | None
    residency: Residency
    hyperparams: Hyperparams
    units: list[UnitRuntime]
    gatherer: Gatherer
    param_shards: PublishedShards
    application: OptimizerApplication
    reduction: GradientReduction
    stage3: ModuleGathering | None
    forward_hooks: ForwardHooks
    timers: Timers
    hooks: list[Any]  # handles of every hook the parts registered on the module

    @property
    def rank(self) -> int:
        """This process's rank in the plan (a mesh's shard group)."""
        return self.groups.rank

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision.compute_dtype


def build_runtime(
    module: torch.nn.Module,
    plan: Plan,
    config: Config,
    optimizer: Optimizer,
    *,
    precision: Precision,
    schedule: Schedule | None,
    param_groups: list[dict[str, Any]],
    trainable: bool,
    client_optimizer: torch.optim.Optimizer | None,
    param_init_fn: Callable[[torch.nn.Module], None] | None,
    owner: Owner,
) -> Runtime:
    """The parts that run `plan` for `module` on this rank (collective: every rank starts
    from rank 0's weights). `precision`: the one the plan runs at (`run_plan`'s);
    `owner`: what the reduction reads of the engine's counters. Where the states live is
    the plan's (`Plan.memory`); the config says where files go and how they are read."""
    zero = config.zero_optimization
    groups, device = groups_of(plan), comm.backend_device()
    rank, compute_dtype, timers = groups.rank, precision.compute_dtype, Timers()
    residency = Residency(
        config,
        plan,
        rank=rank,
        optimizer=optimizer,
        partition_numel=lambda unit: partition_numel(plan, unit, rank),
    )
    whole_frozen(module, plan)
    cast_module(module, plan, compute_dtype)
    hyperparams = Hyperparams(
        optimizer, param_groups, trainable=trainable, client_optimizer=client_optimizer
    )
    buckets = partition.reduction_buckets(plan, int(zero.reduce_bucket_size))
    piece = reduction_piece(plan, int(zero.reduce_bucket_size))
    residency.use_grad_pieces(piece)
    accumulators = None  # units at stages 0-1: one buffer per bucket (one all-reduce each)
    if plan.runs_stage(lambda s: s < 2):
        accumulators = bucket_accumulators(plan, buckets, device)
    holding = Holding(
        compute_dtype=compute_dtype,
        master_dtype=precision.master_dtype,
        state_dtype=precision.state_dtype,  # NVMe units: fp32 in memory (`held_by`)
        device=device,
        grad_dtype=precision.grad_dtype,
        offload=residency.offload,
        pin_memory=residency.pin,
        shards_offloaded=plan.memory.params != "device",  # per unit: `held_by`
    )
    # each unit is built and its shard placed (NVMe: written) before the next is built:
    # the rank's share of the parameters is never in memory at once
    built = build_units(
        module,
        plan,
        rank=rank,
        holding=holding,
        residency=residency,
        optimizer=optimizer,
        group_hparams=hyperparams.group_hparams,
        param_init_fn=param_init_fn,
        accumulators=accumulators,
    )
    store = ParamShardStore(
        built,
        plan,
        rank=rank,
        process_rank=torch.distributed.get_rank(),
        dtype=compute_dtype,
        offload=zero.offload_param,
        aio=config.aio,
        pin_memory=residency.pin,
    )
    units = store.units
    gatherer = Gatherer(
        plan,
        store,
        dtype=compute_dtype,
        device=device,
        settings=GatherSettings(
            max_live=int(zero.stage3_max_live_parameters),
            prefetch_numel=int(zero.stage3_prefetch_bucket_size),
            max_reuse=int(zero.stage3_max_reuse_distance),
            eval_live=int(zero.stage3_eval_live_parameters),
            quantized=zero.zero_quantized_weights,
        ),
        timer=timers,
        bind=lambda i, full: bind(units[i], full),
        unbind=lambda i: unbind(units[i], compute_dtype, device),
    )
    param_shards = PublishedShards(store, gatherer)
    application = OptimizerApplication(
        plan,
        rank,
        optimizer=optimizer,
        schedule=schedule,
        residency=residency,
        compute_dtype=compute_dtype,
        device=device,
        param_shards=param_shards,
        timer=timers,
    )
    overlap = zero.overlap_comm if zero.overlap_comm is not None else plan.stage == 3
    reduction = GradientReduction(
        owner,
        plan,
        rank,
        units,
        buckets,
        device=device,
        compute_dtype=compute_dtype,
        gatherer=gatherer,
        residency=residency,
        timers=timers,
        overlap=overlap,
        quantized=zero.zero_quantized_gradients,
        bits=zero.zero_quantized_gradients_bits,
        wire_dtype=gradient_wire_dtype(config),
        piece=piece,
    )
    stage3 = None
    if plan.stage == 3:
        stage3 = ModuleGathering(
            gatherer, units, module, on_backward_use=reduction.note_backward_use
        )
    forward_hooks = ForwardHooks(
        compute_dtype=compute_dtype,
        device=device,
        autocast=config.torch_autocast.enabled,
        gatherer=gatherer,
        stage3=stage3,
    )
    hooks = [
        p.register_post_accumulate_grad_hook(_weakly(reduction.on_grad))
        for rt in units
        for p, _, _ in rt.params
    ]
    hooks += forward_hooks.install(module)
    hooks += stage3.hooks if stage3 is not None else []
    return Runtime(
        plan=plan,
        groups=groups,
        precision=precision,
        device=device,
        optimizer=optimizer,
        schedule=schedule,
        loss_scaler=loss_scaler(config) if precision.compute == "fp16" else None,
        residency=residency,
        hyperparams=hyperparams,
        units=units,
        gatherer=gatherer,
        param_shards=param_shards,
        application=application,
        reduction=reduction,
        stage3=stage3,
        forward_hooks=forward_hooks,
        timers=timers,
        hooks=hooks,
    )


def _weakly(method: Callable[[torch.nn.Parameter], None]) -> Callable[[torch.nn.Parameter], None]:
    """`method` as a parameter hook that does not keep its object alive: torch holds a
    parameter's post-accumulate hooks from C++, where Python's collector cannot see the
    cycle (parameter → hook → engine → module → parameter), so a strong hook would keep
    every engine, its buffers and its swap files until the process ends."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return hook
