"""The step's rules, shared by the engine and `fzero.train_step`: what each unit's
gradient says (its squares, whether it is finite), and from all units together whether
the step runs (fp16 overflow), the global norm, and the factor every gradient is scaled
by (loss-scale inverse x clip coefficient, as DeepSpeed's `unscale_and_clip_grads`).
Then the engine's step itself (`take_step`) and its learning rates (`Hyperparams`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero import comm
from fzero.engine._apply import hparam_fields
from fzero.engine._scheduler import step_scheduler
from fzero.optim import LossScaleState, clip_coefficient, with_overrides

__all__ = [
    "GradStats",
    "Hyperparams",
    "StepDecision",
    "decide_step",
    "grad_stats",
    "take_step",
    "unit_grad_stats",
    "zero_grads",
]

log = logging.getLogger("fzero")
Engine = Any  # fzero.engine.Engine (this module sits below it)

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


# ---- the engine's step ----------------------------------------------------------------------


def unit_grad_stats(engine: Engine) -> list[GradStats]:
    """`grad_stats` of every unit's owned gradient, in unit order (NVMe: taken when the
    last micro-step wrote the gradient; a unit without one has zeros)."""
    if not engine.residency.grads_on_disk:
        return [
            engine.grad_stats(rt.grad[engine.owned(rt.unit)] if engine.stage < 2 else rt.grad)
            for rt in engine.units
        ]
    zeros = engine.grad_stats(torch.zeros(1))
    return [rt.grad_stats if rt.grad_on_disk and rt.grad_stats else zeros for rt in engine.units]


def take_step(engine: Engine, lr_kwargs: dict[str, Any] | None = None) -> StepDecision:
    """The engine's step at an accumulation boundary: decide, then skip (fp16 overflow)
    or update every unit and step the lr scheduler; gradients zeroed either way."""
    decision = decide_step(
        unit_grad_stats(engine),
        loss_scaler=engine.loss_scaler,
        loss_scale=engine.loss_scale_state,
        clipping=engine.config.gradient_clipping,
        device=engine.device,
        world_size=engine.world_size,
    )
    engine.loss_scale_state = decision.loss_scale
    if decision.skip:
        engine.skipped_steps += 1
        log.warning(
            "fzero: step %d skipped: gradient overflow; loss scale now %s",
            engine.global_steps,
            decision.loss_scale.scale if decision.loss_scale else None,
        )
    else:
        engine.optimizer_application.apply(decision.factor, engine.hyperparams.current_lrs())
        step_scheduler(engine, lr_kwargs)
    zero_grads(engine)
    return decision


def zero_grads(engine: Engine) -> None:
    for rt in engine.units:
        rt.grad.zero_()
        rt.grad_on_disk, rt.grad_stats = False, None


class Hyperparams:
    """Each unit's hyper-parameters, and the param groups scripts read and edit: the
    client optimizer's when there is one, else the engine's own (an lr scheduler sets
    their lr when stepped, as DeepSpeed's do)."""

    def __init__(self, engine: Engine, groups: list[dict[str, Any]], trainable: bool) -> None:
        self.engine = engine
        base = engine.functional_optimizer.hparams
        group_hparams = [
            with_overrides(
                base,
                {
                    k: (tuple(v) if k == "betas" else v)
                    for k, v in group.items()
                    if k not in ("params", "name") and trainable
                },
            )
            for group in groups
        ]
        self.own_groups = [
            {"params": list(group["params"]), **hparam_fields(hp)}
            for group, hp in zip(groups, group_hparams)
        ]
        for rt in engine.units:
            rt.hparams = group_hparams[rt.unit.group]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        client = self.engine.client_optimizer
        return client.param_groups if client is not None else self.own_groups

    def current_lrs(self) -> list[float]:
        """The lr of each param group for the step about to run (a scheduler writes it
        when stepped, as DeepSpeed's do)."""
        return [group["lr"] for group in self.param_groups]

    def momentum(self) -> list[Any]:
        """Each param group's momentum: Adam's `betas`, SGD's `momentum` (DeepSpeed's
        `get_mom`), with a schedule's cycled beta1 in place."""
        engine = self.engine
        schedule = getattr(engine.schedule, "momentum", None)
        beta1 = schedule(engine.lr_steps) if schedule is not None else None
        result = []
        for group in self.param_groups:
            if "betas" in group:
                betas = tuple(group["betas"])
                result.append((beta1, betas[1]) if beta1 is not None else betas)
            else:
                result.append(group.get("momentum", 0.0))
        return result
