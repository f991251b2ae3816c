"""Learning-rate schedules as pure values: `schedule(step, base_lr) -> lr`.

`step` is the index of the optimizer step about to run (0 for the first).
DeepSpeed's schedulers are stepped after each optimizer step, so the lr of
step `s` is their `get_lr()` at `last_batch_iteration = s - 1`, where -1 is the
value the scheduler sets when it is built. The formulas follow DeepSpeed's
`deepspeed/runtime/lr_schedules.py`; `warmup_exp_decay_exp` follows the Bing
BERT recipe (`DeepSpeedExamples/bing_bert/nvidia/modelingpreln.py` usage).
`base_lr` is the param group's configured lr: schedules that scale it use it,
the others ignore it (as DeepSpeed's set every group to the same value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "Schedule",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupExpDecayExp",
    "WarmupLR",
    "constant",
]


class Schedule(Protocol):
    def __call__(self, step: int, base_lr: float) -> float:
        """The lr of optimizer step `step` for a group configured with `base_lr`."""
        ...


@dataclass(frozen=True)
class Constant:
    def __call__(self, step: int, base_lr: float) -> float:
        return base_lr


constant = Constant()


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """DeepSpeed's warmup fraction at `last_batch_iteration = iteration` (< warmup steps)."""
    steps = max(2, warmup_num_steps)
    if warmup_type == "log":  # DeepSpeed's operations, in its order: the same bits
        return (1.0 / math.log(steps)) * math.log(iteration + 1)
    return iteration / steps


@dataclass(frozen=True)
class WarmupLR:
    """Warm up from `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then hold.
    Without `warmup_max_lr`, up to each group's configured lr (DeepSpeed 0.19's default;
    `WarmupDecayLR` keeps 1e-3, as DeepSpeed's)."""

    warmup_min_lr: float = 0.0
    warmup_max_lr: float | None = None
    warmup_num_steps: int = 1000
    warmup_type: Literal["log", "linear"] = "log"

    def gamma(self, iteration: int) -> float:
        if iteration < max(2, self.warmup_num_steps):
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def __call__(self, step: int, base_lr: float) -> float:
        iteration = step - 1
        if iteration < 0:
            return self.warmup_min_lr
        top = base_lr if self.warmup_max_lr is None else self.warmup_max_lr
        return self.warmup_min_lr + (top - self.warmup_min_lr) * self.gamma(iteration)


@dataclass(frozen=True)
class WarmupDecayLR(WarmupLR):
    """`WarmupLR`, then linear decay to 0 at `total_num_steps`."""

    total_num_steps: int = 10_000
    warmup_max_lr: float | None = 1e-3

    def gamma(self, iteration: int) -> float:
        if iteration < max(2, self.warmup_num_steps):
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        remaining = self.total_num_steps - iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - max(2, self.warmup_num_steps)))


@dataclass(frozen=True)
class WarmupCosineLR:
    """Ratio of `base_lr`: warm up from `warmup_min_ratio` to 1, then cosine to `cos_min_ratio`."""

    total_num_steps: int = 10_000
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = 1000
    cos_min_ratio: float = 1e-4
    warmup_type: Literal["log", "linear"] = "log"

    def ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0  # DeepSpeed sets lr 0 before its first scheduler step
        warmup = max(2, self.warmup_num_steps)
        if iteration < warmup:
            gamma = _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        done = iteration - warmup + 1
        total = self.total_num_steps - warmup
        # past the end it stays at cos_min_ratio (DeepSpeed clamps the progress at 1)
        cosine = (1 + math.cos(math.pi * min(1.0, done / max(1, total)))) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def __call__(self, step: int, base_lr: float) -> float:
        return base_lr * self.ratio(step - 1)


@dataclass(frozen=True)
class OneCycle:
    """One triangular cycle between `cycle_min_lr` and `cycle_max_lr`, then decay.

    With `cycle_momentum`, beta1 cycles inversely between `cycle_max_mom` and
    `cycle_min_mom` (`momentum(step)`), and an Adam-family optimizer's betas are
    `(beta1, 0.99)` meanwhile (`betas(step)`: DeepSpeed's OneCycle writes that pair into
    the param groups, whatever beta2 was). Stair counts above 0 move the lr (and
    momentum) in that many equal stairs per half-cycle. `decay_step_size = 0` means no
    post-cycle decay (DeepSpeed divides by it; fzero holds `cycle_min_lr` instead).
    """

    cycle_min_lr: float = 1e-4
    cycle_max_lr: float = 1e-3
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: int | None = None
    cycle_first_stair_count: int = 0
    cycle_second_stair_count: int | None = None
    decay_step_size: int = 0
    cycle_momentum: bool = True
    cycle_min_mom: float = 0.8
    cycle_max_mom: float = 0.9
    decay_mom_rate: float = 0.0

    @property
    def total_size(self) -> float:
        second = self.cycle_second_step_size
        return float(self.cycle_first_step_size) + float(
            self.cycle_first_step_size if second is None else second
        )

    def _scale(self, iteration: int) -> float:
        first, total = float(self.cycle_first_step_size), self.total_size
        step_ratio = first / total
        batch = iteration + 1
        cycle = math.floor(1 + batch / total)
        x = 1.0 + batch / total - cycle
        if x <= step_ratio:
            scale, stairs = x / step_ratio, self.cycle_first_stair_count
        else:
            second = self.cycle_second_stair_count
            scale = (x - 1) / (step_ratio - 1)
            stairs = self.cycle_first_stair_count if second is None else second
        if stairs > 0:
            within = batch % total
            if within <= first:
                position = within * stairs / first
            else:
                position = (total - within) * stairs / (total - first)
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self, iteration: int) -> float:
        if not self.decay_step_size:
            return 0.0
        return (iteration - self.total_size + 1) / self.decay_step_size

    def __call__(self, step: int, base_lr: float) -> float:
        iteration = step - 1
        if iteration < 0:
            return self.cycle_min_lr
        if iteration < self.total_size:
            return self.cycle_min_lr + (self.cycle_max_lr - self.cycle_min_lr) * self._scale(
                iteration
            )
        return self.cycle_min_lr / (1 + self.decay_lr_rate * self._decay_interval(iteration))

    def momentum(self, step: int) -> float | None:
        """beta1 for step `step`, or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        iteration = step - 1
        if iteration < 0:
            return self.cycle_min_mom
        if iteration < self.total_size:
            return self.cycle_max_mom - (self.cycle_max_mom - self.cycle_min_mom) * self._scale(
                iteration
            )
        return self.cycle_max_mom * (1 + self.decay_mom_rate * self._decay_interval(iteration))

    def betas(self, step: int) -> tuple[float, float] | None:
        """An Adam-family optimizer's betas for step `step`, or None when momentum is not
        cycled: `(momentum(step), 0.99)`, the pair DeepSpeed's OneCycle writes."""
        beta1 = self.momentum(step)
        return None if beta1 is None else (beta1, 0.99)


@dataclass(frozen=True)
class LRRangeTest:
    """lr = min_lr · (1 + step_rate · interval), interval = iterations / step_size (floored
    when `staircase`): the LR range test of Smith 2017."""

    lr_range_test_min_lr: float = 1e-3
    lr_range_test_step_size: int = 2000
    lr_range_test_step_rate: float = 1.0
    lr_range_test_staircase: bool = False

    def __call__(self, step: int, base_lr: float) -> float:
        iteration = step - 1
        if iteration < 0:
            return self.lr_range_test_min_lr
        interval = (iteration + 1) / self.lr_range_test_step_size
        if self.lr_range_test_staircase:
            interval = math.floor(interval)
        return self.lr_range_test_min_lr * (1 + self.lr_range_test_step_rate * interval)


@dataclass(frozen=True)
class WarmupExpDecayExp:
    """Bing BERT's `warmup_exp_decay_exp`, a multiplier of `base_lr`:
    `(x / warmup)^degree` while `x = step / total_steps < warmup`, then
    `decay_rate^((step - warmup · total_steps) / decay_steps)`."""

    total_steps: int
    warmup_proportion: float = 0.002
    decay_rate: float = 0.99
    decay_steps: int = 1000
    degree: float = 2.0

    def __call__(self, step: int, base_lr: float) -> float:
        x = step / self.total_steps
        if x < self.warmup_proportion:
            return base_lr * (x / self.warmup_proportion) ** self.degree
        warmup_end = self.warmup_proportion * self.total_steps
        return base_lr * self.decay_rate ** ((step - warmup_end) / self.decay_steps)
