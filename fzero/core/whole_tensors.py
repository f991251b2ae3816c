"""The update of an optimizer that needs whole tensors (`fzero.optim.WholeTensors`, e.g.
Muon's Newton-Schulz step), over one unit's optimizer partition on this rank.

Such an optimizer declares which tensors it takes (`WholeTensors.takes`); for those its
step is elementwise up to a direction (`direction_`), a function of the whole tensor's
direction (`whole`), then elementwise again (`apply_`). A taken tensor's direction is
made whole by one all-gather of the unit's directions where the plan splits the unit
over ranks, or read where it lies: where each taken tensor lies within one rank's part
(the `partition.whole_tensors` strategy) no gather runs (`owns_whole`). The other
tensors take the optimizer's elementwise step (`rest_`).

`fzero.core.apply.OptimizerApplication` runs it for each unit in order, in both doors.
It dispatches on the declaration only, never on the optimizer's name
([Note: needs] in `fzero.optim`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from fzero.core.groups import gather_optimizer_shards, groups_of
from fzero.core.layout import UnitRuntime, gather_pieces, scatter_pieces
from fzero.core.state import optimizer_partition
from fzero.core.update import Segments, tensor_segments
from fzero.optim import WholeTensors
from fzero.partition import Placement, Plan, Unit, spans_parts

__all__ = ["owns_whole", "state_piece", "whole_tensors_update_", "whole_update"]


def whole_tensors_update_(
    plan: Plan,
    rank: int,
    rt: UnitRuntime,
    grad: Tensor,
    hp: Any,
    needs: WholeTensors,
    *,
    device: torch.device,
) -> None:
    """One unit's step, in place on `rt`'s master and state, from `grad` (this rank's
    partition's gradient, scaled) at hyper-parameters `hp`: `direction_` on each taken
    tensor's piece of the partition; each taken tensor's direction made whole
    (`whole_update`), `whole` on it where this rank owns part of it, `apply_` on that
    part; `rest_` for the unit's other tensors. Collective when sharded: every rank runs
    every unit in order."""
    shapes = {pl.fqn: tuple(plan.manifest[pl.fqn].shape) for pl in rt.unit.placements}
    taken = {fqn for fqn, shape in shapes.items() if needs.takes(fqn, shape, hp)}
    state = rt.state
    direction = torch.zeros_like(grad) if taken else None
    segments = tensor_segments(plan, rank, rt.index)
    for start, stop, fqn in segments:
        g, p, piece = grad[start:stop], rt.master[start:stop], state_piece(state, start, stop)
        if fqn in taken:
            direction[start:stop] = needs.direction_(g, piece, p, hp)  # type: ignore[index]
        else:
            needs.rest_(g, piece, p, hp)
    if direction is not None:
        update = whole_update(plan, rank, rt, direction, taken, segments, hp, needs, device=device)
        for start, stop, fqn in segments:
            if fqn in taken:
                needs.apply_(rt.master[start:stop], update[start:stop], hp)
    rt.state = state._replace(step=state.step + 1)


def whole_update(
    plan: Plan,
    rank: int,
    rt: UnitRuntime,
    direction: Tensor,
    taken: set[str],
    segments: Segments,
    hp: Any,
    needs: WholeTensors,
    *,
    device: torch.device,
) -> Tensor:
    """`needs.whole`'s update over this rank's partition of the unit, from the
    partition's directions (gathered into the whole unit where sharded)."""
    unit, part = rt.unit, optimizer_partition(plan, rt.unit, rank)
    mine = {fqn for start, stop, fqn in segments if fqn in taken and stop > start}
    if part.stop - part.start != unit.numel and owns_whole(unit, taken):
        return _whole_here(plan, unit, part, direction.to(device), mine, hp, needs)
    whole = direction.to(device)
    if part.stop - part.start != unit.numel or part.start != 0:
        whole = torch.empty(unit.numel, dtype=torch.float32, device=device)
        direction = direction.to(device).contiguous()
        groups = groups_of(plan)
        what = f"whole-tensor directions of unit {rt.index} {unit.name!r}"
        gather_optimizer_shards(whole, direction, plan, rt.index, groups, what=what, async_op=False)
    out = torch.zeros(unit.numel, dtype=torch.float32, device=device)
    for pl in unit.placements:
        if pl.fqn in mine:
            shape = plan.manifest[pl.fqn].shape
            value = needs.whole(gather_pieces(whole, pl, shape), hp)
            scatter_pieces(out, value.reshape(-1), pl)
    return out[part]


def _whole_here(
    plan: Plan,
    unit: Unit,
    part: slice,
    local: Tensor,
    mine: set[str],
    hp: Any,
    needs: WholeTensors,
) -> Tensor:
    """`needs.whole` where this rank's partition holds each of its taken tensors whole
    (`partition.whole_tensors`): no gather."""
    out = torch.zeros_like(local)
    for pl in unit.placements:
        if pl.fqn in mine:
            here = Placement(
                pl.fqn, tuple(replace(p, offset=p.offset - part.start) for p in pl.pieces)
            )
            value = needs.whole(gather_pieces(local, here, plan.manifest[pl.fqn].shape), hp)
            scatter_pieces(out, value.reshape(-1), here)
    return out


def state_piece(state: Any, start: int, stop: int) -> Any:
    """`state` with each tensor field sliced to `[start:stop]` (views; `step` as is)."""
    fields = {k: v[start:stop] for k, v in state._asdict().items() if isinstance(v, Tensor)}
    return state._replace(**fields)


def owns_whole(unit: Unit, taken: set[str]) -> bool:
    """Whether each of the unit's `taken` tensors lies within one rank's part (the same
    answer on every rank: a property of the plan, `partition.spans_parts`)."""
    return not spans_parts(unit, taken)
