"""Watching a run: DeepSpeed's monitors, communication logger and FLOPs profiler on
fzero's own measurements, and what `fzero plot` draws.

- `monitor(config)` / `Monitor`: the `tensorboard`, `csv_monitor`, `wandb` and `comet`
  blocks (DeepSpeed's events, `Train/Samples/...` against samples, plus fzero's
  throughput, MFU, memory against the plan, communication per mesh axis and NVMe
  rates); rank 0 writes. The engine writes through one by itself; `train_step` loops
  call `Monitor.log(metrics, samples=...)`.
- `CommsLogger` / `comms_logger()`: `comms_logger`, on fzero's attributable collectives,
  per operation, purpose and mesh axes, beside `comm_volume`'s model (`comms_summary`).
- `FlopsProfiler` / `get_model_profile`: `flops_profiler`, counted by
  `torch.utils.flop_counter.FlopCounterMode`; `peak_flops` for MFU.
- `read_run` / `plot_runs`: a metrics file, a TensorBoard or CSV monitor directory, as
  series; one PNG of several runs.
"""

from fzero.monitoring._comms import (
    OPERATIONS,
    PURPOSES,
    CommRow,
    CommsLogger,
    bus_bandwidth_factor,
    comms_logger,
    comms_logger_for,
    format_comms_summary,
    modelled_rows,
    purpose_of,
)
from fzero.monitoring._events import (
    PREFIX,
    Event,
    event_name,
    report_events,
    series_name,
    step_events,
)
from fzero.monitoring._flops import (
    FlopsProfiler,
    ModuleProfile,
    ProfiledStep,
    StepTimes,
    format_number,
    get_model_profile,
)
from fzero.monitoring._monitor import BLOCKS, Monitor, monitor
from fzero.monitoring._peak import NVIDIA_PEAKS, Peak, measure_matmul_flops, peak_flops
from fzero.monitoring._plot import PANELS, plot_runs
from fzero.monitoring._progress import ProgressBar
from fzero.monitoring._runs import Run, read_run

__all__ = [
    "BLOCKS",
    "NVIDIA_PEAKS",
    "OPERATIONS",
    "PANELS",
    "PREFIX",
    "PURPOSES",
    "CommRow",
    "CommsLogger",
    "Event",
    "FlopsProfiler",
    "ModuleProfile",
    "Monitor",
    "Peak",
    "ProfiledStep",
    "ProgressBar",
    "Run",
    "StepTimes",
    "bus_bandwidth_factor",
    "comms_logger",
    "comms_logger_for",
    "comms_summary",
    "event_name",
    "format_comms_summary",
    "format_number",
    "get_model_profile",
    "measure_matmul_flops",
    "modelled_rows",
    "monitor",
    "peak_flops",
    "plot_runs",
    "purpose_of",
    "read_run",
    "report_events",
    "series_name",
    "step_events",
]


def comms_summary(show_straggler: bool = False) -> str:
    """The communication logger's table (`deepspeed.comm.log_summary()` prints it on
    rank 0); collective when `show_straggler`."""
    return comms_logger().summary(show_straggler=show_straggler)
