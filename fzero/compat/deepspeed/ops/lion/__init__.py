"""`deepspeed.ops.lion`: DeepSpeedCPULion and FusedLion as `torch.optim` optimizers
that step with `fzero.optim.lion` (standalone), and that fzero's engine runs with its
own (native) Lion kernel when handed to `initialize`.

Lion's formula is the paper's (Chen et al. 2023), as `fzero.optim.lion` says, where
DeepSpeed's kernels compute it too: they differ only on an element whose momentum
interpolation is exactly zero, which DeepSpeed moves by ±lr and the paper (and fzero)
leaves in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from fzero.compat.deepspeed.ops._stepping import step_each
from fzero.optim import LionState, Optimizer, lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class DeepSpeedCPULion(torch.optim.Optimizer):
    """DeepSpeed's CPU Lion (its arguments and defaults): a `torch.optim.Optimizer`
    whose `step` is `fzero.optim.lion`'s in-place update per parameter; in
    `fzero.initialize` the engine runs its groups as `fzero.optim.lion`."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        lion(lr, betas, weight_decay)  # the arguments checked, naming a bad one
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        super().__init__(model_params, defaults)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Lion step of every parameter with a gradient (sparse gradients refused)."""
        return step_each(self, closure, _rule, LionState)


def _rule(group: dict[str, Any]) -> Optimizer:
    return lion(group["lr"], group["betas"], group["weight_decay"])


class FusedLion(DeepSpeedCPULion):
    """DeepSpeed's fused (GPU) Lion, its arguments and defaults; as `DeepSpeedCPULion`.
    `set_grad_none`: `zero_grad` sets gradients to None (DeepSpeed's default)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
