"""Adagrad (Duchi, Hazan & Singer 2011, "Adaptive Subgradient Methods for Online Learning
and Stochastic Optimization"), as `torch.optim.Adagrad` computes it.

    g = g + wd · p                                   (L2 weight decay)
    clr = lr / (1 + (step - 1) · lr_decay)           (step 1-based)
    sum = sum + g · g                                (sum starts at initial_accumulator_value)
    p = p - clr · g / (sqrt(sum) + eps)

The operations follow `torch.optim.adagrad._single_tensor_adagrad` one for one, so a run
matches `torch.optim` to rounding; the state's `sum` is torch's `state["sum"]`. DeepSpeed
runs its config's `Adagrad` as `torch.optim.Adagrad`, or with `offload_optimizer` as
`DeepSpeedCPUAdagrad`, whose kernel computes this formula too (without `lr_decay`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero.optim._base import NativeKernel, Optimizer, with_overrides
from fzero.optim._tree import over_trees

__all__ = [
    "AdagradHParams",
    "AdagradState",
    "adagrad",
    "adagrad_init",
    "adagrad_native",
    "adagrad_update",
    "adagrad_update_",
]


@dataclass(frozen=True)
class AdagradHParams:
    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10


class AdagradState(NamedTuple):
    step: int
    sum: Tensor


def adagrad_init(param: Tensor, initial_accumulator_value: float = 0.0) -> AdagradState:
    """Step 0 and the sum filled with `initial_accumulator_value`, shaped like `param`."""
    return AdagradState(0, torch.full_like(param, initial_accumulator_value))


def _step_size(hp: AdagradHParams, step: int) -> float:
    """torch's `clr` for 1-based `step`."""
    return hp.lr / (1 + (step - 1) * hp.lr_decay)


def adagrad_update(
    grad: Tensor, state: AdagradState, param: Tensor, hparams: AdagradHParams
) -> tuple[Tensor, AdagradState]:
    """One Adagrad step, pure: returns new tensors, reads its inputs only."""
    hp, step = hparams, state.step + 1
    if hp.weight_decay:
        grad = grad.add(param, alpha=hp.weight_decay)
    total = state.sum.addcmul(grad, grad, value=1)
    std = total.sqrt().add_(hp.eps)
    return param.addcdiv(grad, std, value=-_step_size(hp, step)), AdagradState(step, total)


def adagrad_update_(
    grad: Tensor, state: AdagradState, param: Tensor, hparams: AdagradHParams
) -> AdagradState:
    """`adagrad_update` in place: writes `param` and the state's sum; `grad` is not written."""
    hp, step = hparams, state.step + 1
    if hp.weight_decay:
        grad = grad.add(param, alpha=hp.weight_decay)
    state.sum.addcmul_(grad, grad, value=1)
    std = state.sum.sqrt().add_(hp.eps)
    param.addcdiv_(grad, std, value=-_step_size(hp, step))
    return AdagradState(step, state.sum)


def _native_update_(
    kernels: Any,
    param: Tensor,
    grad: Tensor,
    state: AdagradState,
    hparams: AdagradHParams,
    grad_scale: float,
    out: Tensor | None,
) -> AdagradState:
    """`adagrad_update_` through `kernels.adagrad_` (fzero.native)."""
    hp, step = hparams, state.step + 1
    kernels.adagrad_(
        param, grad, state.sum, lr=_step_size(hp, step), eps=hp.eps,
        weight_decay=hp.weight_decay, grad_scale=grad_scale, out=out,
    )  # fmt: skip
    return state._replace(step=step)


adagrad_native = NativeKernel(update_=_native_update_)
"""Adagrad's update through fzero's native kernel (`fzero.native.adagrad_`)."""


def adagrad(
    lr: float = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
) -> Optimizer:
    """Adagrad with `torch.optim.Adagrad`'s arguments and defaults; one fp32 state slot
    (the sum of squared gradients)."""
    hp = AdagradHParams(lr, lr_decay, weight_decay, initial_accumulator_value, eps)
    for name in ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"):
        if not getattr(hp, name) >= 0:
            raise ValueError(f"{name} is {getattr(hp, name)}; it must be >= 0")

    def init(param: Tensor) -> AdagradState:
        return adagrad_init(param, hp.initial_accumulator_value)

    def update(grad: Tensor, state: AdagradState, param: Tensor, **overrides: Any):
        return adagrad_update(grad, state, param, with_overrides(hp, overrides))

    def update_(grad: Tensor, state: AdagradState, param: Tensor, **overrides: Any):
        return adagrad_update_(grad, state, param, with_overrides(hp, overrides))

    leaf = Optimizer("adagrad", hp, init, update, update_, state_slots=1, native=adagrad_native)
    return over_trees(leaf)
