"""`deepspeed.runtime.lr_schedules`: the names of the schedules a config's `scheduler`
block may give (Accelerate checks a scheduler's class name against them), and
DeepSpeed's scheduler classes for a script that builds one itself over its optimizer
(a torch optimizer, or the engine's) and hands it to `initialize(lr_scheduler=...)` or
steps it.

Each class has DeepSpeed 0.19's arguments, defaults, checks and methods (`step`,
`get_lr`, `get_last_lr`, `state_dict`, `load_state_dict`, `last_batch_iteration`);
the lr of each param group is the pure schedule `fzero.optim` runs for the config's
block (`schedule(last_batch_iteration + 1, group_lr)`), written into the group as
DeepSpeed's `update_lr` writes it. A per-group value (a list with one entry per group)
makes one pure schedule per group.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from fzero import optim as fo

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

__all__ = [
    "LR_RANGE_TEST",
    "ONE_CYCLE",
    "VALID_LR_SCHEDULES",
    "WARMUP_COSINE_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_LINEAR_RATE",
    "WARMUP_LOG_RATE",
    "WARMUP_LR",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "get_torch_optimizer",
    "update_lr",
]

log = logging.getLogger("fzero")


def get_torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """`optimizer` itself, or the torch optimizer it wraps (`.optimizer`); a TypeError
    for anything else (DeepSpeed's rule)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def update_lr(param_groups: list[dict[str, Any]], lrs: Sequence[float]) -> list[Any]:
    """Write `lrs` into the groups (into a tensor lr in place); the groups' lrs."""
    for group, lr in zip(param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[Any]:
    """A scalar for every group, or a list/tuple with one value per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, list | tuple):
        if len(value) != groups:
            raise ValueError(f"expected {groups} value for {name}, got {len(value)}")
        return list(value)
    return [value] * groups


def _warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        log.warning(
            "Using unknown warmup_type: %s. The increasing function is set to default (log)",
            warmup_type,
        )
        return WARMUP_LOG_RATE
    return warmup_type


def _positive_steps(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")


class _GroupSchedules:
    """DeepSpeed's scheduler object over `optimizer`'s param groups, one pure schedule
    per group: group `i`'s lr is `schedules[i](last_batch_iteration + 1, lr_i)`, `lr_i`
    its lr when the scheduler was built."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, schedules: list[Any], last_batch_iteration: int
    ) -> None:
        self.optimizer = optimizer
        self._schedules = schedules
        self._base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[Any] | None = None
        if last_batch_iteration == -1:  # DeepSpeed's schedulers set the first step's lr
            self._last_lr = update_lr(optimizer.param_groups, self._lrs())

    def _lrs(self) -> list[float]:
        step = self.last_batch_iteration + 1
        return [s(step, base) for s, base in zip(self._schedules, self._base_lrs)]

    _warns_before_start = False  # WarmupLR's and WarmupCosineLR's get_lr warn

    def get_lr(self) -> list[float]:
        """Each group's lr at `last_batch_iteration`."""
        if self.last_batch_iteration < 0 and self._warns_before_start:
            log.warning("Attempting to get learning rate from scheduler before it has started")
        return self._lrs()

    def get_last_lr(self) -> list[Any]:
        """The lrs the last `step` (or the constructor) wrote."""
        assert self._last_lr is not None, "need to call step() first"
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one position (or go to `last_batch_iteration`) and write the lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self._lrs())

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Move to the saved position (the lrs come back with the optimizer state)."""
        self.last_batch_iteration = state["last_batch_iteration"]


class WarmupLR(_GroupSchedules):
    """Warm each group's lr up from `warmup_min_lr` to `warmup_max_lr` (default: the
    group's lr) over `warmup_num_steps`, log or linear, then hold it."""

    _warns_before_start = True

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _positive_steps(warmup_num_steps, "warmup_num_steps")
        optimizer = get_torch_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        lows = _per_group(optimizer, warmup_min_lr, "min_lr")
        highs = _per_group(optimizer, warmup_max_lr, "max_lr")
        kind = _warmup_type(warmup_type)
        self.warmup_num_steps, self.warmup_type = max(2, warmup_num_steps), kind
        self.min_lrs, self.max_lrs = lows, highs
        pairs = zip(lows, highs)
        schedules = [self._schedule(low, high, warmup_num_steps, kind) for low, high in pairs]
        super().__init__(optimizer, schedules, last_batch_iteration)

    def _schedule(self, low: float, high: float, steps: int, kind: Any) -> Any:
        return fo.WarmupLR(
            warmup_min_lr=float(low), warmup_max_lr=float(high), warmup_num_steps=steps,
            warmup_type=kind,
        )  # fmt: skip


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`, then a linear decay to 0 at `total_num_steps`."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
            last_batch_iteration,
        )  # fmt: skip
        if total_num_steps < self.warmup_num_steps:
            log.warning(
                "total_num_steps %s is less than warmup_num_steps %s",
                total_num_steps,
                warmup_num_steps,
            )

    def _schedule(self, low: float, high: float, steps: int, kind: Any) -> Any:
        return fo.WarmupDecayLR(
            warmup_min_lr=float(low), warmup_max_lr=float(high), warmup_num_steps=steps,
            warmup_type=kind, total_num_steps=self.total_num_steps,
        )  # fmt: skip


class WarmupCosineLR(_GroupSchedules):
    """Each group's lr times a ratio: warmed up from `warmup_min_ratio` to 1, then a
    cosine down to `cos_min_ratio` at `total_num_steps`, held there after."""

    _warns_before_start = True

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _positive_steps(warmup_num_steps, "warmup_num_steps")
        optimizer = get_torch_optimizer(optimizer)
        kind = _warmup_type(warmup_type)
        self.total_num_steps, self.warmup_num_steps = total_num_steps, max(2, warmup_num_steps)
        if total_num_steps < self.warmup_num_steps:
            log.warning(
                "total_num_steps %s is less than warmup_num_steps %s",
                total_num_steps,
                warmup_num_steps,
            )
        schedule = fo.WarmupCosineLR(
            total_num_steps=total_num_steps, warmup_min_ratio=warmup_min_ratio,
            warmup_num_steps=warmup_num_steps, cos_min_ratio=cos_min_ratio, warmup_type=kind,
        )  # fmt: skip
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        schedules = [schedule] * len(optimizer.param_groups)
        super().__init__(optimizer, schedules, last_batch_iteration)


class OneCycle(_GroupSchedules):
    """One triangular cycle of each group's lr between `cycle_min_lr` and `cycle_max_lr`
    (in stairs with stair counts), then a decay; with `cycle_momentum` (over an
    optimizer with betas) each group's betas cycle inversely as `(momentum, 0.99)`,
    written into the group as DeepSpeed's OneCycle writes them (the engine reads a
    group's betas at every step)."""

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        optimizer = get_torch_optimizer(optimizer)
        if float(cycle_first_step_size) <= 0:
            raise ValueError(
                f"cycle_first_step_size must be positive, got {float(cycle_first_step_size)}"
            )
        if cycle_second_step_size is not None and float(cycle_second_step_size) < 0:
            raise ValueError(
                f"cycle_second_step_size must be non-negative, got {float(cycle_second_step_size)}"
            )
        lows = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        highs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        if cycle_momentum and "betas" not in optimizer.defaults:
            log.warning(
                "cycle_momentum is disabled because optimizer %s does not support momentum, "
                "no betas attribute in defaults",
                type(optimizer).__name__,
            )
            cycle_momentum = False
        mins, maxs = [0.8] * len(lows), [0.9] * len(lows)  # unused without cycling
        if cycle_momentum:  # DeepSpeed checks the momentum lists only then
            mins = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
            maxs = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.min_lrs, self.max_lrs, self.cycle_momentum = lows, highs, cycle_momentum
        schedules = [
            fo.OneCycle(
                cycle_min_lr=float(low),
                cycle_max_lr=float(high),
                decay_lr_rate=decay_lr_rate,
                cycle_first_step_size=cycle_first_step_size,
                cycle_second_step_size=cycle_second_step_size,
                cycle_first_stair_count=cycle_first_stair_count,
                cycle_second_stair_count=cycle_second_stair_count,
                decay_step_size=decay_step_size,
                cycle_momentum=cycle_momentum,
                cycle_min_mom=float(low_mom),
                cycle_max_mom=float(high_mom),
                decay_mom_rate=decay_mom_rate,
            )
            for low, high, low_mom, high_mom in zip(lows, highs, mins, maxs)
        ]
        super().__init__(optimizer, schedules, last_batch_iteration)
        if cycle_momentum and last_batch_iteration == -1:
            self._write_betas()

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Each group's betas at `last_batch_iteration` (None without momentum cycling)."""
        if not self.cycle_momentum:
            return None
        step = self.last_batch_iteration + 1
        return [s.betas(step) for s in self._schedules]

    def _write_betas(self) -> None:
        for group, betas in zip(self.optimizer.param_groups, self.get_mom() or []):
            group["betas"] = betas

    def step(self, batch_iteration: int | None = None) -> None:  # DeepSpeed's argument name
        """Advance one position (or go to `batch_iteration`); write the lrs and betas."""
        super().step(batch_iteration)
        if self.cycle_momentum:
            self._write_betas()


class LRRangeTest(_GroupSchedules):
    """Each group's lr grows from `lr_range_test_min_lr` by `lr_range_test_step_rate`
    per `lr_range_test_step_size` steps (in stairs with `lr_range_test_staircase`)."""

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        optimizer = get_torch_optimizer(optimizer)
        if isinstance(lr_range_test_min_lr, list | tuple):
            groups = len(optimizer.param_groups)
            if len(lr_range_test_min_lr) != groups:
                raise ValueError(
                    f"expected {groups} lr_range_test_min_lr, got {len(lr_range_test_min_lr)}"
                )
        _positive_steps(lr_range_test_step_size, "lr_range_test_step_size")
        lows = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.min_lr, self.step_size = lows, lr_range_test_step_size
        self.step_rate, self.staircase = lr_range_test_step_rate, lr_range_test_staircase
        schedules = [
            fo.LRRangeTest(
                lr_range_test_min_lr=float(low),
                lr_range_test_step_size=lr_range_test_step_size,
                lr_range_test_step_rate=lr_range_test_step_rate,
                lr_range_test_staircase=lr_range_test_staircase,
            )
            for low in lows
        ]
        super().__init__(optimizer, schedules, last_batch_iteration)

    def step(self, batch_iteration: int | None = None) -> None:  # DeepSpeed's argument name
        """Advance one position (or go to `batch_iteration`) and write the lrs."""
        super().step(batch_iteration)
