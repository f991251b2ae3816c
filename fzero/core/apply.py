"""Applying the optimizer to this rank's shards.

Each unit's update runs the functional optimizer's in-place path over its contiguous
fp32 partition — through the optimizer's native kernel (`Optimizer.native`) where
fzero's kernels serve the device, with the gradient scale (loss-scale inverse x clip
coefficient) and the compute-dtype copy fused in. What the update needs across shards is
what the optimizer declares (`Optimizer.needs`, see [Note: needs] in `fzero.optim`),
never its name: per-tensor norms (LAMB's trust ratio) take two halves with one
all-reduce of norms between them; whole tensors (Muon's Newton-Schulz) are gathered
where the plan splits them (`fzero.core.whole_tensors`). With NVMe residency the step is
transactional: new state goes to the other slot, every rank agrees on success, then all
commit or all roll back. New masters are written back to the compute-dtype parameters
by all-gathers that overlap the next units' updates (`publish` ... `finish_publish`).

Both doors run it over their units' runtime records (`UnitRuntime`): the engine over its
own, `fzero.train_step` over records of its `TrainState`'s units.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero import native
from fzero.core import nvme as _nvme
from fzero.core.groups import groups_of
from fzero.core.layout import UnitRuntime
from fzero.core.precision import narrowed, round_range_, widened
from fzero.core.publish import InMemoryShards, ParamShards, Publisher, Timer, untimed
from fzero.core.residency import Piece, Residency
from fzero.core.state import optimizer_partition, owned_grad, partition_numel
from fzero.core.update import (
    Segments,
    add_tensor_squares,
    hparam_fields,
    norms_apply,
    norms_direction,
    scheduled_overrides,
    tensor_norms,
    tensor_segments,
)
from fzero.core.whole_tensors import whole_tensors_update_
from fzero.optim import NativeKernel, Optimizer, Schedule, TensorNorms, WholeTensors
from fzero.partition import Plan, Unit

__all__ = ["GroupValues", "OptimizerApplication", "StepClock", "check_needs"]

GroupValues = list[dict[str, Any]]
"""Per param group, what a step reads from it: `"lr"`, and any other hyper-parameter a
script set there since the optimizer was built (torch reads its groups every step)."""


WIDENED_PIECE = 1 << 20
"""Elements a bf16 master or state in memory is widened to fp32 at once to update it."""


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
        timer: Timer = untimed,
    ) -> None:
        self.plan, self.rank = plan, rank
        self.world_size = plan.world_size
        self.optimizer, self.schedule, self.residency = optimizer, schedule, residency
        self.compute_dtype, self.device = compute_dtype, device
        self.param_shards = param_shards or InMemoryShards()
        self.timer = timer
        self.offload = residency.offload  # some unit's optimizer off the device
        check_needs(optimizer)
        if residency.swapped:
            residency.check_optimizer(optimizer)  # the state's file may be another's
        if isinstance(optimizer.needs, WholeTensors) and residency.swapped:
            raise ValueError(
                "Muon with 'zero_optimization.offload_optimizer.device' 'nvme' is refused, as "
                f"is any optimizer that needs whole tensors ({optimizer.name!r} declares "
                "WholeTensors): Muon's Newton-Schulz step needs each matrix's whole momentum "
                "direction, which the swap file's unit-at-a-time pipeline does not gather; "
                "use offload device 'cpu' or 'none'"
            )
        if isinstance(optimizer.needs, TensorNorms) and 0 < len(residency.swapped) < len(
            plan.units
        ):
            raise ValueError(
                f"{optimizer.name!r} needs tensor norms (it declares TensorNorms, as LAMB "
                "does) and the plan keeps some units' optimizer on 'nvme' and others in "
                f"memory (units {[plan.units[i].name for i in residency.swapped]} in the "
                "swap file): its two passes over the swap file and over memory are not run "
                "together; keep every unit's optimizer on 'nvme' or none"
            )
        # fzero's native kernels (C on the CPU, CUDA on a GPU) run the update where the
        # state lives: on the host with optimizer offload, else on the compute device
        self.natives: dict[bool, bool] = {}
        self.kernels: dict[bool, NativeKernel | None] = {}
        for on_host in (False, True):
            where = torch.device("cpu") if on_host else torch.device(device)
            usable, kernel = native.available(where), optimizer.native
            self.natives[on_host] = usable
            self.kernels[on_host] = (
                kernel if usable and kernel is not None and where.type in kernel.devices else None
            )
        self.tensor_index = {fqn: i for i, fqn in enumerate(plan.manifest.fqns)}
        self.publisher = Publisher(
            plan,
            rank,
            compute_dtype=compute_dtype,
            device=device,
            param_shards=self.param_shards,
            swapped=set(residency.swapped),
            timer=timer,
        )
        self.units: list[UnitRuntime] = []
        self.swapped_units: list[UnitRuntime] = []  # those in the swap file, this step
        self.clock = StepClock(0, 0)

    def partition(self, unit: Unit) -> slice:
        return optimizer_partition(self.plan, unit, self.rank)

    def partition_numel(self, unit: Unit) -> int:
        return partition_numel(self.plan, unit, self.rank)

    def apply(
        self, units: list[UnitRuntime], factor: float, group_values: GroupValues, clock: StepClock
    ) -> None:
        """Update every unit of `units` with gradients scaled by `factor` with the groups'
        `group_values` (their lr, ...), and publish the new parameters: the units in the
        swap file first (all or nothing on every rank), then those in memory."""
        self.units, self.clock = units, clock
        needs = self.optimizer.needs
        self.swapped_units = [rt for rt in units if self.residency.holds(rt.index)]
        if self.swapped_units:  # an optimizer that needs tensor norms: all of them (refused else)
            self.nvme_updates(factor, group_values)
            units = [rt for rt in units if not self.residency.holds(rt.index)]
        if isinstance(needs, WholeTensors):  # never with NVMe (refused)
            for rt in units:
                with self.widened_if_narrow(rt):
                    self.whole_tensors_unit(rt, factor, group_values, needs)
                self.residency.give_back(self.residency.lent)
                self.publish(rt)
        elif isinstance(needs, TensorNorms):
            if units:
                self.tensor_norms_step(factor, group_values, needs)
        else:
            for rt in units:
                self.publish(rt, self.update_unit(rt, factor, group_values))
        self.finish_publish()

    def kernel_of(self, rt: UnitRuntime) -> NativeKernel | None:
        """The native kernel for where the unit's optimizer lives (None: the pure one)."""
        return self.kernels[self.residency.offloaded[rt.index]]

    def update_unit(
        self, rt: UnitRuntime, factor: float, group_values: GroupValues
    ) -> Tensor | None:
        """Update the unit's master and state; returns the compute-dtype copy of the new
        master when the native kernel wrote one (for `publish`). bf16 masters or states:
        the update runs in fp32 and rounds back (`fzero.core.precision.widened`)."""
        if not (narrowed(rt.master) or narrowed(rt.state)):
            return self._update_unit(rt, factor, group_values, self.copy_target(rt))
        if self.residency.holds(rt.index):  # bound to its swap buffers (pieces: sub-groups)
            with self.widened_if_narrow(rt):  # the rounding writes the bf16 master itself
                self._update_unit(rt, factor, group_values, written=None)
            return None
        self._update_widened_in_pieces(rt, factor, group_values)
        return None

    def _update_widened_in_pieces(
        self, rt: UnitRuntime, factor: float, group_values: GroupValues
    ) -> None:
        """A bf16 master or state in memory updated `WIDENED_PIECE` elements at a time,
        each widened to fp32, updated from the unit's step count and rounded back
        (`widened`; the seeds follow the element: the bits of the whole partition at
        once), so fp32 copies are a piece's (the whole output layer's held 196 MB on
        the Llama benchmark). An error in a piece leaves the pieces before it updated."""
        master, state = rt.master, rt.state
        start = self.partition(rt.unit).start
        items = state._asdict().items()
        sliced = [k for k, v in items if isinstance(v, Tensor) and v.shape == master.shape]
        owned = owned_grad(self.plan, rt.unit, self.rank, rt.grad, for_update=True)
        fields = {k: v for k, v in items if k not in sliced}
        try:
            for a in range(0, max(master.numel(), 1), WIDENED_PIECE):  # empty: one step
                b = min(a + WIDENED_PIECE, master.numel())
                views = {k: getattr(state, k)[a:b] for k in sliced}
                rt.master, rt.state = master[a:b], state._replace(**views)
                grad = self.step_grad(rt, owned[a:b])
                with widened(rt, step=self.clock.step, start=start + a):
                    self._update_unit(rt, factor, group_values, written=None, grad=grad)
                done = rt.state._asdict()
                for k, view in views.items():  # a state the update returned anew: kept
                    if done[k].data_ptr() != view.data_ptr():
                        view.copy_(done[k])
                fields = {k: v for k, v in done.items() if k not in sliced}
        finally:
            rt.master, rt.state = master, state._replace(**fields)

    def widened_if_narrow(self, rt: UnitRuntime) -> contextlib.AbstractContextManager[None]:
        """fp32 copies of a bf16 master and state inside, rounded back after (else as is)."""
        if not (narrowed(rt.master) or narrowed(rt.state)):
            return contextlib.nullcontext()
        return widened(rt, step=self.clock.step, start=self.partition(rt.unit).start)

    def _update_unit(
        self,
        rt: UnitRuntime,
        factor: float,
        group_values: GroupValues,
        written: Tensor | None,
        grad: Tensor | None = None,
    ) -> Tensor | None:
        grad = self.step_grad(rt) if grad is None else grad
        hp = self.step_hparams(rt, group_values)
        if not self.native_update(rt, grad, factor, hp, written):
            written = None
            if factor != 1.0:
                grad.mul_(factor)
            rt.state = self.optimizer.update_(grad, rt.state, rt.master, **hparam_fields(hp))
        self.residency.give_back(self.residency.lent)
        return written

    def step_grad(self, rt: UnitRuntime, grad: Tensor | None = None) -> Tensor:
        """The gradient of the rank's optimizer partition (or of `grad`, a piece of it) in
        fp32, where the optimizer runs (offload: a host copy, made per step; a
        half-precision accumulator, `Memory.grads`: an fp32 copy, made per step)."""
        if grad is None:
            grad = owned_grad(self.plan, rt.unit, self.rank, rt.grad, for_update=True)
        # in memory where the optimizer is; NVMe: read into a host swap buffer
        if not self.residency.offloaded[rt.index] or self.residency.grad_on_disk(rt.index):
            return grad if grad.dtype == torch.float32 else grad.float()
        if self.residency.pin:  # CUDA's pinned host allocator caches these blocks itself
            return torch.empty(grad.shape, dtype=torch.float32, pin_memory=True).copy_(grad)
        self.residency.lent.append(self.residency.pool.take())  # given back after the unit's update
        return self.residency.lent[-1][: grad.numel()].copy_(grad)

    def native_update(
        self, rt: UnitRuntime, grad: Tensor, factor: float, hp: Any, out: Tensor | None
    ) -> bool:
        """The update through the optimizer's native kernel (`NativeKernel.update_`), the
        gradient scaled by `factor` and the compute-dtype copy written into `out` in the
        same pass; False when it has none for this device."""
        kernel = self.kernel_of(rt)
        if kernel is None or kernel.update_ is None:
            return False
        rt.state = kernel.update_(native, rt.master, grad, rt.state, hp, factor, out)
        return True

    def writes_copy(self, rt: UnitRuntime) -> bool:
        """Whether the unit's native update writes the compute-dtype copy of the new
        master in its pass (a native kernel, and a compute dtype other than fp32)."""
        kernel = self.kernel_of(rt)
        has_kernel = kernel is not None and kernel.update_ is not None
        return has_kernel and self.compute_dtype != torch.float32

    def copy_target(self, rt: UnitRuntime) -> Tensor | None:
        """Where a native update writes the compute-dtype copy of the new master."""
        if not self.writes_copy(rt):
            return None
        if rt.full is None and self.plan.params_memory(rt.index) == "nvme":  # written as it is
            return _nvme.aligned_empty(rt.master.numel(), self.compute_dtype)
        if self.residency.offloaded[rt.index]:  # a host buffer; `publish` moves it to the device
            return torch.empty(
                rt.master.numel(), dtype=self.compute_dtype, pin_memory=self.residency.pin
            )
        if rt.full is None and not self.plan.optimizer_finer(rt.unit):
            return rt.param_shard  # stage 3: the unit's compute-dtype shard itself
        if self.plan.stage_of(rt.unit) == 0 or self.world_size == 1:
            return rt.full[self.partition(rt.unit)]
        return torch.empty(rt.master.numel(), dtype=self.compute_dtype, device=self.device)

    def step_hparams(self, rt: UnitRuntime, group_values: GroupValues) -> Any:
        """The unit's hyper-parameters at this step: its group's, with what the step
        reads from its param group (the lr, and any other a script changed there, as
        torch reads its groups every step) and a schedule's cycled betas, as the
        optimizer applies overrides (`Optimizer.override`)."""
        values = group_values[rt.unit.group]
        scheduled = scheduled_overrides(
            rt.hparams, self.schedule, self.clock.lr_steps, values["lr"]
        )
        return self.optimizer.override(rt.hparams, {**values, **scheduled})

    def whole_tensors_unit(
        self, rt: UnitRuntime, factor: float, group_values: GroupValues, needs: WholeTensors
    ) -> None:
        """One unit's step for an optimizer that needs whole tensors (`WholeTensors`, e.g.
        Muon): `fzero.core.whole_tensors.whole_tensors_update_` from the unit's gradient
        scaled by `factor`, at its hyper-parameters for this step. Collective when
        sharded: every rank runs every unit in order."""
        grad = self.step_grad(rt)
        if factor != 1.0:
            grad.mul_(factor)
        hp = self.step_hparams(rt, group_values)
        whole_tensors_update_(self.plan, self.rank, rt, grad, hp, needs, device=self.device)

    def tensor_norms_step(
        self, factor: float, group_values: GroupValues, needs: TensorNorms
    ) -> None:
        """A trust ratio is per tensor, and a tensor may span ranks: every unit's first
        half with its tensors' squares summed locally, one all-reduce, then every unit's
        second half."""
        sums = self.norm_sums()
        work = []
        for rt in self.units:
            with self.widened_if_narrow(rt):
                work.append(self.norms_direction(rt, factor, group_values, sums, needs))
        norms = self.tensor_norms(sums)
        for rt, hp, direction, segments in work:
            with self.widened_if_narrow(rt):
                self.norms_apply(rt, hp, direction, segments, norms, needs)
            self.publish(rt)

    def norm_sums(self) -> Tensor:
        """Zeroed sums of squares: (parameter, direction) x every tensor of the manifest."""
        count = len(self.plan.manifest.tensors)
        return torch.zeros(2, count, dtype=torch.float64, device=self.device)

    def segments(self, rt: UnitRuntime) -> Segments:
        """(start, stop, fqn) of each tensor's piece in the unit's optimizer partition."""
        return tensor_segments(self.plan, self.rank, rt.index)

    def norms_direction(
        self,
        rt: UnitRuntime,
        factor: float,
        group_values: GroupValues,
        sums: Tensor,
        needs: TensorNorms,
        out: Tensor | None = None,
    ) -> tuple[UnitRuntime, Any, Tensor, Segments]:
        """The first half for one unit (`fzero.core.update.norms_direction`): the state
        advanced, the direction (into `out` when given) and its tensors' squares added
        to `sums`."""
        grad = self.step_grad(rt)
        hp = self.step_hparams(rt, group_values)
        rt.state, direction = norms_direction(
            needs, self.kernel_of(rt), rt.master, grad, rt.state, hp, factor, out=out
        )
        if needs.step_hparams is not None:  # what the second half reads (LAMB's step size)
            hp = needs.step_hparams(hp, rt.state)
        self.residency.give_back(self.residency.lent)
        segments = self.segments(rt)
        add_tensor_squares(
            sums,
            self.tensor_index,
            segments,
            rt.master,
            direction,
            use_native=self.natives[self.residency.offloaded[rt.index]],
        )
        return rt, hp, direction, segments

    def tensor_norms(self, sums: Tensor) -> list[list[float]]:
        return tensor_norms(sums, self.plan, groups_of(self.plan).shard)

    def norms_apply(
        self,
        rt: UnitRuntime,
        hp: Any,
        direction: Tensor,
        segments: Segments,
        norms: list[list[float]],
        needs: TensorNorms,
    ) -> None:
        """The second half: each tensor's piece moves given its whole tensor's norms."""
        norms_apply(
            needs, self.kernel_of(rt), rt.master, hp, direction, segments, norms, self.tensor_index
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

    def nvme_updates(self, factor: float, group_values: GroupValues) -> None:
        """The step over NVMe-resident units, pipelined (`Residency.step_pass`).

        Transactional: each unit's new state goes to its other slot and the new
        parameters are written only locally; then every rank says whether all its I/O
        succeeded. Either all flip their slots and exchange parameters, or all put back
        the parameters from the untouched slots and raise: no rank keeps half a step.
        """
        steps = [rt.state.step for rt in self.swapped_units]
        updated: list[UnitRuntime] = []
        self.residency.rounding_step = self.clock.step  # bf16 moments: the in-memory seeds

        def update(rt: UnitRuntime, buffers: list[Tensor]) -> list[Any]:  # Adam, SGD
            self.residency.bind_swapped(rt, buffers)
            if self.residency.narrow_master:  # published from the copy: the master's
                self._update_unit(rt, factor, group_values, written=None)  # buffer is narrowed
                written = self.copy_target(rt)  # in place as it is written
                if written is None:
                    written = self.unit_copy(rt)
                self.round_master(rt, written, 0)
            else:
                written = self.update_unit(rt, factor, group_values)
            tickets = self.residency.swap_out(
                rt, self.residency.next_slot(rt), wait=False, buffers=buffers
            )
            updated.append(rt)
            self.publish(rt, written, exchange=False)
            return tickets

        needs = self.optimizer.needs
        pieces = self.residency.sub_groups(self.swapped_units)
        if isinstance(needs, TensorNorms):
            self.nvme_tensor_norms(factor, group_values, updated, steps, needs)
        elif pieces is not None:
            step_of = dict(zip((rt.index for rt in self.swapped_units), steps))
            pass_ = self.piece_updates(factor, group_values, updated, step_of)
            failure = self.residency.step_pass(pieces, self.residency.swap_in_piece, pass_)
            self.agree(self.settle(failure), updated, steps)
        else:
            failure = self.residency.step_pass(self.swapped_units, self.residency.swap_in, update)
            self.agree(self.settle(failure), updated, steps)
        for rt in self.swapped_units:
            rt.slot = self.residency.next_slot(rt)
            self.exchange(rt)
        self.residency.trim_after_step()  # memory first: nothing kept between steps
        _nvme.return_free_memory()

    def piece_updates(
        self,
        factor: float,
        group_values: GroupValues,
        updated: list[UnitRuntime],
        step_of: dict[int, int],
    ) -> Any:
        """The step's `compute` over `Piece`s of the swapped units ([Note: sub-groups] in
        `fzero.core.residency`): each piece updated from the unit's step count and
        written to its offsets in the other slot; the unit's compute-dtype copy is
        filled piece by piece and published after its last piece."""
        copies: dict[int, Tensor] = {}

        def update(piece: Piece, buffers: list[Tensor]) -> list[Any]:
            rt = piece.rt
            self.residency.bind_piece(piece, buffers, step=step_of[rt.index])
            if piece.start == 0:
                copies[rt.index] = self.unit_copy(rt)
            copy = copies[rt.index][piece.start : piece.stop]
            lent: list[Tensor] = []
            grad = self.piece_grad(piece, lent)
            try:
                narrow = self.residency.narrow_master
                out = copy if self.writes_copy(rt) and not narrow else None
                if self._update_unit(rt, factor, group_values, out, grad) is None and not narrow:
                    copy.copy_(rt.master)
                if narrow:  # the parameters' new values are the rounded master's
                    self.round_master(rt, copy, piece.start)
            finally:
                self.residency.give_back(lent, self.residency.step_pool)
            tickets = self.residency.swap_out_piece(piece, self.residency.next_slot(rt), buffers)
            if piece.stop == self.partition_numel(rt.unit):
                updated.append(rt)
                self.publish(rt, copies.pop(rt.index), exchange=False)
            return tickets

        return update

    def round_master(self, rt: UnitRuntime, copy: Tensor, at: int) -> None:
        """bf16 masters in the swap file: the updated fp32 master (elements from `at` of
        the rank's partition) rounded stochastically as an in-memory bf16 master is
        (`fzero.core.precision.widened`: the same seed, so the same bits), into bf16
        `copy` (the parameters' new values, which `publish` takes from it), and the
        master set to those values, which the file then holds exactly."""
        start = self.partition(rt.unit).start + at
        round_range_(
            rt.master, copy, unit=rt.unit, index=rt.index, step=self.clock.step, kind=0, start=start
        )
        rt.master.copy_(copy)

    def piece_grad(self, piece: Piece, lent: list[Tensor]) -> Tensor | None:
        """The piece's gradient where the update runs: None when read with it from the
        swap file (`step_grad` takes it), else a copy of its part of the in-memory
        gradient, in a buffer of the step's pool appended to `lent` (or pinned memory)."""
        rt = piece.rt
        if self.residency.grad_on_disk(rt.index):
            return None
        grad = owned_grad(self.plan, rt.unit, self.rank, rt.grad, for_update=True)
        grad = grad[piece.start : piece.stop]
        if self.residency.pin:
            return torch.empty(grad.shape, dtype=torch.float32, pin_memory=True).copy_(grad)
        lent.append(self.residency.step_pool.take())
        return lent[0][: grad.numel()].copy_(grad)

    def unit_copy(self, rt: UnitRuntime) -> Tensor:
        """A host buffer for the unit's new master in the compute dtype, filled piece by
        piece (`piece_updates`), as `copy_target` makes for a whole unit."""
        numel = self.partition_numel(rt.unit)
        if rt.full is None and self.plan.params_memory(rt.index) == "nvme":  # written as is
            return _nvme.aligned_empty(numel, self.compute_dtype)
        return torch.empty(numel, dtype=self.compute_dtype, pin_memory=self.residency.pin)

    def nvme_tensor_norms(
        self,
        factor: float,
        group_values: GroupValues,
        updated: list[UnitRuntime],
        steps: list[int],
        needs: TensorNorms,
    ) -> None:
        """An update that needs tensor norms (LAMB) over NVMe in two passes: the state
        and the direction (the direction parked in the other slot's master region), one
        all-reduce of the norms, then the second half into that region."""
        sums = self.norm_sums()
        kept: dict[int, tuple[Any, list[tuple[int, int, str]]]] = {}

        def direction(rt: UnitRuntime, buffers: list[Tensor]) -> list[Any]:
            self.residency.bind_swapped(rt, buffers)
            update = buffers[-1][: rt.master.numel()]
            _, hp, _, segments = self.norms_direction(rt, factor, group_values, sums, needs, update)
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
            self.norms_apply(rt, hp, buffers[-1][:numel], segments, norms, needs)
            region = self.residency.region(rt, 0, 1 - rt.slot)
            tickets = [(self.residency.nvme.submit(region, rt.master, write=True), rt.master)]
            updated.append(rt)
            self.publish(rt, None, exchange=False)
            return tickets

        self.agree(
            self.residency.step_pass(
                self.swapped_units, self.residency.swap_in, direction, extra=1
            ),
            updated,
            steps,
        )
        norms = self.tensor_norms(sums)
        failure = self.residency.step_pass(self.swapped_units, read_direction, apply, extra=1)
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
                f"failed after {len(updated)} of {len(self.swapped_units)} units on this rank "
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
        for rt, step in zip(self.swapped_units, steps):
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


def check_needs(optimizer: Optimizer) -> None:
    """An optimizer's declarations are of the kinds the core runs."""
    if not (optimizer.needs is None or isinstance(optimizer.needs, TensorNorms | WholeTensors)):
        raise TypeError(
            f"optimizer {optimizer.name!r} declares needs={optimizer.needs!r}; allowed: None, "
            "fzero.optim.TensorNorms(...), fzero.optim.WholeTensors(...)"
        )
    if not (optimizer.native is None or isinstance(optimizer.native, NativeKernel)):
        raise TypeError(
            f"optimizer {optimizer.name!r} declares native={optimizer.native!r}; allowed: "
            "None or fzero.optim.NativeKernel(...)"
        )
