"""What the engine reports while it trains: DeepSpeed's `steps_per_print` lines and
`wall_clock_breakdown`, its monitors (`tensorboard`, `csv_monitor`, `wandb`, `comet`),
`comms_logger` and `flops_profiler` (`fzero.monitoring`), plus tokens/s, TFLOP/s and
MFU, model-state memory against the plan, an optional JSON-lines metrics file, and a
progress bar.

Every `steps_per_print` optimizer steps (a collective: every rank calls it), rank 0
prints one line about the steps since the last one:

    [fzero TinyLM] step 40/60 | steps 31-40: loss 2.8734, 61.2 samples/s, 3,918 tokens/s,
        0.012 TFLOP/s (6N), MFU 1.2% | lr 0.003 | model states 6.73 MB (plan 6.73 MB,
        max over ranks), peak 812 MB | ms/step: backward 31.0 forward 12.0 step 4.1

`TinyLM` is the engine's name (`name=`; by default the model's class, with `#N` for the
N-th engine of the process), so a GAN's two engines say which line is whose. `loss` is
the mean of the losses rank 0 passed to `engine.backward` in those steps (rank 0's
micro-batches only, before the 1/accumulation and loss-scale factors, as DeepSpeed
prints); a plain `loss.backward()` passes none, and the line shows no loss. Rates are
over the wall time of those steps, summed over ranks. MB are 10^6 bytes everywhere.

TFLOP/s: FLOPs per sample as the FLOPs profiler counted them at its step once it has
run ("counted"), else the training estimate 6 x parameters x tokens (Kaplan et al.
2020; "6N") when the inputs carry token ids (`input_ids`, or the first integer tensor).
MFU is TFLOP/s per rank over the device's peak (`fzero.monitoring.peak_flops`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from fzero import _logs, comm, monitoring
from fzero.engine.throughput import ThroughputTimer
from fzero.partition import MemoryEstimate, Plan


class Engine(Protocol):
    """What the reports, monitors and profilers read of their engine
    (`fzero.engine.Engine`; this module sits below it)."""

    name: str
    serial: int
    rank: int
    world_size: int
    stage: int
    precision: str
    compute_dtype: torch.dtype
    config: Any
    plan: Plan
    batch: Any
    device: torch.device
    module: torch.nn.Module
    residency: Any
    param_shards: Any
    timers: Timers
    global_steps: int
    global_samples: int
    skipped_steps: int
    loss_scaler: Any
    current_loss_scale: float

    def get_lr(self) -> list[float]: ...

    def get_global_grad_norm(self) -> float | None: ...

    def was_step_skipped(self) -> bool: ...

    def comm_volume(self) -> list[Any]: ...

    def memory_held(self) -> MemoryEstimate: ...

    def memory_planned(self) -> MemoryEstimate: ...


__all__ = ["Telemetry", "Timers", "count_tokens"]

log = logging.getLogger("fzero")


class Timers:
    """Wall-clock totals by name (forward, backward, step, comm)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start


def count_tokens(args: tuple, kwargs: dict) -> int:
    """Tokens in a forward's inputs: `input_ids`, else the first integer tensor."""
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            return value.numel()
    return 0


def count_samples(args: tuple, kwargs: dict) -> int | None:
    """Rows of a forward's first tensor input (the micro-batch's samples), if any."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim():
            return value.shape[0]
    return None


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _total_steps(engine: Engine) -> int | None:
    """The run's optimizer steps, when the config's schedule states them."""
    scheduler = engine.config.scheduler
    total = (scheduler.params if scheduler is not None else {}).get("total_num_steps")
    return int(total) if isinstance(total, int | float) and total > 0 else None


class Telemetry:
    """Per-engine counters between log lines, and their output."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        _logs.set_level(engine.config.log_level)  # before the engine's first line
        config = engine.config
        self.throughput = ThroughputTimer(  # DeepSpeed's engine.tput_timer
            engine.batch.train_batch_size if engine.batch is not None else None,
            steps_per_output=config.steps_per_print or None,
            enabled=(config.timers or {}).get("throughput", {}).get("enabled", True),
        )
        self.timers: Timers = engine.timers
        self.losses: list[float] = []  # rank 0's micro-batch losses since the last report
        self.step_losses: list[float] = []  # ... since the last optimizer step
        self.tokens = 0
        self.first_step = engine.global_steps + 1  # of the steps the next report covers
        self.params = engine.plan.manifest.numel
        self.traffic = comm.traffic_by_group()  # at the last report
        self.nvme = self._nvme_bytes()
        log.info(
            "fzero: stage %d, %s, world %d, %d units, %s params",
            engine.plan.stage,
            engine.precision,
            engine.plan.processes,
            len(engine.plan.units),
            f"{engine.plan.manifest.numel:,}",
        )
        config = engine.config
        self.monitor = monitoring.Monitor(config, rank=engine.rank)
        self.comms = monitoring.comms_logger_for(config.comms_logger)
        self._key = f"{engine.name}@{engine.serial}"
        if self.comms is not None:
            self.comms.attach(self._key, engine.comm_volume)
        self.flops_per_sample: float | None = None  # once the FLOPs profiler counted
        self.flops: monitoring.ProfiledStep | None = None
        if config.flops_profiler.enabled and engine.rank == 0:
            self.flops = monitoring.ProfiledStep(engine.module, config.flops_profiler, engine)
        self.total_steps = _total_steps(engine)
        self.bar: monitoring.ProgressBar | None = None
        if engine.rank == 0 and config.progress and sys.stdout.isatty():
            try:
                self.bar = monitoring.ProgressBar(engine.name, self.total_steps)
            except ImportError:
                log.info("fzero: no progress bar (tqdm is not installed)")
        self.last = time.perf_counter()  # the first report's interval starts here

    def expect_steps(self, total: int) -> None:
        """The run will take `total` optimizer steps: the bar and the step lines show it
        (a config's schedule with `total_num_steps` says so by itself)."""
        if total < 1:
            raise ValueError(f"expect_steps({total!r}): the total must be >= 1")
        self.total_steps = int(total)
        if self.bar is not None:
            self.bar.set_total(self.total_steps)

    # ---- hooks the engine calls ----------------------------------------------------------

    def forward(self, args: tuple, kwargs: dict) -> contextlib.AbstractContextManager[None]:
        """Around the module's forward: counts tokens, starts the throughput timer; the
        FLOPs profiler's window opens here at its step."""
        self.throughput.start()
        self.tokens += count_tokens(args, kwargs)
        if self.flops is not None:
            return self.flops.forward(self.engine.global_steps, count_samples(args, kwargs))
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """`engine.backward(loss)` starts: the loss as the reports and monitors see it."""
        value = float(loss.detach().float())
        self.losses.append(value)
        self.step_losses.append(value)

    def backward_done(self) -> None:
        """`engine.backward` ended (its reductions too): the FLOPs window closes."""
        if self.flops is not None:
            self.flops.backward_done()

    def micro_step(self) -> None:
        """After a `step()` off the accumulation boundary: the throughput timer stops."""
        self.throughput.stop(global_step=False)

    def step(self) -> None:
        """After each optimizer step: the throughput timer, monitors, the bar; every
        `steps_per_print`, report."""
        self.throughput.stop(global_step=True)
        engine = self.engine
        if self.comms is not None:
            self.comms.note_step(self._key, skipped=engine.was_step_skipped())
        if self.flops is not None:
            counted = self.flops.step_done(engine.global_steps - 1)
            if counted is not None:
                self.flops_per_sample = counted
        step_loss = _mean(self.step_losses)
        self.step_losses.clear()
        if self.monitor.enabled:
            self.monitor.write_events(self._step_events(step_loss))
        every = engine.config.steps_per_print
        report = bool(every) and engine.global_steps % every == 0
        if self.bar is not None and not report:
            self.bar.update(1, _mean(self.losses))
        if not report:
            return
        record = self._collect(every)
        if engine.rank != 0:
            return
        if self.bar is not None:
            self.bar.update(1, record["loss"])
        print(self._format(record), flush=True)
        if engine.config.metrics_file:
            with open(engine.config.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.monitor.enabled:
            self.monitor.write_events(monitoring.report_events(record, record["samples"]))

    def close(self) -> None:
        """The engine goes away: the bar closes and the monitors flush and close."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.monitor.close()
        if self.comms is not None:
            self.comms.detach(self._key)

    # ---- what is reported ----------------------------------------------------------------

    def _step_events(self, loss: float | None) -> list[monitoring.Event]:
        engine = self.engine
        samples = engine.global_samples
        before = samples - (engine.batch.train_batch_size if engine.batch is not None else 0)
        return monitoring.step_events(
            loss=loss,
            lr=(engine.get_lr() or [None])[0],
            samples_before=before,
            samples_after=samples,
            loss_scale=engine.current_loss_scale if engine.loss_scaler is not None else None,
            grad_norm=engine.get_global_grad_norm(),
        )

    def _nvme_bytes(self) -> tuple[int, int]:
        """(read, written) bytes of the engine's swap files so far."""
        files = [
            getattr(self.engine.residency, "nvme", None),
            self.engine.param_shards.store.swap,
        ]
        files = [f for f in files if f is not None]
        return sum(f.bytes_read for f in files), sum(f.bytes_written for f in files)

    def _collect(self, every: int) -> dict[str, Any]:
        engine = self.engine
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        # one collective for what needs every rank: tokens (sum), memory (max)
        held = engine.memory_held().total
        figures = torch.tensor(
            [float(self.tokens), float(held), float(_peak_memory_bytes(engine.device))],
            dtype=torch.float64,
        )
        tokens = figures[:1].clone()
        comm.all_reduce(tokens, op="sum", what="telemetry")
        comm.all_reduce(figures, op="max", what="telemetry")
        record: dict[str, Any] = {
            "step": engine.global_steps,
            "first_step": self.first_step,
            "samples": engine.global_samples,
            "engine": engine.name,
            "loss": _mean(self.losses),
            "lr": engine.get_lr(),
            "grad_norm": engine.get_global_grad_norm(),
            "seconds": elapsed,
        }
        self.first_step = engine.global_steps + 1
        if engine.loss_scaler is not None:
            record["loss_scale"] = engine.current_loss_scale
            record["skipped_steps"] = engine.skipped_steps
        if engine.batch is not None:
            record["samples_per_s"] = engine.batch.train_batch_size * every / elapsed
        if tokens.item():
            record["tokens_per_s"] = tokens.item() / elapsed
        self._add_flops(record, tokens.item(), every)
        self._add_traffic(record, every)
        record["memory_mb"] = figures[1].item() / 1e6
        record["memory_plan_mb"] = engine.memory_planned().total / 1e6
        record["peak_memory_mb"] = figures[2].item() / 1e6
        nvme = self._nvme_bytes()
        if nvme != (0, 0) or self.nvme != (0, 0):
            record["nvme_read_mb_per_s"] = (nvme[0] - self.nvme[0]) / 1e6 / elapsed
            record["nvme_write_mb_per_s"] = (nvme[1] - self.nvme[1]) / 1e6 / elapsed
        self.nvme = nvme
        if engine.config.wall_clock_breakdown:
            record["ms"] = {k: 1e3 * v / every for k, v in sorted(self.timers.totals.items())}
            self.timers.totals.clear()
        self.losses.clear()
        self.tokens = 0
        return record

    def _add_flops(self, record: dict[str, Any], tokens: float, every: int) -> None:
        """TFLOP/s over all ranks, and MFU per rank (rank 0's device peak)."""
        engine = self.engine
        if self.flops_per_sample is not None and engine.batch is not None:
            flops = self.flops_per_sample * engine.batch.train_batch_size * every
            record["flops_source"] = "counted"
        elif tokens:
            flops = 6 * self.params * tokens
            record["flops_source"] = "6N"
        else:
            return
        record["tflops"] = flops / record["seconds"] / 1e12
        if engine.rank == 0:
            peak = monitoring.peak_flops(engine.device, engine.compute_dtype)
            record["mfu"] = record["tflops"] * 1e12 / engine.world_size / peak.flops

    def _add_traffic(self, record: dict[str, Any], every: int) -> None:
        """This process's collectives since the last report: bytes by operation
        (`comm_bytes`) and MB per optimizer step by mesh axes (`comm_mb_per_step`)."""
        traffic = comm.traffic_by_group()
        by_operation: dict[str, int] = {}
        by_axes: dict[str, float] = {}
        for axes, operations in traffic.items():
            for op, (_, size) in operations.items():
                moved = size - self.traffic.get(axes, {}).get(op, (0, 0))[1]
                if moved:
                    by_operation[op] = by_operation.get(op, 0) + moved
                    by_axes[axes] = by_axes.get(axes, 0.0) + moved / 1e6 / every
        self.traffic = traffic
        record["comm_bytes"] = by_operation
        record["comm_mb_per_step"] = by_axes

    def _format(self, record: dict[str, Any]) -> str:
        total = f"/{self.total_steps}" if self.total_steps else ""
        head = f"[fzero {record['engine']}] step {record['step']}{total} | "
        span = record["first_step"], record["step"]
        parts = [f"steps {span[0]}-{span[1]}:" if span[0] != span[1] else f"step {span[1]}:"]
        figures = []
        if record["loss"] is not None:
            figures.append(f"loss {record['loss']:.4f}")
        if "samples_per_s" in record:
            figures.append(f"{record['samples_per_s']:.1f} samples/s")
        if "tokens_per_s" in record:
            figures.append(f"{record['tokens_per_s']:,.0f} tokens/s")
        if "tflops" in record:
            figures.append(f"{record['tflops']:.3g} TFLOP/s ({record['flops_source']})")
        if "mfu" in record:
            figures.append(f"MFU {100 * record['mfu']:.3g}%")
        parts.append(", ".join(figures))
        text = head + " ".join(parts)
        lrs = ", ".join(f"{lr:.3g}" for lr in record["lr"])
        text += f" | lr {lrs}"
        if "loss_scale" in record:
            text += f" loss_scale {record['loss_scale']:g} skipped {record['skipped_steps']}"
        text += (
            f" | model states {record['memory_mb']:.2f} MB (plan {record['memory_plan_mb']:.2f}"
            f" MB, max over ranks), peak {record['peak_memory_mb']:.0f} MB"
        )
        if "nvme_read_mb_per_s" in record:
            text += (
                f" | NVMe read {record['nvme_read_mb_per_s']:.1f} MB/s, write "
                f"{record['nvme_write_mb_per_s']:.1f} MB/s"
            )
        if "ms" in record:
            text += " | ms/step: " + " ".join(f"{k} {v:.1f}" for k, v in record["ms"].items())
        return text


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
