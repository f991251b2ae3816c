"""What every benchmark here shares: timing after a warm-up, rounds that interleave the
rows, medians with their min-max spread, a process's own peak RSS, and the table it
prints (also appended to a results file that `benchmarks/plot.py results` draws).

A row that compares systems runs in its own processes (`run_rows`): its peak RSS is its
own, and no row inherits another's warm-up. Rounds interleave the rows (round 1: A B C,
round 2: A B C, ...), so a machine whose speed drifts over minutes slows every row
alike, and the spread across rounds shows how far one run can be trusted.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

Cell = float | str | None  # a number, a one-word note, or None (printed "-")


class Spread(NamedTuple):
    """The median of repeated measurements and the range they fell in."""

    median: float
    low: float
    high: float


def spread(samples: Sequence[float]) -> Spread:
    if not samples:
        raise ValueError("spread of no samples: expected at least one measurement")
    return Spread(statistics.median(samples), min(samples), max(samples))


def paired_ratio(samples: Sequence[float], baseline: Sequence[float]) -> float:
    """The median of the per-round ratios of two rows measured in the same rounds: each
    pair ran minutes apart at most, so a drift of the machine between rounds cancels."""
    if len(samples) != len(baseline) or not samples:
        raise ValueError(
            f"paired ratio of {len(samples)} and {len(baseline)} samples: expected the same "
            f"number of rounds, at least one"
        )
    return statistics.median([s / b for s, b in zip(samples, baseline)])


def time_call(call: Callable[[], object], sync: Callable[[], object] | None = None) -> float:
    """Seconds one `call` takes; `sync` (a barrier) runs before and after it, so a call
    made on several ranks is timed from when all start to when all finish."""
    if sync:
        sync()
    start = time.perf_counter()
    call()
    if sync:
        sync()
    return time.perf_counter() - start


def time_steps(
    step: Callable[[], object],
    steps: int,
    warmup: int = 3,
    sync: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of each of `steps` calls of `step`, after `warmup` untimed ones."""
    for _ in range(warmup):
        time_call(step, sync)
    return [time_call(step, sync) for _ in range(steps)]


def interleave(
    calls: Sequence[tuple[str, Callable[[], object]]], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds of each named call in each of `rounds` rounds, every call once per round,
    in this process (for kernels that share their buffers)."""
    for _, call in calls:
        for _ in range(warmup):  # first touch of pages, thread start
            call()
    times: dict[str, list[float]] = {name: [] for name, _ in calls}
    for _ in range(rounds):
        for name, call in calls:
            times[name].append(time_call(call))
    return times


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM). Unlike ru_maxrss, which survives
    exec, it starts afresh in a new process, so a row started from a large process
    reports its own."""
    return _status_mb("VmHWM")


def rss_mb() -> float:
    """This process's resident memory now (VmRSS)."""
    return _status_mb("VmRSS")


# What torchrun sets for its workers: a row started from a script that a launcher ran
# (`fzero run -n 2 benchmarks/step_time.py`) must not see its parent's rank and port.
LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def launched_rank() -> int | None:
    """This process's rank when a launcher started it, else None."""
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None else None


def row_environment() -> dict[str, str]:
    """This environment without the variables an outer launcher set."""
    return {
        key: value
        for key, value in os.environ.items()
        if key not in LAUNCHER_VARIABLES and not key.startswith("TORCHELASTIC_")
    }


def torchrun(nproc: int, script: str, *args: str) -> list[str]:
    """argv running `script` on `nproc` local ranks; `--standalone` picks a free port for
    each launch, so rows never collide."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", script, *args,
    ]  # fmt: skip


def run_rows(
    names: Sequence[str], command: Callable[[str, str], list[str]], rounds: int
) -> dict[str, list[dict[str, Any]]]:
    """Each row once per round in its own processes, the rows interleaved:
    `command(name, out)` is the argv of one row, which writes its measurements as a JSON
    object to the file `out`. Returns each row's measurements, one dict per round."""
    if rounds < 1:
        raise ValueError(f"rounds {rounds}: expected at least 1")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="fzero-bench-") as tmp:
        out = os.path.join(tmp, "row.json")
        for round_index in range(rounds):
            for name in names:
                print(f"round {round_index + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
                _run_row(command(name, out), f"row {name!r}, round {round_index + 1}")
                with open(out) as f:
                    results[name].append(json.load(f))
                os.remove(out)
    return results


def _run_row(argv: list[str], what: str, tries: int = 2) -> None:
    """Run one row's processes; a failed launch is tried again once (gloo's teardown at
    exit aborts now and then: "terminate called without an active exception"), and a
    second failure stops the benchmark with the row's output."""
    for attempt in range(1, tries + 1):
        done = subprocess.run(argv, env=row_environment(), capture_output=True, text=True)
        if done.returncode == 0:
            return
        failure = f"{what}: exit code {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
        if attempt == tries:
            raise SystemExit(failure)
        print(f"{what}: exit code {done.returncode}, running it again", file=sys.stderr)


def write_row(path: str, measurements: dict[str, Any]) -> None:
    """What one row's process hands back to `run_rows`."""
    with open(path, "w") as f:
        json.dump(measurements, f)


@dataclass(frozen=True)
class Table:
    """A benchmark's result as printed: a title line, a header, one line per row (its name,
    then one cell per column), and notes under it. `benchmarks/plot.py` reads it back:
    columns are separated by at least two spaces, and a row's cells are numbers or "-"."""

    title: str
    name_header: str
    """What the first column names (engine, kernel, ...)."""
    columns: tuple[tuple[str, str], ...]
    """(header, format spec such as ".3f") of each column after the name."""
    rows: tuple[tuple[str, tuple[Cell, ...]], ...]
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, cells in self.rows:
            if len(cells) != len(self.columns):
                raise ValueError(
                    f"row {name!r} has {len(cells)} cells; expected {len(self.columns)} "
                    f"({', '.join(header for header, _ in self.columns)})"
                )

    def text(self) -> str:
        cells = [
            [_cell(value, spec) for value, (_, spec) in zip(row, self.columns)]
            for _, row in self.rows
        ]
        widths = [
            max([len(header), *(len(line[i]) for line in cells)])
            for i, (header, _) in enumerate(self.columns)
        ]
        name_width = max([len(self.name_header), *(len(name) for name, _ in self.rows)])

        def line(name: str, texts: Sequence[str]) -> str:
            return f"{name:<{name_width}}  " + "  ".join(
                f"{text:>{width}}" for text, width in zip(texts, widths)
            )

        header = line(self.name_header, [header for header, _ in self.columns])
        body = [line(name, texts) for (name, _), texts in zip(self.rows, cells)]
        return "\n".join([self.title, header, *body, *self.notes])


def _cell(value: Cell, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        if " " in value:
            raise ValueError(f"table cell {value!r}: expected one word (a name ends at a space)")
        return value
    return format(value, spec)


def report(name: str, table: Table, results: str | None = None) -> None:
    """Print `table`; with `results`, also append it to that markdown file under a heading
    `name` (the file `make bench` writes and `benchmarks/plot.py results` draws)."""
    text = table.text()
    print(text, flush=True)
    if results:
        with open(results, "a") as f:
            f.write(f"## {name}\n\n```\n{text}\n```\n\n")
