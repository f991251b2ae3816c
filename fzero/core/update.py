"""The update's rules, one implementation for both doors (the engine and
`fzero.train_step`): what each unit's gradient says (its squares, whether it is finite);
from all units together whether the step runs (an fp16 overflow; gradients that are not
finite, where DeepSpeed skips such a step: `skips_nonfinite`), the global norm and the
factor every gradient is scaled by (loss-scale inverse x clip coefficient, as
DeepSpeed's `unscale_and_clip_grads`); and the halves of an update that needs each
tensor's norms (`fzero.optim.TensorNorms`: LAMB's trust ratio is per tensor and a tensor
may span ranks), with one all-reduce of each tensor's squares between them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero import comm, native, partition
from fzero.optim import (
    LossScaleError,
    LossScaleState,
    NativeKernel,
    TensorNorms,
    clip_coefficient,
    segment_sq_sums,
)
from fzero.partition import Plan, Unit

__all__ = [
    "GradStats",
    "Segments",
    "StepDecision",
    "add_tensor_squares",
    "decide_step",
    "grad_stats",
    "hparam_fields",
    "norms_apply",
    "norms_direction",
    "scheduled_betas",
    "scheduled_overrides",
    "skips_nonfinite",
    "tensor_norms",
    "tensor_segments",
]

GradStats = tuple[Tensor, bool]
_SQUARED_CHUNK = 1 << 20  # elements squared in float64 at a time (8 MiB)


def grad_stats(
    grad: Tensor, *, clipping: float, dynamic: bool, into: GradStats | None = None
) -> GradStats:
    """One unit's owned gradient: its sum of squares (float64 with clipping; else one
    float32 pass, for the reported norm) and whether it is finite (checked only with
    dynamic loss scaling). With clipping the float64 squares are summed 2^20 elements at
    a time, in order from the start of `grad` (the same chunks at every stage: a rank
    owns the same elements of a unit at each), so a large unit holds 8 MiB of float64,
    not 8 bytes per element of its part (2.1 GB for Llama 3's embedding at world 2).
    `into`: the stats of the part before `grad` (a gradient reduced in pieces, each
    starting at a multiple of 2^20 elements: `fzero.core.reduce_pieces`), which the sum
    goes on from: with clipping the same float64 sum, in the same order, as over the
    whole part at once."""
    if clipping > 0:  # squared in place: one float64 copy of a chunk at a time
        if grad.numel() <= _SQUARED_CHUNK and into is None:
            sq = grad.to(torch.float64, copy=True).square_().sum()
        else:
            sq = torch.zeros((), dtype=torch.float64, device=grad.device)
            if into is not None:
                sq += into[0]
            for chunk in grad.split(_SQUARED_CHUNK):
                sq += chunk.to(torch.float64, copy=True).square_().sum()
    else:
        wide = None if grad.dtype == torch.float32 else torch.float32  # half accumulators
        sq = torch.linalg.vector_norm(grad, dtype=wide).double().square()
        if into is not None:
            sq = sq + into[0]
    finite = bool(torch.isfinite(grad).all()) if dynamic else True
    return sq, finite and (into is None or into[1])


def skips_nonfinite(config: Any, stage: int) -> bool:
    """Whether a step whose gradients are not finite (inf or NaN anywhere, so the global
    norm is not) is skipped rather than applied, as DeepSpeed 0.19.8 decides it from
    `config` for a plan of ZeRO stage `stage`: with fp16 always (its overflow check; a
    dynamic loss scale also halves); with bf16 at stages 0 and 3, and at stages 1-2 unless
    `bf16.check_grad_overflow` is false; in fp32 at stage 3, and at stages 1-2 unless
    `zero_optimization.compute_grad_norm` is false (stage 0 in fp32 runs the client's
    update as torch does: the step is applied). A skipped step counts in
    `skipped_steps` and leaves the weights, the optimizer state and the lr schedule
    where they were."""
    if config.fp16.enabled:
        return True
    if config.bf16.enabled:
        return stage in (0, 3) or bool(config.bf16.check_grad_overflow)
    return stage == 3 or (stage in (1, 2) and bool(config.zero_optimization.compute_grad_norm))


class StepDecision(NamedTuple):
    """What the step does: skip it (an fp16 overflow, or gradients that are not finite
    where `skips_nonfinite`), and otherwise scale every
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
    step: int = 0,
    skipped: int = 0,
    processes: int | None = None,
    group: Any = None,
    check_finite: bool = False,
) -> StepDecision:
    """Every rank's unit statistics agreed by all-reduces (collective): an overflow
    anywhere (of `processes`, default `world_size`) skips the step everywhere; the norm
    is over the shards of the `world_size` ranks of `group` (a plan's shard group: its
    replicas hold the same shards); with `check_finite` (`skips_nonfinite`) a norm that
    is not finite (gradients with inf or NaN on any rank: every rank sums the same
    squares) skips the step too, the loss scale as it was. An overflow
    the loss scale cannot absorb (at its minimum) raises `LossScaleError` on every rank,
    naming `step` (the one being decided) and the `skipped` steps before it."""
    scale = loss_scale.scale if loss_scale is not None else 1.0
    if loss_scaler is not None and loss_scaler.dynamic:
        flag = torch.tensor([float(not all(finite for _, finite in stats))], device=device)
        if max(world_size, processes or 0) > 1:
            comm.all_reduce(flag, op="max", what="fp16 overflow flag")
        found_inf = bool(flag.item())
        if loss_scaler.stuck(loss_scale, found_inf):
            raise LossScaleError(
                f"fp16: the gradients of step {step} overflowed with the loss scale already at "
                f"its minimum {scale:g} (fp16.min_loss_scale), after {skipped} skipped "
                f"step(s) of {step - 1}: every step from here would be skipped, so training "
                "stops (as DeepSpeed's). The training state is as before this step. Lower the "
                "learning rate, clip gradients, check the data for inf/NaN, or train in bf16"
            )
        loss_scale = loss_scaler.update(loss_scale, found_inf)
        if found_inf:
            return StepDecision(True, 0.0, math.inf, loss_scale)
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    for unit_sq, _ in stats:
        sq += unit_sq
    if world_size > 1:
        comm.all_reduce(sq, op="sum", what="gradient norm", group=group)
    factor = 1.0 / scale
    norm = math.sqrt(sq.item()) * factor
    if check_finite and not math.isfinite(norm):
        return StepDecision(True, 0.0, math.inf, loss_scale)
    if clipping > 0:
        factor *= clip_coefficient(norm, clipping)
    return StepDecision(False, factor, norm, loss_scale)


def hparam_fields(hparams: Any) -> dict[str, Any]:
    """A frozen hyper-parameter dataclass as a dict (`update_`'s keyword arguments)."""
    return {name: getattr(hparams, name) for name in hparams.__dataclass_fields__}


def scheduled_betas(schedule: Any, lr_steps: int) -> tuple[float, float] | None:
    """A schedule's cycled betas at `lr_steps` (OneCycle's `betas`), or None."""
    betas = getattr(schedule, "betas", None)
    return betas(lr_steps) if betas is not None else None


def scheduled_overrides(hparams: Any, schedule: Any, lr_steps: int, lr: float) -> dict[str, Any]:
    """What a step overrides in a unit's hyper-parameters: `lr`, and where the optimizer
    has `betas`, a schedule's cycled betas (both doors, every unit)."""
    overrides: dict[str, Any] = {"lr": lr}
    betas = scheduled_betas(schedule, lr_steps)
    if betas is not None and hasattr(hparams, "betas"):
        overrides["betas"] = betas
    return overrides


# ---- TensorNorms (LAMB's trust ratio): two halves per unit, one all-reduce between ------

Segments = list[tuple[int, int, str]]


def tensor_segments(plan: Plan, rank: int, index: int) -> Segments:
    """(start, stop, fqn) of each tensor's piece in unit `index`'s optimizer partition on
    `rank` (the whole unit at stage 0)."""
    unit = plan.units[index]
    if plan.stage_of(unit) == 0:
        return [
            (pc.offset, pc.offset + pc.numel, pl.fqn) for pl in unit.placements for pc in pl.pieces
        ]
    return [
        (s.shard_offset, s.shard_offset + s.numel, s.fqn)
        for s in partition.local_slices(plan, rank)
        if s.unit == index
    ]


def norms_direction(
    needs: TensorNorms,
    kernel: NativeKernel | None,
    master: Tensor,
    grad: Tensor,
    state: Any,
    hp: Any,
    factor: float,
    *,
    out: Tensor | None = None,
) -> tuple[Any, Tensor]:
    """The first half for one partition (`needs.direction_`, or the `kernel`'s twin): the
    state advances in place; returns the new state (its step counted) and the direction
    (into `out` when given). `grad` is scaled by `factor` (in place on the pure path)."""
    if kernel is not None and kernel.direction_ is not None:
        direction = torch.empty_like(master) if out is None else out
        kernel.direction_(native, master, grad, state, hp, factor, direction)
    else:
        if factor != 1.0:
            grad.mul_(factor)
        computed = needs.direction_(grad, state, master, hp)
        direction = computed if out is None else out.copy_(computed)
    return state._replace(step=state.step + 1), direction


def add_tensor_squares(
    sums: Tensor,
    tensor_index: dict[str, int],
    segments: Segments,
    master: Tensor,
    direction: Tensor,
    *,
    use_native: bool,
) -> None:
    """Add each tensor piece's squares (parameter, direction) into `sums[0 | 1, tensor]`."""
    spans = [(a, b) for a, b, _ in segments]
    squares = native.segment_sq_sums if use_native else segment_sq_sums
    for (_, _, fqn), p_sq, u_sq in zip(segments, squares(master, spans), squares(direction, spans)):
        sums[0, tensor_index[fqn]] += p_sq
        sums[1, tensor_index[fqn]] += u_sq


def tensor_norms(sums: Tensor, plan: Plan, group: Any = None) -> list[list[float]]:
    """Every tensor's parameter and direction norms over the ranks of `group` (the plan's
    shard group, where a process's rank is its plan rank; collective once any unit is at
    stage 1 or more). A unit at stage 0 is whole on every rank, so its tensors' sums are
    already whole: in a plan with split units too, only the group's first rank adds them
    to the all-reduce (exactly, not divided). Likewise a unit on its own axes
    (`Unit.shard_axes`) has replicas among the plan's ranks: only its replica 0 adds its
    shard's sums."""
    if plan.stage > 0:
        rank = comm.get_rank(group)
        counted_elsewhere = [
            i
            for i, u in _tensor_units(plan)
            if (plan.stage_of(u) == 0 and rank != 0) or plan.unit_replica(u, rank)
        ]
        if counted_elsewhere:
            sums[:, counted_elsewhere] = 0.0
        comm.all_reduce(sums, op="sum", what="tensor norms", group=group)
    return sums.sqrt().tolist()


def _tensor_units(plan: Plan) -> list[tuple[int, Unit]]:
    """(manifest index, unit) of every tensor of the manifest."""
    index = {fqn: i for i, fqn in enumerate(plan.manifest.fqns)}
    return [(index[pl.fqn], u) for u in plan.units for pl in u.placements]


def norms_apply(
    needs: TensorNorms,
    kernel: NativeKernel | None,
    master: Tensor,
    hp: Any,
    direction: Tensor,
    segments: Segments,
    norms: list[list[float]],
    tensor_index: dict[str, int],
) -> None:
    """The second half (`needs.apply_`, or the `kernel`'s twin): each tensor's piece moves
    given its whole tensor's norms."""
    spans = [(a, b) for a, b, _ in segments]
    p_norms = [norms[0][tensor_index[fqn]] for _, _, fqn in segments]
    u_norms = [norms[1][tensor_index[fqn]] for _, _, fqn in segments]
    if kernel is not None and kernel.apply_ is not None:
        kernel.apply_(native, master, direction, spans, p_norms, u_norms, hp)
    else:
        needs.apply_(master, direction, spans, p_norms, u_norms, hp)
