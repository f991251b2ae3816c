"""The `Engine`: a `Runtime` (its parts, built by `fzero.engine._runtime.build_runtime`),
its counters and loss scale, and DeepSpeed's surface over them (forward, backward,
step, accessors, checkpoint wrappers).

Everything about layout comes from the plan (`fzero.partition`); every update is a
functional optimizer's in-place path (`fzero.optim`, applied by `fzero.core.apply`);
whose gradient is whose is `_reduction`'s docstring; each unit's buffers are built by
`fzero.core.build`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from fzero import comm, partition
from fzero.config import Config, accumulation_steps, batch_sizes_or_none
from fzero.config.auto import check_resolved
from fzero.core.apply import StepClock
from fzero.core.layout import UnitRuntime
from fzero.core.precision import Precision, gradient_wire_dtype, precision_of
from fzero.core.state import Counters, TrainState, optimizer_partition
from fzero.core.update import GradStats, grad_stats, skips_nonfinite
from fzero.engine import _views
from fzero.engine._accessors import DeepSpeedAccessors
from fzero.engine._build import plan_for
from fzero.engine._checkpoints import CheckpointMethods, named
from fzero.engine._join import Join
from fzero.engine._runtime import build_runtime
from fzero.engine._scheduler import ConfigScheduler, step_scheduler
from fzero.engine._step import take_step
from fzero.engine.optimizer import EngineOptimizer
from fzero.engine.telemetry import Telemetry
from fzero.optim import LossScaleError, Optimizer
from fzero.optim._schedules import Schedule
from fzero.partition import MemoryEstimate, Plan, Unit

__all__ = ["Engine", "Precision"]

log = logging.getLogger("fzero")

_ENGINES = itertools.count()  # serial numbers: keys of each engine's checkpoint group


@dataclass(frozen=True)
class _NoHParams:
    lr: float = 0.0


class _NoState(NamedTuple):
    step: int


def _refuse_update(*_: Any, **__: Any) -> Any:
    raise RuntimeError(_NO_OPTIMIZER_MESSAGE)


_NO_OPTIMIZER_MESSAGE = (
    "fzero: this engine has no optimizer (initialize got none and the config has no "
    "'optimizer' block), so it runs forward only; give an optimizer to train. (DeepSpeed "
    "would step a no-op optimizer here and leave the weights as they are.)"
)
# `initialize` without an optimizer (DeepSpeed's evaluation / ZeRO-3 inference engines)
_NO_OPTIMIZER = Optimizer(
    "none", _NoHParams(), lambda param: _NoState(0), _refuse_update, _refuse_update, 0
)


def _counter(name: str) -> Any:
    """DeepSpeed's engine attribute `name`, a field of the engine's `counters`."""

    def get(self: Engine) -> int:
        return getattr(self.counters, name)

    def set_(self: Engine, value: int) -> None:
        self.counters = self.counters._replace(**{name: int(value)})

    return property(get, set_, doc=f"`counters.{name}`")


def _part(name: str) -> Any:
    """The runtime's part `name`, read through the engine (`engine.units`, ...)."""
    return property(lambda self: getattr(self.runtime, name), doc=f"`runtime.{name}`")


class Engine(DeepSpeedAccessors, CheckpointMethods):
    """Executes a ZeRO plan for `module`. Build it with `fzero.shard` or `fzero.initialize`.

    An engine is its `runtime` (the parts, `fzero.engine._runtime`), its `counters` and
    `loss_scale_state`, and DeepSpeed's surface over them. Its training state is the
    units' buffers (viewed as a `TrainState` by `train_state` without a copy); each
    unit's runtime record is written by the core only."""

    global_steps = _counter("global_steps")
    global_samples = _counter("global_samples")
    micro_steps = _counter("micro_steps")
    skipped_steps = _counter("skipped_steps")
    lr_steps = _counter("lr_steps")
    units = _part("units")
    plan = _part("plan")
    plan_rank = _part("rank")  # this process's rank in the plan (a mesh's shard group)
    groups = _part("groups")
    dtypes = _part("precision")  # compute, master and optimizer-state dtypes
    compute_dtype = _part("compute_dtype")
    device = _part("device")
    functional_optimizer = _part("optimizer")  # the update as pure functions
    schedule = _part("schedule")
    residency = _part("residency")
    hyperparams = _part("hyperparams")
    gatherer = _part("gatherer")
    param_shards = _part("param_shards")
    reduction = _part("reduction")
    timers = _part("timers")
    loss_scaler = _part("loss_scaler")  # fp16's, else None
    boundary_override: bool | None = None  # set by set_gradient_accumulation_boundary
    _skipped_last = _step_applied = False
    _global_grad_norm: float | None = None

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        optimizer: Optimizer | None,
        config: Config,
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        precision: str | Precision | None = None,
        strategy: Callable[..., Plan] | None = None,
        schedule: Callable[[int, float], float] | None = None,
        client_optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        param_init_fn: Callable[[torch.nn.Module], None] | None = None,
        name: str | None = None,
    ) -> None:
        comm.init_distributed(report_s=config.collective_report_s)  # who is where, when
        self.config, self.module = check_resolved(config), module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.stage, trainable = config.zero_optimization.stage, optimizer is not None
        self.batch = batch_sizes_or_none(config, self.world_size)
        self.accumulation = accumulation_steps(config, self.world_size)
        self.counters = Counters()
        self.serial = next(_ENGINES)  # the same on every rank: engines are built in step
        self.name = name or type(module).__name__ + (f"#{self.serial}" if self.serial else "")
        self.client_optimizer, self.client_lr_scheduler = client_optimizer, lr_scheduler
        groups = list(param_groups) if param_groups else [{"params": list(module.parameters())}]
        where, asked = f"engine {self.name}", precision_of(config, precision)
        plan, run = plan_for(module, groups, config, self.world_size, strategy, where, asked)
        self.runtime = build_runtime(
            module, plan, self.config, optimizer if trainable else _NO_OPTIMIZER,
            precision=run, schedule=schedule, param_groups=groups, trainable=trainable,
            client_optimizer=client_optimizer, param_init_fn=param_init_fn, owner=self,
        )  # fmt: skip
        self.precision = self.runtime.precision.compute  # "fp32", "bf16" or "fp16"
        self.loss_scale_state = self.loss_scaler.init() if self.loss_scaler else None
        self.optimizer = EngineOptimizer(self)  # what DeepSpeed scripts hold
        self._join = Join(self.reduction, self.stage)
        self._hooks = [*self.runtime.hooks, *_views.mark_engine(self.runtime, self)]
        self._schedulers(schedule if trainable else None, lr_scheduler if trainable else None)
        self.telemetry = Telemetry(self)  # it says what was built

    def _schedulers(self, schedule: Schedule | None, lr_scheduler: Any) -> None:
        """What the engine steps after each applied step, a plain attribute as DeepSpeed's
        (`fzero.engine._scheduler`): the client's scheduler, else the config's, else None."""
        self.config_scheduler = ConfigScheduler(self, schedule) if schedule is not None else None
        self.lr_scheduler: Any = lr_scheduler
        if self.lr_scheduler is None:
            self.lr_scheduler = self.config_scheduler

    @property
    def offload(self) -> bool:
        """Whether masters, optimizer state and the update live on the host (ZeRO-Offload,
        Ren et al. 2021): the device keeps compute-dtype parameters and gradients."""
        return self.residency.offload

    def partition(self, unit: Unit) -> slice:
        """This rank's optimizer partition of the unit buffer (the whole buffer in stage 0)."""
        return optimizer_partition(self.plan, unit, self.plan_rank)

    @property
    def train_state(self) -> TrainState:
        """The engine's training state as a `TrainState` over its own buffers (no copy):
        what `save_checkpoint` saves and `load_checkpoint` restores."""
        return _views.train_state(self.runtime, self.counters, self.loss_scale_state)

    @property
    def nvme(self) -> Any:
        """The optimizer's swap file when offloading to NVMe, else None."""
        return self.residency.nvme

    # ---- forward / backward / step ------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @property
    def _modules(self) -> dict[str, torch.nn.Module]:
        """The child registry DeepSpeed's engine has as an `nn.Module` (its `module`), which
        Accelerate's helpers read before they unwrap `engine.module`."""
        return {"module": self.module}

    def __getattr__(self, name: str) -> Any:
        """Public attributes the engine lacks come from the module (DeepSpeed's engine does
        the same: `engine.named_parameters()`, `engine.generate(...)`, a model's fields)."""
        module = self.__dict__.get("module")
        if module is not None and not name.startswith("_") and hasattr(module, name):
            return getattr(module, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")

    @named("forward")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (floating inputs cast to the compute dtype, stage-3 gathering:
        the module's own hooks, so calling the module directly trains the same). A
        plain `loss.backward()` through the returned tensors is this engine's backward."""
        self.residency.check_usable()
        self._join.forward(self.micro_steps)  # inside join(): this rank still trains
        with self.telemetry.forward(args, kwargs), self.timers("forward"):
            output = self.module(*args, **kwargs)
        for tensor in _tensors_requiring_grad(output):
            tensor.register_hook(self.reduction.on_output_grad)
        return output

    @named("backward")
    def backward(
        self, loss: Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> Tensor:
        """Backward of `loss / gradient_accumulation_steps` (times the fp16 loss scale;
        without the division when not `scale_wrt_gas`, for callers that scale the loss
        themselves); reduces gradients as the plan says. Returns that divided `loss`."""
        self.check_trainable()
        accumulation = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        scale = self.loss_scale_state.scale if self.loss_scale_state else 1.0
        self.telemetry.backward(loss)
        with self.reduction.explicit_backward(), self.timers("backward"):
            (loss.float() * (scale / accumulation)).backward(retain_graph=retain_graph)
        with self.timers("backward"):
            self.reduction.finish()
        self.telemetry.backward_done()
        return loss / accumulation  # DeepSpeed's return value

    def scale(self, loss: Tensor) -> Tensor:
        """`loss` times the fp16 loss scale, for a plain `engine.scale(loss).backward()`
        (DeepSpeed's `engine.scale`); the output hooks divide by the accumulation steps."""
        self.reduction.scaled_by_caller()
        return loss * (self.loss_scale_state.scale if self.loss_scale_state else 1.0)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch ends an accumulation window: by the micro-step
        count, or as `set_gradient_accumulation_boundary` last said."""
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's caller-managed accumulation (Accelerate's): from now on the caller
        says whether the next backward ends a window, and calls `step()` only when it
        does; each such `step()` is one micro-step and one optimizer step."""
        self.boundary_override = bool(is_boundary)

    @named("step")
    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """At the accumulation boundary: unscale, clip, update owned shards, regather;
        then step `lr_scheduler` (with `lr_kwargs`) unless the step was skipped (an fp16
        overflow; gradients not finite, as DeepSpeed skips them: `skips_nonfinite`)."""
        self.check_trainable()
        if self.reduction.no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(); leave the block first")
        self.reduction.before_step()
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps, self._step_applied = self.micro_steps + 1, False
        if not boundary:
            return self.telemetry.micro_step()
        try:
            with self.timers("step"):
                decision = take_step(
                    self.units, self.plan, self.groups, residency=self.residency,
                    application=self.runtime.application, grad_stats=self.grad_stats,
                    loss_scaler=self.loss_scaler, loss_scale=self.loss_scale_state,
                    clipping=self.config.gradient_clipping, device=self.device,
                    group_values=self.hyperparams.current(), skipped=self.skipped_steps,
                    clock=StepClock(self.lr_steps, self.global_steps + 1),
                    wire_dtype=gradient_wire_dtype(self.config),
                    reduced_whole=self.reduction.core.reduced_whole,
                    check_finite=skips_nonfinite(self.config, self.plan.stage),
                )  # fmt: skip
        except (OSError, LossScaleError):  # not applied (NVMe I/O, fp16 stuck at the minimum)
            self.micro_steps -= 1
            raise
        self.loss_scale_state = decision.loss_scale
        if decision.skip:
            self.skipped_steps += 1
            if decision.loss_scale is not None:
                log.warning("fzero: step %d skipped: gradient overflow; loss scale now %s",
                            self.global_steps, self.current_loss_scale)  # fmt: skip
            else:
                log.warning("fzero: step %d skipped: the gradients are not finite (inf or "
                            "NaN); the weights were not updated", self.global_steps)  # fmt: skip
        else:
            step_scheduler(self, lr_kwargs)
        self._global_grad_norm, self._skipped_last = decision.norm, decision.skip
        self._step_applied = not decision.skip
        self.global_steps += 1
        if self.batch is not None:
            self.global_samples += self.batch.train_batch_size
        self.telemetry.step()

    def check_trainable(self) -> None:
        """Raise unless this engine has an optimizer to train with and its state is whole
        (not after a failed in-place NVMe step)."""
        if self.functional_optimizer is _NO_OPTIMIZER:
            raise RuntimeError(_NO_OPTIMIZER_MESSAGE)
        self.residency.check_usable()

    def drop_accumulation_window(self) -> None:
        """Back to the first micro-step of the current accumulation window (its
        gradients were lost: NVMe gradient writes failed)."""
        self.micro_steps -= self.micro_steps % self.gradient_accumulation_steps()

    def publish_master(self, rt: UnitRuntime, written: Tensor | None = None) -> None:
        """Start writing the unit's fp32 master (edited outside a step: restored state),
        or `written`, its copy in the compute dtype, to the parameters; `finish_publish`
        completes it. Collective."""
        self.runtime.application.publish(rt, written)

    def finish_publish(self) -> None:
        self.runtime.application.finish_publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every `param.grad` of the module (DeepSpeed's `engine.zero_grad`): what
        other passes left there, set to None or, with `set_to_none=False`, zeroed in place
        (torch's `Optimizer.zero_grad` semantics). This engine's own gradients live in its
        buffers until the step, which clears them."""
        for p in self.module.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def grad_stats(self, grad: Tensor, into: GradStats | None = None) -> GradStats:
        """What the step needs of one unit's owned gradient (`_step.grad_stats`); `into`:
        of the part before it (a gradient kept in pieces)."""
        dynamic = self.loss_scaler is not None and self.loss_scaler.dynamic
        clipping = self.config.gradient_clipping
        return grad_stats(grad, clipping=clipping, dynamic=dynamic, into=into)

    # ---- learning rate ------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups; a script's edit of a group's `lr` is the lr of the
        next step (with a schedule, the schedule sets it at each step, as DeepSpeed's)."""
        return self.hyperparams.param_groups

    def get_lr(self) -> list[float]:
        return self.hyperparams.current_lrs()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside the block sums gradients locally without reducing them; the
        first backward at an accumulation boundary after it reduces them all. Stages 0-1
        only (stages 2-3 reduce as they shard, as in DeepSpeed); no `step()` inside."""
        with self.reduction.without_sync():
            yield

    @contextlib.contextmanager
    def join(self, replay: Callable[[], Tensor] | None = None) -> Iterator[None]:
        """Uneven inputs (DDP's `Join`): ranks may run different numbers of micro-steps
        inside the block; see `fzero.engine._join`. Stage 3 needs `replay`, a function
        running one forward through this engine and returning its loss."""
        with self._join.block(
            replay, serve=self._serve_backward, backward=self.backward, step=self.step,
            micro_step=lambda: self.micro_steps,
        ):  # fmt: skip
            yield

    @named("backward")
    def _serve_backward(self) -> None:
        """Inside `join()`, out of data: the reductions of the others' backward, with zero
        gradients here (a backward, as the ranks still training run one)."""
        self.reduction.shadow()

    def destroy(self) -> None:
        """Release the engine (DeepSpeed's `destroy`): wait for an asynchronous save, give
        stage-3 parameters back to the module whole, remove every hook. Collective."""
        self.wait_for_checkpoint()
        self.telemetry.close()
        if self.stage == 3:
            for rt in self.units:
                if self.plan.stage_of(rt.unit) == 3:
                    self.gatherer.gather(rt.index)
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @contextlib.contextmanager
    def gathered_parameters(
        self, params: Sequence[torch.nn.Parameter], modifier_rank: int | None = None
    ) -> Iterator[None]:
        """Full `params` inside the block (DeepSpeed's `GatheredParameters`); collective.
        With `modifier_rank`, that rank's edits are broadcast on exit and kept."""
        where = f"gathered_parameters of engine {self.name} (micro-step {self.micro_steps})"
        gathered = _views.gathered_parameters(self.runtime, params, modifier_rank)
        with comm.named_operation(where), gathered:
            yield

    # ---- whole-model views (fzero.engine._views) ------------------------------------------

    def full_master(self, rt: UnitRuntime) -> Tensor:
        """The unit's whole fp32 master buffer, gathered on every rank (collective)."""
        return _views.full_master(self.runtime, rt)

    @named("state_dict", entry=True)
    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The consolidated model state dict (masters cast to `dtype`, default the compute
        dtype), on rank 0 ({} elsewhere); collective."""
        self.residency.check_usable()
        return _views.state_dict(self.runtime, self.module, self.counters, dtype)

    def memory_held(self) -> MemoryEstimate:
        """Bytes of every model-state tensor this rank holds now, by kind."""
        return _views.memory_held(self.runtime)

    def comm_volume(self) -> list[partition.Collective]:
        """`fzero.partition.comm_volume` of this engine's plan and settings: the collectives
        one optimizer step issues (stage 3: with the units its last backward gathered
        again, from its recorded use order)."""
        return _views.comm_volume(self.runtime, self.config, self.accumulation, self.loss_scaler)

    def memory_planned(self) -> MemoryEstimate:
        """What the plan says this rank holds (`partition.memory_per_rank`)."""
        eval_live = self.config.zero_optimization.stage3_eval_live_parameters
        return _views.memory_planned(self.runtime, eval_live)


# ---- helpers -----------------------------------------------------------------------------


def _tensors_requiring_grad(value: Any) -> Iterator[Tensor]:
    """The tensors in a forward's output (nested tuples, lists, dicts) that need grads."""
    if isinstance(value, Tensor):
        if value.requires_grad:
            yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_requiring_grad(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors_requiring_grad(item)
