"""`deepspeed.ops.adagrad`: DeepSpeedCPUAdagrad as the `torch.optim.Adagrad` fzero runs
with its own (native) Adagrad kernel when handed to `initialize`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdagrad"]


def DeepSpeedCPUAdagrad(  # DeepSpeed's name
    model_params: Iterable[Any],
    lr: float = 1e-2,
    eps: float = 1e-10,
    weight_decay: float = 0,
    amsgrad: bool = False,
    fp32_optimizer_states: bool = True,
) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adagrad: `torch.optim.Adagrad`, which fzero's engine runs with
    its native kernel (`fzero.optim.adagrad`).

    DeepSpeed's CPU kernel divides the gradient before weight decay by the root of the
    decayed squares' sum; `torch.optim.Adagrad` (what DeepSpeed runs without offload)
    divides the decayed gradient. With `weight_decay` 0 the two are one formula; with
    decay this refuses rather than train differently from either (give the decay to
    `torch.optim.Adagrad` or the config's `Adagrad` block: torch's formula).
    `amsgrad` has no meaning for Adagrad (DeepSpeed ignores it): True is refused too.
    """
    if weight_decay:
        raise NotImplementedError(
            f"deepspeed.ops.adagrad.DeepSpeedCPUAdagrad with weight_decay={weight_decay}: "
            "DeepSpeed's CPU kernel leaves the decay out of the numerator, which fzero does "
            "not reproduce; allowed: weight_decay=0, or torch.optim.Adagrad / the config's "
            '{"type": "Adagrad"} block for decay as torch.optim.Adagrad applies it'
        )
    if amsgrad:
        raise NotImplementedError(
            "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad with amsgrad=True: Adagrad has no "
            "AMSGrad variant (DeepSpeed ignores the flag); allowed: amsgrad=False"
        )
    return torch.optim.Adagrad(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
