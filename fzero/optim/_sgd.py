"""SGD with momentum and Nesterov momentum, as `torch.optim.SGD` computes it.

    g = g + wd · p;  buf = g (first step) else momentum · buf + (1 - dampening) · g
    g = g + momentum · buf (Nesterov) else buf;  p = p - lr · g
(Sutskever et al. 2013, in PyTorch's formulation.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero.optim._base import NativeKernel, Optimizer, with_overrides
from fzero.optim._tree import over_trees

__all__ = [
    "SgdHParams",
    "SgdState",
    "sgd",
    "sgd_init",
    "sgd_native",
    "sgd_update",
    "sgd_update_",
]


@dataclass(frozen=True)
class SgdHParams:
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


class SgdState(NamedTuple):
    step: int
    momentum_buffer: Tensor


def sgd_init(param: Tensor) -> SgdState:
    return SgdState(0, torch.zeros_like(param))


def _direction(grad: Tensor, buf: Tensor, hp: SgdHParams) -> Tensor:
    return grad.add(buf, alpha=hp.momentum) if hp.nesterov else buf


def sgd_update(
    grad: Tensor, state: SgdState, param: Tensor, hparams: SgdHParams
) -> tuple[Tensor, SgdState]:
    """One SGD step, pure."""
    hp = hparams
    if hp.weight_decay:
        grad = grad.add(param, alpha=hp.weight_decay)
    buf = state.momentum_buffer
    if hp.momentum:
        if state.step == 0:
            buf = grad.clone()
        else:
            buf = buf.mul(hp.momentum).add(grad, alpha=1 - hp.dampening)
        grad = _direction(grad, buf, hp)
    return param.add(grad, alpha=-hp.lr), SgdState(state.step + 1, buf)


def sgd_update_(grad: Tensor, state: SgdState, param: Tensor, hparams: SgdHParams) -> SgdState:
    """`sgd_update` in place on `param` and the momentum buffer."""
    hp = hparams
    if hp.weight_decay:
        grad = grad.add(param, alpha=hp.weight_decay)
    buf = state.momentum_buffer
    if hp.momentum:
        if state.step == 0:
            buf.copy_(grad)
        else:
            buf.mul_(hp.momentum).add_(grad, alpha=1 - hp.dampening)
        grad = _direction(grad, buf, hp)
    param.add_(grad, alpha=-hp.lr)
    return SgdState(state.step + 1, buf)


def _native_update_(
    kernels: Any,
    param: Tensor,
    grad: Tensor,
    state: SgdState,
    hparams: SgdHParams,
    grad_scale: float,
    out: Tensor | None,
) -> SgdState:
    """`sgd_update_` through `kernels.sgd_` (fzero.native)."""
    hp = hparams
    kernels.sgd_(
        param, grad, state.momentum_buffer, first=state.step == 0, lr=hp.lr,
        momentum=hp.momentum, dampening=hp.dampening, weight_decay=hp.weight_decay,
        nesterov=hp.nesterov, grad_scale=grad_scale, out=out,
    )  # fmt: skip
    return state._replace(step=state.step + 1)


sgd_native = NativeKernel(update_=_native_update_)
"""SGD's update through fzero's native kernel (`fzero.native.sgd_`)."""


def sgd(
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    *,
    nesterov: bool = False,
) -> Optimizer:
    """SGD (as `torch.optim.SGD`); one fp32 state slot (the momentum buffer)."""
    hp = SgdHParams(lr, momentum, dampening, weight_decay, nesterov)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"nesterov needs momentum > 0 and dampening 0 (got momentum={momentum}, "
            f"dampening={dampening})"
        )

    def update(grad: Tensor, state: SgdState, param: Tensor, **overrides: Any):
        return sgd_update(grad, state, param, with_overrides(hp, overrides))

    def update_(grad: Tensor, state: SgdState, param: Tensor, **overrides: Any):
        return sgd_update_(grad, state, param, with_overrides(hp, overrides))

    leaf = Optimizer("sgd", hp, sgd_init, update, update_, state_slots=1, native=sgd_native)
    return over_trees(leaf)
