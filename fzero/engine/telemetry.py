"""What the engine reports while it trains: DeepSpeed's `steps_per_print` lines and
`wall_clock_breakdown`, plus tokens/s, an estimate of TFLOP/s, model-state memory
against the plan, an optional JSON-lines metrics file, and a progress bar.

Every `steps_per_print` optimizer steps (a collective: every rank calls it):

    [fzero Net] step 40 loss 5.4121 lr [0.00229] samples/s 61.2 tokens/s 3918 TFLOP/s 0.01
            mem 6.7/6.7 MB (max over ranks; plan) peak RSS 812 MB | backward 31.0ms ...

`Net` is the engine's name (`name=`; by default the model's class, with `#N` for the
N-th engine of the process), so a GAN's two engines say which line is whose. `loss`
is the mean of the losses rank 0 passed to `engine.backward` since the last line (rank
0's micro-batches only, before the 1/accumulation and loss-scale factors, as
DeepSpeed prints); a plain `loss.backward()` passes none, and the line shows no loss.

TFLOP/s is the usual training estimate 6 x parameters x tokens / time (Kaplan et al.
2020), shown when the inputs carry token ids (`input_ids`, or the first integer tensor).
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

from fzero import comm
from fzero.partition import MemoryEstimate, Plan


class Engine(Protocol):
    """What the reports read of their engine (`fzero.engine.Engine`; this module sits
    below it)."""

    name: str
    rank: int
    precision: str
    config: Any
    plan: Plan
    batch: Any
    device: torch.device
    timers: Timers
    global_steps: int
    skipped_steps: int
    loss_scaler: Any
    loss_scale: float

    def get_lr(self) -> list[float]: ...

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


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class Telemetry:
    """Per-engine counters between log lines, and their output."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.timers: Timers = engine.timers
        self.losses: list[float] = []
        self.tokens = 0
        self.last = time.perf_counter()
        self.params = engine.plan.manifest.numel
        self.traffic = comm.traffic()  # at the last report
        self._bar: Any = None
        log.info(
            "fzero: stage %d, %s, world %d, %d units, %s params",
            engine.plan.stage,
            engine.precision,
            engine.plan.processes,
            len(engine.plan.units),
            f"{engine.plan.manifest.numel:,}",
        )
        config = engine.config
        if engine.rank == 0 and config.progress and sys.stdout.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                log.info("fzero: no progress bar (tqdm is not installed)")
            else:
                self._bar = tqdm(desc="fzero", unit="step", dynamic_ncols=True)

    def forward(self, args: tuple, kwargs: dict) -> None:
        self.tokens += count_tokens(args, kwargs)

    def step(self) -> None:
        """After each optimizer step: tick the bar; every `steps_per_print`, report."""
        engine = self.engine
        if self._bar is not None:
            self._bar.update(1)
            if self.losses:
                self._bar.set_postfix(loss=f"{self.losses[-1]:.4f}", refresh=False)
        every = engine.config.steps_per_print
        if not every or engine.global_steps % every:
            return
        record = self._collect(every)
        if engine.rank != 0:
            return
        text = self._format(record)
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)
        if engine.config.metrics_file:
            with open(engine.config.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")

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
        comm.all_reduce(tokens, op="sum")
        comm.all_reduce(figures, op="max")
        record: dict[str, Any] = {
            "step": engine.global_steps,
            "engine": engine.name,
            "loss": sum(self.losses) / len(self.losses) if self.losses else None,
            "lr": engine.get_lr(),
            "seconds": elapsed,
        }
        if engine.loss_scaler is not None:
            record["loss_scale"] = engine.loss_scale
            record["skipped_steps"] = engine.skipped_steps
        if engine.batch is not None:
            record["samples_per_s"] = engine.batch.train_batch_size * every / elapsed
        if tokens.item():
            record["tokens_per_s"] = tokens.item() / elapsed
            record["tflops"] = 6 * self.params * tokens.item() / elapsed / 1e12
        traffic = comm.traffic()
        record["comm_bytes"] = {  # this process's collectives since the last report
            op: size - self.traffic.get(op, (0, 0))[1] for op, (_, size) in traffic.items()
        }
        self.traffic = traffic
        record["memory_mb"] = figures[1].item() / 2**20
        record["memory_plan_mb"] = engine.memory_planned().total / 2**20
        record["peak_memory_mb"] = figures[2].item() / 2**20
        if engine.config.wall_clock_breakdown:
            record["ms"] = {k: 1e3 * v / every for k, v in sorted(self.timers.totals.items())}
            self.timers.totals.clear()
        self.losses.clear()
        self.tokens = 0
        return record

    def _format(self, record: dict[str, Any]) -> str:
        lrs = ", ".join(f"{lr:.3g}" for lr in record["lr"])
        text = f"[fzero {record['engine']}] step {record['step']}"
        if record["loss"] is not None:
            text += f" loss {record['loss']:.4f}"
        text += f" lr [{lrs}]"
        if "loss_scale" in record:
            text += f" loss_scale {record['loss_scale']:g} skipped {record['skipped_steps']}"
        if "samples_per_s" in record:
            text += f" samples/s {record['samples_per_s']:.1f}"
        if "tokens_per_s" in record:
            text += f" tokens/s {record['tokens_per_s']:.0f} TFLOP/s {record['tflops']:.3f}"
        text += (
            f" mem {record['memory_mb']:.2f}/{record['memory_plan_mb']:.2f} MB"
            f" peak {record['peak_memory_mb']:.0f} MB"
        )
        if "ms" in record:
            text += " | " + " ".join(f"{k} {v:.1f}ms" for k, v in record["ms"].items())
        return text

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
