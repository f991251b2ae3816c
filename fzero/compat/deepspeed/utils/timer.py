"""`deepspeed.utils.timer`: DeepSpeed's timers, which research code uses as general
utilities: `SynchronizedWallClockTimer` (named timers, `timers("fwd").start()` /
`.stop()` / `.elapsed()` in milliseconds, `timers.log([...])`), `NoopTimer`,
`ThroughputTimer` (DeepSpeed's signature over `fzero.engine.throughput`) and
`trim_mean`. The timers read the host clock, after waiting for the GPU where there is
one (DeepSpeed records CUDA events there: the same intervals)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fzero.engine.throughput import ThroughputTimer as _ThroughputTimer

__all__ = ["NoopTimer", "SynchronizedWallClockTimer", "ThroughputTimer", "trim_mean"]


def trim_mean(data: list[float], trim_percent: float) -> float:
    """The mean of `data` without its `trim_percent` smallest and largest values (sorts
    `data` in place, as DeepSpeed's does); 0 for no data."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent is {trim_percent}; it must be in [0, 1]")
    if not data:
        return 0
    data.sort()
    cut = round(len(data) * trim_percent)
    kept = data[cut : len(data) - cut]
    if not kept:
        raise ValueError(f"trim_percent {trim_percent} leaves none of {len(data)} values")
    return sum(kept) / len(kept)


def _now() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.time()


class SynchronizedWallClockTimer:
    """A group of named timers (`timers(name)` makes one on first use)."""

    class Timer:
        """One timer: the intervals between `start()` and `stop()` since the last reset."""

        def __init__(self, name: str) -> None:
            self.name_ = name
            self.started_ = False
            self.start_time = self.end_time = 0.0
            self.event_timers: list[float] = []  # seconds, one per interval
            self.elapsed_records: list[float] | None = None

        def start(self) -> None:
            if self.started_:
                raise RuntimeError(f"{self.name_} timer has already been started")
            self.start_time = _now()
            self.started_ = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            if not self.started_:
                raise RuntimeError(f"{self.name_} timer is not started")
            self.end_time = _now()
            self.event_timers.append(self.end_time - self.start_time)
            self.started_ = False

        def reset(self) -> None:
            self.started_ = False
            self.elapsed_records = None
            self.event_timers.clear()

        def elapsed(self, reset: bool = True) -> float:
            """Milliseconds timed since the last reset (a running interval counts to
            now and goes on)."""
            running = self.started_
            if running:
                self.stop()
            self.elapsed_records = [seconds * 1000.0 for seconds in self.event_timers]
            total = sum(self.elapsed_records)
            if reset:
                self.reset()
            if running:
                self.start()
            return total

        def mean(self) -> float:
            """The trimmed (10%) mean interval, in milliseconds."""
            self.elapsed(reset=False)
            return trim_mean(list(self.elapsed_records or []), 0.1)

    def __init__(self) -> None:
        self.timers: dict[str, SynchronizedWallClockTimer.Timer] = {}

    def get_timers(self) -> dict[str, SynchronizedWallClockTimer.Timer]:
        return self.timers

    def __call__(self, name: str) -> SynchronizedWallClockTimer.Timer:
        if name not in self.timers:
            self.timers[name] = self.Timer(name)
        return self.timers[name]

    @staticmethod
    def memory_usage() -> str:
        """The accelerator's allocated and cached memory, as DeepSpeed prints it."""
        gib = 1024**3
        cuda = torch.cuda.is_available()
        values = (
            (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
             torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved())
            if cuda else (0, 0, 0, 0)
        )  # fmt: skip
        names = ("mem_allocated", "max_mem_allocated", "cache_allocated", "max_cache_allocated")
        return "".join(f" | {n}: {v / gib:.4f} GB" for n, v in zip(names, values))

    def log(
        self,
        names: Sequence[str],
        normalizer: float = 1.0,
        reset: bool = True,
        memory_breakdown: bool = False,
        ranks: Sequence[int] | None = None,
    ) -> None:
        """Print `time (ms) | name: elapsed / normalizer | ...` on `ranks` (rank 0)."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer is {normalizer}; it must be > 0")
        line = "time (ms)"
        for name in names:
            if name in self.timers:
                line += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank in (ranks or [0]):
            print(line, flush=True)

    def get_mean(
        self, names: Sequence[str], normalizer: float = 1.0, reset: bool = True
    ) -> dict[str, float]:
        """Each named timer's `mean()` x 1000 / `normalizer` (DeepSpeed's arithmetic: the
        mean is in milliseconds already, so the figure is in microseconds)."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer is {normalizer}; it must be > 0")
        return {n: self.timers[n].mean() * 1000.0 / normalizer for n in names if n in self.timers}


class NoopTimer:
    """Timers that time nothing (DeepSpeed's stand-in when timing is off)."""

    class Timer:
        def start(self) -> None: ...

        def reset(self) -> None: ...

        def stop(self, **kwargs: Any) -> None: ...

        def elapsed(self, **kwargs: Any) -> float:
            return 0

        def mean(self) -> float:
            return 0

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str) -> NoopTimer.Timer:
        return self.timer

    def get_timers(self) -> dict[str, Any]:
        return {}

    def log(self, names: Sequence[str], *args: Any, **kwargs: Any) -> None:
        """Prints nothing."""


class ThroughputTimer(_ThroughputTimer):
    """DeepSpeed's constructor: `config` (its timers config: `enabled`, default on),
    `batch_size`, `start_step`, `steps_per_output`, `monitor_memory`, `logging_fn`."""

    def __init__(
        self,
        config: Any,
        batch_size: int | None,
        start_step: int = 2,
        steps_per_output: int | None = None,
        monitor_memory: bool = False,
        logging_fn: Callable[[str], None] | None = None,
    ) -> None:
        enabled = bool(getattr(config, "enabled", True)) if config is not None else True
        super().__init__(batch_size, start_step, steps_per_output, monitor_memory, enabled)
        self.config, self.logging = config, logging_fn or print
