"""Where each unit's optimizer partition lives between steps: with the parameters'
device, in host memory (ZeRO-Offload, Ren et al. 2021), or in a swap file on NVMe
(ZeRO-Infinity, Rajbhandari et al. 2021).

On NVMe every unit has two slots of master + optimizer state by default
(`offload_optimizer.commit: two_slots`): a step reads the current slot and writes the
other, and the engine flips them only when every rank has written everything
(`failures`), so a step is all or nothing. With `commit: in_place` there is one slot,
overwritten by the step: half the disk, and an I/O error mid-step leaves the file
holding no single step, so the engine refuses to go on (`broken`) until a checkpoint
is loaded. Stages 2-3 keep each unit's gradient accumulator in the file too
(`grads_on_disk`). With bf16 states (the plan's `memory.states`: DeepSpeed's
`bf16.bf16_optimizer_states`) the optimizer's moments rest there in bf16
(stochastically rounded on the way out, exact on the way in); in memory and in the
update they are fp32. With bf16 masters (`memory.master`: DeepSpeed's
`bf16.bf16_master_weights_and_grads`) the master rests there in bf16 too: the step
rounds the updated master stochastically, as an in-memory bf16 master is rounded (the
same seeds: `fzero.core.precision.rounding_spans`), publishes those bf16 values as the
parameters, and writes them exactly; a master that comes from elsewhere (a build, a
checkpoint of fp32 masters) is rounded to nearest, as `Tensor.to` rounds an in-memory
one. With bf16 gradient accumulators (`memory.grads`: DeepSpeed's
`data_types.grad_accum_dtype`) each micro-step's sum is rounded to nearest into the
file, as an in-memory bf16 accumulator's `add_` rounds it. Host buffers for what moves
every step come from a pool of unit-sized aligned fp32 buffers; a bf16 master, moment or
gradient sum travels inside its kind's fp32 buffer (read into its upper part and
widened in place, rounded in place into its lower part to be written: [Note: bf16
moments in their fp32 buffers]). With
`zero_optimization.sub_group_size` below the largest unit's partition, the step (and
the engine's build) take units in pieces through a pool of piece-sized buffers
([Note: sub-groups]). Backward's gradient sums in the file (adding each micro-step's,
the writes in flight) are `fzero.core.swap_grads`'s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fzero import comm
from fzero.config import Config
from fzero.core import nvme as _nvme
from fzero.core.layout import UnitRuntime
from fzero.core.precision import init_state, round_spans_into, rounding_spans
from fzero.core.state import optimizer_partition
from fzero.core.swap_buffers import (
    BF16_PAGE,
    narrow_in_place,
    packed,
    swap_buffer_numel,
    widen_packed,
)
from fzero.core.swap_grads import GradWrites, write_grad
from fzero.optim import TensorNorms
from fzero.partition import Plan, Unit

__all__ = ["Piece", "Residency", "swap_buffer_numel"]

SUB_GROUP_DEFAULT = 1_000_000_000  # DeepSpeed's `sub_group_size`

# [Note: sub-groups]
#
# DeepSpeed's ZeRO-3 optimizer splits each rank's fp32 partition into sub-groups of at
# most `zero_optimization.sub_group_size` elements and swaps and steps them one at a
# time (`DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups`), so the step's host
# buffers follow the sub-group, not the largest tensor. fzero does the same over the
# swap file: a unit whose partition is larger than the sub-group is stepped in pieces
# (`Piece`) of `sub_group_size` elements rounded down to a multiple of 2048 (at least
# 2048), so every piece starts on a 4 KiB boundary of its fp32 and bf16 regions
# (O_DIRECT). Each piece's master, moments and gradient are read from their offset in
# the unit's regions, updated and written back there. The result is the whole unit's,
# bit for bit, for an optimizer whose update of an element reads only that element
# (`needs=None`): the same step count and hyper-parameters for every piece, the
# gradient scaled by the same factor (clipping and unscaling are computed before the
# step, over whole units), and a bf16 moment's piece rounded from the seed the whole
# partition's rounding gives its first element ([Note: bf16 moments in their fp32
# buffers]). Optimizers that need tensor norms (LAMB) step whole units, and a
# `sub_group_size` below such a unit's partition is refused: its trust ratio needs the
# whole tensor before any piece moves.


class Piece(NamedTuple):
    """Elements [start, stop) of unit `rt`'s optimizer partition: one sub-group of the
    step over the swap file ([Note: sub-groups])."""

    rt: UnitRuntime
    start: int
    stop: int


class Residency:
    """The swap file (if any), the host buffer pool, and moving units in and out. Where
    the optimizer partitions live and the moments' dtype are the plan's (`Plan.memory`:
    `optimizer`, `states`); the config says where the file goes and how it is read."""

    def __init__(
        self,
        config: Config,
        plan: Plan,
        *,
        rank: int,
        optimizer: Any,
        partition_numel: Callable[[Unit], int],
        swap_gradients: bool = True,
    ) -> None:
        """`swap_gradients=False` keeps stage 2-3 gradient accumulators in memory even
        with `offload_optimizer.swap_gradients` (`fzero.train_step` reduces into its
        state's buffers)."""
        zero = config.zero_optimization
        # units at stages 0-1 keep whole gradients in memory (all-reduced at the boundary)
        swap_gradients = swap_gradients and not plan.runs_stage(lambda s: s < 2)
        self.swap_gradients = swap_gradients and zero.offload_optimizer.swap_gradients
        self.plan, self.partition_numel, self.rank = plan, partition_numel, rank
        # ZeRO-Offload: fp32 masters, optimizer state and the update on the host; the
        # device keeps compute-dtype parameters and gradients. Per unit (`Plan.optimizer_memory`)
        where = [plan.optimizer_memory(u) for u in plan.units]
        self.offloaded = [kind != "device" for kind in where]  # by unit index
        self.offload = any(self.offloaded)
        self.swapped = [i for i, kind in enumerate(where) if kind == "nvme"]  # in the file
        self._position = {index: at for at, index in enumerate(self.swapped)}
        self.pin = self.offload and zero.offload_optimizer.pin_memory and torch.cuda.is_available()
        self.nvme: Any = None  # the swap file when offloading the optimizer to NVMe
        self.kinds: list[str] = []
        self.grads_on_disk = False  # stages 2-3: gradient accumulators in it too
        self.slots = 2  # copies of each unit's master and state: two_slots or in_place
        self.state_dtype = torch.float32  # of the moments in the file
        self.master_dtype = torch.float32  # of the masters in the file
        self.grad_dtype = torch.float32  # of the gradient accumulators in the file
        self.broken = ""  # why the state holds no single step (a failed in-place step or load)
        self.stored = 0  # units written by `write_next_slot` (checkpoint loads)
        self.rounding_step = 0  # the step whose update is written (set by the step)
        self.pipeline_depth = 2
        self.write_buffers = 2  # backward's gradient writes in flight: `_open_swap`
        self.grad_writes = GradWrites()  # backward's, in flight: `fzero.core.swap_grads`
        # host buffers of the largest unit partition, for what offload moves every step
        largest = max((partition_numel(u) for u in plan.units), default=0)
        self.pool = _nvme.BufferPool(swap_buffer_numel(largest))
        # the step's swap buffers: the pool's, or with sub-groups their own, smaller ones
        self.step_pool = self.pool
        self.grad_pool = self.pool  # backward's gradient writes: `use_grad_pieces`
        self.sub_group = 0  # elements per piece of a unit the step takes; 0: whole units
        self.lent: list[Tensor] = []  # pool buffers in use by the current unit update
        if "nvme" in (*where, *(plan.params_memory(u) for u in plan.units)):
            _nvme.map_large_buffers()
        if self.swapped:
            self._open_swap(zero, config, optimizer, rank)

    def _open_swap(self, zero: Any, config: Config, optimizer: Any, rank: int) -> None:
        kinds = [
            k for k, v in optimizer.init(torch.zeros(1))._asdict().items() if isinstance(v, Tensor)
        ]
        self.kinds = ["master", *kinds]
        # Two slots per unit: a step reads the current one and writes the other, and
        # flips them only when every rank has written everything (transactional).
        self.slots = 2 if zero.offload_optimizer.commit == "two_slots" else 1
        if self.plan.memory.states == "bf16":
            self.state_dtype = torch.bfloat16
        if self.plan.memory.master == "bf16":
            self.master_dtype = torch.bfloat16
        self.check_optimizer(optimizer)
        held = [self.plan.units[i] for i in self.swapped]
        sizes = [
            self.kind_bytes(k) * self.partition_numel(u)
            for _slot in range(self.slots)
            for u in held
            for k in range(len(self.kinds))
        ]
        # Stages 2-3 keep each unit's reduced gradient there too (ZeRO-Infinity), so the
        # host holds no whole-model buffer: read with the state at the step.
        self.grads_on_disk = self.plan.stage >= 2 and self.swap_gradients
        if self.grads_on_disk and self.plan.optimizer_extra_size > 1:
            assert self.plan.mesh is not None
            raise ValueError(
                "zero_optimization.offload_optimizer.swap_gradients is true (the default "
                "with device 'nvme' at stages 2-3) but the plan splits the optimizer state "
                f"over {self.plan.mesh.shard}, finer than its gradients "
                f"({self.plan.mesh.grads_shard}): the accumulation boundary reduces each "
                "accumulated gradient shard once more, which fzero runs in memory only; set "
                "offload_optimizer.swap_gradients to false (the accumulators in host memory, "
                "the optimizer state on NVMe) or split the optimizer as the gradients"
            )
        if self.grads_on_disk:
            if self.plan.memory.grads == "bf16":
                self.grad_dtype = torch.bfloat16
            size = self.grad_dtype.itemsize
            sizes += [size * self.plan.grads_size(u, rank) for u in held]
        per_unit = len(self.kinds) + self.grads_on_disk  # bf16 moments too: in their own
        self.pipeline_depth = max(2, zero.offload_optimizer.buffer_count // per_unit)
        self._split_units(zero.sub_group_size, optimizer)
        # Backward writes one gradient shard per unit: as many in flight as the step has
        # units in its pipeline. More queue behind the same I/O threads and hold a
        # unit-sized buffer each (`buffer_count` of them held 1.8 GB per rank of a 3B
        # model through backward, and from one step to the next)
        self.write_buffers = self.pipeline_depth
        self._check_memory(per_unit)
        self.nvme = _nvme.SwapFile(
            zero.offload_optimizer.nvme_path,
            comm.get_rank(),  # the process's: replicas on a mesh share a plan rank
            sizes,
            threads=config.aio.thread_count,
            block_size=config.aio.block_size,
        )

    def check_optimizer(self, optimizer: Any) -> None:
        """Refuse an optimizer that needs tensor norms (LAMB) over a file it cannot run
        on: its update direction waits in the other slot's master region between its two
        passes, so it needs two slots and fp32 masters. Checked when the file opens and
        by each step function over it (`train_step` may bring another optimizer)."""
        if not isinstance(getattr(optimizer, "needs", None), TensorNorms):
            return
        if self.slots == 1:
            raise ValueError(
                "zero_optimization.offload_optimizer.commit 'in_place' does not work with "
                "LAMB or any optimizer that needs tensor norms "
                f"({getattr(optimizer, 'name', '?')!r} declares TensorNorms: its update "
                "direction waits in the second slot between its two passes); use commit "
                "'two_slots'"
            )
        if self.narrow_master:
            raise ValueError(
                "memory.master is 'bf16' (DeepSpeed's bf16.bf16_master_weights_and_grads) "
                "with the optimizer on 'nvme', and optimizer "
                f"{getattr(optimizer, 'name', '?')!r} needs tensor norms (it declares "
                "TensorNorms, as LAMB does): its step parks an fp32 direction where the "
                "master rests; use fp32 masters, or the optimizer on 'cpu' or the device"
            )

    def _check_memory(self, per_unit: int) -> None:
        """Refuse before training starts when the host cannot hold even the step's swap
        buffers (a lower bound of the working set: units in flight x their tensors x the
        largest unit partition, for every local rank)."""
        available = _nvme.available_memory()
        if available is None:
            return
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        per_rank = self.pipeline_depth * per_unit * 4 * self.step_pool.numel
        if per_rank * ranks > available:
            raise MemoryError(
                f"NVMe offload needs at least {per_rank:,} bytes of host buffers per rank "
                f"({self.pipeline_depth} units in flight x {per_unit} tensors x "
                f"{self.step_pool.numel:,} elements x 4 bytes) x {ranks} local rank(s); "
                f"{available:,} bytes are available: lower "
                "zero_optimization.offload_optimizer.buffer_count or "
                "zero_optimization.sub_group_size, or plan smaller units"
            )

    def _split_units(self, size: int, optimizer: Any) -> None:
        """Step units larger than `size` elements in pieces ([Note: sub-groups]): the
        step's swap buffers sized by the piece, not by the largest unit."""
        key = "zero_optimization.sub_group_size"
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{key} is {size!r}; allowed: a positive number of elements")
        piece = max(BF16_PAGE, size // BF16_PAGE * BF16_PAGE)
        held = [self.plan.units[i] for i in self.swapped]
        largest = max(held, key=self.partition_numel)
        if piece >= self.partition_numel(largest):
            return
        whole = ""
        if isinstance(getattr(optimizer, "needs", None), TensorNorms):
            whole = (
                f"optimizer {getattr(optimizer, 'name', '?')!r} needs tensor norms (it "
                "declares TensorNorms, as LAMB does): its trust ratio needs each whole "
                "tensor before any piece of it moves, so it steps whole units"
            )
        elif self.plan.optimizer_extra_size > 1:
            whole = (
                "the plan splits the optimizer finer than the gradients "
                f"(optimizer_extra_size {self.plan.optimizer_extra_size}), whose step "
                "takes whole units"
            )
        if not whole:
            self.sub_group = piece
            self.step_pool = _nvme.BufferPool(swap_buffer_numel(piece))
            return
        if size == SUB_GROUP_DEFAULT:  # DeepSpeed's default: whole units, as before
            return
        raise ValueError(
            f"{key} {size:,} is smaller than unit {largest.name!r}'s optimizer partition "
            f"on rank {self.rank} ({self.partition_numel(largest):,} elements) with "
            f"offload_optimizer.device 'nvme', and {whole}; allowed: a {key} of at least "
            "the largest unit's partition (or the default 1e9), an optimizer that needs "
            "no tensor norms, or offload_optimizer.device 'cpu'"
        )

    def use_grad_pieces(self, piece: int) -> None:
        """Backward keeps large units' gradients in pieces of `piece` elements
        ([Note: gradients reduced in pieces]): its writes take piece-sized buffers."""
        if self.grads_on_disk and swap_buffer_numel(piece) < self.pool.numel:
            self.grad_pool = _nvme.BufferPool(swap_buffer_numel(piece))

    def sub_groups(self, units: Sequence[UnitRuntime]) -> list[Piece] | None:
        """The pieces the step takes `units` in ([Note: sub-groups]), or None when it
        takes them whole. With pieces, the pool lets go of backward's unit-sized
        buffers first: the step takes its own, piece-sized ones."""
        if not self.sub_group:
            return None
        self.pool.trim(0)
        pieces = []
        for rt in units:
            numel = self.partition_numel(rt.unit)
            starts = range(0, max(numel, 1), self.sub_group)
            pieces += [Piece(rt, a, min(numel, a + self.sub_group)) for a in starts]
        return pieces

    @property
    def narrow_states(self) -> bool:
        """Whether the moments rest in the file in bf16 (fp32 in memory and the update)."""
        return self.state_dtype != torch.float32

    @property
    def narrow_master(self) -> bool:
        """Whether the masters rest in the file in bf16 (fp32 in the update)."""
        return self.master_dtype != torch.float32

    @property
    def narrow_grads(self) -> bool:
        """Whether the gradient accumulators rest in the file in bf16."""
        return self.grad_dtype != torch.float32

    def narrow(self, kind_index: int) -> bool:
        """Whether `kinds[kind_index]` rests in the file in bf16."""
        return self.narrow_master if kind_index == 0 else self.narrow_states

    def kind_dtype(self, kind_index: int) -> torch.dtype:
        """The dtype `kinds[kind_index]` rests in in the file."""
        return self.master_dtype if kind_index == 0 else self.state_dtype

    def kind_bytes(self, kind_index: int) -> int:
        """Bytes per element of `kinds[kind_index]` in the file."""
        return self.kind_dtype(kind_index).itemsize

    def next_slot(self, rt: UnitRuntime) -> int:
        """Where a step writes the unit: the other slot, or (in_place) the same one."""
        return (rt.slot + 1) % self.slots

    def holds(self, index: int) -> bool:
        """Whether unit `index`'s master and optimizer state live in the swap file."""
        return index in self._position

    def grad_on_disk(self, index: int) -> bool:
        """Whether unit `index`'s gradient accumulator lives in the swap file."""
        return self.grads_on_disk and index in self._position

    def region(self, rt: UnitRuntime, kind_index: int, slot: int) -> int:
        at = self._position[rt.index]
        return (slot * len(self.swapped) + at) * len(self.kinds) + kind_index

    def grad_region(self, rt: UnitRuntime) -> int:
        return self.slots * len(self.swapped) * len(self.kinds) + self._position[rt.index]

    def check_usable(self) -> None:
        """Raise if an in-place step failed midway (the file holds no single step)."""
        if self.broken:
            raise RuntimeError(self.broken)

    def write_kind(
        self,
        rt: UnitRuntime,
        kind_index: int,
        slot: int,
        tensor: Tensor,
        buffers: list[Tensor] | None = None,
        start: int = 0,
    ) -> tuple[Any, Tensor]:
        """Start writing fp32 `tensor` as kind `kind_index` of the unit, at element
        `start` of its region (a piece: [Note: sub-groups]); a (ticket, buffer) pair. A
        bf16 moment is rounded stochastically first: in place, into the bf16 view of its
        kind's buffer in `buffers` (a swap buffer set: see [Note: bf16 moments in their
        fp32 buffers]), or into a new aligned buffer without one; element i of the piece
        draws the bits element start + i of the whole partition would, from the seeds an
        in-memory bf16 moment of the same step, kind and tensor elements draws
        (`rounding_spans` of `rounding_step`: not the rank, so the file changes no bit). A
        bf16 master is rounded to nearest the same ways (exact for a master a step
        rounded already)."""
        if self.narrow(kind_index):
            numel = tensor.numel()
            spans = None  # a master: to nearest
            if kind_index > 0:
                at = optimizer_partition(self.plan, rt.unit, self.rank).start + start
                step = self.rounding_step
                spans = rounding_spans(rt.unit, rt.index, step, kind_index, at, at + numel)
            if buffers is None:
                staged = _nvme.aligned_empty(numel, torch.bfloat16)
                tensor = round_spans_into(tensor, staged, spans)
            else:
                buffer = buffers[kind_index]
                if tensor.data_ptr() != buffer.data_ptr():  # the moment into its buffer
                    buffer[:numel].copy_(tensor)
                tensor = narrow_in_place(buffer, numel, spans)
        elif tensor.data_ptr() % _nvme.ALIGN:
            tensor = _nvme.aligned_empty(tensor.numel()).copy_(tensor)
        region, offset = self.region(rt, kind_index, slot), start * self.kind_bytes(kind_index)
        return self.nvme.submit(region, tensor, write=True, offset=offset), tensor

    def resident_tensors(self, rt: UnitRuntime) -> list[Tensor]:
        return [rt.master] + [getattr(rt.state, k) for k in self.kinds[1:]]

    def swap_out(
        self, rt: UnitRuntime, slot: int, wait: bool, buffers: list[Tensor] | None = None
    ) -> list[Any]:
        """Write the unit's master and state to `slot` of its regions (from aligned
        copies when they are not already in aligned swap buffers; bf16 moments rounded
        in place in `buffers`, the unit's swap set, when given: their fp32 values are
        gone once written). Without `buffers`, waited for: one kind at a time, so one
        aligned or bf16 copy is alive at once, not one per kind."""
        if buffers is None and wait:
            for k, tensor in enumerate(self.resident_tensors(rt)):
                self.wait_swap([self.write_kind(rt, k, slot, tensor)], "writing")
            return []
        tickets = [
            self.write_kind(rt, k, slot, tensor, buffers)
            for k, tensor in enumerate(self.resident_tensors(rt))
        ]
        if wait:
            self.wait_swap(tickets, "writing")
        return tickets

    def swap_out_piece(self, piece: Piece, slot: int, buffers: list[Tensor]) -> list[Any]:
        """Start writing the piece's master and state, bound by `bind_piece`, to their
        offsets in `slot` of the unit's regions (bf16 moments rounded in place in
        `buffers`); the tickets."""
        tensors = enumerate(self.resident_tensors(piece.rt))
        return [self.write_kind(piece.rt, k, slot, t, buffers, piece.start) for k, t in tensors]

    def swap_in(self, rt: UnitRuntime, buffers: list[Tensor]) -> list[Any]:
        """Start reading the unit's current master and state (and gradient, when the
        swap file holds it) into `buffers`; a gradient not written this window reads as
        zeros."""
        return self.swap_in_piece(Piece(rt, 0, self.partition_numel(rt.unit)), buffers)

    def swap_in_piece(self, piece: Piece, buffers: list[Tensor]) -> list[Any]:
        """`swap_in` of elements [start, stop) of the unit's partition, from their
        offsets in its regions ([Note: sub-groups])."""
        rt, numel = piece.rt, piece.stop - piece.start
        tickets = []
        for k in range(len(self.kinds)):
            region, offset = self.region(rt, k, rt.slot), piece.start * self.kind_bytes(k)
            target = buffers[k][:numel]
            if self.narrow(k):  # widened to fp32 by `bind_swapped`
                target = packed(buffers[k], numel)
            tickets.append((self.nvme.submit(region, target, False, offset), target))
        if self.grads_on_disk:
            grad = buffers[len(self.kinds)][:numel]
            if rt.grad_on_disk:  # bf16: widened to fp32 by `bind_swapped`
                if self.narrow_grads:
                    grad = packed(buffers[len(self.kinds)], numel)
                region, offset = self.grad_region(rt), self.grad_dtype.itemsize * piece.start
                tickets.append((self.nvme.submit(region, grad, False, offset), grad))
            else:
                grad.zero_()
        return tickets

    def wait_swap(self, tickets: list[Any], what: str) -> None:
        """Wait for (and remove) every transfer in `tickets`; on a failure the rest are
        still waited for before it is raised, so no transfer outlives its buffer."""
        try:
            while tickets:
                ticket, _ = tickets.pop(0)
                self.nvme.wait(ticket, what)
        finally:
            self.drain([tickets])

    def bind_swapped(self, rt: UnitRuntime, buffers: list[Tensor]) -> None:
        """Point the unit's master and state (and gradient) at the swap set `buffers`,
        read by `swap_in` (bf16 moments widened to fp32 here)."""
        self.bind_piece(Piece(rt, 0, self.partition_numel(rt.unit)), buffers)

    def bind_piece(self, piece: Piece, buffers: list[Tensor], **fields: Any) -> None:
        """`bind_swapped` for a piece read by `swap_in_piece`; `fields` (the optimizer
        step count the piece starts from) replace those of the unit's state too."""
        rt, numel = piece.rt, piece.stop - piece.start
        for k in (k for k in range(len(self.kinds)) if self.narrow(k)):
            widen_packed(buffers[k], numel)
        rt.master = buffers[0][:numel]
        fields |= {k: buffers[i + 1][:numel] for i, k in enumerate(self.kinds[1:])}
        rt.state = rt.state._replace(**fields)
        if self.grads_on_disk:
            if self.narrow_grads and rt.grad_on_disk:  # read by `swap_in_piece`
                widen_packed(buffers[len(self.kinds)], numel)
            rt.grad = buffers[len(self.kinds)][:numel]

    def evict(self, rt: UnitRuntime) -> None:
        empty = torch.empty(0)
        rt.master = empty
        rt.state = rt.state._replace(**dict.fromkeys(self.kinds[1:], empty))
        if self.grads_on_disk:
            rt.grad = empty

    def trim_after_step(self) -> None:
        """After a step over the swap file the pool keeps no buffer: backward's gradient
        writes and the next step take theirs afresh (page faults of a few ms per unit,
        against seconds of its I/O), so forward and a save between steps hold none of
        them (3B: 0.6 GB for the three buffers backward's writes take), and backward
        only what its writes take."""
        self.pool.trim(0)
        self.step_pool.trim(0)

    def swap_buffers(self, extra: int = 0, pool: _nvme.BufferPool | None = None) -> list[Tensor]:
        """One pooled fp32 host buffer per swapped kind (bf16 moments too: [Note: bf16
        moments in their fp32 buffers]), the gradient, and `extra` more, each for the
        largest unit's partition (`swap_buffer_numel`), or the step's piece from
        `step_pool`; give them back with `give_back`."""
        pool = pool or self.pool
        return [pool.take() for _ in range(len(self.kinds) + self.grads_on_disk + extra)]

    def give_back(self, buffers: list[Tensor], pool: _nvme.BufferPool | None = None) -> None:
        for buffer in buffers:
            (pool or self.pool).give(buffer)
        buffers.clear()

    def zero_grads(self, units: list[UnitRuntime]) -> None:
        """Clear the units' gradient accumulators after a step (NVMe gradients: the
        file's copies count as unwritten for the next window)."""
        for rt in units:
            rt.grad.zero_()
            rt.grad_on_disk, rt.grad_stats = False, None

    def failures(self, failure: str, world_size: int) -> list[str]:
        """Every rank's I/O failure of the pass just run ("rank r: error"), agreed by all
        (collective): either every rank commits or every rank rolls back."""
        failures = [failure.encode()]
        if max(world_size, self.plan.processes) > 1:
            failures = comm.all_gather_bytes(failure.encode(), what="NVMe I/O failures")
        return [f"rank {r}: {m.decode()}" for r, m in enumerate(failures) if m]

    @contextlib.contextmanager
    def resident(self, rt: UnitRuntime, write_back: bool) -> Iterator[None]:
        """The unit's master, optimizer state and gradient accumulator in host memory
        inside the block (a no-op unless they live on NVMe); written back on exit with
        `write_back`."""
        if not self.holds(rt.index):
            yield
            return
        buffers = self.swap_buffers()
        self.wait_swap(self.swap_in(rt, buffers), "reading")
        self.bind_swapped(rt, buffers)
        try:
            yield
            if write_back:  # into the other slot, current once written
                self.swap_out(rt, self.next_slot(rt), wait=True, buffers=buffers)
                rt.slot = self.next_slot(rt)
                if self.grads_on_disk:
                    write_grad(self, rt)
        finally:
            self.evict(rt)
            self.give_back(buffers)

    def write_in_pieces(self, rt: UnitRuntime, optimizer: Any) -> None:
        """Write a unit just built to its current slot in sub-group pieces ([Note:
        sub-groups]): each piece's master copied from `rt.master` (the values the unit
        was built from) into a swap buffer, its optimizer state initialised over that
        piece (the optimizer's `init` is elementwise where pieces are taken), then
        evicted. The build holds the unit's values and a piece, not a master and moments
        of the whole partition."""
        values, numel = rt.master, rt.master.numel()
        buffers = self.swap_buffers(0, self.step_pool)
        try:
            for start in range(0, max(numel, 1), self.sub_group):
                piece = Piece(rt, start, min(numel, start + self.sub_group))
                master = buffers[0][: piece.stop - start].copy_(values[start : piece.stop])
                state = init_state(optimizer, master, torch.float32)
                fields = {
                    k: buffers[i + 1][: master.numel()].copy_(getattr(state, k))
                    for i, k in enumerate(self.kinds[1:])
                }
                rt.master, rt.state = master, rt.state._replace(**fields)
                self.wait_swap(self.swap_out_piece(piece, rt.slot, buffers), "writing")
        finally:
            self.evict(rt)
            self.give_back(buffers, self.step_pool)

    def write_next_slot(self, rt: UnitRuntime, with_grad: bool) -> None:
        """Write the master and state bound to `rt` (and its gradient) to the unit's other
        slot, then evict them; they become current when the caller flips `rt.slot`
        (checkpoint loads, after every rank has read its part)."""
        try:
            self.stored += 1
            self.swap_out(rt, self.next_slot(rt), wait=True)
            if with_grad and self.grads_on_disk:
                write_grad(self, rt)
        finally:
            self.evict(rt)

    def step_pass(
        self,
        units: Sequence[Any],
        read: Callable[[Any, list[Tensor]], list[Any]],
        compute: Callable[[Any, list[Tensor]], list[Any]],
        extra: int = 0,
    ) -> str:
        """One pass over `units` (`UnitRuntime`s, or `Piece`s of them: [Note:
        sub-groups]) through `pipeline_depth` sets of swap buffers from `step_pool`:
        while `compute` runs on unit i (returning its writes), the next units are being
        read (`read` starts that) and unit i-1 written. Returns "" or the first I/O
        error; every transfer has finished either way and no unit stays resident."""
        depth = max(2, min(self.pipeline_depth, len(units)))
        sets = [self.swap_buffers(extra, self.step_pool) for _ in range(depth)]
        reads: dict[int, list[Any]] = {}
        writes: list[list[Any]] = [[] for _ in sets]

        def start_read(j: int) -> None:
            self.wait_swap(writes[j % depth], "writing")  # the last unit in that set
            reads[j] = read(units[j], sets[j % depth])

        failure = ""
        try:
            for j in range(min(depth - 1, len(units))):
                start_read(j)
            for i, rt in enumerate(units):
                self.wait_swap(reads[i], "reading")
                del reads[i]
                if i + depth - 1 < len(units):  # into the set unit i-1 leaves
                    start_read(i + depth - 1)
                writes[i % depth] = compute(rt, sets[i % depth])
            for tickets in writes:
                self.wait_swap(tickets, "writing")
        except OSError as error:
            failure = str(error)
        finally:  # also on any other error: no transfer outlives its buffer
            self.drain([*reads.values(), *writes])
            for item in units:
                self.evict(item.rt if isinstance(item, Piece) else item)
            for buffers in sets:
                self.give_back(buffers, self.step_pool)
        return failure

    def drain(self, batches: list[list[Any]]) -> None:
        """Wait for (and remove) every transfer in `batches`, ignoring their errors (one
        was raised)."""
        for tickets in batches:
            while tickets:
                self.nvme.io.wait(tickets.pop(0)[0])
