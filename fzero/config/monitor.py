"""DeepSpeed's blocks for watching a run: the monitors (`tensorboard`, `csv_monitor`,
`wandb`, `comet`), `comms_logger` and `flops_profiler`, with DeepSpeed's keys and
defaults (`deepspeed/monitor/config.py`, `deepspeed/comm/config.py`,
`deepspeed/profiling/constants.py`). `fzero.monitor` serves them."""

from __future__ import annotations

from dataclasses import dataclass, field

from fzero.config._base import Section

__all__ = [
    "CSVConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "FlopsProfilerConfig",
    "TensorBoardConfig",
    "WandbConfig",
]


@dataclass(frozen=True, kw_only=True)
class TensorBoardConfig(Section):
    """Event files through `torch.utils.tensorboard` (the `tensorboard` package)."""

    enabled: bool = False
    """Write the run's events to TensorBoard event files (rank 0)."""
    output_path: str = ""
    """Directory under which the run's folder is made ("" is the working directory)."""
    job_name: str = "DeepSpeedJobName"
    """The run's folder: the event files go to `output_path/job_name/`."""


@dataclass(frozen=True, kw_only=True)
class CSVConfig(Section):
    """One CSV file per event (`step,<name>` rows; the step is the sample count)."""

    enabled: bool = False
    """Write the run's events to CSV files (rank 0)."""
    output_path: str = ""
    """Directory under which the run's folder is made ("" is the working directory)."""
    job_name: str = "DeepSpeedJobName"
    """The run's folder: `output_path/job_name/Train_Samples_train_loss.csv`, ..."""


@dataclass(frozen=True, kw_only=True)
class WandbConfig(Section):
    """A Weights & Biases run (`wandb.init(project=, group=, entity=team)`); with
    `WANDB_MODE=offline` it is written to `./wandb/` with no network."""

    enabled: bool = False
    """Log the run's events to a W&B run (rank 0)."""
    group: str | None = None
    """The W&B group the run joins."""
    team: str | None = None
    """The W&B entity."""
    project: str = "deepspeed"
    """The W&B project."""


@dataclass(frozen=True, kw_only=True)
class CometConfig(Section):
    """A Comet experiment (`comet_ml.start(...)`, comet_ml >= 3.41)."""

    enabled: bool = False
    """Log the run's events to a Comet experiment (rank 0)."""
    samples_log_interval: int = 100
    """An event is sent again only after this many more samples."""
    project: str | None = None
    """Comet project (else Comet's own settings: COMET_PROJECT_NAME, .comet.config)."""
    workspace: str | None = None
    """Comet workspace (else COMET_WORKSPACE, .comet.config)."""
    api_key: str | None = None
    """Comet API key (else COMET_API_KEY, .comet.config)."""
    experiment_name: str | None = None
    """The experiment's name."""
    experiment_key: str | None = None
    """The key of an experiment to go on with (32 to 50 alphanumerics)."""
    online: bool | None = None
    """False keeps the experiment on disk (Comet's offline mode)."""
    mode: str | None = None
    """"get", "create" or "get_or_create" (Comet's default)."""


@dataclass(frozen=True, kw_only=True)
class CommsLoggerConfig(Section):
    """Every profiled collective timed (made blocking, as DeepSpeed does) and recorded
    by operation, purpose and mesh axes; `deepspeed.comm.log_summary()` (or
    `fzero.monitor.comms_summary()`) prints the table."""

    enabled: bool = False
    """Time fzero's collectives (each made blocking while profiled, as DeepSpeed's)."""
    verbose: bool = False
    """Print each profiled collective on rank 0 as it completes."""
    prof_all: bool = True
    """Profile every collective; false: only those named in `prof_ops`."""
    prof_ops: list[str] = field(default_factory=list)
    """Operations (`all_gather`, `reduce_scatter`, `all_reduce`, `all_to_all`, or
    DeepSpeed's names such as `all_gather_into_tensor`) or purposes (`gradients`,
    `parameters for forward`, ...) to profile when `prof_all` is false."""
    debug: bool = False
    """One row per collective's own description (the unit it moves) instead of per
    purpose: DeepSpeed appends the calling function to the row's name."""


@dataclass(frozen=True, kw_only=True)
class FlopsProfilerConfig(Section):
    """FLOPs, MACs, parameters and latency per module at one step, counted by
    `torch.utils.flop_counter.FlopCounterMode` on rank 0."""

    enabled: bool = False
    """Profile one step (`profile_step`) on rank 0 and print it."""
    recompute_fwd_factor: float = 0.0
    """Forward passes recomputed in backward (activation checkpointing: 1.0) when the
    backward's FLOPs are estimated from the forward's (DeepSpeed's 2 + factor)."""
    profile_step: int = 1
    """The optimizer step (counted from 0, as `global_steps` before it) whose last
    micro-batch is profiled; later steps are better timed (warm)."""
    module_depth: int = -1
    """How deep the per-depth summary goes; -1: every depth."""
    top_modules: int = 1
    """How many modules per depth the summary names."""
    detailed: bool = True
    """Print the module tree with each module's profile."""
    output_file: str | None = None
    """Write the profile to this file instead of printing it."""
