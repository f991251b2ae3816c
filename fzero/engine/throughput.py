"""DeepSpeed's `engine.tput_timer`: the throughput counters scripts read and advance
(`tput_timer.update_epoch_count()` at each epoch's end, as DeepSpeed-Chat's training
does; `avg_samples_per_sec()`), with DeepSpeed's fields and arithmetic. The engine
starts it in each forward and stops it in each `step()`, counting the steps at the
accumulation boundary; the samples/s line fzero's step report prints stands in for
DeepSpeed's own log line, so this timer logs nothing itself."""

from __future__ import annotations

import time

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    """Time from each forward to its `step()`, summed from the `start_step`-th optimizer
    step on (DeepSpeed's: the first steps' warm-up is left out), over `batch_size`
    samples per optimizer step (the train batch). `enabled`: the config's
    `timers.throughput.enabled` (DeepSpeed's default true)."""

    def __init__(
        self,
        batch_size: int | None,
        start_step: int = 2,
        steps_per_output: int | None = None,
        monitor_memory: bool = False,
        enabled: bool = True,
    ) -> None:
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.enabled = enabled
        self.start_time = self.end_time = 0.0
        self.started = self.initialized = False
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        """An epoch ended: count it and start the micro-steps from 0 (DeepSpeed's)."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """A forward begins: its time counts from the `start_step`-th optimizer step."""
        if not self.enabled:
            return
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """A `step()` ended (`global_step`: at the accumulation boundary). `report_speed`
        is accepted for DeepSpeed's signature; fzero's step report prints the rate."""
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Train samples per second over the timed steps (DeepSpeed's arithmetic); -inf
        until a step has been timed (DeepSpeed's divides by zero at the `start_step`-th)."""
        timed = self.global_step_count - self.start_step
        if timed > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed)
        return float("-inf")
