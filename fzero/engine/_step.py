"""The step's rules, shared by the engine and `fzero.train_step`: what each unit's
gradient says (its squares, whether it is finite), and from all units together whether
the step runs (fp16 overflow), the global norm, and the factor every gradient is scaled
by (loss-scale inverse x clip coefficient, as DeepSpeed's `unscale_and_clip_grads`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero import comm
from fzero.optim import LossScaleState, clip_coefficient

__all__ = ["GradStats", "StepDecision", "decide_step", "grad_stats"]

GradStats = tuple[Tensor, bool]


def grad_stats(grad: Tensor, *, clipping: float, dynamic: bool) -> GradStats:
    """One unit's owned gradient: its sum of squares (float64 with clipping; else one
    float32 pass, for the reported norm) and whether it is finite (checked only with
    dynamic loss scaling)."""
    if clipping > 0:
        sq = grad.double().square().sum()
    else:
        sq = torch.linalg.vector_norm(grad).double().square()
    return sq, bool(torch.isfinite(grad).all()) if dynamic else True


class StepDecision(NamedTuple):
    """What the step does: skip it (an fp16 overflow), and otherwise scale every
    gradient by `factor`; the global norm before clipping; the next loss-scale state."""

    skip: bool
    factor: float
    norm: float
    loss_scale: LossScaleState | None


def decide_step(
    stats: list[GradStats],
    *,
    loss_scaler: Any,
    loss_scale: LossScaleState | None,
    clipping: float,
    device: torch.device,
    world_size: int,
) -> StepDecision:
    """Every rank's unit statistics agreed by all-reduces (collective): an overflow
    anywhere skips the step everywhere; the norm is over all ranks' shards."""
    scale = loss_scale.scale if loss_scale is not None else 1.0
    if loss_scaler is not None and loss_scaler.dynamic:
        flag = torch.tensor([float(not all(finite for _, finite in stats))], device=device)
        if world_size > 1:
            comm.all_reduce(flag, op="max")
        found_inf = bool(flag.item())
        loss_scale = loss_scaler.update(loss_scale, found_inf)
        if found_inf:
            return StepDecision(True, 0.0, math.inf, loss_scale)
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    for unit_sq, _ in stats:
        sq += unit_sq
    if world_size > 1:
        comm.all_reduce(sq, op="sum")
    factor = 1.0 / scale
    norm = math.sqrt(sq.item()) * factor
    if clipping > 0:
        factor *= clip_coefficient(norm, clipping)
    return StepDecision(False, factor, norm, loss_scale)
