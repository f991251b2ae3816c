"""`fzero.monitor(...)`: the enabled monitors of a config as one object that rank 0
writes through (DeepSpeed's `MonitorMaster`), for the engine and for `train_step` loops.

```python
mon = fzero.monitor({"tensorboard": {"enabled": True, "output_path": "runs"}})
for batch in data:
    state, metrics = step(state, batch)
    mon.log(metrics, samples=samples_so_far, tokens=batch_tokens)
mon.close()
```
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fzero import comm
from fzero.config import Config, load_config
from fzero.monitoring import _writers
from fzero.monitoring._events import Event, report_events, step_events

__all__ = ["BLOCKS", "Monitor", "monitor"]

BLOCKS = ("tensorboard", "csv_monitor", "wandb", "comet")
"""The config blocks that are monitors, in the order they are written to."""

_WRITERS = {
    "tensorboard": _writers.TensorBoardWriter,
    "csv_monitor": _writers.CSVWriter,
    "wandb": _writers.WandbWriter,
    "comet": _writers.CometWriter,
}


class Monitor:
    """The enabled monitors of one config: `write_events` (DeepSpeed's) sends events to
    each on rank 0, and does nothing elsewhere. `enabled` says whether any block is on
    (the same on every rank)."""

    def __init__(self, config: Config, *, rank: int | None = None) -> None:
        self.blocks = tuple(b for b in BLOCKS if getattr(config, b).enabled)
        for block in self.blocks:
            if block != "csv_monitor":
                _writers.require(block)
        self.rank = comm.get_rank() if rank is None else rank
        self.writers: dict[str, _writers.Writer] = {}
        if self.rank == 0:
            for block in self.blocks:
                self.writers[block] = _WRITERS[block](getattr(config, block))
        self._last: tuple[float, dict[str, int], int] | None = None  # for `log`

    @property
    def enabled(self) -> bool:
        return bool(self.blocks)

    def write_events(self, events: Sequence[Event]) -> None:
        """DeepSpeed's `MonitorMaster.write_events`: `(name, value, samples)` tuples."""
        if not events:
            return
        for writer in self.writers.values():
            writer.write(events)

    def log(
        self,
        metrics: Mapping[str, Any],
        *,
        samples: int,
        tokens: int | None = None,
        samples_before: int | None = None,
    ) -> list[Event]:
        """Write one step's `metrics` (a `train_step` metrics dict, or any mapping with
        its keys) at `samples` trained so far: `loss` as `train_loss` (at
        `samples_before`, default `samples`), `lr` (the first group's), `loss_scale` and
        `grad_norm` when not None, and any figure a metrics record has (`tokens_per_s`, `memory_mb`,
        ...). With `tokens` (this rank's tokens since the last call), tokens/s over the
        wall time since the last call; and the bytes fzero's collectives moved since then,
        in MB per call by mesh axes. Collective-free; returns the events written."""
        lr = metrics.get("lr")
        if isinstance(lr, list | tuple):
            lr = lr[0] if lr else None
        scale = metrics.get("loss_scale")
        events = step_events(
            loss=_number(metrics.get("loss")),
            lr=_number(lr),
            samples_before=samples if samples_before is None else samples_before,
            samples_after=samples,
            loss_scale=_number(scale),
            grad_norm=_number(metrics.get("grad_norm")),
        )
        record = dict(metrics)
        record.update(self._since_last(tokens))
        events += report_events(record, samples)
        self.write_events(events)
        return events

    def _since_last(self, tokens: int | None) -> dict[str, Any]:
        now, traffic = time.perf_counter(), comm.traffic_by_group()
        last, self._last = self._last, (now, _bytes_by_group(traffic), 0)
        if last is None:
            return {}
        seconds, before = now - last[0], last[1]
        figures: dict[str, Any] = {
            "comm_mb_per_step": {
                axes: (size - before.get(axes, 0)) / 1e6
                for axes, size in _bytes_by_group(traffic).items()
                if size != before.get(axes, 0)
            }
        }
        if tokens and seconds > 0:
            figures["tokens_per_s"] = tokens / seconds
        return figures

    def close(self) -> None:
        """Close every writer (W&B finishes its run); writes after this are errors."""
        for writer in self.writers.values():
            writer.close()
        self.writers = {}


def _bytes_by_group(traffic: Mapping[str, Mapping[str, tuple[int, int]]]) -> dict[str, int]:
    return {axes: sum(size for _, size in ops.values()) for axes, ops in traffic.items()}


def _number(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


def monitor(
    config: Config | Mapping[str, Any] | str | Path | None = None,
    *,
    tensorboard: Mapping[str, Any] | None = None,
    csv_monitor: Mapping[str, Any] | None = None,
    wandb: Mapping[str, Any] | None = None,
    comet: Mapping[str, Any] | None = None,
) -> Monitor:
    """The monitors of a DeepSpeed config (a dict, a JSON path or a `Config`: its
    `tensorboard`, `csv_monitor`, `wandb` and `comet` blocks), or of the blocks given
    as keywords (each switched on by being given, e.g. `tensorboard={"output_path":
    "runs", "job_name": "exp1"}`). Rank 0 writes; a block whose package is missing is an
    `ImportError` naming it on every rank."""
    given = {
        name: block
        for name, block in (
            ("tensorboard", tensorboard),
            ("csv_monitor", csv_monitor),
            ("wandb", wandb),
            ("comet", comet),
        )
        if block is not None
    }
    if config is not None and given:
        raise TypeError(
            f"fzero.monitor takes a config or monitor blocks, not both: {sorted(given)}"
        )
    if config is None:
        config = {name: {"enabled": True, **block} for name, block in given.items()}
    return Monitor(load_config(config))
