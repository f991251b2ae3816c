"""`deepspeed.runtime.zero.config`: `ZeroStageEnum`, DeepSpeed's names for the ZeRO stages
(training scripts on torch >= 2.6 list it among `torch.serialization.add_safe_globals`).
DeepSpeed's pydantic config classes are not served: fzero's `zero_optimization` section
is `fzero.config.ZeroConfig`."""

from __future__ import annotations

from enum import Enum

__all__ = ["ZeroStageEnum"]


class ZeroStageEnum(int, Enum):
    """The ZeRO stages by what they partition (`max_stage` is `weights`)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3
