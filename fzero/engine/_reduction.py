"""Gradient reduction, and whose backward pass a gradient arrives in.

A gradient is this engine's when it arrives in one of its own backward passes:
`engine.backward(loss)`, or a plain `loss.backward()` whose graph runs through a tensor
`engine(...)` returned (DeepSpeed >= 0.17's torch-style backward; the output hooks scale
by 1/gradient_accumulation_steps as `engine.backward` does and an end-of-pass callback
finishes the reduction). Those are reduced into the engine's buffers and cleared by its
step. A gradient that reaches the module's parameters in any other pass (another
engine's backward through this module, as a GAN's generator through its discriminator,
or a plain backward through the raw module) stays in `param.grad` exactly as in
PyTorch: the user's `zero_grad()` clears it, and what is still there at the engine's
next own pass or `step()` is added as it is (`take_left_grads`).

The reductions themselves are the core's (`fzero.core.reduce.Reduction`, which
`train_step` runs too): stages 0-1 sum into persistent bucket buffers and reduce
them at the accumulation boundary (stage 0 all-reduces, stage 1 reduces into the
shards); stages 2-3 reduce each bucket as soon as its units' gradients are in
(overlapping backward when `overlap_comm`) and keep this rank's part.
This module decides which pass is whose and drives it; it reads the engine through
`Owner`, and writes no unit's record.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from fzero import comm
from fzero.core.gathering import Gatherer
from fzero.core.layout import UnitRuntime
from fzero.core.reduce import Reduction, any_rank
from fzero.core.residency import Residency
from fzero.core.swap_grads import accumulate_grad, finish_grad_writes
from fzero.core.update import GradStats
from fzero.partition import Plan

__all__ = ["GradientReduction", "Owner"]

_STILL_TRAINING = "join: whether any rank still trains"
_EXPLICIT: list[Any] = []  # engines inside `backward(loss)` now, innermost last


class Owner(Protocol):
    """What the reduction reads of its engine while a pass runs (the engine)."""

    loss_scale_state: Any

    def is_gradient_accumulation_boundary(self) -> bool: ...

    def gradient_accumulation_steps(self) -> int: ...

    def check_trainable(self) -> None: ...

    def grad_stats(self, grad: Tensor, into: GradStats | None = None) -> GradStats: ...

    def drop_accumulation_window(self) -> None: ...


def _graph_task() -> int:
    """The id of the autograd pass running now (-1 outside backward)."""
    return torch._C._current_graph_task_id()


class GradientReduction:
    """Whose backward pass runs, and the core's reductions of the engine's own."""

    def __init__(
        self,
        owner: Owner,
        plan: Plan,
        rank: int,
        units: Sequence[UnitRuntime],
        buckets: Sequence[Sequence[int]],
        *,
        device: torch.device,
        compute_dtype: torch.dtype,
        gatherer: Gatherer,
        residency: Residency,
        timers: Any,
        overlap: bool,
        quantized: bool,
        bits: int = 8,
        wire_dtype: torch.dtype = torch.float32,
        piece: int = 0,
    ) -> None:
        self.owner, self.plan, self.stage, self.units = owner, plan, plan.stage, list(units)
        self.world_size, self.processes = plan.world_size, plan.processes
        self.device, self.compute_dtype = device, compute_dtype
        self.gatherer, self.residency, self.timers = gatherer, residency, timers
        self.core = Reduction(
            plan,
            rank,
            buckets,
            sizes=[len(rt.params) for rt in self.units],
            accumulator=lambda i: self.units[i].grad,
            keep=self._accumulate_grad,
            device=device,
            quantized=quantized and plan.stage >= 2,
            bits=bits,
            overlap=overlap,
            wire_dtype=wire_dtype,
            piece=piece,
        )
        self._param_unit = {
            id(p): (rt, placement) for rt in self.units for p, placement, _ in rt.params
        }
        self.boundary_now = False
        self.explicit = False  # inside this engine's backward(loss)
        self._pass_task: int | None = None  # the autograd pass touching the params now
        self._pass_owned = False
        self.manual_scale = False  # engine.scale(loss) was used for a plain backward
        self.reduced = False  # this micro-step's gradients have been reduced
        self.no_sync = False

    @contextlib.contextmanager
    def without_sync(self) -> Iterator[None]:
        """DeepSpeed's `no_sync`: backward inside sums gradients locally; the first
        backward at an accumulation boundary after it reduces them all. Stages 0-1 only
        (stages 2-3 reduce as they shard, as in DeepSpeed); no `step()` inside."""
        if self.stage >= 2:
            raise RuntimeError(
                f"no_sync() is incompatible with gradient partitioning of ZeRO stage "
                f"{self.stage}; it is allowed at stages 0 and 1"
            )
        if self.no_sync:
            raise RuntimeError("no_sync() is already active; it cannot be re-entered")
        self.no_sync = True
        try:
            yield
        finally:
            self.no_sync = False

    @contextlib.contextmanager
    def explicit_backward(self) -> Iterator[None]:
        """`engine.backward(loss)`: the pass inside is this engine's, whatever it reaches."""
        self.begin()
        self.explicit = True
        _EXPLICIT.append(self)
        try:
            yield
        finally:
            self.explicit = False
            _EXPLICIT.remove(self)

    def begin(self) -> None:
        self.boundary_now = self.owner.is_gradient_accumulation_boundary()
        # units at stages 0-1 average at the boundary only; units at 2-3 every pass
        self.core.begin(reduce=not self.no_sync and self.boundary_now)
        self.gatherer.begin_phase("backward")

    def on_output_grad(self, grad: Tensor) -> Tensor:
        """A plain backward reached a tensor `engine(...)` returned: unless another
        engine's `backward(loss)` runs it, or it computes no parameter gradient
        (`torch.autograd.grad`), it is this engine's pass."""
        if self.explicit or _EXPLICIT:
            return grad
        task = _graph_task()
        if task != self._pass_task and task >= 0 and self._accumulates_here():
            self._enter_pass(task, owned=True)
        if task != self._pass_task or not self._pass_owned:
            return grad
        accumulation = self.owner.gradient_accumulation_steps()
        return grad / accumulation if accumulation > 1 else grad

    def _accumulates_here(self) -> bool:
        """Whether the running autograd pass will store a gradient in a managed param."""
        will_run = getattr(torch._C, "_will_engine_execute_node", None)
        node_of = getattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc", None)
        if will_run is None or node_of is None:
            return True
        return any(will_run(node_of(p)) for rt in self.units for p, _, _ in rt.params)

    def owns_pass(self) -> bool:
        """Whether gradients arriving now are this engine's; a pass not seen before is
        entered as another's."""
        if self.explicit:
            return True
        task = _graph_task()
        if task != self._pass_task:
            self._enter_pass(task, owned=False)
        return self._pass_owned

    def _enter_pass(self, task: int, owned: bool) -> None:
        """First event of autograd pass `task` here; its end is queued on autograd."""
        self._pass_task, self._pass_owned = task, owned
        self.begin()
        if task >= 0:
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._exit_pass, task)
            )

    def _exit_pass(self, task: int) -> None:
        if self._pass_task != task:
            return
        owned, self._pass_task, self.manual_scale = self._pass_owned, None, False
        if owned:
            self.finish()
            return
        self.core.forget()  # another's pass: nothing was taken, stage-3 units go
        if self.stage == 3:
            self.gatherer.release_all()

    def note_backward_use(self) -> None:
        """Stage 3 gathers a saved parameter in backward: in a pass of another's, enter it
        here too, so its end frees the units it gathered."""
        if not self.explicit and _graph_task() >= 0:
            self.owns_pass()

    def _check_scaled(self) -> None:
        state = self.owner.loss_scale_state
        scale = state.scale if state else 1.0
        if scale != 1.0 and not self.explicit and not self.manual_scale:
            raise RuntimeError(
                f"fzero: fp16 loss scale is {scale}, but loss.backward() was called on an "
                "unscaled loss; call engine.backward(loss) or engine.scale(loss).backward()"
            )

    def on_grad(self, p: torch.nn.Parameter) -> None:
        rt, placement = self._param_unit[id(p)]
        if not self.owns_pass():
            self._keep_others_grad(rt, p)
            return
        self.owner.check_trainable()
        self._check_scaled()
        grad = p.grad
        p.grad = None
        if grad is None:
            return
        # the unit's last gradient: autograd is done with its gathered parameters, which
        # go before its bucket's buffer is made (not one more unit-sized buffer at once)
        complete = self.core.arrived(rt.index, launch=False)
        if complete and self.stage == 3:
            self.gatherer.release(rt.index)
        self.core.add(rt.index, placement, grad)
        del grad
        if self.stage == 3 and not self.gatherer.holds(rt.index):
            p.data = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        if complete:
            self.core.launch_ready()

    def _keep_others_grad(self, rt: UnitRuntime, p: torch.nn.Parameter) -> None:
        """Another pass's gradient stays in `p.grad`; stage 3 still frees the unit."""
        if self.plan.stage_of(rt.unit) != 3:
            return
        if self.core.arrived(rt.index, launch=False):
            self.gatherer.release(rt.index)
        elif not self.gatherer.holds(rt.index):
            p.data = torch.empty(0, dtype=self.compute_dtype, device=self.device)

    def _needs_reduction(self) -> bool:
        return not self.no_sync and (self.stage >= 2 or self.boundary_now)

    def finish(self) -> None:
        with self.timers("comm"):
            self.core.finish()
        if self.stage == 3:
            self.gatherer.release_all()
        self.gatherer.end_phase()
        self.reduced = self.reduced or self._needs_reduction()
        if self.residency.grads_on_disk:
            self._finish_grad_writes()

    def _accumulate_grad(self, index: int, value: Tensor, at: int) -> None:
        """Stages 2-3: add this micro-step's reduced gradient shard (or its piece from
        element `at`) to the unit's accumulator (in the swap file with NVMe gradients;
        see `fzero.core.swap_grads`)."""
        rt = self.units[index]
        accumulate_grad(self.residency, rt, value, self.boundary_now, self.owner.grad_stats, at)

    def _finish_grad_writes(self) -> None:
        """With gradients on NVMe, a write that failed on any rank drops the window on
        every rank: its micro-steps are to be run again."""
        messages = finish_grad_writes(self.residency, self.units, self.processes)
        if messages:
            self.owner.drop_accumulation_window()
            raise OSError(
                "NVMe offload: the gradients of this accumulation window were dropped; run "
                f"its micro-steps again ({'; '.join(messages)})"
            )

    def still_training(self, here: bool) -> bool:
        """`engine.join()`: whether any rank still trains (this one if `here`);
        collective, once per micro-step."""
        return any_rank(here, self.processes, _STILL_TRAINING, self.device)

    def shadow(self) -> None:
        """`engine.join()` on a rank out of data: the reductions of a backward that
        computed no gradient here (zeros into the others' averages)."""
        self.begin()
        self.finish()

    def held_numel(self) -> int:
        """Elements of the bucket buffers of a reduction in progress (stages 2-3)."""
        return self.core.held_numel()

    def held_bytes(self) -> int:
        """Bytes of those buffers."""
        return self.core.held_bytes()

    def scaled_by_caller(self) -> None:
        """The caller scaled the loss (`engine.scale(loss).backward()`): a plain backward
        of this micro-step carries the fp16 loss scale."""
        self.manual_scale = True

    def before_step(self) -> None:
        """`engine.step()` starts: what other passes left in `param.grad` is taken, and the
        next micro-step starts unreduced."""
        self.take_left_grads()
        self.reduced = False

    def take_left_grads(self) -> None:
        """Add what other passes left in managed `param.grad`s (the user did not clear
        it), as `torch.optim` would use it. Where this micro-step has been reduced
        already, or was never reduced (its backward was not this engine's), every rank
        joins one more reduction when any rank has something (collective)."""
        left = [(rt, p) for rt in self.units for p, _, _ in rt.params if p.grad is not None]
        if not self._needs_reduction_at_step():
            for rt, p in left:  # stages 0-1 inside an accumulation window: local sums
                self.core.add(rt.index, self._param_unit[id(p)][1], p.grad)
                p.grad = None
            return
        flag = torch.tensor([float(bool(left) or not self.reduced)], device=self.device)
        if self.processes > 1:
            comm.all_reduce(flag, op="max", what="left-over gradients check")
        if not flag.item():
            return
        self.begin()
        for rt, p in left:
            self.core.add(rt.index, self._param_unit[id(p)][1], p.grad)
            p.grad = None
        self.finish()

    def _needs_reduction_at_step(self) -> bool:
        return not self.no_sync and (
            self.stage >= 2 or self.owner.is_gradient_accumulation_boundary()
        )
