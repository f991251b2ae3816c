"""The scheduler object of a config `scheduler` block, with DeepSpeed's contract.

DeepSpeed (`runtime/engine.py`, `_configure_lr_scheduler` and `_take_model_step`)
builds the config's scheduler over the optimizer, writes the lr of the first step
into the param groups when it is built, and steps `engine.lr_scheduler` after every
applied optimizer step (not after an fp16 overflow skip). `engine.lr_scheduler` is a
plain attribute: a client that sets it to None (Lightning, which steps the scheduler
itself) or to another object changes what the engine steps, saves and loads.

`ConfigScheduler` is that object over fzero's pure schedules: its position is the
engine's `lr_steps` (the number of times it was stepped, DeepSpeed's
`last_batch_iteration + 1`), and stepping it writes `schedule(lr_steps, base_lr)` into
each param group. Like DeepSpeed's `load_state_dict`, loading its state moves the
position and writes no lr (the lr comes back with the optimizer state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from fzero.core.update import scheduled_betas

__all__ = ["ConfigScheduler", "step_scheduler"]


class Engine(Protocol):
    """What the schedule object and `step_scheduler` read and set of their engine
    (`fzero.engine.Engine`; this module sits below it)."""

    lr_steps: int
    optimizer: Any
    lr_scheduler: Any
    config_scheduler: Any
    client_optimizer: torch.optim.Optimizer | None

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...


class ConfigScheduler:
    """DeepSpeed's `lr_schedules` API (`step`, `get_lr`, `get_last_lr`, `state_dict`,
    `load_state_dict`, `last_batch_iteration`) for a pure `schedule(step, base_lr)`."""

    def __init__(self, engine: Engine, schedule: Callable[[int, float], float]) -> None:
        self.engine = engine
        self.schedule = schedule
        self.base_lrs = [group["lr"] for group in engine.param_groups]
        self._write()  # DeepSpeed's schedulers set the first step's lr when built

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    @property
    def last_batch_iteration(self) -> int:
        return self.engine.lr_steps - 1

    def get_lr(self) -> list[float]:
        """The lr of each param group at the current position."""
        return [self.schedule(self.engine.lr_steps, base) for base in self.base_lrs]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def step(
        self, last_batch_iteration: int | None = None, batch_iteration: int | None = None
    ) -> None:
        """Advance one position (or go to `last_batch_iteration`, DeepSpeed's argument;
        `batch_iteration` is OneCycle's and LRRangeTest's name for it) and write the lrs."""
        given = last_batch_iteration if last_batch_iteration is not None else batch_iteration
        self.engine.lr_steps = self.engine.lr_steps + 1 if given is None else given + 1
        self._write()

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Move to the saved position; the lrs are the optimizer state's (as DeepSpeed)."""
        if not isinstance(state, dict) or "last_batch_iteration" not in state:
            raise ValueError(
                f"scheduler state is {state!r}; expected a dict with 'last_batch_iteration'"
            )
        self.engine.lr_steps = int(state["last_batch_iteration"]) + 1

    def _write(self) -> None:
        """The lrs into the param groups, and a cycled momentum's betas into those that
        have betas (DeepSpeed's OneCycle writes both; the update reads them from the
        schedule, so these are what the groups show)."""
        betas = scheduled_betas(self.schedule, self.engine.lr_steps)
        for group, lr in zip(self.engine.param_groups, self.get_lr()):
            group["lr"] = lr
            if betas is not None and "betas" in group:
                group["betas"] = betas


def step_scheduler(engine: Engine, lr_kwargs: dict[str, Any] | None) -> None:
    """After an applied optimizer step: step `engine.lr_scheduler` when there is one
    (DeepSpeed's `_take_model_step`); without a config schedule `lr_steps` counts the
    updates (the functional door's counter)."""
    if engine.config_scheduler is None:
        engine.lr_steps += 1
    scheduler = engine.lr_scheduler
    # torch's schedulers warn unless the optimizer they wrap has stepped: the engine's
    # update was that step (its `step()` is never called on its own), also for a
    # scheduler the client steps itself
    for wrapped in (engine.client_optimizer, getattr(scheduler, "optimizer", None)):
        if isinstance(wrapped, torch.optim.Optimizer):
            wrapped._opt_called = True
    if scheduler is not None:
        scheduler.step(**(lr_kwargs or {}))
