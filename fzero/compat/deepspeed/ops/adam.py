"""`deepspeed.ops.adam`: DeepSpeedCPUAdam and FusedAdam as the `torch.optim` optimizers
fzero runs with its own (native) kernels when handed to `initialize`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _adam(
    params: Iterable[Any],
    lr: float,
    bias_correction: bool,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    adamw_mode: bool,
) -> torch.optim.Optimizer:
    if not bias_correction:
        raise NotImplementedError(
            "bias_correction=False: give it in the config's optimizer block instead "
            '({"type": "AdamW", "params": {"bias_correction": false}})'
        )
    kind = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return kind(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


def DeepSpeedCPUAdam(  # DeepSpeed's name
    model_params: Iterable[Any],
    lr: float = 1e-3,
    bias_correction: bool = True,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    adamw_mode: bool = True,
    fp32_optimizer_states: bool = True,
) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam: `torch.optim.AdamW` (or Adam without `adamw_mode`), which
    fzero's engine runs with its native CPU kernel."""
    return _adam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode)


def FusedAdam(  # DeepSpeed's name
    params: Iterable[Any],
    lr: float = 1e-3,
    bias_correction: bool = True,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    adam_w_mode: bool = True,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    set_grad_none: bool = True,
) -> torch.optim.Optimizer:
    """DeepSpeed's FusedAdam: `torch.optim.AdamW` (or Adam without `adam_w_mode`)."""
    return _adam(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode)
