"""Loss scaling for fp16 as a pure state transition (Micikevicius et al. 2018).

Dynamic scaling follows DeepSpeed's `DynamicLossScaler.update_scale`: on an
overflow the step is skipped and, once `hysteresis` overflows have been
absorbed, the scale is divided by `factor` (not below `min_scale`); after
`window` iterations without overflow it is multiplied by `factor`. The
hysteresis budget is restored at each growth (or after every good step with
`consecutive_hysteresis`). A static scale never changes and never skips.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["DynamicLossScale", "LossScaleState", "StaticLossScale"]


class LossScaleState(NamedTuple):
    scale: float
    hysteresis: int
    iteration: int
    last_overflow_iteration: int


@dataclass(frozen=True)
class DynamicLossScale:
    initial_scale_power: int = 16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    factor: float = 2.0
    consecutive_hysteresis: bool = False

    dynamic = True

    def init(self) -> LossScaleState:
        return LossScaleState(float(2**self.initial_scale_power), self.hysteresis, 0, -1)

    def update(self, state: LossScaleState, found_inf: bool) -> LossScaleState:
        scale, hysteresis, iteration, last_overflow = state
        if found_inf:
            if self.hysteresis == 1 or hysteresis == 1:
                scale = max(scale / self.factor, self.min_scale)
            else:
                hysteresis -= 1
            last_overflow = iteration
        else:
            if self.consecutive_hysteresis:
                hysteresis = self.hysteresis
            if (iteration - last_overflow) % self.window == 0:
                if not self.consecutive_hysteresis:
                    hysteresis = self.hysteresis
                scale *= self.factor
        return LossScaleState(scale, hysteresis, iteration + 1, last_overflow)


@dataclass(frozen=True)
class StaticLossScale:
    scale: float = 1.0

    dynamic = False

    def init(self) -> LossScaleState:
        return LossScaleState(float(self.scale), 0, 0, -1)

    def update(self, state: LossScaleState, found_inf: bool) -> LossScaleState:
        return state._replace(iteration=state.iteration + 1)
