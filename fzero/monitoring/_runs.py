"""A run's series, read back from what fzero or DeepSpeed wrote: a JSON-lines metrics
file (`metrics_file`), a TensorBoard directory (read through `tensorboard`'s
`EventAccumulator`), or a CSV monitor's directory. Each becomes the same value: series
named as the monitors name them without `Train/Samples/` (`train_loss`, `lr`,
`tokens_per_second`, `model_state_MB`, `comm_MB_per_step_world`, ...), each a list of
(x, value) with x the samples trained on (the x of DeepSpeed's events) — or the step,
for a metrics file written before records carried samples."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fzero.monitoring._events import report_events, series_name, step_events

__all__ = ["Run", "read_run"]


@dataclass(frozen=True)
class Run:
    """One run's series: name -> [(x, value), ...], x ascending."""

    name: str
    x_label: str
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def read_run(path: str | Path, name: str | None = None) -> Run:
    """The series of one run: a metrics file, or a directory holding TensorBoard event
    files (anywhere below it) or a CSV monitor's files."""
    path = Path(path)
    name = name or path.stem if path.is_file() else name or path.name
    if path.is_file():
        return _from_metrics(path, name)
    if not path.is_dir():
        raise FileNotFoundError(f"run {str(path)!r}: no such file or directory")
    if any(path.rglob("events.out.tfevents.*")):
        return _from_tensorboard(path, name)
    if any(path.rglob("*.csv")):
        return _from_csv(path, name)
    raise ValueError(
        f"run {str(path)!r}: a directory with neither TensorBoard event files "
        "(events.out.tfevents.*) nor CSV monitor files (*.csv)"
    )


def _add(series: dict[str, list[tuple[float, float]]], name: str, x: float, y: float) -> None:
    series.setdefault(name, []).append((float(x), float(y)))


def _from_metrics(path: Path, name: str) -> Run:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not a JSON line: {error}") from None
    if not records or not all(isinstance(r, Mapping) and "step" in r for r in records):
        raise ValueError(f"{path}: not an fzero metrics file (JSON lines with a 'step')")
    by_samples = all("samples" in r for r in records)
    series: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        x = r["samples"] if by_samples else r["step"]
        lrs = r.get("lr") or [None]
        events = step_events(
            loss=r.get("loss"),
            lr=lrs[0],
            samples_before=x,
            samples_after=x,
            loss_scale=r.get("loss_scale"),
            grad_norm=r.get("grad_norm"),
        )
        for event, value, _ in events + report_events(r, x):
            _add(series, series_name(event), x, value)
    return Run(name, "samples" if by_samples else "step", series)


def _from_tensorboard(path: Path, name: str) -> Run:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ImportError(
            f"run {str(path)!r} holds TensorBoard event files, which are read through the "
            "package 'tensorboard': pip install tensorboard (or fzero's 'monitor' extra)"
        ) from None
    series: dict[str, list[tuple[float, float]]] = {}
    for directory in sorted({p.parent for p in path.rglob("events.out.tfevents.*")}):
        events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            for scalar in events.Scalars(tag):
                _add(series, series_name(tag), scalar.step, scalar.value)
    return Run(name, "samples", _sorted(series))


def _from_csv(path: Path, name: str) -> Run:
    series: dict[str, list[tuple[float, float]]] = {}
    for file in sorted(path.rglob("*.csv")):
        with open(file, newline="") as f:
            rows = list(csv.reader(f))
        if not rows or len(rows[0]) != 2 or rows[0][0] != "step":
            raise ValueError(f"{file}: not a CSV monitor file (a 'step,<name>' header)")
        for row in rows[1:]:
            _add(series, series_name(file.stem), float(row[0]), float(row[1]))
    return Run(name, "samples", _sorted(series))


def _sorted(series: dict[str, list[tuple[float, float]]]) -> dict[str, list[tuple[float, float]]]:
    return {k: sorted(v, key=lambda point: point[0]) for k, v in series.items()}
