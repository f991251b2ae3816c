"""Publishing: writing updated fp32 masters back to the compute-dtype parameters every
rank computes with — this rank's part, then an all-gather of the whole unit buffer at
stages 1-3 (overlapping whatever runs before `finish_publish`), or the stage-3 shard to
where shards live between uses (with an optimizer split finer than the gradients, first
gathered from the optimizer shards within it: `Plan.optimizer_extra_size`). The one
implementation the engine's step, `train_step` and checkpoint restores
(`fzero.checkpoint.restore`) all use, over `UnitRuntime` records (`runtime_of` makes one
for a `TrainState`'s unit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from fzero import comm
from fzero.core.groups import gather_optimizer_shards, gather_to_grads_shard, groups_of
from fzero.core.layout import UnitRuntime, bind, scatter_pieces
from fzero.core.state import TrainState, UnitState, optimizer_partition
from fzero.partition import Plan, Unit

__all__ = [
    "InMemoryShards",
    "ParamShards",
    "Publisher",
    "accept_edits",
    "attach_params",
    "install",
    "install_unit",
    "rolled_back",
    "runtime_of",
    "views",
]

Timer = Callable[[str], contextlib.AbstractContextManager[None]]


class ParamShards(Protocol):
    """Where stage 3's compute-dtype parameter shards live between uses (the engine's
    `fzero.core.param_shards.PublishedShards`: the device, the host or a swap file;
    `InMemoryShards` otherwise)."""

    def store_param_shard(self, rt: UnitRuntime, value: Tensor, wait: bool = True) -> None: ...

    def finish_param_writes(self) -> str: ...


class InMemoryShards:
    """Stage-3 parameter shards held in memory: a store is a copy into the shard."""

    def store_param_shard(self, rt: UnitRuntime, value: Tensor, wait: bool = True) -> None:
        if rt.param_shard is not None and value is not rt.param_shard:
            rt.param_shard.copy_(value)

    def finish_param_writes(self) -> str:
        return ""


@contextlib.contextmanager
def untimed(_name: str) -> Iterator[None]:
    """A `Timer` that times nothing."""
    yield


class Publisher:
    """New masters into the parameters, unit by unit (`publish`), completed by
    `finish_publish`."""

    def __init__(
        self,
        plan: Plan,
        rank: int,
        *,
        compute_dtype: torch.dtype,
        device: torch.device,
        param_shards: ParamShards | None = None,
        swapped: Container[int] = (),
        timer: Timer = untimed,
    ) -> None:
        """`swapped`: the units whose masters sit in reused NVMe swap buffers (the
        all-gather's input is copied out of them)."""
        self.plan, self.rank, self.stage, self.world_size = plan, rank, plan.stage, plan.world_size
        self.groups = groups_of(plan)
        self.compute_dtype, self.device, self.swapped = compute_dtype, device, swapped
        self.param_shards = param_shards or InMemoryShards()
        self.timer = timer
        self.publishing: list[tuple[Any, UnitRuntime, Tensor | None]] = []

    def partition(self, unit: Unit) -> slice:
        return optimizer_partition(self.plan, unit, self.rank)

    def publish(
        self, rt: UnitRuntime, written: Tensor | None = None, exchange: bool = True
    ) -> None:
        """Start writing the unit's updated fp32 master back to the compute-dtype
        parameters everyone uses; the all-gather overlaps the next units' updates.
        `written`: the compute-dtype copy a native update already made. Without
        `exchange` only this rank's part is written (`exchange` sends it later)."""
        stage = self.plan.stage_of(rt.unit)
        if rt.full is None or stage == 3:
            if rt.param_shard is not None and written is not rt.param_shard:
                value = written if written is not None else rt.master
                # NVMe: a master in a reused swap buffer is copied (in the compute dtype
                # already, an fp32 master was written from the buffer itself, which the
                # next unit read into while the write was in flight)
                reused = rt.index in self.swapped and written is None
                value = value.to(self.compute_dtype, copy=reused)
                if self.plan.optimizer_finer(rt.unit):  # optimizer shards of the param shard
                    value = value.to(self.device)
                    value = gather_to_grads_shard(value, self.plan, self.groups, what=_updated(rt))
                self.param_shards.store_param_shard(rt, value, wait=False)
            return
        if stage == 0 or self.world_size == 1 or not exchange:
            target = rt.full[self.partition(rt.unit)]
            if target.data_ptr() != rt.master.data_ptr() and written is not target:
                target.copy_(written if written is not None else rt.master)
            if exchange:
                self.publishing.append((None, rt, None))
            return
        shard = written if written is not None else rt.master.to(self.compute_dtype)
        # offload: the updated parameters move back (NVMe: out of a reused swap buffer)
        shard = shard.to(self.device, copy=rt.index in self.swapped and written is None)
        work = gather_optimizer_shards(
            rt.full, shard, self.plan, rt.index, self.groups, what=_updated(rt)
        )
        self.publishing.append((work, rt, shard))

    def exchange(self, rt: UnitRuntime) -> None:
        """All-gather the parts `publish(..., exchange=False)` wrote on every rank."""
        stage = self.plan.stage_of(rt.unit)
        if rt.full is None or stage == 3:
            return
        if stage == 0:  # every rank updated the whole unit: nothing to exchange
            self.publishing.append((None, rt, None))
            return
        if self.world_size == 1:
            self.publishing.append((None, rt, None))
            return
        shard = rt.full[self.partition(rt.unit)].clone()
        work = gather_optimizer_shards(
            rt.full, shard, self.plan, rt.index, self.groups, what=_updated(rt)
        )
        self.publishing.append((work, rt, shard))

    def finish_publish(self) -> None:
        failure = self.param_shards.finish_param_writes()
        if failure:
            raise OSError(f"NVMe offload: writing the new parameters failed ({failure})")
        with self.timer("comm"):
            for work, rt, _shard in self.publishing:
                if work is not None:
                    work.wait()
                if any(len(pl.pieces) > 1 for _, pl, _ in rt.params):
                    bind(rt)  # copies, not views: refresh them
        self.publishing.clear()


def runtime_of(plan: Plan, index: int, unit: UnitState, hparams: Any = None) -> UnitRuntime:
    """A runtime record over a `TrainState` unit's buffers (what the update and
    `Publisher` run over)."""
    rt = UnitRuntime(index, plan.units[index], [], unit.master, unit.optim, unit.grad)
    rt.hparams = hparams
    attach_params(plan, rt, unit)
    return rt


def views(rt: UnitRuntime, unit: UnitState) -> bool:
    """Whether runtime record `rt` is over `unit`'s buffers (the same tensors): a record
    `runtime_of` made for an earlier state of the same buffers serves this one."""
    params = rt.full if rt.full is not None else rt.param_shard
    return (
        rt.master is unit.master
        and rt.state is unit.optim
        and rt.grad is unit.grad
        and params is unit.params
    )


def attach_params(plan: Plan, rt: UnitRuntime, unit: UnitState) -> None:
    """The unit's compute-dtype parameters as publishing writes them: the whole buffer
    (`full`), or stage 3's shard (`param_shard`; None where the master serves)."""
    if plan.stage_of(rt.unit) == 3:
        rt.full, rt.param_shard = None, unit.params
    else:
        rt.full, rt.param_shard = unit.params, None


def install(units: Sequence[UnitRuntime], like: TrainState, state: TrainState) -> None:
    """Make a restored `state` the units' (`like` is the state the restore read into):
    masters copied into buffers the parameters view, else taken; optimizer states taken;
    loaded gradients copied (NVMe: the next slots, already written, become current).
    The parameters are published after (`Publisher`)."""
    if like.residence is not None:
        like.residence.commit()
    with torch.no_grad():
        for rt, old, unit in zip(units, like.units, state.units):
            if unit.grad is not old.grad and rt.grad.numel():
                rt.grad.copy_(unit.grad)
            if like.residence is not None and like.residence.holds(rt.index):
                continue
            if rt.master._base is None:
                rt.master = unit.master
            elif unit.master is not rt.master:  # else read in place already
                rt.master.copy_(unit.master)  # a view of the parameters' buffer
            rt.state = unit.optim


def install_unit(rt: UnitRuntime, saved: Mapping[str, Any]) -> None:
    """Copy a unit's saved master and optimizer tensors (by field name, `master` for the
    master) into its buffers, and its optimizer step count; each must have the shape of
    the buffer it replaces. The parameters are published after (`Publisher`)."""
    current = {"master": rt.master, **_tensor_fields(rt.state)}
    for name, tensor in current.items():
        value = saved.get(name)
        if not isinstance(value, Tensor) or value.shape != tensor.shape:
            found = (
                f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
            )
            raise ValueError(
                f"optimizer state_dict unit {rt.index} {name!r}: expected a tensor "
                f"of shape {tuple(tensor.shape)}, found {found}"
            )
    with torch.no_grad():
        for name, tensor in current.items():
            tensor.copy_(saved[name])
    rt.state = rt.state._replace(step=int(saved["step"]))


def _tensor_fields(state: Any) -> dict[str, Tensor]:
    return {k: v for k, v in state._asdict().items() if isinstance(v, Tensor)}


@contextlib.contextmanager
def rolled_back(units: Sequence[UnitRuntime]) -> Iterator[None]:
    """Inside: the units' optimizer states and NVMe gradient flags are put back as they
    were if the block raises (a restore that failed before `install`)."""
    before = [(rt.state, rt.grad_on_disk) for rt in units]
    try:
        yield
    except BaseException:
        for rt, (state, grad_on_disk) in zip(units, before):
            rt.state, rt.grad_on_disk = state, grad_on_disk
        raise


def accept_edits(
    rt: UnitRuntime, full: Tensor, plan: Plan, rank: int, source: int, param_shards: ParamShards
) -> None:
    """A gathered unit's parameters (its whole buffer `full`) as rank `source` edited them
    become its weights on every rank: broadcast, then written to the master and the
    stage-3 shard (DeepSpeed's `GatheredParameters(modifier_rank=...)`). Collective."""
    for p, placement, _ in rt.params:  # parameters that are copies write back
        scatter_pieces(full, p.detach().reshape(-1), placement)
    if plan.processes > 1:  # `source` is a process's rank
        comm.broadcast_from(
            full, source, what=f"edited parameters of unit {rt.index} {rt.unit.name!r}"
        )
    part = full[optimizer_partition(plan, rt.unit, rank)]
    if rt.master.data_ptr() != part.data_ptr():
        rt.master.copy_(part)
    bind(rt, full)
    if rt.param_shard is not None:  # stage 3: the shard takes the edit (a gathered copy
        start, stop = plan.grads_range(rt.unit, rank)  # of it is released: stale from now on)
        param_shards.store_param_shard(rt, full[start:stop])


def _updated(rt: UnitRuntime) -> str:
    return f"updated parameters of unit {rt.index} {rt.unit.name!r}"
