"""Adam and AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019), as `torch.optim.Adam` computes them.

The operations follow `torch.optim.adam._single_tensor_adam` one for one, so a
run matches `torch.optim` to rounding. `bias_correction=False` drops both
corrections (DeepSpeed's option). `decoupled=True` is AdamW: decay applied to
the parameter before the update, `p *= 1 - lr * weight_decay`; otherwise decay
is L2, added to the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero.optim._base import NativeKernel, Optimizer, with_overrides
from fzero.optim._tree import over_trees

__all__ = [
    "AdamHParams",
    "AdamState",
    "adam",
    "adam_init",
    "adam_native",
    "adam_update",
    "adam_update_",
    "adamw",
]


@dataclass(frozen=True)
class AdamHParams:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    bias_correction: bool = True
    decoupled: bool = False


class AdamState(NamedTuple):
    step: int
    exp_avg: Tensor
    exp_avg_sq: Tensor


def adam_init(param: Tensor) -> AdamState:
    """Zero moments shaped like `param`, step 0."""
    return AdamState(0, torch.zeros_like(param), torch.zeros_like(param))


def _coefficients(hp: AdamHParams, step: int) -> tuple[float, float]:
    """(step_size, sqrt of the second-moment correction) for 1-based `step`."""
    beta1, beta2 = hp.betas
    if not hp.bias_correction:
        return hp.lr, 1.0
    return hp.lr / (1 - beta1**step), math.sqrt(1 - beta2**step)


def adam_update(
    grad: Tensor, state: AdamState, param: Tensor, hparams: AdamHParams
) -> tuple[Tensor, AdamState]:
    """One Adam(W) step, pure: returns new tensors, reads its inputs only."""
    hp, step = hparams, state.step + 1
    beta1, beta2 = hp.betas
    if hp.weight_decay and hp.decoupled:
        param = param.mul(1 - hp.lr * hp.weight_decay)
    elif hp.weight_decay:
        grad = grad.add(param, alpha=hp.weight_decay)
    exp_avg = state.exp_avg.lerp(grad, 1 - beta1)
    exp_avg_sq = state.exp_avg_sq.mul(beta2).addcmul(grad, grad, value=1 - beta2)
    step_size, correction2_sqrt = _coefficients(hp, step)
    denom = (exp_avg_sq.sqrt() / correction2_sqrt).add(hp.eps)
    return param.addcdiv(exp_avg, denom, value=-step_size), AdamState(step, exp_avg, exp_avg_sq)


def adam_update_(grad: Tensor, state: AdamState, param: Tensor, hparams: AdamHParams) -> AdamState:
    """`adam_update` in place: writes `param` and the state's moments; `grad` is not written."""
    hp, step = hparams, state.step + 1
    beta1, beta2 = hp.betas
    if hp.weight_decay and hp.decoupled:
        param.mul_(1 - hp.lr * hp.weight_decay)
    elif hp.weight_decay:
        grad = grad.add(param, alpha=hp.weight_decay)
    state.exp_avg.lerp_(grad, 1 - beta1)
    state.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size, correction2_sqrt = _coefficients(hp, step)
    denom = (state.exp_avg_sq.sqrt() / correction2_sqrt).add_(hp.eps)
    param.addcdiv_(state.exp_avg, denom, value=-step_size)
    return AdamState(step, state.exp_avg, state.exp_avg_sq)


def _native_update_(
    kernels: Any,
    param: Tensor,
    grad: Tensor,
    state: AdamState,
    hparams: AdamHParams,
    grad_scale: float,
    out: Tensor | None,
) -> AdamState:
    """`adam_update_` through `kernels.adam_` (fzero.native)."""
    hp = hparams
    kernels.adam_(
        param, grad, state.exp_avg, state.exp_avg_sq, step=state.step + 1, lr=hp.lr,
        betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay, decoupled=hp.decoupled,
        bias_correction=hp.bias_correction, grad_scale=grad_scale, out=out,
    )  # fmt: skip
    return state._replace(step=state.step + 1)


adam_native = NativeKernel(update_=_native_update_)
"""Adam(W)'s update through fzero's native kernel (`fzero.native.adam_`)."""


def _bundle(name: str, hp: AdamHParams) -> Optimizer:
    def update(grad: Tensor, state: AdamState, param: Tensor, **overrides: Any):
        return adam_update(grad, state, param, with_overrides(hp, overrides))

    def update_(grad: Tensor, state: AdamState, param: Tensor, **overrides: Any):
        return adam_update_(grad, state, param, with_overrides(hp, overrides))

    leaf = Optimizer(name, hp, adam_init, update, update_, state_slots=2, native=adam_native)
    return over_trees(leaf)


def adam(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    decoupled: bool = False,
) -> Optimizer:
    """Adam with L2 weight decay (as `torch.optim.Adam`); `decoupled=True` gives AdamW."""
    hp = AdamHParams(lr, tuple(betas), eps, weight_decay, bias_correction, decoupled)
    _check(hp)
    return _bundle("adamw" if decoupled else "adam", hp)


def adamw(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    bias_correction: bool = True,
) -> Optimizer:
    """AdamW: Adam with decoupled weight decay (as `torch.optim.AdamW`)."""
    return adam(lr, betas, eps, weight_decay, bias_correction=bias_correction, decoupled=True)


def _check(hp: AdamHParams) -> None:
    if hp.lr < 0:
        raise ValueError(f"lr is {hp.lr}; it must be >= 0")
    if len(hp.betas) != 2 or not all(0.0 <= b < 1.0 for b in hp.betas):
        raise ValueError(f"betas is {hp.betas}; expected two values in [0, 1)")
    if hp.eps < 0:
        raise ValueError(f"eps is {hp.eps}; it must be >= 0")
    if hp.weight_decay < 0:
        raise ValueError(f"weight_decay is {hp.weight_decay}; it must be >= 0")
