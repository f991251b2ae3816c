"""`deepspeed.runtime.fp16.loss_scaler`: DeepSpeed's loss scalers with their fields and
methods, for scripts that import them. Training scripts on torch >= 2.6 name
`LossScaler` (with `ZeroStageEnum`) among `torch.serialization.add_safe_globals` to load
DeepSpeed's pickled checkpoints; fzero writes no pickle, but the import must work.
`DynamicLossScaler.update_scale` steps fzero's `DynamicLossScale` (DeepSpeed's rule:
hysteresis, growth after `scale_window` clean steps, an error at the minimum)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from fzero.optim import DynamicLossScale, LossScaleState

__all__ = ["DynamicLossScaler", "LossScaler", "LossScalerBase"]

log = logging.getLogger("fzero")


class LossScalerBase:
    """A loss scale `cur_scale` (`loss_scale`) that scales a loss before backward."""

    def __init__(self, cur_scale: float) -> None:
        self.cur_scale = cur_scale
        self.dynamic = False

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: tuple[Tensor, ...], grad_out: Any) -> tuple:
        return tuple(self.loss_scale * g for g in grad_in)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            log.warning("fzero: overflow; the step is skipped (the gradients are not finite)")

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * self.loss_scale

    def backward(self, loss: Tensor, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)


class LossScaler(LossScalerBase):
    """A static loss scale (`scale`, default 1): never overflows, never changes."""

    def __init__(self, scale: float = 1) -> None:
        super().__init__(scale)

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return False


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic loss scale: halved on an overflow once `delayed_shift`
    overflows have been absorbed (not below `min_scale`; at it, an error unless
    `raise_error_at_min_scale` is false), doubled after `scale_window` steps without."""

    def __init__(
        self,
        init_scale: float,
        scale_window: int,
        min_scale: float,
        delayed_shift: int,
        consecutive_hysteresis: bool,
        raise_error_at_min_scale: bool = True,
        dtype: torch.dtype = torch.half,
    ) -> None:
        super().__init__(init_scale)
        self.scale_factor = 2.0
        self.scale_window, self.min_scale = scale_window, min_scale
        self.delayed_shift, self.consecutive_hysteresis = delayed_shift, consecutive_hysteresis
        self.raise_error_at_min_scale, self.dtype = raise_error_at_min_scale, dtype
        self.dynamic = True
        self._rule = DynamicLossScale(
            window=scale_window, hysteresis=delayed_shift, min_scale=min_scale,
            factor=self.scale_factor, consecutive_hysteresis=consecutive_hysteresis,
        )  # fmt: skip
        self._state = LossScaleState(float(init_scale), delayed_shift, 0, -1)

    @property
    def cur_iter(self) -> int:
        return self._state.iteration

    @property
    def last_overflow_iter(self) -> int:
        return self._state.last_overflow_iteration

    @property
    def cur_hysteresis(self) -> int:
        return self._state.hysteresis

    def has_overflow_serial(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in params)

    def has_overflow(self, params: Iterable[torch.nn.Parameter]) -> bool:
        return self.has_overflow_serial(params)

    def update_scale(self, overflow: bool) -> None:
        state = self._state._replace(scale=float(self.cur_scale))
        if self.raise_error_at_min_scale and self._rule.stuck(state, overflow):
            raise Exception(  # DeepSpeed's type and words
                "Current loss scale already at minimum - cannot decrease scale anymore. "
                "Exiting run."
            )
        self._state = self._rule.update(state, overflow)
        self.cur_scale = self._state.scale
        if overflow:
            log.info("fzero: overflow; loss scale now %s", self.cur_scale)
