"""The engine's step (`take_step`: the core's rules in `fzero.core.update` over the
runtime's units, then its optimizer application) and its learning rates
(`Hyperparams`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from fzero.core.apply import GroupValues, OptimizerApplication, StepClock
from fzero.core.groups import Groups
from fzero.core.layout import UnitRuntime
from fzero.core.reduce import reduce_to_optimizer_shards
from fzero.core.residency import Residency
from fzero.core.state import owned_grad
from fzero.core.update import GradStats, StepDecision, decide_step, hparam_fields, scheduled_betas
from fzero.optim import LossScaleState, Optimizer, with_overrides
from fzero.partition import Plan

__all__ = ["Hyperparams", "take_step", "unit_grad_stats"]


def unit_grad_stats(
    units: Sequence[UnitRuntime],
    plan: Plan,
    rank: int,
    residency: Residency,
    grad_stats: Callable[[torch.Tensor], GradStats],
) -> list[GradStats]:
    """`grad_stats` of every unit's owned gradient, in unit order (NVMe: taken when the
    last micro-step wrote the gradient; a unit without one has zeros, as has a replica of
    a shard its replica 0 counts: `Plan.unit_replica`)."""
    zeros = grad_stats(torch.zeros(1))
    return [
        zeros
        if plan.unit_replica(rt.unit, rank)
        else (rt.grad_stats if rt.grad_on_disk and rt.grad_stats else zeros)
        if residency.grad_on_disk(rt.index)
        else grad_stats(owned_grad(plan, rt.unit, rank, rt.grad))
        for rt in units
    ]


def take_step(
    units: Sequence[UnitRuntime],
    plan: Plan,
    groups: Groups,
    *,
    residency: Residency,
    application: OptimizerApplication,
    grad_stats: Callable[[torch.Tensor], GradStats],
    loss_scaler: Any,
    loss_scale: LossScaleState | None,
    clipping: float,
    device: torch.device,
    group_values: GroupValues,
    clock: StepClock,
    skipped: int,
    wire_dtype: torch.dtype = torch.float32,
    reduced_whole: Collection[int] = (),
    check_finite: bool = False,
) -> StepDecision:
    """The step at an accumulation boundary: the accumulated gradient shards reduced into
    the optimizer's where it is split finer (`reduce_to_optimizer_shards`, in
    `wire_dtype`; but `reduced_whole`'s, all-reduced whole already), decide
    (collective), then skip it (fp16 overflow; gradients not finite with
    `check_finite`, `fzero.core.update.skips_nonfinite`) or update every unit; gradients
    zeroed either way."""
    grads = [rt.grad for rt in units]
    reduce_to_optimizer_shards(plan, groups.rank, grads, groups, wire_dtype, reduced_whole)
    decision = decide_step(
        unit_grad_stats(units, plan, groups.rank, residency, grad_stats),
        loss_scaler=loss_scaler,
        loss_scale=loss_scale,
        clipping=clipping,
        device=device,
        world_size=plan.world_size,
        processes=plan.processes,
        group=groups.shard,
        step=clock.step,
        skipped=skipped,
        check_finite=check_finite,
    )
    if not decision.skip:
        application.apply(list(units), decision.factor, group_values, clock)
    residency.zero_grads(list(units))
    return decision


class Hyperparams:
    """Each unit's hyper-parameters, and the param groups scripts read and edit: the
    client optimizer's when there is one, else the engine's own (an lr scheduler sets
    their lr when stepped, as DeepSpeed's do)."""

    def __init__(
        self,
        optimizer: Optimizer,
        groups: list[dict[str, Any]],
        *,
        trainable: bool,
        client_optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.client_optimizer = client_optimizer
        group_hparams = [
            with_overrides(
                optimizer.hparams,
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
        # what the groups said when built: a value a script changes later is read (torch's)
        self._built = [self._values(g, hp) for g, hp in zip(self.param_groups, group_hparams)]

    @staticmethod
    def _values(group: dict[str, Any], hparams: Any) -> dict[str, Any]:
        """The group's values of `hparams`' fields but the lr (sequences as tuples)."""
        names = [f for f in hparams.__dataclass_fields__ if f != "lr" and f in group]
        return {
            n: tuple(group[n]) if isinstance(group[n], list | tuple) else group[n] for n in names
        }

    def current(self) -> GroupValues:
        """Per group, what the step reads from it: its lr, and every hyper-parameter a
        script changed there since the engine was built (a client's OneCycle writes
        betas, a weight-decay schedule writes weight_decay), as torch reads its groups
        at every step."""
        out = []
        for group, hp, built in zip(self.param_groups, self.group_hparams, self._built):
            now = self._values(group, hp)
            changed = {k: v for k, v in now.items() if v != built.get(k)}
            out.append({"lr": float(group["lr"]), **changed})
        return out

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        client = self.client_optimizer
        return client.param_groups if client is not None else self.own_groups

    def current_lrs(self) -> list[float]:
        """The lr of each param group for the step about to run (a scheduler writes it
        when stepped, as DeepSpeed's do)."""
        return [group["lr"] for group in self.param_groups]

    def momentum(self, schedule: Any, lr_steps: int) -> list[Any]:
        """Each param group's momentum: Adam's `betas`, SGD's `momentum` (DeepSpeed's
        `get_mom`), with `schedule`'s cycled betas at position `lr_steps` in place."""
        cycled = scheduled_betas(schedule, lr_steps)
        result = []
        for group in self.param_groups:
            if "betas" in group:
                result.append(cycled if cycled is not None else tuple(group["betas"]))
            else:
                result.append(group.get("momentum", 0.0))
        return result
