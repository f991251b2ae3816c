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

Reduction follows the plan's buckets (`partition.reduction_buckets`): stages 0-1 sum
into persistent bucket buffers and all-reduce them at the accumulation boundary; stages
2-3 reduce each bucket as soon as its units' gradients are in (overlapping backward
when `overlap_comm`) and keep this rank's part. Collectives are issued in bucket order,
the same on every rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from fzero import comm, partition
from fzero.core.layout import Bucket, UnitRuntime, add_pieces, drop_flat
from fzero.core.reduce import Pending, finish, reduce_bucket

__all__ = ["GradientReduction"]

Engine = Any  # fzero.engine.Engine (this module sits below it)
_EXPLICIT: list[Any] = []  # engines inside `backward(loss)` now, innermost last


def _graph_task() -> int:
    """The id of the autograd pass running now (-1 outside backward)."""
    return torch._C._current_graph_task_id()


class GradientReduction:
    """Buckets, the backward-pass bookkeeping, and the reductions of one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.buckets: list[Bucket] = []
        self._param_unit: dict[int, tuple[UnitRuntime, Any]] = {}
        self._pending: Pending = []
        self._spare_flat: Tensor | None = None  # a reduced bucket's buffer, for the next
        self._launch_next = 0
        self.boundary_now = False
        self.explicit = False  # inside this engine's backward(loss)
        self._pass_task: int | None = None  # the autograd pass touching the params now
        self._pass_owned = False
        self.manual_scale = False  # engine.scale(loss) was used for a plain backward
        self.reduced = False  # this micro-step's gradients have been reduced
        self.no_sync = False

    def build(self, bucket_numel: int) -> None:
        """Buckets over the engine's units; which unit and piece each parameter is."""
        self.buckets = self.build_buckets(bucket_numel)
        self._param_unit = {
            id(p): (rt, placement) for rt in self.engine.units for p, placement, _ in rt.params
        }

    @contextlib.contextmanager
    def without_sync(self) -> Iterator[None]:
        """DeepSpeed's `no_sync`: backward inside sums gradients locally; the first
        backward at an accumulation boundary after it reduces them all. Stages 0-1 only
        (stages 2-3 reduce as they shard, as in DeepSpeed); no `step()` inside."""
        stage = self.engine.stage
        if stage >= 2:
            raise RuntimeError(
                f"no_sync() is incompatible with gradient partitioning of ZeRO stage "
                f"{stage}; it is allowed at stages 0 and 1"
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

    def build_buckets(self, bucket_numel: int) -> list[Bucket]:
        """Reduction buckets; in stages 0-1 their buffers are the persistent gradient
        accumulators and each unit's `grad` is a view of its bucket's buffer."""
        buckets = []
        for indices in partition.reduction_buckets(self.engine.plan, bucket_numel):
            bucket = Bucket([self.engine.units[i] for i in indices])
            for rt in bucket.units:
                rt.bucket = bucket
            if self.engine.stage < 2:
                self.bucket_views(bucket, "grad")
            buckets.append(bucket)
        return buckets

    def bucket_views(self, bucket: Bucket, name: str) -> None:
        spare = self._spare_flat
        if spare is not None and spare.numel() == bucket.numel:
            bucket.buffer, self._spare_flat = spare.zero_(), None
        else:
            bucket.buffer = torch.zeros(
                bucket.numel, dtype=torch.float32, device=self.engine.device
            )
        offset = 0
        for rt in bucket.units:
            setattr(rt, name, bucket.buffer[offset : offset + rt.unit.numel])
            offset += rt.unit.numel

    def begin(self) -> None:
        self.boundary_now = self.engine.is_gradient_accumulation_boundary()
        self._launch_next = 0
        self.engine.stage3.begin_phase("backward")

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
        accumulation = self.engine.gradient_accumulation_steps()
        return grad / accumulation if accumulation > 1 else grad

    def _accumulates_here(self) -> bool:
        """Whether the running autograd pass will store a gradient in a managed param."""
        will_run = getattr(torch._C, "_will_engine_execute_node", None)
        node_of = getattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc", None)
        if will_run is None or node_of is None:
            return True
        return any(will_run(node_of(p)) for rt in self.engine.units for p, _, _ in rt.params)

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
        for rt in self.engine.units:  # another's pass: nothing was taken, stage-3 units go
            rt.reported, rt.ready = 0, False
            if self.engine.stage == 3:
                self.engine.stage3.release(rt)

    def note_backward_use(self) -> None:
        """Stage 3 gathers a saved parameter in backward: in a pass of another's, enter it
        here too, so its end frees the units it gathered."""
        if not self.explicit and _graph_task() >= 0:
            self.owns_pass()

    def _check_scaled(self) -> None:
        scale = self.engine.loss_scale_state.scale if self.engine.loss_scale_state else 1.0
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
        self.engine.check_trainable()
        self._check_scaled()
        grad = p.grad
        p.grad = None
        if grad is None:
            return
        target = rt.grad if self.engine.stage < 2 else self._flat_grad(rt)
        add_pieces(target, grad.reshape(-1), placement)
        if self.engine.stage == 3 and rt.full is None:
            p.data = torch.empty(0, dtype=self.engine.compute_dtype, device=self.engine.device)
        rt.reported += 1
        if rt.reported == len(rt.params):
            rt.ready = True
            if self.engine.stage == 3:
                self.engine.stage3.release(rt)
            if self.engine.overlap_comm:
                self._launch_ready()

    def _keep_others_grad(self, rt: UnitRuntime, p: torch.nn.Parameter) -> None:
        """Another pass's gradient stays in `p.grad`; stage 3 still frees the unit."""
        if self.engine.stage != 3 or rt.unit.persistent:
            return
        rt.reported += 1
        if rt.reported == len(rt.params):
            self.engine.stage3.release(rt)
        elif rt.full is None:
            p.data = torch.empty(0, dtype=self.engine.compute_dtype, device=self.engine.device)

    def _flat_grad(self, rt: UnitRuntime) -> Tensor:
        """Stages 2-3: the unit's full-size gradient, a view of its bucket's buffer,
        alive from the first gradient until the bucket is reduced."""
        if rt.flat_grad is None:
            assert rt.bucket is not None
            self.bucket_views(rt.bucket, "flat_grad")
        assert rt.flat_grad is not None
        return rt.flat_grad

    def _needs_reduction(self) -> bool:
        return not self.no_sync and (self.engine.stage >= 2 or self.boundary_now)

    def _launch_ready(self) -> None:
        """Launch bucket reductions in bucket order (the same on every rank), as far as
        their units are ready: collectives must be issued in one order everywhere."""
        while self._launch_next < len(self.buckets) and all(
            rt.ready for rt in self.buckets[self._launch_next].units
        ):
            self._launch(self.buckets[self._launch_next])
            self._launch_next += 1

    def _launch(self, bucket: Bucket) -> None:
        if not self._needs_reduction():
            return  # stage 0-1 inside an accumulation window: keep summing locally
        if self.engine.stage < 2:
            assert bucket.buffer is not None
            if self.engine.world_size > 1:
                work = comm.all_reduce(bucket.buffer, op="avg", async_op=True)
                self._pending.append((work, lambda: None))
            return
        flats = [self._flat_grad(rt) for rt in bucket.units]
        assert bucket.buffer is not None
        pending = reduce_bucket(
            bucket.buffer,
            flats,
            [self.engine.owned(rt.unit) for rt in bucket.units],
            lambda i, part: self._accumulate_grad(bucket.units[i], part),
            world_size=self.engine.world_size,
            quantized=self.engine.stage >= 2
            and self.engine.config.zero_optimization.zero_quantized_gradients,
        )
        pending.append((None, lambda: self._drop_flat(bucket)))
        if self.engine.world_size == 1:
            finish(pending)  # nothing in flight: keep the parts now, reuse the buffer
        else:
            self._pending += pending

    def _drop_flat(self, bucket: Bucket) -> None:
        """The bucket's gradients are reduced and kept: its buffer is the next bucket's
        (within this backward; a fresh unit-sized buffer costs its page faults, 18 ms
        for 16.8M elements)."""
        self._spare_flat = bucket.buffer
        drop_flat(bucket)

    def finish(self) -> None:
        for rt in self.engine.units:
            rt.ready = True  # parameters unused in this backward contribute zeros
        with self.engine.timers("comm"):
            self._launch_ready()
            finish(self._pending)
        self._spare_flat = None
        for rt in self.engine.units:
            rt.reported, rt.ready = 0, False
            if self.engine.stage == 3:
                self.engine.stage3.release(rt)
        self.engine.stage3.end_phase()
        self.reduced = self.reduced or self._needs_reduction()
        if self.engine.residency.grads_on_disk:
            self._finish_grad_writes()

    def _accumulate_grad(self, rt: UnitRuntime, value: Tensor) -> None:
        """Stages 2-3: add this micro-step's reduced gradient shard to the unit's
        accumulator (in the swap file with NVMe gradients; see `Residency`)."""
        self.engine.residency.accumulate_grad(rt, value, self.boundary_now, self.engine.grad_stats)

    def _finish_grad_writes(self) -> None:
        """With gradients on NVMe, a write that failed on any rank drops the window on
        every rank: its micro-steps are to be run again."""
        messages = self.engine.residency.finish_grad_writes(self.engine.world_size)
        if messages:
            self.engine.micro_steps -= (
                self.engine.micro_steps % self.engine.gradient_accumulation_steps()
            )
            raise OSError(
                "NVMe offload: the gradients of this accumulation window were dropped; run "
                f"its micro-steps again ({'; '.join(messages)})"
            )

    def take_left_grads(self) -> None:
        """Add what other passes left in managed `param.grad`s (the user did not clear
        it), as `torch.optim` would use it. Where this micro-step has been reduced
        already, or was never reduced (its backward was not this engine's), every rank
        joins one more reduction when any rank has something (collective)."""
        left = [(rt, p) for rt in self.engine.units for p, _, _ in rt.params if p.grad is not None]
        if not self._needs_reduction_at_step():
            for rt, p in left:  # stages 0-1 inside an accumulation window: local sums
                add_pieces(rt.grad, p.grad.reshape(-1), self._param_unit[id(p)][1])
                p.grad = None
            return
        flag = torch.tensor([float(bool(left) or not self.reduced)], device=self.engine.device)
        if self.engine.world_size > 1:
            comm.all_reduce(flag, op="max")
        if not flag.item():
            return
        self.begin()
        for rt, p in left:
            target = rt.grad if self.engine.stage < 2 else self._flat_grad(rt)
            add_pieces(target, p.grad.reshape(-1), self._param_unit[id(p)][1])
            p.grad = None
        self.finish()

    def _needs_reduction_at_step(self) -> bool:
        return not self.no_sync and (
            self.engine.stage >= 2 or self.engine.is_gradient_accumulation_boundary()
        )
