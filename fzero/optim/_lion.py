"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Program 1):

    c = β1 · m + (1 - β1) · g
    p = p · (1 - lr · wd) - lr · sign(c)             (decoupled weight decay)
    m = β2 · m + (1 - β2) · g

in the operations of the widely used PyTorch port (lucidrains/lion-pytorch) and of
DeepSpeed's `DeepSpeedCPULion`: `m.mul(β1).add(g, alpha=1 - β1)` for c and the same
form for the new m; the decay multiplies p before the signed step. Defaults are
DeepSpeed's (`lr` 1e-3, `betas` (0.9, 0.999), no decay); the paper suggests β2 0.99
and an lr 3-10x smaller than AdamW's.

sign(±0) is 0 (the paper's sign: an element whose interpolation is exactly zero, as a
never-used parameter's, does not move) and sign(NaN) is NaN. DeepSpeed's kernels move
such elements by ±lr: `DeepSpeedCPULion` by -lr·copysign(1, c), `FusedLion` by +lr
(`c > 0 ? -lr : lr`); elsewhere they compute this formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero.optim._base import NativeKernel, Optimizer, with_overrides
from fzero.optim._tree import over_trees

__all__ = [
    "LionHParams",
    "LionState",
    "lion",
    "lion_init",
    "lion_native",
    "lion_sign",
    "lion_update",
    "lion_update_",
]


@dataclass(frozen=True)
class LionHParams:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0


class LionState(NamedTuple):
    step: int
    exp_avg: Tensor


def lion_init(param: Tensor) -> LionState:
    """Zero momentum shaped like `param`, step 0."""
    return LionState(0, torch.zeros_like(param))


def lion_sign(c: Tensor) -> Tensor:
    """sign(c) with sign(±0) = 0 and sign(NaN) = NaN (torch.sign maps NaN to 0, which
    would leave an element with a NaN momentum frozen without a trace; as with Adam, a
    NaN reaches the parameter)."""
    sign = (c > 0).to(c.dtype) - (c < 0).to(c.dtype)
    return torch.where(torch.isnan(c), c, sign)


def _interpolation(exp_avg: Tensor, grad: Tensor, beta: float) -> Tensor:
    """β · m + (1 - β) · g, as `m.mul(β).add(g, alpha=1 - β)` (new tensor)."""
    return exp_avg.mul(beta).add(grad, alpha=1 - beta)


def lion_update(
    grad: Tensor, state: LionState, param: Tensor, hparams: LionHParams
) -> tuple[Tensor, LionState]:
    """One Lion step, pure: returns new tensors, reads its inputs only."""
    hp = hparams
    beta1, beta2 = hp.betas
    sign = lion_sign(_interpolation(state.exp_avg, grad, beta1))
    if hp.weight_decay:
        param = param.mul(1 - hp.lr * hp.weight_decay)
    new = param.add(sign, alpha=-hp.lr)
    return new, LionState(state.step + 1, _interpolation(state.exp_avg, grad, beta2))


def lion_update_(grad: Tensor, state: LionState, param: Tensor, hparams: LionHParams) -> LionState:
    """`lion_update` in place: writes `param` and the momentum; `grad` is not written."""
    hp = hparams
    beta1, beta2 = hp.betas
    sign = lion_sign(_interpolation(state.exp_avg, grad, beta1))
    if hp.weight_decay:
        param.mul_(1 - hp.lr * hp.weight_decay)
    param.add_(sign, alpha=-hp.lr)
    state.exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
    return LionState(state.step + 1, state.exp_avg)


def _native_update_(
    kernels: Any,
    param: Tensor,
    grad: Tensor,
    state: LionState,
    hparams: LionHParams,
    grad_scale: float,
    out: Tensor | None,
) -> LionState:
    """`lion_update_` through `kernels.lion_` (fzero.native)."""
    hp = hparams
    kernels.lion_(
        param, grad, state.exp_avg, lr=hp.lr, betas=hp.betas, weight_decay=hp.weight_decay,
        grad_scale=grad_scale, out=out,
    )  # fmt: skip
    return state._replace(step=state.step + 1)


lion_native = NativeKernel(update_=_native_update_)
"""Lion's update through fzero's native kernel (`fzero.native.lion_`)."""


def lion(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
) -> Optimizer:
    """Lion (see the module docstring), DeepSpeed's defaults; one fp32 state slot (the
    momentum)."""
    hp = LionHParams(lr, tuple(betas), weight_decay)
    if not hp.lr >= 0:
        raise ValueError(f"lr is {hp.lr}; it must be >= 0")
    if len(hp.betas) != 2 or not all(0.0 <= b <= 1.0 for b in hp.betas):
        raise ValueError(f"betas is {hp.betas}; expected two values in [0, 1]")
    if not hp.weight_decay >= 0:
        raise ValueError(f"weight_decay is {hp.weight_decay}; it must be >= 0")

    def update(grad: Tensor, state: LionState, param: Tensor, **overrides: Any):
        return lion_update(grad, state, param, with_overrides(hp, overrides))

    def update_(grad: Tensor, state: LionState, param: Tensor, **overrides: Any):
        return lion_update_(grad, state, param, with_overrides(hp, overrides))

    leaf = Optimizer("lion", hp, lion_init, update, update_, state_slots=1, native=lion_native)
    return over_trees(leaf)
