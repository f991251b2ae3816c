"""DeepSpeed's read-only engine accessors (`fp16_enabled()`, `train_batch_size()`,
`get_global_grad_norm()`, ...), which scripts and clients (Transformers, Accelerate,
Lightning) call by name: one-line answers from the engine's state, kept apart from the
engine's own logic."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["DeepSpeedAccessors"]


class DeepSpeedAccessors:
    """Mixed into `fzero.engine.Engine`; reads only the attributes annotated here."""

    module: torch.nn.Module
    rank: int
    loss_scale_state: Any
    batch: Any
    accumulation: int
    precision: str
    stage: int
    config: Any
    hyperparams: Any
    schedule: Any
    lr_steps: int
    _skipped_last: bool
    _step_applied: bool
    _global_grad_norm: float | None

    def train(self, mode: bool = True) -> Any:
        self.module.train(mode)
        return self

    def eval(self) -> Any:
        return self.train(False)

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def loss_scale(self) -> float:
        return self.loss_scale_state.scale if self.loss_scale_state else 1.0

    def was_step_skipped(self) -> bool:
        return self._skipped_last

    def was_step_applied(self) -> bool:
        """Whether the latest `step()` updated the parameters (DeepSpeed's): False off an
        accumulation boundary and when the step was skipped."""
        return self._step_applied

    def train_batch_size(self) -> int | None:
        return self.batch.train_batch_size if self.batch else None

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.batch.micro_batch_size if self.batch else None

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters()

    def fp16_enabled(self) -> bool:
        return self.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.precision == "bf16"

    def zero_optimization(self) -> bool:
        return self.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state lives off the device (`offload_optimizer` cpu or
        nvme), as DeepSpeed's accessor says."""
        return bool(self.config.zero_optimization.offload_optimizer.on)

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the last step's gradients, before clipping (None before
        the first step; inf when the step was skipped: an fp16 overflow, or gradients
        that are not finite)."""
        return self._global_grad_norm

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: Adam's `betas`, SGD's `momentum` (DeepSpeed)."""
        return self.hyperparams.momentum(self.schedule, self.lr_steps)
