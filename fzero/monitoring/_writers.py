"""The monitors DeepSpeed's config blocks name, each writing DeepSpeed's events
`(name, value, samples)` as DeepSpeed's `deepspeed/monitor/*.py` does: TensorBoard
event files through `torch.utils.tensorboard`, one CSV file per event, a Weights &
Biases run, a Comet experiment. Only rank 0 writes (the caller builds writers there);
each optional package is imported when its block is enabled, and a missing one is an
error naming the package on every rank."""

from __future__ import annotations

import csv
import importlib.util
import os
from collections.abc import Sequence
from typing import Any, Protocol

from fzero.config.monitor import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
from fzero.monitoring._events import Event

__all__ = [
    "CSVWriter",
    "CometWriter",
    "TensorBoardWriter",
    "WandbWriter",
    "Writer",
    "require",
]


class Writer(Protocol):
    """One monitor backend."""

    def write(self, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...


# block -> (the module it imports, what to install)
_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet_ml>=3.41"),
}


def require(block: str) -> None:
    """Raise unless the package the monitor block `block` writes through is importable
    (called on every rank, so all of them stop together)."""
    module, install = _PACKAGES[block]
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"config block {block!r} is enabled, but the package {module!r} it writes "
            f"through is not installed: pip install '{install}' (or fzero's 'monitor' "
            "extra), or switch the block off"
        )


def _run_directory(output_path: str, job_name: str) -> str:
    """DeepSpeed's `os.path.join(output_path, job_name)`, made."""
    path = os.path.join(output_path, job_name)
    os.makedirs(path, exist_ok=True)
    return path


class TensorBoardWriter:
    """Event files in `output_path/job_name/`: one scalar per event, the sample count as
    its step; flushed after every write, as DeepSpeed's."""

    def __init__(self, config: TensorBoardConfig) -> None:
        require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = _run_directory(config.output_path, config.job_name)
        self._writer: Any = SummaryWriter(log_dir=self.log_dir)

    def write(self, events: Sequence[Event]) -> None:
        for name, value, samples in events:
            self._writer.add_scalar(name, value, samples)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def csv_file_name(event: str) -> str:
    """The file DeepSpeed's CSV monitor writes an event to (`Train/Samples/lr` ->
    `Train_Samples_lr.csv`)."""
    return event.replace("/", "_").replace(" ", "_") + ".csv"


class CSVWriter:
    """`output_path/job_name/<event>.csv` per event, rows `step,<last part of the
    name>` (the step being the sample count), as DeepSpeed's `csvMonitor`; a file that
    exists already is appended to without a second header."""

    def __init__(self, config: CSVConfig) -> None:
        self.log_dir = _run_directory(config.output_path, config.job_name)

    def write(self, events: Sequence[Event]) -> None:
        rows: dict[str, list[tuple[int, float]]] = {}
        for name, value, samples in events:
            rows.setdefault(name, []).append((samples, value))
        for name, values in rows.items():
            path = os.path.join(self.log_dir, csv_file_name(name))
            fresh = not os.path.exists(path) or os.path.getsize(path) == 0
            with open(path, "a", newline="") as f:
                out = csv.writer(f)
                if fresh:
                    out.writerow(["step", name.rsplit("/", 1)[-1]])
                out.writerows(values)

    def close(self) -> None:
        """Every write closed its files."""


class WandbWriter:
    """A W&B run, `wandb.init(project=, group=, entity=team)`; each event logged with the
    sample count as W&B's step. `WANDB_MODE=offline` keeps it in `./wandb/`."""

    def __init__(self, config: WandbConfig) -> None:
        require("wandb")
        import wandb

        self._wandb: Any = wandb
        self.run: Any = wandb.init(project=config.project, group=config.group, entity=config.team)

    def write(self, events: Sequence[Event]) -> None:
        for name, value, samples in events:
            self.run.log({name: value}, step=samples)

    def close(self) -> None:
        self.run.finish()


class CometWriter:
    """A Comet experiment (`comet_ml.start`); an event is sent again only once
    `samples_log_interval` more samples have passed (DeepSpeed's `EventsLogScheduler`)."""

    def __init__(self, config: CometConfig) -> None:
        require("comet")
        import comet_ml

        self.interval = config.samples_log_interval
        self._last: dict[str, int] = {}
        self.experiment: Any = comet_ml.start(
            api_key=config.api_key,
            project=config.project,
            workspace=config.workspace,
            experiment_key=config.experiment_key,
            mode=config.mode,
            online=config.online,
        )
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)

    def write(self, events: Sequence[Event]) -> None:
        for name, value, samples in events:
            last = self._last.get(name)
            if last is None or samples - last >= self.interval:
                self._last[name] = samples
                self.experiment.log_metric(name, value, step=samples)

    def close(self) -> None:
        self.experiment.end()
