"""The `Engine`: DeepSpeed's surface (forward, backward, step, accessors, checkpoint
wrappers) wiring the parts of this package together, and the step's bookkeeping:
clipping, the fp16 overflow check and loss scale, counters, learning rates.

Everything about layout comes from the plan (`fzero.partition`); every update is a
functional optimizer's in-place path (`fzero.optim`, applied by `_apply`); whose
gradient is whose is `_reduction`'s docstring; each unit's buffers are `_units`'.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from fzero import _nvme, comm, partition
from fzero._meta_init import MetaInitializer
from fzero._train_state import Counters, TrainState, UnitState
from fzero.config import Config, batch_sizes, check_resolved
from fzero.engine import _views
from fzero.engine._apply import OptimizerApplication, hparam_fields
from fzero.engine._precision import DTYPES, Precision, cast_floats, loss_scaler, precision_of
from fzero.engine._reduction import GradientReduction
from fzero.engine._residency import Residency, UnitResidence
from fzero.engine._stage3 import Stage3Gatherer
from fzero.engine._step import GradStats, decide_step, grad_stats
from fzero.engine._units import (
    UnitRuntime,
    bind,
    scatter_pieces,
    unbind,
)
from fzero.engine_optimizer import EngineOptimizer
from fzero.optim import Optimizer, with_overrides
from fzero.partition import MemoryEstimate, Plan, Unit
from fzero.telemetry import Telemetry, Timers

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


def _named(operation: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An engine method whose collectives, if a rank never arrives, say which rank and
    where (`comm.named_operation`)."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: Engine, *args: Any, **kwargs: Any) -> Any:
            where = f"{operation} of engine {self.name} (micro-step {self.micro_steps})"
            with comm.named_operation(where):
                return method(self, *args, **kwargs)

        return run

    return wrap


class Engine:
    """Executes a ZeRO plan for `module`. Build it with `fzero.shard` or `fzero.initialize`."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        optimizer: Optimizer | None,
        config: Config,
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        precision: Precision | None = None,
        strategy: Callable[..., Plan] | None = None,
        schedule: Callable[[int, float], float] | None = None,
        client_optimizer: torch.optim.Optimizer | None = None,
        client_scheduler: Any = None,
        param_init_fn: Callable[[torch.nn.Module], None] | None = None,
        name: str | None = None,
    ) -> None:
        comm.init_distributed()
        self.config = check_resolved(config)
        self.module = module
        # the update as pure functions; `self.optimizer` is what DeepSpeed scripts hold
        self.functional_optimizer = optimizer if optimizer is not None else _NO_OPTIMIZER
        self.optimizer = EngineOptimizer(self)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = comm.backend_device()
        self.precision = precision or precision_of(config)
        if self.precision not in DTYPES:
            raise ValueError(f"precision is {self.precision!r}; allowed: {sorted(DTYPES)}")
        self.compute_dtype = DTYPES[self.precision]
        zero = config.zero_optimization
        self.stage = zero.stage
        # ZeRO-Offload (Ren et al. 2021): fp32 masters, optimizer state and the update
        # on the host; the device keeps compute-dtype parameters and gradients.
        self.offload = zero.offload_optimizer.device in ("cpu", "nvme")
        # stage 3 parameter shards between uses: on the device, the host or NVMe
        self.param_offload = zero.offload_param.device
        # fzero's native kernels run the update where the state lives on the CPU
        self.batch = _batch_or_none(config, self.world_size)
        self.schedule = schedule
        self.client_optimizer = client_optimizer
        self.client_scheduler = client_scheduler
        self.overlap_comm = zero.overlap_comm if zero.overlap_comm is not None else self.stage == 3
        self.loss_scaler = loss_scaler(config) if self.precision == "fp16" else None
        self.loss_scale_state = self.loss_scaler.init() if self.loss_scaler else None
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.lr_steps = 0
        self._skipped_last = False
        self.timers = Timers()
        self._hooks: list[Any] = []
        self.serial = next(_ENGINES)  # the same on every rank: engines are built in step
        self._forward_contexts: list[Any] = []
        self._global_grad_norm: float | None = None
        self.lr_scheduler: Any = None  # what `initialize` returns as the scheduler
        self.name = name or type(module).__name__ + (f"#{self.serial}" if self.serial else "")

        self._groups = (
            list(param_groups) if param_groups else [{"params": list(module.parameters())}]
        )
        manifest = partition.describe(module, self._groups)
        options: dict[str, Any] = {}
        if self.stage == 3:
            options["persistence_threshold"] = zero.stage3_param_persistence_threshold
        self.plan = partition.plan(
            manifest,
            world_size=self.world_size,
            stage=self.stage,
            strategy=strategy or partition.flat_even,
            **options,
        )
        self.residency = Residency(
            config,
            self.plan,
            rank=self.rank,
            optimizer=self.functional_optimizer,
            partition_numel=self.partition_numel,
        )
        self.optimizer_application = OptimizerApplication(self)
        self._cast_module()
        named = dict(module.named_parameters())
        meta = None
        if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            meta = MetaInitializer(module, self.device, param_init_fn)
        self.stage3 = Stage3Gatherer(
            config,
            self.plan,
            rank=self.rank,
            compute_dtype=self.compute_dtype,
            device=self.device,
            pin_memory=self.residency.pin,
            timers=self.timers,
        )
        self.reduction = GradientReduction(self)
        self.stage3.on_backward_use = self.reduction.note_backward_use
        self.units = [
            self._build_unit(i, unit, named, meta) for i, unit in enumerate(self.plan.units)
        ]
        self.stage3.units = self.residency.units = self.units
        if meta is not None:
            meta.finish()
        if self.residency.nvme is not None:
            _nvme.return_free_memory()
        self.reduction.build(zero.reduce_bucket_size)
        for rt in self.units:
            for p, _, _ in rt.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self.reduction.on_grad))
                p._fzero_engine = weakref.ref(self)  # for fzero.gathered_parameters
        self._install_root_hooks()
        if self.stage == 3:
            self.stage3.install_hooks(self.module)
            self._hooks += self.stage3.hooks
        self._set_hparams()
        self.telemetry = Telemetry(self)
        log.info(
            "fzero: stage %d, %s, world %d, %d units, %s params",
            self.stage,
            self.precision,
            self.world_size,
            len(self.units),
            f"{manifest.numel:,}",
        )

    # ---- construction ------------------------------------------------------------------

    def _cast_module(self) -> None:
        """Compute dtype for frozen params and floating buffers (trainable ones are rebound)."""
        if self.compute_dtype == torch.float32:
            return
        managed = {id(p) for p in self._managed_parameters()}
        for p in self.module.parameters():
            if id(p) not in managed and p.is_floating_point():
                p.data = p.data.to(self.compute_dtype)
        for b in self.module.buffers():
            if b.is_floating_point():
                b.data = b.data.to(self.compute_dtype)

    def _managed_parameters(self) -> list[torch.nn.Parameter]:
        named = dict(self.module.named_parameters())
        return [named[spec.fqn] for spec in self.plan.manifest.tensors]

    def partition(self, unit: Unit) -> slice:
        """This rank's optimizer partition of the unit buffer (the whole buffer in stage 0)."""
        if self.stage == 0:
            return slice(0, unit.numel)
        start, stop = unit.shard_range(self.rank)
        return slice(start, stop)

    def owned(self, unit: Unit) -> slice:
        """This rank's shard of the unit buffer (`plan`'s range)."""
        start, stop = unit.shard_range(self.rank)
        return slice(start, stop)

    def _build_unit(
        self,
        index: int,
        unit: Unit,
        named: Mapping[str, torch.nn.Parameter],
        meta: MetaInitializer | None,
    ) -> UnitRuntime:
        fqns = [pl.fqn for pl in unit.placements]
        tensors = meta.until(fqns) if meta is not None else [named[fqn] for fqn in fqns]
        params = [(p, pl, tuple(p.shape)) for p, pl in zip(tensors, unit.placements)]
        flat = torch.zeros(unit.numel, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for p, placement, _ in params:
                scatter_pieces(flat, p.detach().reshape(-1).float(), placement)
        if self.world_size > 1:
            dist.broadcast(flat, src=0)  # every rank starts from rank 0's weights
        keeps_full = self.stage < 3 or unit.persistent
        part = self.partition(unit)
        full = master = param_shard = None
        shares_master = (
            self.compute_dtype == torch.float32
            and not self.offload
            and self.param_offload == "none"
        )
        if keeps_full:
            full = flat if self.compute_dtype == torch.float32 else flat.to(self.compute_dtype)
            master = full[part] if shares_master else self.residency.to_host(flat[part])
        else:
            master = self.residency.to_host(flat[part])
            if not shares_master:
                param_shard = flat[part].to(self.compute_dtype, copy=True)
        del flat
        # stages 0-1: views of the bucket buffers; NVMe offload: in the swap file
        grad_numel = 0 if self.stage < 2 or self.residency.grads_on_disk else unit.shard_numel
        rt = UnitRuntime(
            index=index,
            unit=unit,
            params=params,
            master=master,
            state=self.functional_optimizer.init(master),
            grad=torch.zeros(grad_numel, dtype=torch.float32, device=self.device),
            full=full,
            param_shard=param_shard,
        )
        if keeps_full:
            bind(rt)
        else:
            unbind(rt, self.compute_dtype, self.device)
            self.stage3.store_param_shard(rt, rt.param_shard)
        if self.residency.nvme is not None:  # to the swap file; the host keeps nothing of it
            self.residency.swap_out(rt, rt.slot, wait=True)
            self.residency.evict(rt)
        return rt

    @property
    def train_state(self) -> TrainState:
        """The engine's training state as a `TrainState` over its own buffers (no copy):
        what `save_checkpoint` saves and `load_checkpoint` restores."""
        units = tuple(
            UnitState(
                rt.master,
                rt.state,
                rt.full if self.stage < 3 or rt.unit.persistent else rt.param_shard,
                rt.grad,
            )
            for rt in self.units
        )
        counters = Counters(
            self.global_steps,
            self.global_samples,
            self.micro_steps,
            self.skipped_steps,
            self.lr_steps,
        )
        residence = UnitResidence(self.residency, self.units) if self.nvme is not None else None
        return TrainState(
            self.plan, self.rank, units, counters, self.loss_scale_state, residence=residence
        )

    @property
    def nvme(self) -> Any:
        """The optimizer's swap file when offloading to NVMe, else None."""
        return self.residency.nvme

    def partition_numel(self, unit: Unit) -> int:
        """Elements of this rank's optimizer partition of `unit` (all of it in stage 0)."""
        part = self.partition(unit)
        return part.stop - part.start

    # ---- forward / backward / step ------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Public attributes the engine lacks come from the module (DeepSpeed's engine does
        the same: `engine.named_parameters()`, `engine.generate(...)`, a model's fields)."""
        module = self.__dict__.get("module")
        if module is not None and not name.startswith("_") and hasattr(module, name):
            return getattr(module, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")

    @_named("forward")
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (floating inputs cast to the compute dtype, stage-3 gathering:
        the module's own hooks, so calling the module directly trains the same). A
        plain `loss.backward()` through the returned tensors is this engine's backward."""
        self.telemetry.forward(args, kwargs)
        with self.timers("forward"):
            output = self.module(*args, **kwargs)
        for tensor in _tensors_requiring_grad(output):
            tensor.register_hook(self.reduction.on_output_grad)
        return output

    def _install_root_hooks(self) -> None:
        """Hooks on the module itself (first of all its hooks): inputs cast to the compute
        dtype, and in stage 3 the forward phase with its saved-tensor hooks."""
        root = self.module
        self._hooks.append(
            root.register_forward_pre_hook(self._before_forward, with_kwargs=True, prepend=True)
        )
        self._hooks.append(root.register_forward_hook(self._after_forward, always_call=True))

    def _before_forward(self, _module: Any, args: Any, kwargs: Any) -> Any:
        if self.compute_dtype != torch.float32:
            args, kwargs = cast_floats((args, kwargs), self.compute_dtype)
        contexts: list[Any] = []
        if self.config.torch_autocast.enabled:  # DeepSpeed's torch_autocast (bf16)
            contexts.append(torch.autocast(self.device.type, dtype=torch.bfloat16))
        if self.stage == 3:
            self.stage3.begin_phase("forward")
            hooks = torch.autograd.graph.saved_tensors_hooks(self.stage3.pack, self.stage3.unpack)
            contexts.append(hooks)
        for context in contexts:
            context.__enter__()
        self._forward_contexts.append(contexts)
        return args, kwargs

    def _after_forward(self, _module: Any, _args: Any, _output: Any) -> None:
        if not self._forward_contexts:
            return
        for context in reversed(self._forward_contexts.pop()):
            context.__exit__(None, None, None)
        if self.stage == 3:
            self.stage3.end_phase()

    @_named("backward")
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
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    @_named("step")
    def step(self) -> None:
        """At the accumulation boundary: unscale, clip, update owned shards, regather."""
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
                self._take_step()
        except OSError:  # an NVMe step that was not applied: step() may be called again
            self.micro_steps -= 1
            self.loss_scale_state = loss_scale_state
            raise
        self.global_steps += 1
        if self.batch is not None:
            self.global_samples += self.batch.train_batch_size
        self.telemetry.step()

    def check_trainable(self) -> None:
        """Raise unless this engine has an optimizer to train with."""
        if self.functional_optimizer is _NO_OPTIMIZER:
            raise RuntimeError(_NO_OPTIMIZER_MESSAGE)

    def _unit_grad_stats(self) -> list[GradStats]:
        """`_step.grad_stats` of every unit's owned gradient, in unit order (NVMe: taken
        when the last micro-step wrote the gradient; a unit without one has zeros)."""
        if not self.residency.grads_on_disk:
            return [
                self.grad_stats(rt.grad[self.owned(rt.unit)] if self.stage < 2 else rt.grad)
                for rt in self.units
            ]
        zeros = self.grad_stats(torch.zeros(1))
        return [rt.grad_stats if rt.grad_on_disk and rt.grad_stats else zeros for rt in self.units]

    def grad_stats(self, grad: Tensor) -> GradStats:
        """What the step needs of one unit's owned gradient (`_step.grad_stats`)."""
        dynamic = self.loss_scaler is not None and self.loss_scaler.dynamic
        return grad_stats(grad, clipping=self.config.gradient_clipping, dynamic=dynamic)

    def _take_step(self) -> None:
        decision = decide_step(
            self._unit_grad_stats(),
            loss_scaler=self.loss_scaler,
            loss_scale=self.loss_scale_state,
            clipping=self.config.gradient_clipping,
            device=self.device,
            world_size=self.world_size,
        )
        self.loss_scale_state = decision.loss_scale
        self._global_grad_norm = decision.norm
        self._skipped_last = decision.skip
        if decision.skip:
            self.skipped_steps += 1
            log.warning(
                "fzero: step %d skipped: gradient overflow; loss scale now %s",
                self.global_steps,
                self.loss_scale_state.scale,
            )
            self._zero_grads()
            return
        self.optimizer_application.apply(decision.factor, self._current_lrs())
        self._zero_grads()
        self.lr_steps += 1
        if self.client_scheduler is not None:
            self.client_scheduler.step()

    def publish_master(self, rt: UnitRuntime) -> None:
        """Start writing the unit's fp32 master (edited outside a step: restored state)
        to the parameters; `finish_publish` completes it. Collective."""
        self.optimizer_application.publish(rt)

    def finish_publish(self) -> None:
        self.optimizer_application.finish_publish()

    def _zero_grads(self) -> None:
        for rt in self.units:
            rt.grad.zero_()
            rt.grad_on_disk, rt.grad_stats = False, None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every `param.grad` of the module (DeepSpeed's `engine.zero_grad`): what
        other passes left there. This engine's own gradients live in its buffers until
        the step, which clears them."""
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad = None

    # ---- learning rate --------------------------------------------------------------------

    def _set_hparams(self) -> None:
        """Each unit's hyper-parameters, and the param groups scripts read and edit: the
        client optimizer's when there is one, else the engine's own."""
        base = self.functional_optimizer.hparams
        trainable = self.functional_optimizer is not _NO_OPTIMIZER
        group_hparams = [
            with_overrides(
                base,
                {
                    k: (tuple(v) if k == "betas" else v)
                    for k, v in group.items()
                    if k not in ("params", "name") and trainable
                },
            )
            for group in self._groups
        ]
        self._base_lrs = [hp.lr for hp in group_hparams]
        self._own_groups = [
            {"params": list(group["params"]), **hparam_fields(hp)}
            for group, hp in zip(self._groups, group_hparams)
        ]
        for rt in self.units:
            rt.hparams = group_hparams[rt.unit.group]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups; a script's edit of a group's `lr` is the lr of the
        next step (with a schedule, the schedule sets it at each step, as DeepSpeed's)."""
        if self.client_optimizer is not None:
            return self.client_optimizer.param_groups
        return self._own_groups

    def _current_lrs(self) -> list[float]:
        """The lr of each param group for the step about to run."""
        if self.client_optimizer is None and self.schedule is not None:
            for group, base in zip(self._own_groups, self._base_lrs):
                group["lr"] = self.schedule(self.lr_steps, base)
        return [group["lr"] for group in self.param_groups]

    def get_lr(self) -> list[float]:
        return self._current_lrs()

    # ---- DeepSpeed-compatible accessors -------------------------------------------------

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
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

    def train_batch_size(self) -> int | None:
        return self.batch.train_batch_size if self.batch else None

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.batch.micro_batch_size if self.batch else None

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps if self.batch else 1

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

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the last step's gradients, before clipping (None before
        the first step; inf when an fp16 overflow skipped the step)."""
        return self._global_grad_norm

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: Adam's `betas`, SGD's `momentum` (DeepSpeed)."""
        momentum = getattr(self.schedule, "momentum", None)
        beta1 = momentum(self.lr_steps) if momentum is not None else None
        result = []
        for group in self.param_groups:
            if "betas" in group:
                betas = tuple(group["betas"])
                result.append((beta1, betas[1]) if beta1 is not None else betas)
            else:
                result.append(group.get("momentum", 0.0))
        return result

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside the block sums gradients locally without reducing them; the
        first backward at an accumulation boundary after it reduces them all. Stages 0-1
        only (stages 2-3 reduce as they shard, as in DeepSpeed); no `step()` inside."""
        if self.stage >= 2:
            raise RuntimeError(
                f"no_sync() is incompatible with gradient partitioning of ZeRO stage "
                f"{self.stage}; it is allowed at stages 0 and 1"
            )
        if self.reduction.no_sync:
            raise RuntimeError("no_sync() is already active; it cannot be re-entered")
        self.reduction.no_sync = True
        try:
            yield
        finally:
            self.reduction.no_sync = False

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
        with _views.gathered_parameters(self, params, modifier_rank):
            yield

    # ---- whole-model views (fzero.engine._views) ------------------------------------------

    def full_master(self, rt: UnitRuntime) -> Tensor:
        """The unit's whole fp32 master buffer, gathered on every rank (collective)."""
        return _views.full_master(self, rt)

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The consolidated model state dict (masters cast to `dtype`, default the compute
        dtype), on rank 0 ({} elsewhere); collective."""
        return _views.state_dict(self, dtype)

    def memory_held(self) -> MemoryEstimate:
        """Bytes of every model-state tensor this rank holds now, by kind."""
        return _views.memory_held(self)

    def memory_planned(self) -> MemoryEstimate:
        """What the plan says this rank holds (`partition.memory_per_rank`)."""
        return _views.memory_planned(self)

    # ---- checkpoints ----------------------------------------------------------------------

    @_named("save_checkpoint")
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        *,
        async_save: bool = False,
    ) -> str:
        """Save a sharded checkpoint to `save_dir/tag` (default tag `global_step{N}`) and
        point `save_dir/latest` at it; collective. `client_state` (ints, floats, strings,
        lists, dicts, tensors) comes back from `load_checkpoint`. With `async_save` the
        state is copied to host memory and written by a background thread; the next
        save, load or the process exit waits for it and raises its error."""
        from fzero.checkpoint import _engine_io

        return _engine_io.save_checkpoint(
            self, save_dir, tag, client_state, save_latest, async_save=async_save
        )

    @_named("load_checkpoint")
    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, Any]:
        """Load `load_dir/tag` (default: the tag in `load_dir/latest`), whatever world
        size, stage or strategy saved it; collective. Returns `(path, client_state)`, or
        `(None, None)` with a warning when there is no checkpoint (as DeepSpeed)."""
        from fzero.checkpoint import _engine_io

        return _engine_io.load_checkpoint(
            self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only
        )

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        """The whole model in the compute dtype to `save_dir/save_filename` (safetensors,
        the model's own state_dict keys), written by rank 0; collective. DeepSpeed's
        method, without its pickle file."""
        from fzero.checkpoint._files import write_safetensors

        state = self.state_dict()
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            items = [(k, v.contiguous()) for k, v in state.items()]
            write_safetensors(os.path.join(save_dir, save_filename), items, {"format": "pt"})
        dist.barrier()
        return True

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save has been written and committed."""
        from fzero.checkpoint import _engine_io

        _engine_io.wait_for_save(self)

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


def _batch_or_none(config: Config, world_size: int):
    if config.train_batch_size is None and config.train_micro_batch_size_per_gpu is None:
        if config.gradient_accumulation_steps not in (None, 1):
            return batch_sizes(config, world_size)  # raises: accumulation without a batch size
        return None
    return batch_sizes(config, world_size)
