"""Loss scaling for fp16 as a pure state transition (Micikevicius et al. 2018).

Dynamic scaling follows DeepSpeed's `DynamicLossScaler.update_scale` (0.19's): on an
overflow the step is skipped and, once `hysteresis` overflows have been
absorbed, the scale is divided by `factor` (not below `min_scale`); a clean step that
follows `window` clean steps (counted from the last overflow, or from the start)
multiplies it by `factor`: the first growth comes at the `window + 1`-th clean step. The
hysteresis budget is restored at each growth (or after every good step with
`consecutive_hysteresis`). A static scale never changes and never skips. An overflow
with the scale already at `min_scale` and the hysteresis spent cannot lower it: the run
is stuck skipping every step, and (as DeepSpeed's `raise_error_at_min_scale`) the
step's caller stops with `LossScaleError` (`DynamicLossScale.stuck`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["DynamicLossScale", "LossScaleError", "LossScaleState", "StaticLossScale"]


class LossScaleError(FloatingPointError):
    """fp16 gradients overflowed with the loss scale already at its minimum: no step can
    be taken (the training state is as before the step that raised)."""


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

    def stuck(self, state: LossScaleState, found_inf: bool) -> bool:
        """Whether this overflow would leave the scale where it is: at `min_scale`, with
        no hysteresis left to absorb it (DeepSpeed raises here)."""
        spent = self.hysteresis == 1 or state.hysteresis == 1
        return found_inf and spent and state.scale <= self.min_scale

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
            stable = iteration - last_overflow - 1  # clean steps before this one
            if stable > 0 and stable % self.window == 0:
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

    def stuck(self, state: LossScaleState, found_inf: bool) -> bool:
        """Never: a static scale does not skip steps."""
        return False

    def update(self, state: LossScaleState, found_inf: bool) -> LossScaleState:
        return state._replace(iteration=state.iteration + 1)
