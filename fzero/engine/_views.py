"""Whole-model views of an engine's runtime (`fzero.engine._runtime.Runtime`): its
`TrainState`, the consolidated state dict, memory held against the plan, and DeepSpeed's
`GatheredParameters` (whole parameters for a block, with edits written back to the
shards)."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from fzero import comm, partition
from fzero.config import Config
from fzero.core import init as functional
from fzero.core.layout import UnitRuntime
from fzero.core.precision import gradient_wire_dtype
from fzero.core.publish import accept_edits
from fzero.core.reduce_bucket import scatter_by_all_reduce
from fzero.core.state import Counters, TrainState, UnitState
from fzero.core.swap_units import SwapFileUnits
from fzero.engine._runtime import Runtime
from fzero.engine.zero3_attributes import AliasAnswers
from fzero.optim import DynamicLossScale, LossScaleState, StaticLossScale, TensorNorms, WholeTensors
from fzero.partition import MemoryEstimate

__all__ = [
    "comm_volume",
    "full_master",
    "gathered_parameters",
    "mark_engine",
    "memory_held",
    "memory_planned",
    "state_dict",
    "train_state",
]


@contextlib.contextmanager
def gathered_parameters(
    runtime: Runtime, params: Sequence[torch.nn.Parameter], modifier_rank: int | None = None
) -> Iterator[None]:
    """Full `params` inside the block (DeepSpeed's `GatheredParameters`); collective.

    With `modifier_rank`, that rank's edits are broadcast on exit and become the
    new weights (fp32 masters included; edits are made in the compute dtype).
    """
    processes = runtime.plan.processes
    if modifier_rank is not None and not 0 <= modifier_rank < processes:
        raise ValueError(f"modifier_rank is {modifier_rank}; allowed: None or 0..{processes - 1}")
    wanted = {id(p) for p in params}
    units = [rt for rt in runtime.units if any(id(p) in wanted for p, _, _ in rt.params)]
    managed = {id(p) for rt in units for p, _, _ in rt.params}
    others = [p for p in params if id(p) not in managed]  # frozen: whole everywhere
    gatherer = runtime.gatherer
    sharded = [rt for rt in units if rt.full is None]  # stage 3: gathered for the block
    gathered_here = [rt for rt in sharded if gatherer.units[rt.index].full is None]
    for rt in sharded:
        gatherer.gather(rt.index)
    try:
        yield
    except BaseException:
        for rt in gathered_here:
            gatherer.release(rt.index)
        raise
    if modifier_rank is not None:
        with torch.no_grad():
            for rt in units:
                full = rt.full if rt.full is not None else gatherer.units[rt.index].full
                assert full is not None
                with runtime.residency.resident(rt, write_back=True):
                    accept_edits(
                        rt, full, runtime.plan, runtime.rank, modifier_rank, runtime.param_shards
                    )
            for p in others:
                if processes > 1:
                    comm.broadcast_from(p.data, modifier_rank, what="an edited parameter")
    for rt in gathered_here:
        gatherer.release(rt.index)


def full_master(runtime: Runtime, rt: UnitRuntime) -> Tensor:
    """The unit's whole fp32 master buffer, gathered on every rank (collective)."""
    return functional.full_master(train_state(runtime, Counters(), None), rt.index)


def state_dict(
    runtime: Runtime, module: torch.nn.Module, counters: Counters, dtype: torch.dtype | None
) -> dict[str, Tensor]:
    """The consolidated model state dict, on rank 0 ({} elsewhere); collective: the fp32
    masters cast to `dtype` (default the compute dtype) under every name of a tied
    tensor, the frozen parameters and buffers from the module (`fzero.state_dict`)."""
    state = train_state(runtime, counters, None)
    return functional.state_dict(state, module=module, dtype=dtype or runtime.compute_dtype)


def memory_held(runtime: Runtime) -> MemoryEstimate:
    """Bytes of every model-state tensor this rank holds now, by kind (no duplicates),
    with those in host memory off the device (`host`) and in swap files (`nvme`: one
    copy of each unit's states the files keep, by their dtypes)."""
    seen: set[int] = set()

    def size(t: Tensor | None) -> int:
        if t is None or t.numel() == 0:
            return 0
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return t.untyped_storage().nbytes()

    residency, store, plan = runtime.residency, runtime.param_shards.store, runtime.plan
    params = master = grads = state = host = nvme = 0
    for rt in runtime.units:
        shard = size(rt.param_shard)
        if store.on_disk(rt.index):
            shard = plan.grads_size(rt.unit, runtime.rank) * runtime.compute_dtype.itemsize
            nvme += shard
        elif plan.params_memory(rt.index) == "host":
            host += shard
        params += size(rt.full) + shard + size(runtime.gatherer.units[rt.index].full)
        if rt.full is None and rt.param_shard is None:
            params += size(rt.master)  # fp32 stage 3: the master is the shard
        for p, _, _ in rt.params:
            params += size(p.data)
        if residency.holds(rt.index):  # in the file: what memory holds is a buffer
            numel = residency.partition_numel(rt.unit)
            unit_master = numel * residency.kind_bytes(0)
            unit_state = sum(
                numel * residency.kind_bytes(k) for k in range(1, len(residency.kinds))
            )
            nvme += unit_master + unit_state
        else:
            unit_master = size(rt.master)
            unit_state = sum(size(t) for t in rt.state if isinstance(t, Tensor))
            host += unit_master + unit_state if residency.offloaded[rt.index] else 0
        master, state = master + unit_master, state + unit_state
        if residency.grad_on_disk(rt.index):
            unit_grad = plan.grads_size(rt.unit, runtime.rank) * residency.grad_dtype.itemsize
            nvme += unit_grad
        else:
            unit_grad = size(rt.grad)
        grads += unit_grad
    grads += runtime.reduction.held_bytes()  # bucket buffers of a reduction in flight
    return MemoryEstimate(
        params=params,
        master=master,
        grads=grads,
        optimizer_state=state,
        offload_optimizer=residency.offload,
        offloaded=host,
        nvme=nvme,
    )


def memory_planned(runtime: Runtime, eval_live_parameters: int = 0) -> MemoryEstimate:
    """What the plan says this rank holds between steps (`partition.memory_per_rank`);
    with the units stage 3 keeps gathered for generation (`stage3_eval_live_parameters`).
    hpZ's secondary copy lives from a unit's forward to its backward only: it is
    `memory_per_rank`'s `params_secondary` (the step's peak), not counted here."""
    precision = runtime.precision
    on_mesh = runtime.plan.mesh is not None  # its rank is then a process's
    planned = partition.memory_per_rank(
        runtime.plan,
        comm.get_rank() if on_mesh else runtime.rank,
        param_dtype=partition.dtype_name(precision.compute_dtype),
        grad_dtype="plan",  # each unit in its own (`Plan.grads_dtype`)
        optimizer=runtime.optimizer,  # off the device: unit by unit, as the plan says
        master_dtype=None,  # the plan's, unit by unit (`Plan.master_dtype`)
        state_dtype=None,  # and `Plan.states_dtype`
        eval_live_parameters=eval_live_parameters,
        swap_gradients=runtime.residency.swap_gradients,
    )
    return dataclasses.replace(planned, params_secondary=0)


def train_state(
    runtime: Runtime, counters: Counters, loss_scale: LossScaleState | None
) -> TrainState:
    """The runtime's `TrainState` over its own buffers (no copy); NVMe-resident units are
    reached through its `SwappedUnits`."""
    plan = runtime.plan
    units = tuple(
        UnitState(
            rt.master,
            rt.state,
            rt.full if plan.stage_of(rt.unit) < 3 else rt.param_shard,
            rt.grad,
        )
        for rt in runtime.units
    )
    residency = runtime.residency
    residence = SwapFileUnits(residency, runtime.units) if residency.swapped else None
    return TrainState(runtime.plan, runtime.rank, units, counters, loss_scale, residence=residence)


def mark_engine(runtime: Runtime, engine: object) -> list[Any]:
    """Each managed parameter names its engine (a weak reference), which
    `fzero.gathered_parameters(params)` finds it by, and at stage 3 re-created tensors
    answer `ds_*` attributes as their parameter (`zero3_attributes`' Note); returns
    handles whose `remove()` undoes both (the engine's `destroy`)."""
    params = [p for rt in runtime.units for p, _, _ in rt.params]
    for p in params:
        p._fzero_engine = weakref.ref(engine)
    handles: list[Any] = [_Unmark(params)]
    if runtime.stage3 is not None:
        handles.append(AliasAnswers(engine))
    return handles


class _Unmark:
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params

    def remove(self) -> None:
        for p in self.params:
            p.__dict__.pop("_fzero_engine", None)


def comm_volume(
    runtime: Runtime,
    config: Config,
    accumulation: int,
    loss_scaler: DynamicLossScale | StaticLossScale | None,
) -> list[partition.Collective]:
    """`fzero.partition.comm_volume` of the runtime's plan and the config's settings: the
    collectives one optimizer step issues (stage 3: with the units its last backward
    gathered again, from its recorded use order)."""
    zero = config.zero_optimization
    return partition.comm_volume(
        runtime.plan,
        accumulation_steps=accumulation,
        param_dtype=partition.dtype_name(runtime.compute_dtype),
        bucket_numel=int(zero.reduce_bucket_size),
        scatter_as_all_reduce=scatter_by_all_reduce(),
        regathered=runtime.gatherer.regathered,
        loss_scaling=loss_scaler is not None and loss_scaler.dynamic,
        tensor_norms=isinstance(runtime.optimizer.needs, TensorNorms),
        quantized_weights=zero.zero_quantized_weights,
        quantized_gradients=zero.zero_quantized_gradients,
        quantized_gradient_bits=zero.zero_quantized_gradients_bits,
        grad_wire_dtype=partition.dtype_name(gradient_wire_dtype(config)),
        whole_tensors=_taken_whole(runtime),
    )


def _taken_whole(runtime: Runtime) -> set[str]:
    """The tensors the optimizer updates whole (`WholeTensors.takes`, at each unit's
    param group's hyper-parameters): none for an optimizer without that need."""
    needs, manifest = runtime.optimizer.needs, runtime.plan.manifest
    if not isinstance(needs, WholeTensors):
        return set()
    return {
        pl.fqn
        for rt in runtime.units
        for pl in rt.unit.placements
        if needs.takes(pl.fqn, tuple(manifest[pl.fqn].shape), rt.hparams)
    }
