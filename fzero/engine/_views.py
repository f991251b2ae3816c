"""Whole-model views of a sharded engine: the consolidated state dict, memory held
against the plan, and DeepSpeed's `GatheredParameters` (whole parameters for a block,
with edits written back to the shards). Functions of an engine's public attributes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from fzero import comm, partition
from fzero.core import init as functional
from fzero.core.layout import UnitRuntime
from fzero.core.publish import accept_edits
from fzero.core.residency import SwapFileUnits
from fzero.core.state import TrainState, UnitState
from fzero.partition import MemoryEstimate

__all__ = [
    "full_master",
    "gathered_parameters",
    "memory_held",
    "memory_planned",
    "state_dict",
    "train_state",
]

Engine = Any  # fzero.engine.Engine (this module sits below it)


@contextlib.contextmanager
def gathered_parameters(
    engine: Engine, params: Sequence[torch.nn.Parameter], modifier_rank: int | None = None
) -> Iterator[None]:
    """Full `params` inside the block (DeepSpeed's `GatheredParameters`); collective.

    With `modifier_rank`, that rank's edits are broadcast on exit and become the
    new weights (fp32 masters included; edits are made in the compute dtype).
    """
    if modifier_rank is not None and not 0 <= modifier_rank < engine.world_size:
        raise ValueError(
            f"modifier_rank is {modifier_rank}; allowed: None or 0..{engine.world_size - 1}"
        )
    wanted = {id(p) for p in params}
    units = [rt for rt in engine.units if any(id(p) in wanted for p, _, _ in rt.params)]
    managed = {id(p) for rt in units for p, _, _ in rt.params}
    others = [p for p in params if id(p) not in managed]  # frozen: whole everywhere
    gathered_here = [rt for rt in units if rt.full is None]
    for rt in units:
        engine.stage3.gather(rt)
    try:
        yield
    except BaseException:
        for rt in gathered_here:
            engine.stage3.release(rt)
        raise
    if modifier_rank is not None:
        with torch.no_grad():
            for rt in units:
                with engine.residency.resident(rt, write_back=True):
                    accept_edits(rt, engine.plan, engine.plan_rank, modifier_rank, engine.stage3)
            for p in others:
                if engine.world_size > 1:
                    comm.broadcast(p.data, modifier_rank, what="an edited parameter")
    for rt in gathered_here:
        engine.stage3.release(rt)


def full_master(engine: Engine, rt: UnitRuntime) -> Tensor:
    """The unit's whole fp32 master buffer, gathered on every rank (collective)."""
    return functional.full_master(train_state(engine), rt.index)


def state_dict(engine: Engine, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The consolidated model state dict, on rank 0 ({} elsewhere); collective: the fp32
    masters cast to `dtype` (default the compute dtype) under every name of a tied
    tensor, the frozen parameters and buffers from the module (`fzero.state_dict`)."""
    dtype = dtype or engine.compute_dtype
    return functional.state_dict(train_state(engine), module=engine.module, dtype=dtype)


def memory_held(engine: Engine) -> MemoryEstimate:
    """Bytes of every model-state tensor this rank holds now, by kind (no duplicates)."""
    seen: set[int] = set()

    def size(t: Tensor | None) -> int:
        if t is None or t.numel() == 0:
            return 0
        key = t.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return t.untyped_storage().nbytes()

    params = master = grads = state = 0
    for rt in engine.units:
        params += size(rt.full) + size(rt.param_shard)
        if rt.full is None and rt.param_shard is None:
            params += size(rt.master)  # fp32 stage 3: the master is the shard
        for p, _, _ in rt.params:
            params += size(p.data)
        master += size(rt.master)
        grads += size(rt.grad)
        state += sum(size(t) for t in rt.state if isinstance(t, Tensor))
    grads += engine.reduction.held_numel() * 4  # fp32 buckets of a reduction in flight
    return MemoryEstimate(
        params=params,
        master=master,
        grads=grads,
        optimizer_state=state,
        offload_optimizer=engine.offload,
    )


def memory_planned(engine: Engine) -> MemoryEstimate:
    """What the plan says this rank holds (`partition.memory_per_rank`)."""
    return partition.memory_per_rank(
        engine.plan,
        engine.plan_rank,
        param_dtype=partition.dtype_name(engine.compute_dtype),
        grad_dtype="float32",
        optimizer=engine.functional_optimizer,
        offload_optimizer=engine.offload,
        master_dtype=partition.dtype_name(engine.dtypes.master_dtype),
        # NVMe: the moments are in the swap file, not counted here
        state_dtype=partition.dtype_name(engine.dtypes.state_dtype),
        eval_live_parameters=engine.config.zero_optimization.stage3_eval_live_parameters,
    )


def train_state(engine: Engine) -> TrainState:
    """The engine's `TrainState` over its own buffers (no copy); NVMe-resident units are
    reached through its `SwappedUnits`."""
    units = tuple(
        UnitState(
            rt.master,
            rt.state,
            rt.full if engine.stage < 3 or rt.unit.persistent else rt.param_shard,
            rt.grad,
        )
        for rt in engine.units
    )
    counters = engine.counters
    residence = SwapFileUnits(engine.residency, engine.units) if engine.nvme is not None else None
    return TrainState(
        engine.plan, engine.plan_rank, units, counters, engine.loss_scale_state, residence=residence
    )
