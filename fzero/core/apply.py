"""Applying the optimizer to this rank's shards.

Each unit's update runs the functional optimizer's in-place path over its contiguous
fp32 partition — through fzero's native kernels where the state is on the CPU, with the
gradient scale (loss-scale inverse x clip coefficient) and the compute-dtype copy fused
in — and LAMB's per-tensor trust ratio takes two halves with one all-reduce of norms
between them. With NVMe residency the step is transactional: new state goes to the
other slot, every rank agrees on success, then all commit or all roll back. New masters
are written back to the compute-dtype parameters by all-gathers that overlap the next
units' updates (`publish` ... `finish_publish`).

Both doors run it over their units' runtime records (`UnitRuntime`): the engine over its
own, `fzero.train_step` over records of its `TrainState`'s units.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero import native
from fzero.core import nvme as _nvme
from fzero.core.groups import gather_unit, groups_of
from fzero.core.layout import UnitRuntime, gather_pieces, scatter_pieces
from fzero.core.precision import narrowed, widened
from fzero.core.publish import InMemoryShards, ParamShards, Publisher, Timer, untimed
from fzero.core.residency import Residency
from fzero.core.state import optimizer_partition, partition_numel
from fzero.core.update import (
    Segments,
    add_lamb_squares,
    hparam_fields,
    lamb_apply,
    lamb_direction,
    lamb_norms,
    lamb_segments,
    native_update_,
    scheduled_overrides,
)
from fzero.optim import AdamState, Optimizer, Schedule, adam_update_, with_overrides
from fzero.optim._muon import (
    adam_part,
    muon_direction_,
    orthogonalized,
    scaled_overrides,
    uses_muon,
)
from fzero.partition import Placement, Plan, Unit

__all__ = ["OptimizerApplication", "StepClock"]


class StepClock(NamedTuple):
    """Where a step stands: the schedule's position (`lr_steps`, which the scheduled
    hyper-parameters follow) and the number of the step being applied (messages)."""

    lr_steps: int
    step: int


class OptimizerApplication:
    """The update of every unit at a step, and writing new parameters back."""

    def __init__(
        self,
        plan: Plan,
        rank: int,
        *,
        optimizer: Optimizer,
        schedule: Schedule | None,
        residency: Residency,
        compute_dtype: torch.dtype,
        device: torch.device,
        param_shards: ParamShards | None = None,
        param_offload: str = "none",
        timer: Timer = untimed,
    ) -> None:
        self.plan, self.rank, self.stage = plan, rank, plan.stage
        self.world_size = plan.world_size
        self.optimizer, self.schedule, self.residency = optimizer, schedule, residency
        self.compute_dtype, self.device = compute_dtype, device
        self.param_shards = param_shards or InMemoryShards()
        self.param_offload, self.timer = param_offload, timer
        self.offload = residency.offload
        if optimizer.name == "muon" and residency.nvme is not None:
            raise ValueError(
                "Muon with 'zero_optimization.offload_optimizer.device' 'nvme': its "
                "Newton-Schulz step needs each matrix's whole momentum direction, which the "
                "swap file's unit-at-a-time pipeline does not gather; use offload device "
                "'cpu' or 'none'"
            )
        # fzero's native kernels (C on the CPU, CUDA on a GPU) run the update where the
        # state lives: on the host with optimizer offload, else on the compute device
        self.native = native.available("cpu" if self.offload else device)
        self.tensor_index = {fqn: i for i, fqn in enumerate(plan.manifest.fqns)}
        self.publisher = Publisher(
            plan,
            rank,
            compute_dtype=compute_dtype,
            device=device,
            param_shards=self.param_shards,
            swapped=residency.nvme is not None,
            timer=timer,
        )
        self.units: list[UnitRuntime] = []
        self.clock = StepClock(0, 0)

    def partition(self, unit: Unit) -> slice:
        return optimizer_partition(self.plan, unit, self.rank)

    def partition_numel(self, unit: Unit) -> int:
        return partition_numel(self.plan, unit, self.rank)

    def apply(
        self, units: list[UnitRuntime], factor: float, lrs: list[float], clock: StepClock
    ) -> None:
        """Update every unit of `units` with gradients scaled by `factor` at the groups'
        `lrs`, and publish the new parameters."""
        self.units, self.clock = units, clock
        if self.residency.nvme is not None:
            self.nvme_updates(factor, lrs)
        elif self.optimizer.name == "muon":
            for rt in units:
                with self.widened_if_narrow(rt):
                    self.muon_unit(rt, factor, lrs)
                self.residency.give_back(self.residency.lent)
                self.publish(rt)
        elif self.optimizer.name == "lamb":
            self.lamb_step(factor, lrs)
        else:
            for rt in units:
                self.publish(rt, self.update_unit(rt, factor, lrs))
        self.finish_publish()

    def update_unit(self, rt: UnitRuntime, factor: float, lrs: list[float]) -> Tensor | None:
        """Update the unit's master and state; returns the compute-dtype copy of the new
        master when the native kernel wrote one (for `publish`). bf16 masters or states:
        the update runs in fp32 and rounds back (`fzero.core.precision.widened`)."""
        if not (narrowed(rt.master) or narrowed(rt.state)):
            return self._update_unit(rt, factor, lrs, self.copy_target(rt))
        with self.widened_if_narrow(rt):  # the rounding writes the bf16 master itself
            self._update_unit(rt, factor, lrs, written=None)
        return None

    def widened_if_narrow(self, rt: UnitRuntime) -> contextlib.AbstractContextManager[None]:
        """fp32 copies of a bf16 master and state inside, rounded back after (else as is)."""
        if not (narrowed(rt.master) or narrowed(rt.state)):
            return contextlib.nullcontext()
        return widened(rt, step=self.clock.step, start=self.partition(rt.unit).start)

    def _update_unit(
        self, rt: UnitRuntime, factor: float, lrs: list[float], written: Tensor | None
    ) -> Tensor | None:
        grad = self.step_grad(rt)
        hp = with_overrides(rt.hparams, self.step_overrides(rt, lrs))
        if not self.native_update(rt, grad, factor, hp, written):
            written = None
            if factor != 1.0:
                grad.mul_(factor)
            rt.state = self.optimizer.update_(grad, rt.state, rt.master, **hparam_fields(hp))
        self.residency.give_back(self.residency.lent)
        return written

    def step_grad(self, rt: UnitRuntime) -> Tensor:
        """The gradient of the rank's optimizer partition, where the optimizer runs
        (offload: a host copy, made per step)."""
        grad = rt.grad[self.partition(rt.unit)] if self.stage < 2 else rt.grad
        if not self.offload or self.residency.grads_on_disk:  # NVMe: read into a host swap buffer
            return grad
        if self.residency.pin:  # CUDA's pinned host allocator caches these blocks itself
            return torch.empty(grad.shape, dtype=torch.float32, pin_memory=True).copy_(grad)
        self.residency.lent.append(self.residency.pool.take())  # given back after the unit's update
        return self.residency.lent[-1][: grad.numel()].copy_(grad)

    def native_update(
        self, rt: UnitRuntime, grad: Tensor, factor: float, hp: Any, out: Tensor | None
    ) -> bool:
        """The update through fzero's native kernel (`native_update_`); False when it
        does not apply."""
        if not self.native:
            return False
        state = native_update_(self.optimizer.name, rt.master, grad, rt.state, hp, factor, out)
        if state is None:
            return False
        rt.state = state
        return True

    def copy_target(self, rt: UnitRuntime) -> Tensor | None:
        """Where a native update writes the compute-dtype copy of the new master."""
        if not self.native or self.compute_dtype == torch.float32:
            return None
        if rt.full is None and self.param_offload == "nvme":  # written as it is
            return _nvme.aligned_empty(rt.master.numel(), self.compute_dtype)
        if self.offload:  # a host buffer; `publish` moves it to the device
            return torch.empty(
                rt.master.numel(), dtype=self.compute_dtype, pin_memory=self.residency.pin
            )
        if rt.full is None:
            return rt.param_shard  # stage 3: the unit's compute-dtype shard itself
        if self.stage == 0 or self.world_size == 1:
            return rt.full[self.partition(rt.unit)]
        return torch.empty(rt.master.numel(), dtype=self.compute_dtype, device=self.device)

    def step_overrides(self, rt: UnitRuntime, lrs: list[float]) -> dict[str, Any]:
        return scheduled_overrides(
            rt.hparams, self.schedule, self.clock.lr_steps, lrs[rt.unit.group]
        )

    def muon_unit(self, rt: UnitRuntime, factor: float, lrs: list[float]) -> None:
        """Muon's step for one unit (`fzero.optim.muon`): momentum on this rank's
        partition; each hidden matrix's direction made whole (one all-gather of the
        unit's directions where the partition is a shard), orthogonalized where this
        rank owns part of it, applied to that part; AdamW for the unit's other tensors.
        Collective when sharded: every rank runs every unit in order."""
        grad = self.step_grad(rt)
        if factor != 1.0:
            grad.mul_(factor)
        hp = with_overrides(rt.hparams, scaled_overrides(rt.hparams, self.step_overrides(rt, lrs)))
        shapes = {pl.fqn: self.plan.manifest[pl.fqn].shape for pl in rt.unit.placements}
        hidden = {fqn for fqn, shape in shapes.items() if uses_muon(fqn, shape, hp)}
        state, step = rt.state, rt.state.step
        direction = torch.zeros_like(grad) if hidden else None
        segments = self.lamb_segments(rt)
        for start, stop, fqn in segments:
            g, m = grad[start:stop], state.exp_avg[start:stop]
            if fqn in hidden:
                direction[start:stop] = muon_direction_(g, m, hp)  # type: ignore[index]
            else:
                moments = AdamState(step, m, state.exp_avg_sq[start:stop])
                adam_update_(g, moments, rt.master[start:stop], adam_part(hp))
        if direction is not None:
            ortho = self.muon_update_of(rt, direction, hidden, segments, hp)
            for start, stop, fqn in segments:
                if fqn in hidden:
                    p = rt.master[start:stop].mul_(1 - hp.lr * hp.weight_decay)
                    p.add_(ortho[start:stop].to(p.device), alpha=-hp.lr)
        rt.state = state._replace(step=step + 1)

    def muon_update_of(
        self,
        rt: UnitRuntime,
        direction: Tensor,
        hidden: set[str],
        segments: Segments,
        hp: Any,
    ) -> Tensor:
        """Muon's orthogonalized update over this rank's partition of the unit, from the
        partition's momentum directions (gathered into the whole unit where sharded)."""
        unit, part = rt.unit, self.partition(rt.unit)
        mine = {fqn for start, stop, fqn in segments if fqn in hidden and stop > start}
        if part.stop - part.start != unit.numel and owns_whole(unit, hidden):
            return self._orthogonalized_here(unit, part, direction.to(self.device), mine, hp)
        whole = direction.to(self.device)
        if part.stop - part.start != unit.numel or part.start != 0:
            whole = torch.empty(unit.numel, dtype=torch.float32, device=self.device)
            group, world = groups_of(self.plan).shard, self.plan.world_size
            direction = direction.to(self.device).contiguous()
            gather_unit(whole, direction, unit, world, group=group, async_op=False)
        out = torch.zeros(unit.numel, dtype=torch.float32, device=self.device)
        for pl in unit.placements:
            if pl.fqn in mine:
                shape = self.plan.manifest[pl.fqn].shape
                value = orthogonalized(gather_pieces(whole, pl, shape), hp)
                scatter_pieces(out, value.reshape(-1), pl)
        return out[part]

    def _orthogonalized_here(
        self, unit: Unit, part: slice, local: Tensor, mine: set[str], hp: Any
    ) -> Tensor:
        """Muon's update where this rank's partition holds each of its hidden matrices
        whole (`partition.whole_tensors`): Newton-Schulz on them, no gather."""
        out = torch.zeros_like(local)
        for pl in unit.placements:
            if pl.fqn in mine:
                here = Placement(
                    pl.fqn, tuple(replace(p, offset=p.offset - part.start) for p in pl.pieces)
                )
                value = orthogonalized(
                    gather_pieces(local, here, self.plan.manifest[pl.fqn].shape), hp
                )
                scatter_pieces(out, value.reshape(-1), here)
        return out

    def lamb_step(self, factor: float, lrs: list[float]) -> None:
        """LAMB's trust ratio is per tensor, and a tensor may span ranks: sum each tensor's
        squares locally, one all-reduce, then apply."""
        sums = self.lamb_sums()
        work = []
        for rt in self.units:
            with self.widened_if_narrow(rt):
                work.append(self.lamb_direction(rt, factor, lrs, sums))
        norms = self.lamb_norms(sums)
        for rt, hp, update, segments in work:
            with self.widened_if_narrow(rt):
                self.lamb_apply(rt, hp, update, segments, norms)
            self.publish(rt)

    def lamb_sums(self) -> Tensor:
        """Zeroed sums of squares: (parameter, update) x every tensor of the manifest."""
        count = len(self.plan.manifest.tensors)
        return torch.zeros(2, count, dtype=torch.float64, device=self.device)

    def lamb_segments(self, rt: UnitRuntime) -> Segments:
        """(start, stop, fqn) of each tensor's piece in the unit's optimizer partition."""
        return lamb_segments(self.plan, self.rank, rt.index)

    def lamb_direction(
        self,
        rt: UnitRuntime,
        factor: float,
        lrs: list[float],
        sums: Tensor,
        update: Tensor | None = None,
    ) -> tuple[UnitRuntime, Any, Tensor, Segments]:
        """LAMB's first half for one unit (`fzero.core.update.lamb_direction`): new
        moments, the update direction (into `update` when given) and its tensors' squares
        added to `sums`."""
        grad = self.step_grad(rt)
        hp = with_overrides(rt.hparams, self.step_overrides(rt, lrs))
        rt.state, update = lamb_direction(
            rt.master, grad, rt.state, hp, factor, use_native=self.native, out=update
        )
        self.residency.give_back(self.residency.lent)
        segments = self.lamb_segments(rt)
        add_lamb_squares(
            sums, self.tensor_index, segments, rt.master, update, use_native=self.native
        )
        return rt, hp, update, segments

    def lamb_norms(self, sums: Tensor) -> list[list[float]]:
        return lamb_norms(sums, self.stage, groups_of(self.plan).shard)

    def lamb_apply(
        self,
        rt: UnitRuntime,
        hp: Any,
        update: Tensor,
        segments: Segments,
        norms: list[list[float]],
    ) -> None:
        """LAMB's second half: each tensor's piece moves by its trust ratio."""
        lamb_apply(
            rt.master, hp, update, segments, norms, self.tensor_index, use_native=self.native
        )

    def publish(
        self, rt: UnitRuntime, written: Tensor | None = None, exchange: bool = True
    ) -> None:
        """`Publisher.publish` (the new master to the parameters, overlapping)."""
        self.publisher.publish(rt, written, exchange)

    def exchange(self, rt: UnitRuntime) -> None:
        self.publisher.exchange(rt)

    def finish_publish(self) -> None:
        self.publisher.finish_publish()

    def nvme_updates(self, factor: float, lrs: list[float]) -> None:
        """The step over NVMe-resident units, pipelined (`Residency.step_pass`).

        Transactional: each unit's new state goes to its other slot and the new
        parameters are written only locally; then every rank says whether all its I/O
        succeeded. Either all flip their slots and exchange parameters, or all put back
        the parameters from the untouched slots and raise: no rank keeps half a step.
        """
        steps = [rt.state.step for rt in self.units]
        updated: list[UnitRuntime] = []

        def update(rt: UnitRuntime, buffers: list[Tensor]) -> list[Any]:  # Adam, SGD
            self.residency.bind_swapped(rt, buffers)
            written = self.update_unit(rt, factor, lrs)
            tickets = self.residency.swap_out(
                rt, self.residency.next_slot(rt), wait=False, buffers=buffers
            )
            updated.append(rt)
            self.publish(rt, written, exchange=False)
            return tickets

        if self.optimizer.name == "lamb":
            self.nvme_lamb(factor, lrs, updated, steps)
        else:
            failure = self.residency.step_pass(self.units, self.residency.swap_in, update)
            self.agree(self.settle(failure), updated, steps)
        for rt in self.units:
            rt.slot = self.residency.next_slot(rt)
            self.exchange(rt)
        if self.residency.grads_on_disk:  # memory first: keep only what backward's writes take
            self.residency.pool.trim(self.residency.write_buffers + 1)
        _nvme.return_free_memory()

    def nvme_lamb(
        self, factor: float, lrs: list[float], updated: list[UnitRuntime], steps: list[int]
    ) -> None:
        """LAMB over NVMe in two passes: moments and update direction (the direction
        parked in the other slot's master region), one all-reduce of the norms, then
        master += trust ratio x direction into that region."""
        sums = self.lamb_sums()
        kept: dict[int, tuple[Any, list[tuple[int, int, str]]]] = {}

        def direction(rt: UnitRuntime, buffers: list[Tensor]) -> list[Any]:
            self.residency.bind_swapped(rt, buffers)
            update = buffers[-1][: rt.master.numel()]
            _, hp, _, segments = self.lamb_direction(rt, factor, lrs, sums, update)
            kept[rt.index] = (hp, segments)
            slot = self.residency.next_slot(rt)
            return [
                self.residency.write_kind(rt, k, slot, t, buffers)
                for k, t in enumerate([update, *self.residency.resident_tensors(rt)[1:]])
            ]

        def read_direction(rt: UnitRuntime, buffers: list[Tensor]) -> list[Any]:
            numel = self.partition_numel(rt.unit)
            master, update = buffers[0][:numel], buffers[-1][:numel]
            return [
                (
                    self.residency.nvme.submit(
                        self.residency.region(rt, 0, rt.slot), master, False
                    ),
                    master,
                ),
                (
                    self.residency.nvme.submit(
                        self.residency.region(rt, 0, 1 - rt.slot), update, False
                    ),
                    update,
                ),
            ]

        def apply(rt: UnitRuntime, buffers: list[Tensor]) -> list[Any]:
            numel = self.partition_numel(rt.unit)
            rt.master = buffers[0][:numel]
            hp, segments = kept[rt.index]
            self.lamb_apply(rt, hp, buffers[-1][:numel], segments, norms)
            region = self.residency.region(rt, 0, 1 - rt.slot)
            tickets = [(self.residency.nvme.submit(region, rt.master, write=True), rt.master)]
            updated.append(rt)
            self.publish(rt, None, exchange=False)
            return tickets

        self.agree(
            self.residency.step_pass(self.units, self.residency.swap_in, direction, extra=1),
            updated,
            steps,
        )
        norms = self.lamb_norms(sums)
        failure = self.residency.step_pass(self.units, read_direction, apply, extra=1)
        self.agree(self.settle(failure), updated, steps)

    def settle(self, failure: str) -> str:
        """A pass's I/O failure, or else its parameter writes' (all waited for)."""
        param_failure = self.param_shards.finish_param_writes()
        return failure or param_failure

    def agree(self, failure: str, updated: list[UnitRuntime], steps: list[int]) -> None:
        """Every rank learns whether any rank's pass failed; if one did, all roll back
        (two slots) or stop (in place: nothing to roll back to)."""
        messages = self.residency.failures(failure, self.world_size)
        if messages and self.residency.slots == 1:
            self.residency.broken = (
                f"NVMe offload with commit 'in_place': step {self.clock.step} "
                f"failed after {len(updated)} of {len(self.units)} units on this rank "
                f"were overwritten in {self.residency.nvme.path}, so it holds no single step "
                "and training will not go on from it; load the last checkpoint "
                "(engine.load_checkpoint or fzero.load) to continue, or use commit "
                "'two_slots' for steps "
                f"that roll back ({'; '.join(messages)})"
            )
            raise OSError(self.residency.broken)
        if messages:
            self.roll_back(updated, steps)
            raise OSError(
                "NVMe offload: the optimizer step was not applied; parameters, master weights, "
                f"optimizer state and gradients are as before it ({'; '.join(messages)})"
            )

    def roll_back(self, updated: list[UnitRuntime], steps: list[int]) -> None:
        """Undo a failed NVMe step: parameters from the masters in the current slots
        (never written by the step), step counts restored."""
        for rt, step in zip(self.units, steps):
            rt.state = rt.state._replace(step=step)
        try:
            for rt in updated:
                with self.residency.resident(rt, write_back=False):
                    self.publish(rt, None, exchange=False)
            failure = self.param_shards.finish_param_writes()
            if failure:
                raise OSError(failure)
        except OSError as error:
            raise OSError(
                f"NVMe offload: a step failed and the parameters could not be restored from "
                f"{self.residency.nvme.path} ({error}); reload the last checkpoint"
            ) from error


def owns_whole(unit: Unit, hidden: set[str]) -> bool:
    """Whether each of the unit's `hidden` tensors lies within one rank's part (the same
    answer on every rank: a property of the plan)."""
    for placement in unit.placements:
        if placement.fqn not in hidden:
            continue
        ends = [(p.offset, p.offset + p.numel - 1) for p in placement.pieces if p.numel]
        if len({unit.owner(offset) for pair in ends for offset in pair}) > 1:
            return False
    return True
