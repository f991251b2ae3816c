"""Building a unit's buffers on this rank: the one builder `fzero.init` and the engine
use (the engine then binds the module's parameters to them).

A unit's values come from the model's tensors (`values_on_rank`): whole tensors as
rank 0 holds them (one broadcast per unit), and parameters partitioned at construction
(`fzero.core.partitioned`) gathered one at a time, assembling only the part this rank
keeps where that is all it needs (stage 3's shards): nothing larger than a unit and its
largest tensor exists while a model is adopted, one unit after another.

From the unit's values (its flat fp32 buffer, the same on every rank) a rank keeps:

- stages 0-2 and stage-3 persistent units: the whole buffer in the compute dtype
  (`params`), and its optimizer partition as the master — a view of `params` where
  the master is the compute dtype and held on the compute device, else a copy;
- stage 3: its shard as the master, and its parameter shard in the compute dtype
  (`params`), except where the master itself serves (the master in the compute dtype,
  on the compute device, parameter shards not offloaded, and the optimizer split as
  the parameters, `Plan.optimizer_finer` false: held once);
- a zeroed gradient accumulator in `Holding.grad_dtype` (the whole buffer at stages 0-1
  — a view of the reduction's bucket when given —, the gradient shard at stages 2-3);
- the optimizer's initial state over the master, in `state_dtype`.

With the optimizer split finer than the gradients (`Plan.optimizer_finer`: the unit's
optimizer shard a part of its gradient shard), a parameter and gradient shard is
`Plan.grads_range`, the master and optimizer state the shard within it.

`Holding` says where and in which dtypes (the precision and the offload settings).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from fzero import comm
from fzero.core import nvme as _nvme
from fzero.core.layout import scatter_pieces
from fzero.core.partitioned import gather_whole, is_partitioned
from fzero.core.precision import init_state
from fzero.core.state import UnitState, optimizer_partition
from fzero.optim import Optimizer
from fzero.partition import Plan, Unit

__all__ = ["Holding", "build_unit_state", "unit_values", "values_on_rank"]


class Holding(NamedTuple):
    """Where a rank holds its units and in which dtypes: `compute_dtype` on `device`;
    masters (`master_dtype`) and optimizer state (`state_dtype`, in memory) on `host`
    (the compute device, or the CPU with optimizer offload: `offload`, pinned with
    `pin_memory`); `shards_offloaded`: stage 3's parameter shards live off the compute
    device (`offload_param` cpu or nvme); `to_file`: the master goes to a swap file once
    built (NVMe), so it is made 4 KiB-aligned and written from where it is (O_DIRECT),
    not from an aligned copy; `in_pieces`: it goes there in pieces (`sub_group_size`:
    `Residency.write_in_pieces`), so the master is a view of the values it is built from
    and the optimizer state is made piece by piece as it is written (empty here);
    `grad_dtype`: the gradient accumulator's (`Plan.grads_dtype`)."""

    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    state_dtype: torch.dtype
    device: torch.device
    offload: bool = False
    pin_memory: bool = False
    shards_offloaded: bool = False
    to_file: bool = False
    grad_dtype: torch.dtype = torch.float32
    in_pieces: bool = False

    @property
    def host(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.device

    @property
    def master_serves(self) -> bool:
        """Whether the master is held once, as the compute-dtype parameters."""
        return (
            self.compute_dtype == self.master_dtype
            and not self.offload
            and not self.shards_offloaded
        )


def unit_values(unit: Unit, tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """The unit's flat fp32 buffer on `device`, from its tensors in placement order
    (padding zero)."""
    flat = torch.zeros(unit.numel, dtype=torch.float32, device=device)
    with torch.no_grad():
        for tensor, placement in zip(tensors, unit.placements):
            scatter_pieces(flat, tensor.detach().reshape(-1).float().to(device), placement)
    return flat


def values_on_rank(
    plan: Plan, index: int, tensors: Sequence[Tensor], *, rank: int, device: torch.device
) -> tuple[Tensor, int]:
    """What plan rank `rank` needs of unit `index`'s fp32 values, from its `tensors` in
    placement order, and the element it starts at: the whole buffer, or at stage 3 (not
    persistent) the rank's shard only. Collective: whole tensors are rank 0's (one
    broadcast), partitioned ones are gathered one at a time."""
    unit = plan.units[index]
    if not any(is_partitioned(t) for t in tensors):
        values = unit_values(unit, tensors, device)
        if plan.processes > 1:  # every rank starts from rank 0's weights
            comm.broadcast_from(values, src=0, what=f"rank 0's values of unit {unit.name}")
        return values, 0
    start, stop = 0, unit.numel
    if plan.stage_of(unit) == 3 and not (plan.mesh is not None and plan.mesh.permuted):
        start, stop = plan.grads_range(unit, rank)  # (permuted: the master lies outside)
    flat = torch.zeros(stop - start, dtype=torch.float32, device=device)
    with torch.no_grad():
        for tensor, placement in zip(tensors, unit.placements):
            if is_partitioned(tensor):
                whole = gather_whole(tensor, what=placement.fqn).reshape(-1)
            else:
                whole = tensor.detach().reshape(-1).to(device, copy=True)
                if plan.processes > 1:
                    comm.broadcast_from(whole, src=0, what=f"rank 0's values of {placement.fqn}")
            for pc in placement.pieces:
                low, high = max(pc.offset, start), min(pc.offset + pc.numel, stop)
                if low < high:
                    at = pc.start + low - pc.offset
                    flat[low - start : high - start].copy_(whole[at : at + high - low])
            del whole
    return flat, start


def _to_host(tensor: Tensor, dtype: torch.dtype, holding: Holding) -> Tensor:
    """A new copy in `dtype` where the optimizer runs (pinned on the host when asked;
    4 KiB-aligned for a swap file)."""
    if holding.to_file:
        return _nvme.aligned_empty(tensor.numel(), dtype).view(tensor.shape).copy_(tensor)
    if not holding.offload:
        return tensor.to(holding.device, dtype, copy=True)
    copy = torch.empty(tensor.shape, dtype=dtype, pin_memory=holding.pin_memory)
    return copy.copy_(tensor)


def build_unit_state(
    plan: Plan,
    index: int,
    values: Tensor,
    *,
    rank: int,
    holding: Holding,
    optimizer: Optimizer,
    grad: Tensor | None = None,
    values_from: int = 0,
) -> UnitState:
    """Unit `index`'s buffers on plan rank `rank` from its flat fp32 `values` (see the
    module docstring), which hold the buffer from element `values_from` (0: whole; a
    stage-3 shard needs only its own part). `grad`: the gradient accumulator to use (a
    bucket's view at stages 0-1, an empty one when it lives in a swap file), else a new
    zeroed one."""
    unit = plan.units[index]
    part = optimizer_partition(plan, unit, rank)
    compute, whole = holding.compute_dtype, plan.stage_of(unit) < 3
    serves = holding.master_serves and (whole or not plan.optimizer_finer(unit))
    held = slice(*plan.grads_range(unit, rank))  # stage 3's parameter shard
    if values_from or values.numel() != unit.numel:
        if whole or not values_from <= part.start <= part.stop <= values_from + values.numel():
            raise ValueError(
                f"unit {unit.name}: values from element {values_from} ({values.numel()} "
                f"elements) do not hold rank {rank}'s part [{part.start}, {part.stop})"
                + (" (the whole buffer is needed)" if whole else "")
            )
        part = slice(part.start - values_from, part.stop - values_from)
    if whole:
        params = values if compute == torch.float32 else values.to(compute)
        master = params[part] if serves else _master_of(values[part], holding)
    else:
        master = _master_of(values[part], holding)
        if values_from:
            held = slice(held.start - values_from, held.stop - values_from)
        params = None if serves else values[held].to(compute, copy=True)
    if grad is None:
        numel = plan.grads_size(unit, rank)
        grad = torch.zeros(numel, dtype=holding.grad_dtype, device=holding.device)
    state = init_state(optimizer, master[:0] if holding.in_pieces else master, holding.state_dtype)
    return UnitState(master, state, params, grad)


def _master_of(values: Tensor, holding: Holding) -> Tensor:
    """The master from its part of the values: a copy where the optimizer runs, or the
    values themselves when they go to the swap file piece by piece."""
    if holding.in_pieces:
        return values
    return _to_host(values, holding.master_dtype, holding)
