"""DeepSpeed's communication logger on fzero's attributable collectives.

DeepSpeed's `comms_logger` times every `deepspeed.comm` call it profiles (made blocking
to be timed), and `deepspeed.comm.log_summary()` prints count, message size, latency
and bandwidths per operation name. fzero's collectives each say what they move
(`what`: a unit's parameters, a bucket's gradients, the gradient norm) and in which
fzero operation (forward, backward, step) on which mesh axes, so the rows here are per
operation, **purpose** and axes; the purposes are `fzero.partition.comm_volume`'s, so
each row shows the bytes and calls the plan's model predicts for the optimizer steps
taken while logging, beside what was measured.

Bandwidths follow nccl-tests (`doc/PERFORMANCE.md`), which DeepSpeed cites: algbw is
the collective's buffer (an all-gather's output, a reduce-scatter's input, an
all-reduce's tensor; what fzero counts) over its latency, and busbw scales it by what a
ring moves per rank: (n-1)/n for all-gather, reduce-scatter and all-to-all, 2(n-1)/n
for all-reduce. (DeepSpeed's table reports all-reduce's "tput" as twice that algbw.)
MB are 10^6 bytes; bandwidths in GB/s (10^9 bytes per second; x8 for DeepSpeed's Gbps).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from fzero import comm
from fzero._traffic import label_of, profile_collectives, profiler
from fzero.config.monitor import CommsLoggerConfig
from fzero.partition import Collective

__all__ = [
    "OPERATIONS",
    "CommRow",
    "CommsLogger",
    "bus_bandwidth_factor",
    "comms_logger",
    "comms_logger_for",
    "format_comms_summary",
    "modelled_rows",
    "purpose_of",
]

log = logging.getLogger("fzero")

OPERATIONS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

# DeepSpeed's names for the operations (`prof_ops` takes either)
_DEEPSPEED_NAMES = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_base": "all_gather",
    "allgather_fn": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_fn": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "inference_all_reduce": "all_reduce",
}

# a collective's own description -> comm_volume's purpose, where the words differ
_RENAMED = {"LAMB norms": "LAMB tensor norms"}

PURPOSES = (
    "parameters for forward",
    "parameters for backward",
    "parameters after the update",
    "gradients",
    "gradients across replicas",
    "gradient norm",
    "fp16 overflow flag",
    "LAMB tensor norms",
    "whole-tensor directions",
    "left-over gradients check",
    "telemetry",
)
"""The purposes of fzero's training collectives (comm_volume's `what`, and the step
report's own); quantized ones add " (int8)" / " (int4)"."""


def purpose_of(what: str, within: str, backward: bool) -> str:
    """What a collective is for, in `comm_volume`'s words, from its own description
    `what`, the fzero operation it runs in (`within`: "forward of engine ...") and
    whether autograd's backward is running: a unit's parameter gather is for forward or
    for backward (hpZ's secondary gathers always for backward); updated parameters are
    gathered after the update; each bucket's reduction is "gradients". Anything else
    keeps its own description ("" -> "unnamed")."""
    if what.startswith("updated parameters"):
        return "parameters after the update"
    if what.startswith("parameters"):
        later = backward or within.startswith("backward") or "(hpZ secondary)" in what
        return f"parameters for {'backward' if later else 'forward'}" + (
            " (int8)" if what.endswith("(int8)") else ""
        )
    if what.startswith("gradients"):
        if what.endswith("across replicas"):
            return "gradients across replicas"
        return "gradients" + (f" {what[-6:]}" if what.endswith(("(int8)", "(int4)")) else "")
    if what.startswith("whole-tensor directions"):
        return "whole-tensor directions"
    return _RENAMED.get(what, what or "unnamed")


def bus_bandwidth_factor(operation: str, ranks: int) -> float:
    """busbw / algbw for a collective over `ranks` ranks (nccl-tests)."""
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks
    return 2 * share if operation == "all_reduce" else share


def _trimmed_mean(values: Sequence[float], fraction: float = 0.1) -> float:
    """The mean without the `fraction` smallest and largest values (DeepSpeed's
    `trim_mean(values, 0.1)`, against outliers such as a first call's setup)."""
    ordered = sorted(values)
    cut = int(len(ordered) * fraction)
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


@dataclass
class _Measured:
    ranks: int
    count: int = 0
    bytes: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds
    algbw: list[float] = field(default_factory=list)  # bytes per second


@dataclass(frozen=True)
class CommRow:
    """One row of the summary: what was measured on this rank for one (operation,
    purpose, axes), and what the plan's model says for the steps taken meanwhile."""

    operation: str
    purpose: str
    axes: str
    ranks: int
    count: int
    bytes: int
    latency_total_ms: float
    latency_avg_ms: float
    """Trimmed mean (10% each side), as DeepSpeed's."""
    algbw_gb_per_s: float
    busbw_gb_per_s: float
    modelled_count: int | None = None
    modelled_bytes: int | None = None
    straggler_ms: float | None = None


def modelled_rows(rows: Iterable[Collective], world_size: int) -> dict[tuple, tuple[int, int]]:
    """`comm_volume` rows as (operation, purpose, axes label) -> (calls, bytes); the axes
    as fzero's counters label them ("world" for a group of every process)."""
    found: dict[tuple, tuple[int, int]] = {}
    for row in rows:
        axes = "world" if row.world_size == world_size else "+".join(row.axes) or "world"
        calls, size = found.get((row.operation, row.what, axes), (0, 0))
        found[(row.operation, row.what, axes)] = (calls + row.calls, size + row.bytes)
    return found


class CommsLogger:
    """The process's communication logger (DeepSpeed's `deepspeed.comm.comms_logger`):
    configured from a `comms_logger` block (`configure`), it times the collectives it
    profiles once `fzero.comm.profile_collectives(logger)` hands them to it, and
    `summary()` is the table `deepspeed.comm.log_summary()` prints."""

    def __init__(self, config: CommsLoggerConfig | None = None) -> None:
        config = config or CommsLoggerConfig()
        self.enabled = config.enabled
        self.verbose = config.verbose
        self.prof_all = config.prof_all
        self.prof_ops: list[str] = []
        self.start_profiling_op(config.prof_ops)
        self.debug = config.debug
        self.records: dict[tuple[str, str, str], _Measured] = {}
        self._models: dict[str, Callable[[], Callable[[], list[Collective]] | None]] = {}
        self._steps: dict[str, int] = {}
        self._skipped: dict[str, int] = {}  # of them, fp16 overflow skipped

    def configure(
        self,
        config: CommsLoggerConfig | None = None,
        *,
        enabled: bool | None = None,
        prof_all: bool | None = None,
        prof_ops: list[str] | None = None,
        verbose: bool | None = None,
        debug: bool | None = None,
    ) -> None:
        """DeepSpeed's `deepspeed.comm.configure`: a block's settings, then each keyword
        given."""
        if config is not None:
            self.enabled, self.verbose = config.enabled, config.verbose
            self.prof_all, self.debug = config.prof_all, config.debug
            self.prof_ops = []
            self.start_profiling_op(config.prof_ops)
        for name, value in (
            ("enabled", enabled),
            ("prof_all", prof_all),
            ("verbose", verbose),
            ("debug", debug),
        ):
            if value is not None:
                setattr(self, name, bool(value))
        if prof_ops is not None:
            self.prof_ops = []
            self.start_profiling_op(prof_ops)

    # ---- DeepSpeed's switches ----------------------------------------------------------

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: Iterable[str]) -> None:
        """Profile these operations (fzero's or DeepSpeed's names) or purposes."""
        for name in op_name_list:
            name = _DEEPSPEED_NAMES.get(name, name)
            if name not in OPERATIONS and name not in PURPOSES:
                raise ValueError(
                    f"comms_logger.prof_ops names {name!r}; allowed: the operations "
                    f"{list(OPERATIONS)} (or DeepSpeed's {sorted(_DEEPSPEED_NAMES)}) or the "
                    f"purposes {list(PURPOSES)}"
                )
            if name not in self.prof_ops:
                self.prof_ops.append(name)

    def stop_profiling_op(self, op_name_list: Iterable[str]) -> None:
        names = {_DEEPSPEED_NAMES.get(n, n) for n in op_name_list}
        self.prof_ops = [op for op in self.prof_ops if op not in names]

    # ---- what the engines say ----------------------------------------------------------

    def attach(self, key: str, model: Callable[[], list[Collective]]) -> None:
        """An engine's `comm_volume` (called at summary time), to set beside what its
        optimizer steps (`note_step(key)`) measured. Held weakly when it is a bound
        method, so the logger (process-wide) does not keep an engine alive: an engine
        dropped or destroyed leaves the model, as `detach` does."""
        if inspect.ismethod(model):
            self._models[key] = weakref.WeakMethod(model)
        else:
            self._models[key] = lambda: model
        self._steps.setdefault(key, 0)
        self._skipped.setdefault(key, 0)

    def detach(self, key: str) -> None:
        self._models.pop(key, None)
        self._steps.pop(key, None)
        self._skipped.pop(key, None)

    def note_step(self, key: str, skipped: bool = False) -> None:
        """One optimizer step of the engine `key` was taken (`skipped`: an fp16
        overflow skipped its update, which sends no norm and no new parameters)."""
        if self.enabled and key in self._steps:
            self._steps[key] += 1
            self._skipped[key] += int(skipped)

    def reset(self) -> None:
        """Forget what was measured and the steps counted (not the settings)."""
        self.records.clear()
        self._steps = dict.fromkeys(self._steps, 0)
        self._skipped = dict.fromkeys(self._skipped, 0)

    # ---- measuring (called by fzero._traffic.profiled) ---------------------------------

    def wants(self, operation: str, what: str, within: str) -> bool:
        if not self.enabled:
            return False
        if self.prof_all:
            return True
        backward = torch._C._current_graph_task_id() != -1
        return operation in self.prof_ops or purpose_of(what, within, backward) in self.prof_ops

    def time(
        self,
        operation: str,
        tensor: torch.Tensor,
        group: Any,
        what: str,
        within: str,
        start: Callable[[bool], Any],
        async_op: bool,
    ) -> Any:
        """Run one collective to completion and record its latency."""
        backward = torch._C._current_graph_task_id() != -1
        _synchronize(tensor)
        began = time.perf_counter()
        work = start(True)
        if work is not None:
            work.wait()
        _synchronize(tensor)
        seconds = time.perf_counter() - began
        size = tensor.numel() * tensor.element_size()
        purpose = what if self.debug else purpose_of(what, within, backward)
        key = (operation, purpose or "unnamed", label_of(group))
        ranks = dist.get_world_size(group) if dist.is_initialized() else 1
        entry = self.records.setdefault(key, _Measured(ranks))
        entry.count += 1
        entry.bytes += size
        entry.latencies.append(seconds)
        entry.algbw.append(size / seconds if seconds > 0 else 0.0)
        if self.verbose and comm.get_rank() == 0:
            factor = bus_bandwidth_factor(operation, ranks)
            log.info(
                "fzero comm op: %s | %s | %s | time (ms): %.3f | msg size: %.3f MB | "
                "algbw (GB/s): %.3f | busbw (GB/s): %.3f",
                operation,
                key[1],
                key[2],
                1e3 * seconds,
                size / 1e6,
                entry.algbw[-1] / 1e9,
                factor * entry.algbw[-1] / 1e9,
            )
        return work if async_op else None

    # ---- the summary -------------------------------------------------------------------

    def steps(self) -> int:
        """Optimizer steps the attached engines took while logging (all of them)."""
        return sum(self._steps.values())

    def rows(self) -> list[CommRow]:
        """The measured rows, each with the plans' model for the steps taken, and the
        modelled rows nothing matched (measured 0), in operation order."""
        world = comm.get_world_size()
        model: dict[tuple, tuple[int, int]] = {}
        for key, ref in list(self._models.items()):
            volume = ref()
            if volume is None:
                continue
            steps, skipped = self._steps.get(key, 0), self._skipped.get(key, 0)
            for row, (calls, size) in modelled_rows(volume(), world).items():
                taken = steps - skipped if row[1] in _NOT_WHEN_SKIPPED else steps
                before = model.get(row, (0, 0))
                model[row] = (before[0] + calls * taken, before[1] + size * taken)
        rows = []
        for key in sorted(set(self.records) | set(model), key=_order):
            entry = self.records.get(key)
            modelled = model.get(key)
            if modelled is None and self._models and _base_purpose(key[1]) in _MODELLED:
                modelled = (0, 0)  # a training collective the plan says this step has none of
            if entry is None:
                if not modelled or not modelled[0]:
                    continue
                entry = _Measured(0)
            rows.append(_row(key, entry, modelled))
        return rows

    def with_stragglers(self, rows: list[CommRow]) -> list[CommRow]:
        """`rows` with each one's straggler time: the sum over its calls of this rank's
        latency minus the fastest rank's (DeepSpeed's definition). Collective."""
        return _with_stragglers(rows, self.records)

    def summary(self, show_straggler: bool = False, rows: list[CommRow] | None = None) -> str:
        """The table `log_summary` prints: of `rows` (default `rows()`, with straggler
        times when `show_straggler`: collective, every rank calls it)."""
        if not self.enabled and not self.records:
            return (
                "fzero communication summary: the comms logger is off, nothing was timed "
                "(enable the config's comms_logger block, or deepspeed.comm.configure("
                "enabled=True))"
            )
        if rows is None:
            rows = self.rows()
            if show_straggler:
                rows = self.with_stragglers(rows)
        return format_comms_summary(rows, steps=self.steps())


_MODELLED = frozenset(PURPOSES) - {"telemetry"}
_NOT_WHEN_SKIPPED = ("gradient norm", "parameters after the update")


def _base_purpose(purpose: str) -> str:
    """A purpose without its quantized suffix (" (int8)")."""
    return purpose.removesuffix(" (int8)").removesuffix(" (int4)")


def _order(key: tuple[str, str, str]) -> tuple:
    operation, purpose, axes = key
    rank = OPERATIONS.index(operation) if operation in OPERATIONS else len(OPERATIONS)
    return rank, purpose, axes


def _row(key: tuple[str, str, str], entry: _Measured, modelled: tuple[int, int] | None) -> CommRow:
    operation, purpose, axes = key
    total = sum(entry.latencies)
    algbw = _trimmed_mean(entry.algbw) if entry.algbw else 0.0
    return CommRow(
        operation=operation,
        purpose=purpose,
        axes=axes,
        ranks=entry.ranks,
        count=entry.count,
        bytes=entry.bytes,
        latency_total_ms=1e3 * total,
        latency_avg_ms=1e3 * _trimmed_mean(entry.latencies) if entry.latencies else 0.0,
        algbw_gb_per_s=algbw / 1e9,
        busbw_gb_per_s=bus_bandwidth_factor(operation, entry.ranks) * algbw / 1e9,
        modelled_count=None if modelled is None else modelled[0],
        modelled_bytes=None if modelled is None else modelled[1],
    )


def _with_stragglers(rows: list[CommRow], records: dict[tuple, _Measured]) -> list[CommRow]:
    """Each row's straggler time: this rank's latencies minus, call by call, the
    smallest any rank measured for that call (one gather of every rank's latencies)."""
    mine = {"|".join(k): v.latencies for k, v in records.items()}
    everyone = [msgpack.unpackb(b) for b in comm.all_gather_bytes(msgpack.packb(mine))]
    found = []
    for row in rows:
        key = f"{row.operation}|{row.purpose}|{row.axes}"
        lists = [theirs.get(key, []) for theirs in everyone]
        if key not in mine or any(len(other) != len(mine[key]) for other in lists):
            found.append(row)  # ranks issued different numbers: no call-by-call minimum
            continue
        fastest = [min(calls) for calls in zip(*lists)]
        lag = sum(t - f for t, f in zip(mine[key], fastest))
        found.append(dataclasses.replace(row, straggler_ms=1e3 * lag))
    return found


def format_comms_summary(rows: Sequence[CommRow], *, steps: int) -> str:
    """The summary table: per operation, purpose and axes the calls and MB measured on
    this rank, total and mean latency, algbw and busbw, and beside them the calls and MB
    the plan's `comm_volume` gives for the `steps` optimizer steps taken while logging
    ("-" where the model has no such row: collectives outside the training step)."""
    straggler = any(r.straggler_ms is not None for r in rows)
    head = (
        f"{'operation':<15}{'purpose':<30}{'axes':<11}{'calls':>7}{'MB':>11}{'msg MB':>10}"
        f"{'lat ms':>10}{'avg ms':>9}{'algbw GB/s':>11}{'busbw GB/s':>11}"
        f"{'model calls':>12}{'model MB':>11}" + (f"{'straggler ms':>13}" if straggler else "")
    )
    lines = [
        f"fzero communication summary: rank {comm.get_rank()}, {steps} optimizer step(s) "
        "while logging (MB = 10^6 bytes; GB/s = 10^9 bytes/s; latency: issue to completion)",
        head,
    ]
    for r in rows:
        message = r.bytes / r.count / 1e6 if r.count else 0.0
        model_calls = "-" if r.modelled_count is None else f"{r.modelled_count}"
        model_mb = "-" if r.modelled_bytes is None else f"{r.modelled_bytes / 1e6:.4f}"
        line = (
            f"{r.operation:<15}{r.purpose[:29]:<30}{r.axes[:10]:<11}{r.count:>7}"
            f"{r.bytes / 1e6:>11.4f}{message:>10.4f}{r.latency_total_ms:>10.2f}"
            f"{r.latency_avg_ms:>9.3f}{r.algbw_gb_per_s:>11.3f}{r.busbw_gb_per_s:>11.3f}"
            f"{model_calls:>12}{model_mb:>11}"
        )
        if straggler:
            line += f"{r.straggler_ms:>13.2f}" if r.straggler_ms is not None else f"{'-':>13}"
        lines.append(line)
    total = sum(r.bytes for r in rows)
    lines.append(
        f"{'total':<56}{sum(r.count for r in rows):>7}{total / 1e6:>11.4f}{'':>10}"
        f"{sum(r.latency_total_ms for r in rows):>10.2f}"
    )
    return "\n".join(lines)


def _synchronize(tensor: torch.Tensor) -> None:
    """Wait for the device's queued work, so a CUDA collective's time is its own."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def comms_logger() -> CommsLogger:
    """The process's communication logger (DeepSpeed's `deepspeed.comm.comms_logger`):
    the one collectives are timed with, made (off) on first use."""
    found = profiler()
    if found is None:
        found = CommsLogger()
        profile_collectives(found)
    return found


def comms_logger_for(config: CommsLoggerConfig) -> CommsLogger | None:
    """An engine's `comms_logger` block: when enabled, the process's logger configured
    by it (a second engine's block configures the same logger, as DeepSpeed's
    `deepspeed.comm.configure` does); None when the block is off."""
    if not config.enabled:
        return None
    logger = comms_logger()
    logger.configure(config)
    return logger
