"""Building a unit's buffers on this rank: the one builder `fzero.init` and the engine
use (the engine then binds the module's parameters to them).

From the unit's values (its flat fp32 buffer, the same on every rank) a rank keeps:

- stages 0-2 and stage-3 persistent units: the whole buffer in the compute dtype
  (`params`), and its optimizer partition as the master — a view of `params` where
  the master is the compute dtype and held on the compute device, else a copy;
- stage 3: its shard as the master, and its shard in the compute dtype (`params`),
  except where the master itself serves (fp32 compute, master on the compute device,
  parameter shards not offloaded: held once);
- a zeroed fp32 gradient accumulator (the whole buffer at stages 0-1 — a view of the
  reduction's bucket when given —, the shard at stages 2-3);
- the optimizer's initial state over the master, in `state_dtype`.

`Holding` says where and in which dtypes (the precision and the offload settings).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from fzero.core.layout import scatter_pieces
from fzero.core.precision import init_state
from fzero.core.state import UnitState, optimizer_partition
from fzero.optim import Optimizer
from fzero.partition import Plan, Unit

__all__ = ["Holding", "build_unit_state", "unit_values"]


class Holding(NamedTuple):
    """Where a rank holds its units and in which dtypes: `compute_dtype` on `device`;
    masters (`master_dtype`) and optimizer state (`state_dtype`, in memory) on `host`
    (the compute device, or the CPU with optimizer offload: `offload`, pinned with
    `pin_memory`); `shards_offloaded`: stage 3's parameter shards live off the compute
    device (`offload_param` cpu or nvme)."""

    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    state_dtype: torch.dtype
    device: torch.device
    offload: bool = False
    pin_memory: bool = False
    shards_offloaded: bool = False

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


def _to_host(tensor: Tensor, dtype: torch.dtype, holding: Holding) -> Tensor:
    """A new copy in `dtype` where the optimizer runs (pinned on the host when asked)."""
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
) -> UnitState:
    """Unit `index`'s buffers on plan rank `rank` from its flat fp32 `values` (see the
    module docstring). `grad`: the gradient accumulator to use (a bucket's view at stages
    0-1, an empty one when it lives in a swap file), else a new zeroed one."""
    unit = plan.units[index]
    part = optimizer_partition(plan, unit, rank)
    compute, serves = holding.compute_dtype, holding.master_serves
    if plan.stage < 3 or unit.persistent:
        params = values if compute == torch.float32 else values.to(compute)
        master = params[part] if serves else _to_host(values[part], holding.master_dtype, holding)
    else:
        master = _to_host(values[part], holding.master_dtype, holding)
        params = None if serves else values[part].to(compute, copy=True)
    if grad is None:
        grad = torch.zeros(unit.shard_size(rank), dtype=torch.float32, device=holding.device)
    return UnitState(master, init_state(optimizer, master, holding.state_dtype), params, grad)
