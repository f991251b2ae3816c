"""The engine's step (`take_step`: the core's rules in `fzero.core.update` over the
engine's units, then its optimizer application) and its learning rates (`Hyperparams`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from fzero.core.apply import StepClock
from fzero.core.update import GradStats, StepDecision, decide_step, hparam_fields, scheduled_beta1
from fzero.engine._scheduler import step_scheduler
from fzero.optim import with_overrides

__all__ = [
    "Hyperparams",
    "take_step",
    "unit_grad_stats",
    "zero_grads",
]

log = logging.getLogger("fzero")
Engine = Any  # fzero.engine.Engine (this module sits below it)

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
        world_size=engine.plan.world_size,
        processes=engine.world_size,
        group=engine.groups.shard,
        step=engine.global_steps + 1,
        skipped=engine.skipped_steps,
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
        engine.optimizer_application.apply(
            engine.units,
            decision.factor,
            engine.hyperparams.current_lrs(),
            StepClock(engine.lr_steps, engine.global_steps + 1),
        )
        step_scheduler(engine, lr_kwargs)
    zero_grads(engine)
    return decision


def zero_grads(engine: Engine) -> None:
    engine.residency.zero_grads(engine.units)


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
        self.group_hparams = group_hparams  # each unit's, by its group (`UnitRuntime`)

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
        beta1 = scheduled_beta1(engine.schedule, engine.lr_steps)
        result = []
        for group in self.param_groups:
            if "betas" in group:
                betas = tuple(group["betas"])
                result.append((beta1, betas[1]) if beta1 is not None else betas)
            else:
                result.append(group.get("momentum", 0.0))
        return result
