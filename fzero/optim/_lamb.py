"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning"), as DeepSpeed's
FusedLamb computes it (the optimizer of its config's `"Lamb"` and of its BERT tutorial):

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g²
    u = m / (sqrt(v) + eps) + wd · p
    trust = clamp(‖p‖ / ‖u‖, min_coeff, max_coeff) when both norms are non-zero, else 1
    p = p - lr · c · trust · u,   c = sqrt(1 - b2^t) / (1 - b1^t) (1 without bias correction)

FusedLamb's kernel corrects the bias in the step size `c`, not in the moments as the
paper's Algorithm 2 writes m̂ / (sqrt(v̂) + eps): the two differ in where eps sits and,
through the trust ratio's clamp and the weight decay, in the step. The trust ratio is
per tensor, as in FusedLamb (whose clamp bounds `max_coeff`/`min_coeff` these are; the
BERT tutorial uses 0.3 / 0.01). A flat
buffer holding several tensors is updated segment by segment. Under sharding a
tensor's norms span ranks, so LAMB declares `TensorNorms` (`fzero.optim.Optimizer`):
`lamb_direction_` computes u (and the moments), the core sums `segment_sq_sums`
across ranks, then `lamb_apply_` applies the trust ratios; `lamb_native` runs both
halves through fzero's native kernels.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero.optim._base import NativeKernel, Optimizer, TensorNorms, with_overrides
from fzero.optim._tree import over_trees

__all__ = [
    "LambHParams",
    "LambState",
    "lamb",
    "lamb_apply_",
    "lamb_direction_",
    "lamb_init",
    "lamb_native",
    "lamb_step_hparams",
    "lamb_update",
    "lamb_update_",
    "segment_sq_sums",
    "step_size",
    "trust_ratio",
]


@dataclass(frozen=True)
class LambHParams:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    bias_correction: bool = True
    max_coeff: float = 10.0
    min_coeff: float = 0.01


class LambState(NamedTuple):
    step: int
    exp_avg: Tensor
    exp_avg_sq: Tensor


def lamb_init(param: Tensor) -> LambState:
    return LambState(0, torch.zeros_like(param), torch.zeros_like(param))


def trust_ratio(param_norm: float, update_norm: float, hparams: LambHParams) -> float:
    """‖p‖ / ‖u‖ clamped to [min_coeff, max_coeff]; 1 when either norm is zero."""
    if param_norm > 0 and update_norm > 0:
        return min(max(param_norm / update_norm, hparams.min_coeff), hparams.max_coeff)
    return 1.0


def step_size(hp: LambHParams, step: int) -> float:
    """lr · sqrt(1 - b2^step) / (1 - b1^step) (lr without bias correction): FusedLamb's
    step size at 1-based `step`."""
    beta1, beta2 = hp.betas
    if not hp.bias_correction:
        return hp.lr
    return hp.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def lamb_step_hparams(hparams: LambHParams, state: LambState) -> LambHParams:
    """The second half's hyper-parameters once the first advanced `state` (its step
    counted): lr the bias-corrected step size, bias correction done."""
    lr = step_size(hparams, state.step)
    return dataclasses.replace(hparams, lr=lr, bias_correction=False)


def lamb_update(
    grad: Tensor, state: LambState, param: Tensor, hparams: LambHParams
) -> tuple[Tensor, LambState]:
    """One LAMB step on one tensor (one trust ratio), pure."""
    hp, step = hparams, state.step + 1
    beta1, beta2 = hp.betas
    exp_avg = state.exp_avg.mul(beta1).add(grad, alpha=1 - beta1)
    exp_avg_sq = state.exp_avg_sq.mul(beta2).addcmul(grad, grad, value=1 - beta2)
    update = exp_avg / exp_avg_sq.sqrt().add(hp.eps)
    if hp.weight_decay:
        update = update.add(param, alpha=hp.weight_decay)
    ratio = trust_ratio(param.norm().item(), update.norm().item(), hp)
    moved = param.add(update, alpha=-step_size(hp, step) * ratio)
    return moved, LambState(step, exp_avg, exp_avg_sq)


def lamb_direction_(grad: Tensor, state: LambState, param: Tensor, hparams: LambHParams) -> Tensor:
    """Advance the moments in place and return the update direction u (a new tensor;
    the bias correction is the step size's, `lamb_step_hparams`)."""
    hp = hparams
    beta1, beta2 = hp.betas
    state.exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    state.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    update = state.exp_avg / state.exp_avg_sq.sqrt().add_(hp.eps)
    if hp.weight_decay:
        update.add_(param, alpha=hp.weight_decay)
    return update


def segment_sq_sums(values: Tensor, segments: Sequence[tuple[int, int]]) -> Tensor:
    """Sum of squares of `values[start:stop]` for each segment, in float64."""
    if not segments:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([values[a:b].double().square().sum() for a, b in segments])


def lamb_apply_(
    param: Tensor,
    update: Tensor,
    segments: Sequence[tuple[int, int]],
    param_norms: Sequence[float],
    update_norms: Sequence[float],
    hparams: LambHParams,
) -> None:
    """p -= lr · trust · u for each segment, given the segments' full-tensor norms."""
    for (a, b), p_norm, u_norm in zip(segments, param_norms, update_norms):
        ratio = trust_ratio(float(p_norm), float(u_norm), hparams)
        param[a:b].add_(update[a:b], alpha=-hparams.lr * ratio)


def lamb_update_(
    grad: Tensor,
    state: LambState,
    param: Tensor,
    hparams: LambHParams,
    segments: Sequence[tuple[int, int]] | None = None,
) -> LambState:
    """`lamb_update` in place over a flat buffer of whole tensors at `segments`
    (default: the buffer is one tensor)."""
    segments = [(0, param.numel())] if segments is None else list(segments)
    update = lamb_direction_(grad, state, param, hparams)
    param_norms = segment_sq_sums(param, segments).sqrt().tolist()
    update_norms = segment_sq_sums(update, segments).sqrt().tolist()
    advanced = LambState(state.step + 1, state.exp_avg, state.exp_avg_sq)
    second = lamb_step_hparams(hparams, advanced)
    lamb_apply_(param, update, segments, param_norms, update_norms, second)
    return advanced


def _native_direction_(
    kernels: Any,
    param: Tensor,
    grad: Tensor,
    state: LambState,
    hparams: LambHParams,
    grad_scale: float,
    out: Tensor,
) -> None:
    """`lamb_direction_` through `kernels.lamb_direction_`, the direction into `out`."""
    hp = hparams
    kernels.lamb_direction_(
        param, grad, state.exp_avg, state.exp_avg_sq, out, step=state.step + 1,
        betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay,
        bias_correction=False, grad_scale=grad_scale,  # the step size's (`step_size`)
    )  # fmt: skip


def _native_apply_(
    kernels: Any,
    param: Tensor,
    update: Tensor,
    segments: Sequence[tuple[int, int]],
    param_norms: Sequence[float],
    update_norms: Sequence[float],
    hparams: LambHParams,
) -> None:
    """`lamb_apply_` through `kernels.lamb_apply_` (one scale, -lr x trust, a segment)."""
    scales = [-hparams.lr * trust_ratio(p, u, hparams) for p, u in zip(param_norms, update_norms)]
    kernels.lamb_apply_(param, update, segments, scales)


lamb_native = NativeKernel(direction_=_native_direction_, apply_=_native_apply_)
"""LAMB's two halves through fzero's native kernels (`fzero.native.lamb_direction_`,
`fzero.native.lamb_apply_`)."""


def lamb(
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
) -> Optimizer:
    """LAMB as DeepSpeed's FusedLamb computes it, with its defaults (eps 1e-8, trust
    clamp [0.01, 10], the bias corrected in the step size)."""
    hp = LambHParams(lr, tuple(betas), eps, weight_decay, bias_correction, max_coeff, min_coeff)
    if not 0 <= min_coeff <= max_coeff:
        raise ValueError(f"min_coeff {min_coeff} and max_coeff {max_coeff}: need 0 <= min <= max")
    if len(hp.betas) != 2 or not all(0.0 <= b < 1.0 for b in hp.betas):
        raise ValueError(f"betas is {hp.betas}; expected two values in [0, 1)")

    def update(grad: Tensor, state: LambState, param: Tensor, **overrides: Any):
        return lamb_update(grad, state, param, with_overrides(hp, overrides))

    def update_(grad: Tensor, state: LambState, param: Tensor, segments=None, **overrides: Any):
        return lamb_update_(grad, state, param, with_overrides(hp, overrides), segments)

    needs = TensorNorms(
        direction_=lamb_direction_, apply_=lamb_apply_, step_hparams=lamb_step_hparams
    )
    leaf = Optimizer(
        "lamb", hp, lamb_init, update, update_, state_slots=2, needs=needs, native=lamb_native
    )
    return over_trees(leaf)
