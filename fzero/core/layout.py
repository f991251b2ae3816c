"""Each unit's buffers on this rank, and how the module's parameters view them.

Per unit and rank (ZeRO, Rajbhandari et al. 2020):

- `full`: the unit's compute-dtype flat buffer, which the module's parameters view
  (stages 0-2 and stage-3 persistent units; a stage-3 unit's gathered buffer is the
  `Gatherer`'s, `fzero.core.gathering`);
- `param_shard`: stage 3's compute-dtype shard (the master itself when fp32);
- `master`: fp32 weights of the optimizer partition (this rank's shard for stages 1-3,
  the whole buffer for stage 0); a view of `full` when fp32;
- `grad`: fp32 gradient accumulator (whole buffer for stages 0-1, shard for 2-3);
- `state`: the optimizer state over `master`.

A tensor of the model may sit in several pieces of a unit (`Placement.pieces`); the
helpers here copy values between a tensor and its pieces.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fzero.partition import Placement, Unit

__all__ = [
    "UnitRuntime",
    "ZeroParamStatus",
    "add_pieces",
    "bind",
    "gather_pieces",
    "scatter_pieces",
    "unbind",
]


class ZeroParamStatus(enum.Enum):
    """Whether a stage-3 parameter is whole here (DeepSpeed's enum, values included:
    clients such as TRL compare `param.ds_status` with it)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


@dataclass
class UnitRuntime:
    """The mutable buffers of one unit on this rank, and its per-step bookkeeping."""

    index: int
    unit: Unit
    params: list[tuple[torch.nn.Parameter, Placement, tuple[int, ...]]]
    master: Tensor
    state: Any
    grad: Tensor
    full: Tensor | None = None
    param_shard: Tensor | None = None
    hparams: Any = None
    # stages 2-3 with NVMe offload: the gradient accumulator lives in the swap file
    grad_on_disk: bool = False  # this accumulation window has written it
    grad_stats: tuple[Tensor | None, bool] | None = None  # of the window's final gradient
    slot: int = 0  # NVMe offload: which of the unit's two state copies is current


def scatter_pieces(flat: Tensor, values: Tensor, placement: Placement) -> None:
    for pc in placement.pieces:
        flat[pc.offset : pc.offset + pc.numel].copy_(values[pc.start : pc.start + pc.numel])


# elements added at once from another dtype on the CPU, which casts an operand of another
# dtype into a temporary of its whole size first (a bf16 embedding's gradient: 98 MB more)
_CAST_CHUNK = 1 << 20


def add_pieces(flat: Tensor, values: Tensor, placement: Placement) -> None:
    """Add `values` (a flat tensor) into its pieces of `flat` at `placement`; from another
    dtype on the CPU in chunks of `_CAST_CHUNK` (elementwise: the same sums)."""
    for pc in placement.pieces:
        into = flat[pc.offset : pc.offset + pc.numel]
        part = values[pc.start : pc.start + pc.numel]
        if part.dtype == into.dtype or into.device.type != "cpu":
            into.add_(part)
            continue
        for start in range(0, pc.numel, _CAST_CHUNK):
            into[start : start + _CAST_CHUNK].add_(part[start : start + _CAST_CHUNK])


def gather_pieces(full: Tensor, placement: Placement, shape: tuple[int, ...]) -> Tensor:
    """The tensor at `placement` in `full`: a view when it is one piece, else a copy."""
    pieces = sorted(placement.pieces, key=lambda pc: pc.start)
    if len(pieces) == 1:
        pc = pieces[0]
        return full[pc.offset : pc.offset + pc.numel].view(shape)
    if not pieces:
        return full.new_zeros(shape)
    return torch.cat([full[pc.offset : pc.offset + pc.numel] for pc in pieces]).view(shape)


def bind(rt: UnitRuntime, full: Tensor | None = None) -> None:
    """Point the unit's module parameters at their pieces of `full` (default `rt.full`;
    stage 3: the gathered buffer)."""
    full = full if full is not None else rt.full
    assert full is not None
    for p, placement, shape in rt.params:
        p.data = gather_pieces(full, placement, shape)
        if hasattr(p, "ds_status"):
            p.ds_status = ZeroParamStatus.AVAILABLE


def unbind(rt: UnitRuntime, dtype: torch.dtype, device: torch.device) -> None:
    """Leave the unit's module parameters empty (stage 3, between uses)."""
    for p, _, _ in rt.params:
        p.data = torch.empty(0, dtype=dtype, device=device)
        if hasattr(p, "ds_status"):
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
