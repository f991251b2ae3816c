"""What a run's figures are called in a monitor: DeepSpeed's events and fzero's own.

An event is DeepSpeed's 3-tuple `(name, value, samples)`: the x axis is the number of
samples the run has trained on (`engine.global_samples`), so runs with different
batch sizes line up. DeepSpeed's engine writes `Train/Samples/train_loss` (the mean
loss of the step's micro-batches on rank 0, at the samples counted *before* the step),
`Train/Samples/lr` (the first group's, after the step) and `Train/Samples/loss_scale`
(fp16), and with `wall_clock_breakdown` `Train/Samples/elapsed_time_ms_<timer>`.
fzero adds, every report (`steps_per_print`), what the step line shows: throughput,
TFLOP/s and MFU, model-state memory against the plan, communication by mesh axes and
NVMe rates. MB is 10^6 bytes here as everywhere in fzero.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "PREFIX",
    "Event",
    "event_name",
    "report_events",
    "series_name",
    "step_events",
]

Event = tuple[str, float, int]
"""DeepSpeed's event: (name, value, samples)."""

PREFIX = "Train/Samples/"

# metrics-record key -> event name after PREFIX; the value is the record's as it is
_REPORTED = {
    "samples_per_s": "samples_per_second",
    "tokens_per_s": "tokens_per_second",
    "tflops": "tflops",
    "mfu": "mfu",
    "memory_mb": "model_state_MB",
    "memory_plan_mb": "model_state_plan_MB",
    "peak_memory_mb": "peak_memory_MB",
    "nvme_read_mb_per_s": "nvme_read_MB_per_second",
    "nvme_write_mb_per_s": "nvme_write_MB_per_second",
}


def event_name(series: str) -> str:
    """The event a series is written as (`train_loss` -> `Train/Samples/train_loss`)."""
    return PREFIX + series


def series_name(event: str) -> str:
    """The series an event or a CSV monitor's file stem names (`Train/Samples/lr` and
    `Train_Samples_lr` -> `lr`); other names stay as they are."""
    for prefix in (PREFIX, PREFIX.replace("/", "_")):
        if event.startswith(prefix):
            return event[len(prefix) :]
    return event


def step_events(
    *,
    loss: float | None,
    lr: float | None,
    samples_before: int,
    samples_after: int,
    loss_scale: float | None = None,
    grad_norm: float | None = None,
) -> list[Event]:
    """What DeepSpeed's engine writes at each optimizer step: the step's mean
    micro-batch loss at the samples before it, the learning rate (and fp16 loss scale)
    after it; and fzero's global gradient norm (before clipping) after it."""
    events: list[Event] = []
    if loss is not None:
        events.append((event_name("train_loss"), float(loss), samples_before))
    if lr is not None:
        events.append((event_name("lr"), float(lr), samples_after))
    if loss_scale is not None:
        events.append((event_name("loss_scale"), float(loss_scale), samples_after))
    if grad_norm is not None:
        events.append((event_name("grad_norm"), float(grad_norm), samples_after))
    return events


def report_events(record: Mapping[str, Any], samples: int) -> list[Event]:
    """fzero's figures of one metrics record (a `metrics_file` line, or a `train_step`
    metrics dict) at `samples`: the throughput, memory and rate keys of `_REPORTED`,
    `comm_mb_per_step` by mesh axes (`comm_MB_per_step_<axes>`), and `ms` (per-step
    timers, DeepSpeed's `elapsed_time_ms_<timer>`)."""
    return list(_report_events(record, samples))


def _report_events(record: Mapping[str, Any], samples: int) -> Iterator[Event]:
    for key, name in _REPORTED.items():
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield event_name(name), float(value), samples
    for axes, megabytes in sorted((record.get("comm_mb_per_step") or {}).items()):
        yield event_name(f"comm_MB_per_step_{axes}"), float(megabytes), samples
    for timer, ms in sorted((record.get("ms") or {}).items()):
        yield event_name(f"elapsed_time_ms_{timer}"), float(ms), samples
