"""The `Engine`: DeepSpeed's surface (forward, backward, step, accessors, checkpoint
wrappers) wiring the parts of this package together, and the step's bookkeeping:
clipping, the fp16 overflow check and loss scale, counters, learning rates.

Everything about layout comes from the plan (`fzero.partition`); every update is a
functional optimizer's in-place path (`fzero.optim`, applied by `_apply`); whose
gradient is whose is `_reduction`'s docstring; each unit's buffers are `_units`'.
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
from fzero.core.apply import OptimizerApplication
from fzero.core.groups import check_same_plan, groups_of
from fzero.core.layout import (
    UnitRuntime,
)
from fzero.core.precision import Precision, check_precision, loss_scaler, precision_of
from fzero.core.reduce import bucket_accumulators, scatter_by_all_reduce
from fzero.core.residency import Residency
from fzero.core.stage3 import Stage3Gatherer
from fzero.core.state import Counters, TrainState, optimizer_partition, partition_numel
from fzero.core.update import GradStats, grad_stats
from fzero.engine import _views
from fzero.engine._accessors import DeepSpeedAccessors
from fzero.engine._build import build_units, cast_module, install_hooks, plan_for
from fzero.engine._checkpoints import CheckpointMethods, named
from fzero.engine._reduction import GradientReduction
from fzero.engine._scheduler import ConfigScheduler
from fzero.engine._step import Hyperparams, take_step
from fzero.engine.optimizer import EngineOptimizer
from fzero.engine.telemetry import Telemetry, Timers
from fzero.optim import LossScaleError, Optimizer
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


class Engine(DeepSpeedAccessors, CheckpointMethods):
    """Executes a ZeRO plan for `module`. Build it with `fzero.shard` or `fzero.initialize`.

    Its state is the units' buffers (`units`, viewed as a `TrainState` by `train_state`
    without a copy), `counters`, `loss_scale_state` and the process's generator; each
    unit's runtime record is written by the core only."""

    global_steps = _counter("global_steps")
    global_samples = _counter("global_samples")
    micro_steps = _counter("micro_steps")
    skipped_steps = _counter("skipped_steps")
    lr_steps = _counter("lr_steps")

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
        comm.init_distributed()
        self.config = check_resolved(config)
        if config.collective_report_s is not None:
            comm.report_waits_after(config.collective_report_s)
        self.module = module
        # the update as pure functions; `self.optimizer` is what DeepSpeed scripts hold
        self.functional_optimizer = optimizer if optimizer is not None else _NO_OPTIMIZER
        self.optimizer = EngineOptimizer(self)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = comm.backend_device()
        # compute, master and optimizer-state dtypes; `precision` names the first
        self.dtypes = precision_of(config, precision)
        check_precision(self.dtypes, config)
        self.precision = self.dtypes.compute
        self.compute_dtype = self.dtypes.compute_dtype
        zero = config.zero_optimization
        self.stage = zero.stage
        # ZeRO-Offload (Ren et al. 2021): fp32 masters, optimizer state and the update
        # on the host; the device keeps compute-dtype parameters and gradients.
        self.offload = zero.offload_optimizer.on
        # stage 3 parameter shards between uses: on the device, the host or NVMe
        self.param_offload = zero.offload_param.device
        # fzero's native kernels run the update where the state lives on the CPU
        self.batch = batch_sizes_or_none(config, self.world_size)
        self.accumulation = accumulation_steps(config, self.world_size)
        self.schedule = schedule
        self.client_optimizer = client_optimizer
        self.client_lr_scheduler = lr_scheduler  # DeepSpeed's name for the argument
        self.overlap_comm = zero.overlap_comm if zero.overlap_comm is not None else self.stage == 3
        self.loss_scaler = loss_scaler(config) if self.precision == "fp16" else None
        self.loss_scale_state = self.loss_scaler.init() if self.loss_scaler else None
        # steps, samples, micro-steps, skipped steps, the schedule's position: a value,
        # read and set through DeepSpeed's attribute names below
        self.counters = Counters()
        self._skipped_last = False
        self.boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._joined: int | None = None  # inside join(): see there
        self.timers = Timers()
        self._hooks: list[Any] = []
        self.serial = next(_ENGINES)  # the same on every rank: engines are built in step
        self._global_grad_norm: float | None = None
        self.name = name or type(module).__name__ + (f"#{self.serial}" if self.serial else "")

        self._groups = (
            list(param_groups) if param_groups else [{"params": list(module.parameters())}]
        )
        self.plan = plan_for(module, self._groups, config, self.world_size, strategy)
        check_same_plan(self.plan, f"engine {self.name}")
        # the process's groups and rank in the plan (a mesh's shard group; `rank` is the
        # process's, DeepSpeed's global rank)
        self.groups = groups_of(self.plan)
        self.plan_rank = self.groups.rank
        self.residency = Residency(
            config,
            self.plan,
            rank=self.plan_rank,
            optimizer=self.functional_optimizer,
            partition_numel=self.partition_numel,
        )
        cast_module(self)
        self.stage3 = Stage3Gatherer(
            config,
            self.plan,
            rank=self.plan_rank,
            compute_dtype=self.compute_dtype,
            device=self.device,
            pin_memory=self.residency.pin,
            timers=self.timers,
        )
        self.optimizer_application = OptimizerApplication(
            self.plan,
            self.plan_rank,
            optimizer=self.functional_optimizer,
            schedule=schedule,
            residency=self.residency,
            compute_dtype=self.compute_dtype,
            device=self.device,
            param_shards=self.stage3,
            param_offload=self.param_offload,
            timer=self.timers,
        )
        trainable = self.functional_optimizer is not _NO_OPTIMIZER
        self.hyperparams = Hyperparams(self, self._groups, trainable)
        buckets = partition.reduction_buckets(self.plan, int(zero.reduce_bucket_size))
        accumulators = None  # stages 0-1: one buffer per bucket (one all-reduce each)
        if self.stage < 2:
            accumulators = bucket_accumulators(self.plan, buckets, self.device)
        self.units = build_units(self, param_init_fn, accumulators)
        self.stage3.units = self.residency.units = self.units
        self.reduction = GradientReduction(
            self,
            self.plan,
            self.plan_rank,
            self.units,
            buckets,
            device=self.device,
            compute_dtype=self.compute_dtype,
            stage3=self.stage3,
            residency=self.residency,
            timers=self.timers,
            overlap=self.overlap_comm,
            quantized=zero.zero_quantized_gradients,
            bits=zero.zero_quantized_gradients_bits,
        )
        self.stage3.on_backward_use = self.reduction.note_backward_use
        self._hooks += install_hooks(self)
        # what the engine steps after each applied step, a plain attribute as DeepSpeed's
        # (`fzero.engine._scheduler`): the client's scheduler, else the config's, else None
        self.config_scheduler = (
            ConfigScheduler(self, schedule) if schedule is not None and trainable else None
        )
        self.lr_scheduler: Any = lr_scheduler if trainable else None
        if self.lr_scheduler is None:
            self.lr_scheduler = self.config_scheduler
        self.telemetry = Telemetry(self)
        log.info(
            "fzero: stage %d, %s, world %d, %d units, %s params",
            self.stage,
            self.precision,
            self.world_size,
            len(self.units),
            f"{self.plan.manifest.numel:,}",
        )

    def partition(self, unit: Unit) -> slice:
        """This rank's optimizer partition of the unit buffer (the whole buffer in stage 0)."""
        return optimizer_partition(self.plan, unit, self.plan_rank)

    def owned(self, unit: Unit) -> slice:
        """This rank's shard of the unit buffer (`plan`'s range)."""
        start, stop = unit.shard_range(self.plan_rank)
        return slice(start, stop)

    @property
    def train_state(self) -> TrainState:
        """The engine's training state as a `TrainState` over its own buffers (no copy):
        what `save_checkpoint` saves and `load_checkpoint` restores."""
        return _views.train_state(self)

    @property
    def nvme(self) -> Any:
        """The optimizer's swap file when offloading to NVMe, else None."""
        return self.residency.nvme

    def partition_numel(self, unit: Unit) -> int:
        """Elements of this rank's optimizer partition of `unit` (all of it in stage 0)."""
        return partition_numel(self.plan, unit, self.plan_rank)

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
        if self._joined is not None and self._joined != self.micro_steps:
            self._joined = self.micro_steps  # inside join(): this rank still trains
            self.reduction.still_training(True)
        self.telemetry.forward(args, kwargs)
        with self.timers("forward"):
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
        themselves); reduces gradients as the plan says. Returns `loss`."""
        self.check_trainable()
        accumulation = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        scale = self.loss_scale_state.scale if self.loss_scale_state else 1.0
        self.telemetry.losses.append(float(loss.detach().float()))
        with self.reduction.explicit_backward(), self.timers("backward"):
            (loss.float() * (scale / accumulation)).backward(retain_graph=retain_graph)
        with self.timers("backward"):
            self.reduction.finish()
        return loss

    def scale(self, loss: Tensor) -> Tensor:
        """`loss` times the fp16 loss scale, for a plain `engine.scale(loss).backward()`
        (DeepSpeed's `engine.scale`); the output hooks divide by the accumulation steps."""
        self.reduction.manual_scale = True
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
        then step `lr_scheduler` (with `lr_kwargs`) unless fp16 overflow skipped it."""
        self.check_trainable()
        if self.reduction.no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(); leave the block first")
        self.reduction.take_left_grads()
        self.reduction.reduced = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        loss_scale_state = self.loss_scale_state
        try:
            with self.timers("step"):
                decision = take_step(self, lr_kwargs)
        except (OSError, LossScaleError):  # not applied (NVMe I/O, fp16 stuck at the minimum)
            self.micro_steps -= 1
            self.loss_scale_state = loss_scale_state
            raise
        self._global_grad_norm, self._skipped_last = decision.norm, decision.skip
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

    def publish_master(self, rt: UnitRuntime) -> None:
        """Start writing the unit's fp32 master (edited outside a step: restored state)
        to the parameters; `finish_publish` completes it. Collective."""
        self.optimizer_application.publish(rt)

    def finish_publish(self) -> None:
        self.optimizer_application.finish_publish()

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

    def grad_stats(self, grad: Tensor) -> GradStats:
        """What the step needs of one unit's owned gradient (`_step.grad_stats`)."""
        dynamic = self.loss_scaler is not None and self.loss_scaler.dynamic
        return grad_stats(grad, clipping=self.config.gradient_clipping, dynamic=dynamic)

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
        inside the block. A rank that leaves it keeps serving the others' gradient
        reductions and steps with zero gradients until every rank has left, so the
        result is a run where a rank out of data contributes nothing (gradients are
        still averaged over the whole world, as DDP's default). Each micro-step's first
        forward inside costs one one-element all-reduce (who still trains). The loop
        must be forward, backward, `step()` per micro-step. At stage 3 the others' forward
        and backward gather parameters, so a rank that has left runs `replay()` — one
        forward through this engine returning a loss, e.g. on its last batch — and a
        backward of it weighted 0: the same gathers in the same order (a model whose
        program does not depend on its data), no contribution."""
        if self.stage == 3 and replay is None:
            raise NotImplementedError(
                "engine.join() at ZeRO stage 3 needs replay=: a function running one "
                "forward through the engine and returning its loss (e.g. on the rank's last "
                "batch), which a rank out of data runs, weighted 0, to serve the others' "
                "all-gathers; or give every rank the same number of micro-batches"
            )
        if self._joined is not None:
            raise RuntimeError("engine.join() is already active; it cannot be re-entered")
        self._joined = -1  # the micro-step whose "still training" flag was sent
        try:
            yield
            while self.reduction.still_training(False):  # out of data: serve the others
                if replay is None:
                    self._serve_backward()
                else:  # stage 3: the others' gathers, by the same program
                    self._joined = self.micro_steps  # this micro-step's flag is sent
                    self.backward(replay() * 0.0)
                self.step()
        finally:
            self._joined = None

    @named("backward")
    def _serve_backward(self) -> None:
        """Inside `join()`, out of data: the reductions of the others' backward, with zero
        gradients here (a backward, as the ranks still training run one)."""
        self.reduction.shadow()

    def destroy(self) -> None:
        """Release the engine (DeepSpeed's `destroy`): wait for an asynchronous save, give
        stage-3 parameters back to the module whole, remove every hook. Collective."""
        self.wait_for_checkpoint()
        if self.stage == 3:
            for rt in self.units:
                self.stage3.gather(rt)
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for rt in self.units:
            for p, _, _ in rt.params:
                p.__dict__.pop("_fzero_engine", None)

    @contextlib.contextmanager
    def gathered_parameters(
        self, params: Sequence[torch.nn.Parameter], modifier_rank: int | None = None
    ) -> Iterator[None]:
        """Full `params` inside the block (DeepSpeed's `GatheredParameters`); collective.
        With `modifier_rank`, that rank's edits are broadcast on exit and kept."""
        where = f"gathered_parameters of engine {self.name} (micro-step {self.micro_steps})"
        with comm.named_operation(where), _views.gathered_parameters(self, params, modifier_rank):
            yield

    # ---- whole-model views (fzero.engine._views) ------------------------------------------

    def full_master(self, rt: UnitRuntime) -> Tensor:
        """The unit's whole fp32 master buffer, gathered on every rank (collective)."""
        return _views.full_master(self, rt)

    @named("state_dict", entry=True)
    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The consolidated model state dict (masters cast to `dtype`, default the compute
        dtype), on rank 0 ({} elsewhere); collective."""
        self.residency.check_usable()
        return _views.state_dict(self, dtype)

    def memory_held(self) -> MemoryEstimate:
        """Bytes of every model-state tensor this rank holds now, by kind."""
        return _views.memory_held(self)

    def comm_volume(self) -> list[partition.Collective]:
        """`fzero.partition.comm_volume` of this engine's plan and settings: the collectives
        one optimizer step issues (stage 3: with the units its last backward gathered
        again, from its recorded use order)."""
        zero = self.config.zero_optimization
        return partition.comm_volume(
            self.plan,
            accumulation_steps=self.accumulation,
            param_dtype=partition.dtype_name(self.compute_dtype),
            bucket_numel=int(zero.reduce_bucket_size),
            scatter_as_all_reduce=scatter_by_all_reduce(),
            regathered=self.stage3.regathered,
            loss_scaling=self.loss_scaler is not None and self.loss_scaler.dynamic,
            optimizer=self.functional_optimizer.name,
            quantized_weights=zero.zero_quantized_weights,
            quantized_gradients=zero.zero_quantized_gradients,
            quantized_gradient_bits=zero.zero_quantized_gradients_bits,
        )

    def memory_planned(self) -> MemoryEstimate:
        """What the plan says this rank holds (`partition.memory_per_rank`)."""
        return _views.memory_planned(self)

    # ---- telemetry ------------------------------------------------------------------------


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
