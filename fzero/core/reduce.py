"""Averaging gradients over ranks, one bucket at a time, for both doors.

`Reduction` is the one bookkeeping both doors run (the engine from its parameter hooks,
`train_step` from its leaves' hooks): where a unit's gradient of this pass is added,
which units are complete, and the launch of each bucket once all its units are.

A bucket (`fzero.partition.reduction_buckets`: consecutive units from the last one back,
up to `reduce_bucket_size` elements) is reduced by one collective as soon as all its
units' gradients are in, overlapping the rest of backward (`overlap_comm`); buckets are
launched in bucket order, the same on every rank, and the next bucket's buffer is made
once the reductions before the last one have landed, so a rank holds the bucket it
fills beside the one being reduced (`overlap_comm` off: one bucket), not all the buckets
of a backward. Stages 2-3 keep only this rank's
part of each unit; one bucket's collectives are `fzero.core.reduce_bucket`'s. Averages
are elementwise, so a bucket gives each element exactly what one collective per unit
gives. A unit larger than a bucket at stages 2-3 is reduced in pieces
(`fzero.core.reduce_pieces`).

A plan on a mesh reduces within its shard group, then averages each rank's reduced part
over the replicas holding the same shard (MiCS/HSDP: the cross-group link carries one
shard per rank, not the bucket). Stage 0 all-reduces over every process at once; stage
1 reduces each whole accumulated gradient into the shards as stage 2 does, once, at the
accumulation boundary (`Reduction._reduce_to_shards`: the ZeRO paper's ZeRO-1 traffic, a
reduce-scatter and the parameters' all-gather, where an all-reduce would send twice the
gradient bytes).

Where the optimizer state is split over more axes than the gradients
(`OnMesh.optimizer_extra`: the optimizer over the world, the gradients within a node),
each micro-step reduces within the gradients' group only and the shard accumulates at
its split, without replicas' averages; at the accumulation boundary
`reduce_to_optimizer_shards` reduce-scatters each accumulated shard over the extra axes
into the optimizer's block of it (a reduce-scatter, not an all-reduce and a slice: each
rank sends and receives half the bytes).

Stages are per unit (`Plan.stage_of`): a plan of ZeRO-1 embeddings and ZeRO-3 blocks
sums the embeddings' gradients into their whole accumulators and all-reduces them at the
accumulation boundary, while the blocks' are reduce-scattered every pass; a bucket holds
units of one kind only (`fzero.partition.reduction_buckets`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor

from fzero import comm
from fzero.core.groups import (
    Groups,
    UnitComm,
    check_even,
    check_finer,
    exchange_block,
    groups_of,
    unit_group,
)
from fzero.core.layout import add_pieces
from fzero.core.reduce_bucket import Pending, finish, nothing, reduce_bucket
from fzero.core.reduce_pieces import Pieces
from fzero.core.state import optimizer_partition
from fzero.partition import Placement, Plan, Unit

__all__ = ["Reduction", "any_rank", "bucket_accumulators", "reduce_to_optimizer_shards"]

_GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bucket_accumulators(
    plan: Plan, buckets: Sequence[Sequence[int]], device: torch.device
) -> list[Tensor | None]:
    """Units at stages 0-1: each one's gradient accumulator (in `Plan.grads_dtype`, one
    per bucket: `reduction_buckets` does not mix them) as a view of one zeroed buffer per
    bucket, so that a bucket is all-reduced by one collective (`Reduction`); None for a
    unit at stages 2-3 (its accumulator is its shard, made with its state)."""
    grads: list[Tensor | None] = [None] * len(plan.units)
    for indices in buckets:
        if plan.stage_of(indices[0]) >= 2:
            continue
        numel = sum(plan.units[i].numel for i in indices)
        dtype = _GRAD_DTYPES[plan.grads_dtype(indices[0])]
        buffer = torch.zeros(numel, dtype=dtype, device=device)
        offset = 0
        for i in indices:
            grads[i] = buffer[offset : offset + plan.units[i].numel]
            offset += plan.units[i].numel
    return grads


def _span(tensors: Sequence[Tensor]) -> Tensor | None:
    """The one flat tensor `tensors` are consecutive pieces of (views of one storage, in
    order), or None when they are not."""
    first = tensors[0]
    if any(t.dim() != 1 or not t.is_contiguous() for t in tensors):
        return None
    base = first._base if first._base is not None else first
    end = first.data_ptr()
    for t in tensors:
        same = t._base is base or (t._base is None and t is base)
        if not same or t.data_ptr() != end or t.dtype != first.dtype:
            return None
        end += t.numel() * t.element_size()
    start = (first.data_ptr() - base.data_ptr()) // first.element_size()
    return base.view(-1)[start : start + sum(t.numel() for t in tensors)]


class Reduction:
    """The gradient reductions of one door over `plan`'s `buckets`, pass after pass.

    A pass (`begin`) adds each tensor's gradient at its placement (`add`) into the
    unit's target: for a unit at stages 0-1 (`Plan.stage_of`) its accumulator
    `accumulator(i)`, summed locally until a pass that `reduce`s; at stages 2-3 a
    full-size view of its bucket's buffer, alive until the bucket is reduced, when
    `keep(i, part)` receives this rank's averaged part of unit i. A unit is complete
    when `sizes[i]` gradients have `arrived`; complete buckets launch at once, in bucket
    order (the same on every rank), beside the rest of backward with `overlap`, else
    waited for there. A bucket's buffer is made once the reductions launched before the
    last one have landed: with `overlap` stages 2-3 hold a bucket being filled beside one
    being reduced (DeepSpeed's two buffers), without it one bucket at a time. `finish`
    launches the rest (units this pass did not use reduce zeros) and waits.
    `quantized`: qgZ at stages 2-3 (`reduce_bucket`), in `bits` 8 or 4;
    `wire_dtype`: the dtype gradients travel in (DeepSpeed's `communication_data_type`).
    `piece` (`reduce_pieces.reduction_piece`; 0: none): a unit at stages 2-3 with even
    shards whose part on this rank is larger is reduced in pieces of that many elements
    of each part ([Note: gradients reduced in pieces]), and `keep(i, part, at)` receives
    each at its offset `at` in the part (0 for a whole part).
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        buckets: Sequence[Sequence[int]],
        *,
        sizes: Sequence[int],
        accumulator: Callable[[int], Tensor],
        keep: Callable[[int, Tensor, int], None],
        device: torch.device,
        quantized: bool = False,
        bits: int = 8,
        overlap: bool = True,
        wire_dtype: torch.dtype = torch.float32,
        piece: int = 0,
    ) -> None:
        self.plan, self.rank, self.buckets = plan, rank, [list(b) for b in buckets]
        self.wire_dtype = wire_dtype
        self.sizes, self.accumulator, self.keep = list(sizes), accumulator, keep
        self.device, self.quantized, self.overlap = device, quantized, overlap
        self.bits = bits
        self.whole = [stage < 2 for stage in plan.stages]  # gradients all-reduced whole
        # ZeRO-1 units whose bucket is all-reduced over every process (beside stage-0
        # units): their whole average is everywhere, `reduce_to_optimizer_shards` skips them
        self.reduced_whole: set[int] = set()
        self.groups = groups_of(plan)
        check_even(plan, quantized, "zero_quantized_gradients (qgZ)")
        check_finer(plan, quantized, "zero_quantized_gradients (qgZ)")
        self.piece = piece
        self.pieced = [self._pieced(i) for i in range(len(plan.units))]
        # pieced units of one tensor from their first element: reduced from its gradient
        # as autograd made it, with no bucket copy ([Note: gradients reduced in pieces])
        self.direct = [p and _one_run(u) for p, u in zip(self.pieced, plan.units)]
        self._sources: dict[int, Tensor] = {}  # such units' gradients of this pass
        self.place: dict[int, tuple[int, int]] = {}  # unit -> (bucket, offset in it)
        for b, indices in enumerate(self.buckets):
            offset = 0
            for i in indices:
                self.place[i] = (b, offset)
                offset += plan.units[i].numel
        self.arrived_count = [0] * len(plan.units)
        self.reduce = True  # whether the pass running now reduces
        self._buffers: dict[int, Tensor] = {}  # stages 2-3: bucket -> its gradients
        self._spare: Tensor | None = None  # a reduced bucket's buffer, for the next
        self._zeroed: set[int] = set()  # units whose part of their bucket's buffer is in use
        self._in_flight: dict[int, Tensor] = {}  # launched buckets' buffers, by id
        self._next = 0
        self._launches: list[Pending] = []  # each launched bucket's reductions, oldest first
        self._chains: list[Pieces] = []  # pieced reductions in flight, oldest first

    def _pieced(self, index: int) -> bool:
        """Whether unit `index`'s gradient is reduced in pieces ([Note: gradients reduced
        in pieces]): at stages 2-3, even shards, not quantized, its part on this rank
        larger than a piece (then it is a bucket of its own)."""
        unit = self.plan.units[index]
        return (
            self.piece > 0
            and self.plan.stage_of(unit) >= 2
            and not unit.bounds
            and not self.quantized
            and self.plan.grads_size(unit, self.rank) > self.piece
        )

    def begin(self, reduce: bool) -> None:
        """A new pass; `reduce`: whether the units at stages 0-1 average over ranks in it
        (the pass that ends an accumulation window; else they sum locally). Units at
        stages 2-3 reduce every pass."""
        self.reduce, self._next = reduce, 0
        self.arrived_count = [0] * len(self.plan.units)
        self._sources.clear()

    def target(self, index: int, dtype: torch.dtype | None = None) -> Tensor:
        """Where unit `index`'s gradient of this pass is summed (flat, the unit's size).
        `dtype`: the arriving gradient's, which a pieced unit's buffer takes (widened
        to fp32 should another dtype arrive: every value kept exactly)."""
        if self.whole[index]:
            return self.accumulator(index)
        b, offset = self.place[index]
        buffer = self._buffers.get(b)
        wide = torch.float32
        if buffer is None:
            kept = dtype if self.pieced[index] and dtype is not None else wide
            numel = sum(self.plan.units[i].numel for i in self.buckets[b])
            buffer = self._new_buffer(numel, kept)
            self._buffers[b] = buffer
        elif dtype is not None and buffer.dtype not in (dtype, wide):
            buffer = self._buffers[b] = buffer.to(wide)
        view = buffer[offset : offset + self.plan.units[index].numel]
        if index not in self._zeroed:  # the unit's part is zeroed when first written
            view.zero_()
            self._zeroed.add(index)
        return view

    def _new_buffer(self, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """A bucket buffer of `numel` elements, each unit's part zeroed when the unit's
        first gradient arrives (`target`): a bucket of many units takes memory as its
        gradients come in, while the units they come from are released, not all at its
        first gradient. The reductions launched before the last one are waited for
        first, and their buffers go before this one is made: with `overlap` the last
        bucket's reduction runs on beside the backward that fills this one (DeepSpeed's
        two buffers with `overlap_comm`; waiting for it too serialised backward with
        the reductions, 15-40% slower steps at stages 2-3 on two CPU ranks), and
        backward holds two buckets of gradients, not every bucket it reduced until its
        end; without `overlap`, each bucket was reduced when it filled: one. Within a
        pass the last reduced buffer is reused when it has the size: a fresh one costs
        its page faults (18 ms for 16.8M elements)."""
        self._wait(in_flight=1 if self.overlap else 0)
        spare, self._spare = self._spare, None
        if spare is not None and spare.numel() == numel and spare.dtype == dtype:
            return spare
        del spare  # freed before the new buffer is made
        return torch.empty(numel, dtype=dtype, device=self.device)

    def add(self, index: int, placement: Placement, grad: Tensor) -> None:
        """Add one tensor's gradient into unit `index`'s target at `placement`."""
        flat = grad.reshape(-1)
        if self.direct[index] and index not in self._sources:
            b = self.place[index][0]
            if b not in self._buffers:  # its first gradient: kept as it is
                self._sources[index] = flat
                return
        first = self._sources.pop(index, None)
        if first is not None:  # a second gradient of the unit in one pass: summed
            add_pieces(self.target(index, first.dtype), first, placement)
        add_pieces(self.target(index, grad.dtype), flat, placement)

    def arrived(self, index: int, launch: bool = True) -> bool:
        """Count one gradient of unit `index`; whether the unit is complete now (then,
        with `launch`, the buckets complete so far are launched)."""
        self.arrived_count[index] += 1
        complete = self.arrived_count[index] == self.sizes[index]
        if complete and launch:
            self.launch_ready()
        return complete

    def complete(self, index: int) -> bool:
        return self.arrived_count[index] >= self.sizes[index]

    def launch_ready(self) -> None:
        """Launch bucket reductions in bucket order as far as their units are complete;
        without `overlap` each is waited for at once (DeepSpeed's `overlap_comm` false: a
        bucket is reduced when it fills, not beside the rest of backward), so its
        buffer is free for the next. A pieced reduction in flight moves on one piece."""
        self._chains = [chain for chain in self._chains if not chain.done]
        for chain in self._chains:
            chain.advance()
        while self._next < len(self.buckets) and all(
            self.complete(i) for i in self.buckets[self._next]
        ):
            self._launch(self._next)
            self._next += 1
            if not self.overlap:
                self._wait()

    def finish(self) -> None:
        """End of the pass: launch what is left and wait for every reduction."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self._wait()
        self._spare = None
        self._chains = []
        self.arrived_count = [0] * len(self.plan.units)

    def _wait(self, in_flight: int = 0) -> None:
        """Wait for the launched buckets' reductions, oldest first, until `in_flight` of
        them are left running."""
        while len(self._launches) > in_flight:
            finish(self._launches.pop(0))

    def forget(self) -> None:
        """End of a pass that reduces nothing (another's backward through the module)."""
        self.arrived_count = [0] * len(self.plan.units)
        self._sources.clear()

    def held_numel(self) -> int:
        """Elements of the stage 2-3 bucket buffers alive now: those being filled, those
        whose reduction is in flight, and the one kept for reuse."""
        return sum(buffer.numel() for buffer in self._held())

    def held_bytes(self) -> int:
        """Bytes of the buffers `held_numel` counts (a pieced unit's in its gradients'
        dtype)."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._held())

    def _held(self) -> list[Tensor]:
        sources = [c.source for c in self._chains if c.source is not None]
        held = (*self._buffers.values(), *self._in_flight.values(), *self._sources.values())
        buffers = {id(b): b for b in (*held, *sources)}
        if self._spare is not None:
            buffers[id(self._spare)] = self._spare
        return list(buffers.values())

    def _launch(self, b: int) -> None:
        indices = self.buckets[b]
        if self.whole[indices[0]]:  # a bucket's units are all whole or all split
            if not self.reduce or self.plan.processes == 1:
                return  # inside an accumulation window: keep summing locally
            grads = [self.accumulator(i) for i in indices]
            span = _span(grads)
            if span is not None and all(self.plan.stage_of(i) == 1 for i in indices):
                self._launches.append(self._reduce_to_shards(indices, span, grads))
                return
            self.reduced_whole.update(i for i in indices if self.plan.stage_of(i) == 1)
            launched: Pending = []
            for tensor in [span] if span is not None else grads:
                wire = tensor if tensor.dtype == self.wire_dtype else tensor.to(self.wire_dtype)
                work = comm.all_reduce(wire, op="avg", async_op=True, what=_grads_of(indices))
                after = nothing if wire is tensor else functools.partial(tensor.copy_, wire)
                launched.append((work, after))
            self._launches.append(launched)
            return
        if self.pieced[indices[0]]:  # a bucket of its own
            self._launch_pieces(b, indices[0])
            return
        flats = [self.target(i) for i in indices]  # zeros for units this pass left unused
        buffer = self._buffers.pop(b)
        self._zeroed.difference_update(indices)
        owned = [slice(*self.plan.grads_range(self.plan.units[i], self.rank)) for i in indices]
        own = self._group(indices[0])  # a bucket's units reduce over one group
        pending = reduce_bucket(
            buffer,
            flats,
            owned,
            lambda k, part: self.keep(indices[k], part, 0),
            world_size=own.world,
            quantized=self.quantized,
            what=_grads_of(indices),
            bits=self.bits,
            group=own.group,
            replicas=own.replicate,
            hops=own.hops,
            bounds=[self.plan.units[i].bounds for i in indices],
            wire_dtype=self.wire_dtype,
        )
        self._in_flight[id(buffer)] = buffer
        pending.append((None, functools.partial(self._reuse, buffer)))
        if self.plan.processes == 1:
            finish(pending)  # nothing in flight: keep the parts now, reuse the buffer
        else:
            self._launches.append(pending)

    def _launch_pieces(self, b: int, index: int) -> None:
        """Start reducing unit `index` (bucket `b`) piece by piece ([Note: gradients
        reduced in pieces]); a unit this pass left unused reduces zeros, with no buffer."""
        buffer = self._buffers.pop(b, None)
        source = buffer if buffer is not None else self._sources.pop(index, None)
        self._zeroed.discard(index)
        unit, extra = self.plan.units[index], self.plan.optimizer_extra_size
        own, plan_rank = self._group(index), self.plan.rank_in_plan_order
        if unit.shard_axes is None:
            starts = [
                self.plan.grads_range(unit, plan_rank(r * extra))[0] for r in range(own.world)
            ]
        else:  # on its own axes: its shards in their group's order
            starts = [unit.shard_range(r)[0] for r in range(own.world)]
        chain = Pieces(
            source,
            starts,
            self.plan.grads_size(unit, self.rank),
            self.piece,
            lambda part, at: self.keep(index, part, at),
            rank=own.rank,
            group=own.group,
            replicas=own.replicate,
            wire_dtype=self.wire_dtype,
            device=self.device,
            what=_grads_of([index]),
        )
        pending: Pending = [(chain, nothing)]
        if buffer is not None:
            self._in_flight[id(buffer)] = buffer
            pending.append((None, functools.partial(self._reuse, buffer)))
        if self.plan.processes == 1:
            finish(pending)
        else:
            self._chains.append(chain)
            self._launches.append(pending)

    def _reduce_to_shards(self, indices: list[int], span: Tensor, grads: list[Tensor]) -> Pending:
        """A bucket of ZeRO-1 units at the accumulation boundary: each rank updates only
        its shard, so each unit's whole accumulated gradient is reduced into it as a
        stage-2 gradient is (a reduce-scatter per even unit, each owned part of an uneven
        unit reduced to its owner; gloo: the bucket all-reduced), within the plan's group
        then over its replicas: the ZeRO paper's ZeRO-1 traffic, a reduce-scatter and
        the parameters' all-gather, not an all-reduce before it. The rest of each
        accumulator is stale until the step zeroes it."""
        owned = [slice(*self.plan.grads_range(self.plan.units[i], self.rank)) for i in indices]

        def keep(k: int, part: Tensor) -> None:
            target = grads[k][owned[k]]
            if part.data_ptr() != target.data_ptr():
                target.copy_(part)

        own = self._group(indices[0])
        return reduce_bucket(
            span,
            grads,
            owned,
            keep,
            world_size=own.world,
            what=_grads_of(indices),
            group=own.group,
            replicas=own.replicate,
            bounds=[self.plan.units[i].bounds for i in indices],
            wire_dtype=self.wire_dtype,
        )

    def _group(self, index: int) -> UnitComm:
        """Where unit `index`'s gradients reduce (the plan's gradients' group, or its own
        axes': `unit_group`)."""
        return unit_group(self.plan, self.groups, self.plan.units[index], self.rank)

    def _reuse(self, buffer: Tensor) -> None:
        del self._in_flight[id(buffer)]
        self._spare = buffer


def _one_run(unit: Unit) -> bool:
    """Whether `unit` holds one tensor, in one run from its first element (the unit's
    buffer is that tensor's elements, then padding)."""
    if len(unit.placements) != 1 or len(unit.placements[0].pieces) != 1:
        return False
    piece = unit.placements[0].pieces[0]
    return piece.start == 0 and piece.offset == 0


def _grads_of(indices: Sequence[int]) -> str:
    return f"gradients of units {list(indices)}"


def reduce_to_optimizer_shards(
    plan: Plan,
    rank: int,
    grads: Sequence[Tensor],
    groups: Groups,
    wire_dtype: torch.dtype = torch.float32,
    reduced_whole: Collection[int] = (),
) -> None:
    """At the accumulation boundary of a plan whose optimizer state is split finer than
    its gradients (`Plan.optimizer_extra_size` > 1): average each stage 1-3 unit's
    accumulated gradient shard (`grads`, in unit order; a ZeRO-1 unit's whole
    accumulator, reduced into that shard within the gradients' group) over the
    `optimizer` group (the `optimizer_extra` axes) by one reduce-scatter, leaving rank
    `rank`'s block at `Plan.optimizer_in_grads` (a ZeRO-1 unit's at its optimizer
    partition); where the optimizer's order differs (`OnMesh.permuted`) each block is
    first exchanged for the one of this rank's optimizer shard (`exchange_block`). The
    rest of the accumulator is stale until the step zeroes it. Collective; nothing
    otherwise. `wire_dtype`: the dtype the sums travel in, as the micro-steps'.
    `reduced_whole`: ZeRO-1 units whose whole gradient was all-reduced over every process
    (`Reduction.reduced_whole`): their average is in place already, nothing moves."""
    if plan.optimizer_extra_size == 1:
        return
    pending: Pending = []
    for index, unit in enumerate(plan.units):
        stage = plan.stage_of(unit)
        if stage == 0 or index in reduced_whole or unit.shard_axes is not None:
            continue  # (a unit on its own axes: reduced over its replicas every time)
        accumulated, part = grads[index], plan.optimizer_in_grads(unit, rank)
        if stage == 1:  # its whole accumulator, reduced into this gradient shard already
            accumulated = accumulated[slice(*plan.grads_range(unit, rank))]
        wire = accumulated.to(wire_dtype)
        block = torch.empty(part.stop - part.start, dtype=wire_dtype, device=wire.device)
        what = f"{_grads_of([index])} across replicas"
        group = groups.optimizer
        work = comm.reduce_scatter_into(block, wire, async_op=True, what=what, group=group)
        # kept where the update reads it: a ZeRO-1 unit's at its optimizer partition
        mine = optimizer_partition(plan, unit, rank)
        target = grads[index][mine] if stage == 1 else accumulated[part]
        pending.append((work, functools.partial(_keep_block, target, block, groups, index)))
    finish(pending)


def _keep_block(target: Tensor, block: Tensor, groups: Groups, index: int) -> None:
    """The boundary's reduced `block` of unit `index` into `target`, exchanged first for
    this rank's optimizer shard's where the orders differ (`exchange_block`)."""
    what = f"{_grads_of([index])} to their optimizer shards"
    target.copy_(exchange_block(block, groups, what=what))


def any_rank(flag: bool, world_size: int, what: str, device: torch.device) -> bool:
    """Whether `flag` holds on any rank (collective; one element on `device`). Join's
    flag: not checked against the operation around it (`comm.unchecked`)."""
    value = torch.tensor([float(flag)], device=device)
    if world_size > 1:
        with comm.unchecked():
            comm.all_reduce(value, op="max", what=what)
    return bool(value.item())
