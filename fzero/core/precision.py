"""Compute dtypes, casting a forward's inputs to them, and the fp16 loss scale's setup.

fp32 masters always; bf16 or fp16 compute copies; fp16 with DeepSpeed's dynamic loss
scale (`loss_scale: 0`) or a static one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fzero.config import Config
from fzero.optim import DynamicLossScale, StaticLossScale

__all__ = ["DTYPES", "Precision", "cast_floats", "loss_scaler", "precision_of"]

Precision = str  # "fp32" | "bf16" | "fp16"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor in `value` (nested tuples, lists, dicts) cast to `dtype`."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(cast_floats(v, dtype) for v in value)
    if isinstance(value, list):
        return [cast_floats(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value


def precision_of(config: Config) -> Precision:
    """The compute precision a config asks for."""
    if config.fp16.enabled:
        return "fp16"
    if config.bf16.enabled:
        return "bf16"
    return "fp32"


def loss_scaler(config: Config) -> DynamicLossScale | StaticLossScale:
    """The fp16 block's loss scaling: dynamic when `loss_scale` is 0, else static."""
    fp16 = config.fp16
    if fp16.loss_scale:
        return StaticLossScale(fp16.loss_scale)
    return DynamicLossScale(
        initial_scale_power=fp16.initial_scale_power,
        window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        min_scale=fp16.min_loss_scale,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )
