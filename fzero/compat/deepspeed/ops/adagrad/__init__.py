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
    """DeepSpeed's CPU Adagrad (its arguments and defaults): `torch.optim.Adagrad`,
    whose formula DeepSpeed's kernel computes, run by fzero's engine with its native
    kernel (`fzero.optim.adagrad`). `amsgrad` changes nothing, as in DeepSpeed."""
    return torch.optim.Adagrad(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
