"""`deepspeed.monitor.monitor`: `MonitorMaster` and the single-backend monitors, taking
a monitor config as DeepSpeed's do — any object with the blocks as attributes, such as
an engine's `config` (`MonitorMaster(engine.config)`) — and writing DeepSpeed's
`(name, value, samples)` events through fzero's writers on rank 0."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fzero import comm
from fzero.monitoring import Event, Monitor, _writers

__all__ = ["CometMonitor", "MonitorMaster", "TensorBoardMonitor", "WandbMonitor", "csvMonitor"]


class MonitorMaster(Monitor):
    """Every enabled block of `monitor_config` (`tensorboard`, `csv_monitor`, `wandb`,
    `comet`); `write_events(event_list)` writes on rank 0."""

    def __init__(self, monitor_config: Any) -> None:
        super().__init__(monitor_config)


class _One:
    """One backend from its block, as DeepSpeed's `TensorBoardMonitor(config)`."""

    block = ""
    writer: Any = None

    def __init__(self, config: Any) -> None:
        self.monitor_config = config
        self.enabled = bool(config.enabled)
        self._writer = None
        if self.enabled:
            if self.block != "csv_monitor":
                _writers.require(self.block)
            if comm.get_rank() == 0:
                self._writer = type(self).writer(config)

    def write_events(self, event_list: Sequence[Event]) -> None:
        if self._writer is not None:
            self._writer.write(event_list)


class TensorBoardMonitor(_One):
    block, writer = "tensorboard", _writers.TensorBoardWriter


class csvMonitor(_One):
    block, writer = "csv_monitor", _writers.CSVWriter


class WandbMonitor(_One):
    block, writer = "wandb", _writers.WandbWriter


class CometMonitor(_One):
    block, writer = "comet", _writers.CometWriter
