"""`deepspeed.ops.lamb`: FusedLamb as a `torch.optim` optimizer that steps with
`fzero.optim.lamb` (standalone), and that fzero's engine runs as its own Lamb (native
kernels, per-tensor trust ratios across shards) when handed to `initialize`.

DeepSpeed's FusedLamb kernel (`csrc/lamb/fused_lamb_cuda_kernel.cu`) computes, per tensor,

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g²
    u = m / (sqrt(v) + eps) + wd · p
    p = p - step_size · clamp(‖p‖ / ‖u‖, min_coeff, max_coeff) · u

with `step_size = lr · sqrt(1 - b2^t) / (1 - b1^t)` (`lr` without `bias_correction`):
fzero's Lamb, the same update. Its other options compute what fzero's Lamb does not,
so they are refused here rather than run differently: `eps_inside_sqrt=True` divides by
`sqrt(v + eps)`; `max_grad_norm > 0` clips by a norm that only a caller of
`step(grad_norms=...)` gives it (clip with the config's `gradient_clipping`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from fzero.compat.deepspeed.ops._stepping import step_each
from fzero.optim import LambState, Optimizer, lamb

__all__ = ["FusedLamb"]


def _refusal(name: str, value: Any, allowed: str, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"FusedLamb: {name}={value!r} is not supported: {why}; allowed: {allowed}"
    )


def _rule(group: dict[str, Any]) -> Optimizer:
    """The Lamb a param group steps with, after refusing what fzero's Lamb does not compute
    (`fzero.optim.lamb` checks betas and the coefficient bounds, naming a bad one)."""
    if group["max_grad_norm"] != 0:
        raise _refusal(
            "max_grad_norm", group["max_grad_norm"], "0",
            "DeepSpeed clips by a norm only a caller of step(grad_norms=...) gives; clip "
            "with the config's gradient_clipping instead",
        )  # fmt: skip
    return lamb(
        group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"],
        bias_correction=bool(group["bias_correction"]), max_coeff=group["max_coeff"],
        min_coeff=group["min_coeff"],
    )  # fmt: skip


class FusedLamb(torch.optim.Optimizer):
    """DeepSpeed's FusedLamb (its arguments and defaults): a `torch.optim.Optimizer`
    whose `step` is `fzero.optim.lamb`'s in-place update per parameter (one trust ratio
    per tensor, as DeepSpeed's); in `fzero.initialize` the engine runs its groups as
    `fzero.optim.lamb`. What fzero's Lamb does not compute is refused when constructed
    (and when a group is added), naming the argument: see the module's docstring.

    Args:
        params (Iterable): parameters, or dicts of param groups.
        lr (float): learning rate.
        bias_correction (bool): correct the moments' bias in the step size.
        betas (tuple[float, float]): the moments' decay rates.
        eps (float): added to sqrt(v).
        eps_inside_sqrt (bool): True (eps under the square root) is refused.
        weight_decay (float): added to the update as `weight_decay · p`.
        max_grad_norm (float): any but 0 is refused.
        max_coeff (float): the trust ratio's upper bound.
        min_coeff (float): its lower bound.
        amsgrad (bool): True is refused, as DeepSpeed refuses it.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")  # DeepSpeed's
        if eps_inside_sqrt:
            raise _refusal(
                "eps_inside_sqrt", eps_inside_sqrt, "False",
                "fzero's Lamb divides by sqrt(v) + eps, not sqrt(v + eps)",
            )  # fmt: skip
        defaults = {
            "lr": lr, "bias_correction": bias_correction, "betas": tuple(betas), "eps": eps,
            "weight_decay": weight_decay, "max_grad_norm": max_grad_norm,
            "max_coeff": max_coeff, "min_coeff": min_coeff,
        }  # fmt: skip
        super().__init__(params, defaults)
        self.eps_mode = 1  # DeepSpeed's attribute: eps outside the square root

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, refusing values fzero's Lamb does not compute (before adding)."""
        _rule({**self.defaults, **param_group})
        super().add_param_group(param_group)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One Lamb step of every parameter with a gradient (sparse gradients refused)."""
        return step_each(self, closure, _rule, LambState)
